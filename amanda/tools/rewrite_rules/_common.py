"""What the example rule sets share: finding a backend's variants.

Each backend keeps its variants of the rule sets in its own package
(``amanda/runtime/<backend>/rewrite_rules.py``, reached through its tool
support's ``rewrite_rules()``); the patterns and helpers they share are in
:mod:`amanda.passes.rewrite_helpers`.
"""

from __future__ import annotations

from amanda.passes.rewrite import RewriteError
from amanda.runtime import backends
from amanda.runtime.tool_support import support_for


def _variants(backend):
    support = support_for(backend)
    return None if support is None or not hasattr(support, "rewrite_rules") \
        else support.rewrite_rules()


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
