"""Subgraph rewriting on the IR: patterns, matching, replacement and a bounded driver.

A *pattern* is a small IR graph. Its inputs are wildcards that match any tensor
(the same wildcard must match the same tensor everywhere it is used); its ops
match ops of the same type whose inputs match the pattern op's inputs, position
by position. The producer of the pattern's first output is the *anchor*: matching
starts there and walks backwards through inputs, so every pattern op must be an
ancestor of the anchor.

An op of a pattern matches a graph op when:

* the type is equal (a pattern type ``"Add|AddV2"`` accepts either);
* the pattern op's namespace, if not empty, is a prefix of the graph op's;
* every attr of the pattern op is equal in the graph op (``ANY`` skips one);
* the number of inputs is equal (or at least as large, when the pattern op was
  made with ``extra_inputs=True``); the inputs match in order (either order for
  two-input ops whose type is in ``Pattern.commutative``);
* every constraint registered for it holds (a predicate on the graph op, or on
  the tensor bound to a wildcard, and the match so far).

A match is then *closed*: tensors produced inside it, other than those standing
for the pattern's outputs, are read only inside it (otherwise removing the
matched ops would break other readers).

`apply_rules` is the driver. Each iteration walks the graph's ops in order and,
for each op, tries the rules in order; a match is kept only if none of its ops
is claimed by a match found earlier in the same iteration (so matches never
overlap, and the earliest anchor in graph order wins, then the earliest rule).
The kept matches are then replaced one by one in that order; a wildcard bound
to a tensor that an earlier replacement of the same iteration replaced reads
the replacement (the back-to-back case where torch.fx's matcher went wrong,
pytorch #159613). Iterations repeat until one finds nothing or
``max_iterations`` is reached. Each match attempt costs at most the size of the
pattern (times 2 per commutative op tried both ways), so one iteration is
linear in the graph: there is no search over subsets of matches
(the blowup of pytorch #97817).

The code is split in three modules: `rewrite_patterns` (`Pattern`, ``op``,
`constraint`), `rewrite_matching` (`Match`, `match_at`, `find_matches`) and this
one (`explain`, `Rule`, `apply_rules`, `RewritePass`); import every name from here.
"""

from __future__ import annotations

import dataclasses

from amanda.ir import Graph, Op, Tensor
from amanda.passes.manager import PassResult
# The module was split in three; every name it had stays importable from here.
from amanda.passes.rewrite_matching import Match, MatchFailure, find_matches, match_at  # noqa: F401
from amanda.passes.rewrite_patterns import (  # noqa: F401
    ANY,
    EXTRA_INPUTS,
    Pattern,
    PatternOps,
    RewriteError,
    constraint,
    op,
)

__all__ = [
    "ANY", "Explanation", "Match", "MatchFailure", "Pattern", "RewriteError", "RewriteResult",
    "RewritePass", "Rule", "apply_rules", "explain", "find_matches", "match_at",
]


# ---------------------------------------------------------------------------
# Explaining
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Explanation:
    """Why a pattern matches at an op, or which node and condition failed.

    Attributes:
        matched: whether the pattern matches.
        pattern: the pattern's name.
        at: the graph op tried as anchor (None if no candidate exists).
        node: the failing pattern node's name (None when matched).
        target: the graph op or tensor it was compared with, by name.
        reason: the failed condition.
        match: the `Match` when matched.
        depth: how far matching got (pattern ops and wildcards matched before
            the failure); -1 when the graph has no candidate anchor.
    """

    matched: bool
    pattern: str
    at: str | None
    node: str | None = None
    node_type: str | None = None
    target: str | None = None
    reason: str | None = None
    match: Match | None = None
    depth: int = 0

    @property
    def message(self):
        """One readable sentence."""
        if self.matched:
            return f"pattern {self.pattern!r} matches at op {self.at!r} ({len(self.match.ops)} ops)"
        if self.at is None:
            return f"pattern {self.pattern!r} does not match: {self.reason}"
        kind = f"pattern node {self.node!r}" + (f" ({self.node_type})" if self.node_type else " (wildcard)")
        against = f" against {self.target!r}" if self.target else ""
        return (f"pattern {self.pattern!r} does not match at op {self.at!r}: {kind}{against}: "
                f"{self.reason}")

    def __str__(self):
        return self.message

    def __bool__(self):
        return self.matched


