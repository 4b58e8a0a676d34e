"""Context mapping: make one tool portable across backends.

A :class:`MappingTool` holds rules ``[namespace, rule]``. Before the tools that
depend on it analyse an op, every rule whose namespace is a prefix of the
context's namespace runs on the context (``"pytorch"`` matches every PyTorch
context). A rule is one function, or a ``(before, after)`` pair whose second
function runs after the dependent tools' analysis routines.
"""

from __future__ import annotations

import amanda
from amanda.errors import AmandaError


class MappingTool(amanda.Tool):
    """Apply namespace-matched rules to every context, forward and backward.

    Args:
        rules: a sequence of ``[namespace, rule]`` pairs; ``rule`` is a callable
            taking the context, or a ``(before, after)`` pair of callables
            (either may be None).

    Raises:
        AmandaError: a rule is malformed.
    """

    def __init__(self, rules):
        super().__init__()
        self.rules = [self._check(rule) for rule in rules]
        self._matches = {}
        self.standalone = False  # rules only run where a dependent tool analyses
        for backward in (False, True):
            for outputs in (False, True):
                self.add_inst_for_op(self.map_before, backward=backward, require_outputs=outputs)
                self.add_post_inst_for_op(self.map_after, backward=backward,
                                          require_outputs=outputs)

    @staticmethod
    def _check(rule):
        try:
            namespace, fn = rule
        except (TypeError, ValueError):
            raise AmandaError(f"MappingTool: a rule is [namespace, function], got {rule!r}") from None
        if callable(fn):
            before, after = fn, None
        else:
            try:
                before, after = fn
            except (TypeError, ValueError):
                raise AmandaError("MappingTool: a rule's function must be callable or a "
                                  f"(before, after) pair, got {fn!r}") from None
        for f in (before, after):
            if f is not None and not callable(f):
                raise AmandaError(f"MappingTool: {f!r} in the rule for {namespace!r} "
                                  "is not callable")
        return str(namespace), before, after

    def _rules_for(self, namespace):
        rules = self._matches.get(namespace)
        if rules is None:
            rules = self._matches[namespace] = [
                (before, after) for prefix, before, after in self.rules
                if namespace.startswith(prefix)]
        return rules

    def map_before(self, context):
        for before, _ in self._rules_for(context.namespace):
            if before is not None:
                before(context)

    def map_after(self, context):
        for _, after in self._rules_for(context.namespace):
            if after is not None:
                after(context)
