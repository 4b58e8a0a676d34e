"""What the example rule sets share: finding a backend's variants.

Each backend keeps its variants of the rule sets in its own package
(``amanda/runtime/<backend>/rewrite_rules.py``, the ``rewrite_rules`` part
of its descriptor, :class:`amanda.runtime.backends.Backend`); the patterns and helpers they share are in
:mod:`amanda.passes.rewrite_helpers`.
"""

from __future__ import annotations

from amanda.passes.rewrite import RewriteError
from amanda.runtime import backends


def _variants(backend):
    found = backends.for_namespace(backend)
    return None if found is None else found.part("rewrite_rules")


def variant(rule_set, backend):
    """The function building rule set ``rule_set`` (``"gelu_tanh_rules"``)
    for ``backend``.

    Raises:
        RewriteError: the backend has no variant of it.
    """
    found = _variants(backend)
    if found is None or not hasattr(found, rule_set):
        offered = [b.name for b in backends.all_backends()
                   if hasattr(_variants(b.name), rule_set)]
        raise RewriteError(f"{rule_set}: no rules for backend {backend!r} ({', '.join(offered)})")
    return getattr(found, rule_set)