def explain(pattern, graph, at=None):
    """Explains whether ``pattern`` matches ``graph`` with its anchor at ``at``.

    Args:
        pattern: a `Pattern`, a `Rule`, or a list of them (a rule set such as
            ``gelu_tanh_rules("onnx")``, whose patterns spell one rewrite in
            several op orders): the first that matches is reported, else the
            attempt that got furthest (the first of those in list order).
        graph: the graph.
        at: a graph op or op name. If None, every op of the anchor's type is
            tried and the attempt that got furthest is explained.

    Returns:
        An `Explanation`; ``str()`` of it names the failing pattern node, the
        graph op it was compared with and the condition that failed.

    Raises:
        RewriteError: ``at`` names no op of ``graph``, or ``pattern`` is empty.
    """
    if isinstance(pattern, (list, tuple)):
        if not pattern:
            raise RewriteError("explain: no pattern given")
        explanations = [explain(p, graph, at) for p in pattern]
        return next((e for e in explanations if e.matched), None) or max(explanations, key=lambda e: e.depth)
    if isinstance(pattern, Rule):
        pattern = pattern.pattern
    if at is None:
        candidates = [op for op in graph if op.type in pattern.anchor_types]
        if not candidates:
            return Explanation(False, pattern.name, None, reason=f"the graph has no op of type "
                               f"{' or '.join(sorted(pattern.anchor_types))} for anchor "
                               f"{pattern.anchor.name!r}", depth=-1)
        results = [(c, match_at(pattern, graph, c)) for c in candidates]
        for c, r in results:
            if isinstance(r, Match):
                return _explained(pattern, c, r)
        c, r = max(results, key=lambda cr: cr[1].depth)  # the first of the furthest
        return _explained(pattern, c, r)
    op = at
    if isinstance(at, str):
        op = next((o for o in graph if o.name == at), None)
    if not isinstance(op, Op) or op.graph is not graph:
        raise RewriteError(f"explain: {at!r} is not an op of graph {graph.name!r}")
    return _explained(pattern, op, match_at(pattern, graph, op))


def _explained(pattern, op, result):
    if isinstance(result, Match):
        return Explanation(True, pattern.name, op.name, match=result, depth=len(result.ops) + len(result.bindings))
    node, target = result.node, result.target
    return Explanation(False, pattern.name, op.name, node=node.name, depth=result.depth,
                       node_type=node.type if isinstance(node, Op) else None,
                       target=None if target is None else ("%" + target.name if isinstance(target, Tensor)
                                                           else target.name),
                       reason=result.reason)

# ---------------------------------------------------------------------------
# Rules and the driver
# ---------------------------------------------------------------------------


class Rule:
    """A pattern and what replaces it.

    Args:
        pattern: a `Pattern`.
        replacement: either an IR `Graph` whose inputs are the pattern's
            wildcards (by position) and whose outputs replace the pattern's
            outputs; or a callable ``replacement(match)`` that creates ops in
            ``match.graph`` (they are inserted just before the anchor) and
            returns the replacement tensors (one per pattern output), or a
            `Graph` to inline like above, or None to skip this match.
        name: the rule's name (the pattern's if None).
        prune: op types (e.g. ``("Const",)``) whose ops, when they produce a
            tensor bound to a wildcard and nothing reads them after the
            replacement, are removed with the match: the constants a pattern
            checked through constraints and the replacement no longer reads.
    """

    def __init__(self, pattern, replacement, name=None, prune=()):
        self.pattern = pattern
        self.replacement = replacement
        self.name = name or pattern.name
        self.prune = frozenset(prune)
        if isinstance(replacement, Graph):
            self._check_template(replacement)
        elif not callable(replacement):
            raise RewriteError(f"rule {self.name!r}: replacement must be a Graph or a callable")

    def _check_template(self, template):
        n_in, n_out = len(self.pattern.graph.inputs), len(self.pattern.graph.outputs)
        if len(template.inputs) != n_in or len(template.outputs) != n_out:
            raise RewriteError(f"rule {self.name!r}: the replacement graph has {len(template.inputs)} inputs and "
                               f"{len(template.outputs)} outputs; the pattern has {n_in} and {n_out}")

    def __repr__(self):
        return f"<Rule {self.name!r}>"


@dataclasses.dataclass
class RewriteResult(PassResult):
    """What `apply_rules` did: a `PassResult` with details.

    Attributes:
        graph: the rewritten graph.
        modified: whether anything was replaced.
        applied: ``(rule name, anchor op name, iteration)`` per replacement, in order.
        iterations: how many iterations ran.
        converged: False if ``max_iterations`` stopped the driver while rules
            still matched.
    """

    applied: list
    iterations: int
    converged: bool

    def counts(self):
        """Replacements per rule name."""
        result = {}
        for rule, _, _ in self.applied:
            result[rule] = result.get(rule, 0) + 1
        return result


def apply_rules(graph, rules, max_iterations=10, in_place=False, verify=True):
    """Rewrites ``graph`` with ``rules`` until nothing matches (bounded).

    Args:
        graph: the IR graph.
        rules: a `Rule` or a sequence of rules, tried in order at each op.
        max_iterations: the most iterations (each one a full walk).
        in_place: edit ``graph`` itself instead of a copy.
        verify: run the IR verifier after each iteration.

    Returns:
        A `RewriteResult`.

    Raises:
        RewriteError: a replacement returned the wrong number of tensors or
            tensors of another graph; with ``in_place=False`` the input graph is
            untouched.
    """
    rules = [rules] if isinstance(rules, Rule) else list(rules)
    if max_iterations < 1:
        raise RewriteError(f"max_iterations must be at least 1, got {max_iterations}")
    work = graph if in_place else graph.copy()
    applied = []
    converged = False
    iteration = 0
    while iteration < max_iterations:
        iteration += 1
        matches = _select_matches(work, rules)
        if not matches:
            converged = True
            break
        replaced = {}
        for rule, match in matches:
            anchor_name = match.anchor.name
            if _replace(rule, match, replaced):
                applied.append((rule.name, anchor_name, iteration))
        if verify:
            work.verify()
    else:
        converged = not _select_matches(work, rules)
    return RewriteResult(work, bool(applied), applied, iteration, converged)


