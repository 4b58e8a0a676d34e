"""Subgraph rewriting: patterns, rules, a bounded driver, a match explainer, example rules.

    from amanda.tools import rewrite
    from amanda.tools.rewrite import op

    def relu_of_add(a, b):
        return op.Relu(op("Add|AddV2", a, b, name="add"))

    pattern = rewrite.pattern(relu_of_add, commutative=["Add", "AddV2"])
    rule = rewrite.Rule(pattern, lambda m: [m.graph.create_op("AddRelu", m.inputs).outputs[0]])
    result = rewrite.rewrite(ir_graph, [rule])          # a RewriteResult; ir_graph untouched
    print(rewrite.explain(pattern, ir_graph, at="relu_3"))

Patterns are small IR graphs (`Pattern`), written directly or as plain Python
functions over symbolic ops (`pattern`, ``op``), with constraints: predicates on
the matched ops and on the tensors bound to wildcards. Matching, the order in
which non-overlapping matches are applied and the iteration bound are described
in `amanda.passes.rewrite`.

Rewriting works on any IR graph; to run the result, lower it back:

* PyTorch graph capture: ``program.rewrite(rules)`` on a
  `amanda.runtime.pytorch.capture.CapturedProgram`;
* TensorFlow: ``lower_to_graph_def(rewritten, base=tf_graph)``
  (`amanda.runtime.tensorflow.graphdef`);
* ONNX: ``amanda.runtime.onnx.lower(rewritten)``.

Example rules (per backend, since op vocabularies differ):
`fold_batchnorm_rules`, `gelu_tanh_rules`, `fake_quant_matmul_rules`; they live in
`amanda.tools.rewrite_rules`, one module per rule set, and are importable from here.
"""

from __future__ import annotations

from amanda.passes.rewrite import (
    ANY,
    Explanation,
    Match,
    Pattern,
    RewriteError,
    RewriteResult,
    Rule,
    apply_rules,
    constraint,
    explain,
    find_matches,
    inline_graph,
    op,
)
from amanda.tools.rewrite_rules import (
    fake_quant_matmul_rules,
    fold_batchnorm_rules,
    gelu_tanh_rules,
)
from amanda.passes.rewrite_helpers import pattern

__all__ = [
    "ANY", "Explanation", "Match", "Pattern", "RewriteError", "RewriteResult", "Rule", "constraint",
    "explain", "fake_quant_matmul_rules", "find_matches", "fold_batchnorm_rules", "gelu_tanh_rules",
    "inline_graph", "op", "pattern", "rewrite",
]



def rewrite(graph, rules, max_iterations=10, in_place=False):
    """Applies ``rules`` to an IR graph until nothing matches or ``max_iterations``.

    Args:
        graph: an `amanda.ir.Graph`.
        rules: a `Rule` or a list of them (tried in order at each op).
        max_iterations: the bound on full passes over the graph.
        in_place: rewrite ``graph`` itself rather than a copy.

    Returns:
        A `RewriteResult`: ``graph``, ``modified``, ``applied`` (rule, anchor,
        iteration), ``iterations``, ``converged``.
    """
    return apply_rules(graph, rules, max_iterations=max_iterations, in_place=in_place)