class RewritePass:
    """`apply_rules` under the pass contract, to queue in a `PassManager`.

    Args:
        rules: a `Rule` or a sequence of rules.
        name: the pass's name in the manager's errors and history.
        **options: ``max_iterations``, ``in_place`` and ``verify``, as for
            `apply_rules`.

    Calling the pass returns the `RewriteResult` of `apply_rules`.
    """

    def __init__(self, rules, name="rewrite", **options):
        self.rules = [rules] if isinstance(rules, Rule) else list(rules)
        self.name = name
        self.options = options

    def __call__(self, graph):
        return apply_rules(graph, self.rules, **self.options)


def _select_matches(graph, rules):
    """Non-overlapping matches: ops in graph order, rules in order, first claim wins."""
    by_type = {}
    for rule in rules:
        for t in rule.pattern.anchor_types:
            by_type.setdefault(t, []).append(rule)
    claimed = set()
    selected = []
    for g_op in graph:
        if g_op in claimed:
            continue
        for rule in by_type.get(g_op.type, ()):
            result = match_at(rule.pattern, graph, g_op)
            if isinstance(result, Match) and not any(o in claimed for o in result.ops.values()):
                claimed.update(result.ops.values())
                selected.append((rule, result))
                break
    return selected


def _replace(rule, match, replaced):
    graph = match.graph
    # Wildcards bound to tensors replaced earlier in this iteration read the replacements.
    for p, t in list(match.bindings.items()):
        while id(t) in replaced:
            t = replaced[id(t)]
        match.bindings[p] = t
    anchor = match.anchor
    with graph.inserting_before(anchor):
        made = rule.replacement if isinstance(rule.replacement, Graph) else rule.replacement(match)
        if made is None:
            return False
        if isinstance(made, Graph):
            rule._check_template(made)
            made = inline_graph(graph, made, match.inputs)
    made = list(made)
    olds = match.outputs
    if len(made) != len(olds):
        raise RewriteError(f"rule {rule.name!r} at op {anchor.name!r}: replacement gave {len(made)} tensors "
                           f"for {len(olds)} pattern outputs")
    for t in made:
        if not isinstance(t, Tensor) or t.graph is not graph:
            raise RewriteError(f"rule {rule.name!r} at op {anchor.name!r}: replacement {t!r} is not a tensor "
                               "of the graph")
    for old, new in zip(olds, made):
        if new is not old:
            old.replace_all_uses_with(new)
            replaced[id(old)] = new
    for g_op in _users_first(match.ops.values()):
        if _unused(g_op):
            graph.remove_op(g_op)
    for t in match.inputs if rule.prune else ():
        if t.producer is not None and t.producer.type in rule.prune and _unused(t.producer):
            graph.remove_op(t.producer)
    return True


def _users_first(ops):
    """``ops`` ordered so that each comes after every op of ``ops`` reading it
    (by a tensor or a control edge): a reverse topological order of the match.

    Removing in this order removes exactly what removing in reverse graph order
    would, without the O(graph) position lookup `Match.matched_ops` needs.
    """
    inside = set(ops)
    done, order = set(), []

    def visit(op):  # depth-first over producers inside the match (a few ops)
        done.add(op)
        for producer in [t.producer for t in op.inputs] + list(op.control_inputs):
            if producer in inside and producer not in done:
                visit(producer)
        order.append(op)

    for op in ops:
        if op not in done:
            visit(op)
    return order[::-1]


def _unused(g_op):
    return not g_op.users and not any(t.is_graph_output for t in g_op.outputs) and not g_op.control_users


def inline_graph(graph, template, inputs):
    """Copies the ops of ``template`` into ``graph`` at its cursor.

    Args:
        graph: the target graph.
        template: a graph whose inputs stand for ``inputs``.
        inputs: tensors of ``graph``, one per template input.

    Returns:
        The tensors of ``graph`` standing for the template's outputs.
    """
    from amanda.ir.attrs import copy_attrs

    env = {id(t): v for t, v in zip(template.inputs, inputs)}
    for t_op in template:
        new = graph.create_op(t_op.type, [env[id(t)] for t in t_op.inputs], num_outputs=len(t_op.outputs),
                              attrs=copy_attrs(t_op.attrs), namespace=t_op.namespace or graph.namespace,
                              name=t_op.name)
        for old, made in zip(t_op.outputs, new.outputs):
            made.attrs = dict(old.attrs)
            env[id(old)] = made
    return [env[id(t)] for t in template.outputs]

