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
"""

from __future__ import annotations

import dataclasses

from amanda.errors import AmandaError
from amanda.ir import Graph, Op, Tensor

__all__ = [
    "ANY", "Explanation", "Match", "MatchFailure", "Pattern", "RewriteError", "RewriteResult",
    "Rule", "apply_rules", "explain", "find_matches", "match_at",
]


class RewriteError(AmandaError):
    """A pattern or rule is malformed, or a replacement is inconsistent."""


class _Any:
    def __repr__(self):
        return "ANY"


#: An attr value in a pattern op that matches any value (or no value).
ANY = _Any()

# Pattern-op attr keys that configure matching rather than being compared.
EXTRA_INPUTS = "$extra_inputs"
_CONTROL_KEYS = frozenset({EXTRA_INPUTS})


# ---------------------------------------------------------------------------
# Patterns
# ---------------------------------------------------------------------------


class Pattern:
    """A small IR graph to look for, with constraints.

    Args:
        graph: the pattern graph; its inputs are wildcards, its outputs the
            tensors a replacement must provide (the first one's producer is the
            anchor).
        constraints: ``{name: predicate or [predicate, ...]}`` where ``name`` is
            a pattern op or pattern input name and ``predicate(target, match)``
            gets the graph op (or the bound tensor) and the `Match` so far and
            returns a bool. Give a predicate a readable ``__name__`` or use
            `constraint` to name it: explanations quote the name.
        commutative: op types whose two inputs may match in either order.
        name: the pattern's name in messages.

    Raises:
        RewriteError: the pattern has no outputs, an output is a wildcard, an op
            is not an ancestor of the anchor, or a constraint names nothing.
    """

    def __init__(self, graph, constraints=None, commutative=(), name=None):
        self.graph = graph
        self.name = name or graph.name
        self.commutative = frozenset(commutative)
        self.constraints = {}
        for key, predicates in (constraints or {}).items():
            if callable(predicates):
                predicates = [predicates]
            self.constraints[key] = list(predicates)
        self._check()

    @property
    def anchor(self):
        """The pattern op matching starts from."""
        return self.graph.outputs[0].producer

    @property
    def anchor_types(self):
        """The op types an anchor candidate may have."""
        return frozenset(self.anchor.type.split("|"))

    @classmethod
    def trace(cls, fn, constraints=None, commutative=(), name=None, namespace=""):
        """Builds a pattern from a plain Python function over symbolic ops.

        ``fn`` receives one wildcard per parameter and returns one value (or a
        tuple); inside it, ``op("Conv2D", x, w)`` or ``op.Conv2D(x, w)`` (see
        `PatternOps`) records a pattern op, whose result is its first output;
        ``value.output(i)`` reads another output::

            def conv_bn(x, w, scale, offset, mean, var):
                return op.FusedBatchNormV3(op.Conv2D(x, w), scale, offset, mean, var)

        Args:
            fn: the function; its parameter names name the wildcards.
            constraints, commutative: as for `Pattern`.
            name: the pattern's name (``fn.__name__`` if None).
            namespace: the namespace of the recorded ops ("" matches any).

        Returns:
            A `Pattern`.
        """
        import inspect

        graph = Graph(name or fn.__name__, namespace=namespace)
        params = list(inspect.signature(fn).parameters)
        values = [_Value(graph.add_input(p)) for p in params]
        token = _TRACING.push(graph)
        try:
            result = fn(*values)
        finally:
            _TRACING.pop(token)
        results = result if isinstance(result, (tuple, list)) else [result]
        for r in results:
            if not isinstance(r, _Value):
                raise RewriteError(f"pattern function {fn.__name__!r} must return values made by op(...), "
                                   f"got {type(r).__name__}")
        graph.set_outputs([r.tensor for r in results])
        return cls(graph, constraints=constraints, commutative=commutative, name=name or fn.__name__)

    def _check(self):
        graph = self.graph
        if not graph.outputs:
            raise RewriteError(f"pattern {self.name!r} has no outputs")
        for t in graph.outputs:
            if t.producer is None:
                raise RewriteError(f"pattern {self.name!r}: output %{t.name} is a wildcard, not an op output")
        reached = set()
        stack = [self.anchor]
        while stack:
            op = stack.pop()
            if op in reached:
                continue
            reached.add(op)
            stack.extend(t.producer for t in op.inputs if t.producer is not None)
        stray = [op.name for op in graph if op not in reached]
        if stray:
            raise RewriteError(f"pattern {self.name!r}: ops {stray} are not ancestors of the anchor "
                               f"{self.anchor.name!r}; matching starts at the anchor")
        op_names, input_names = {op.name for op in graph}, {t.name for t in graph.inputs}
        if op_names & input_names:
            raise RewriteError(f"pattern {self.name!r}: {sorted(op_names & input_names)} name both an op and "
                               "a wildcard; constraints and Match[...] look nodes up by name")
        names = op_names | input_names
        unknown = sorted(set(self.constraints) - names)
        if unknown:
            raise RewriteError(f"pattern {self.name!r}: constraints name {unknown}, which are neither "
                               f"ops nor inputs of the pattern ({sorted(names)})")

    def __repr__(self):
        return f"<Pattern {self.name!r}: {len(self.graph)} ops, anchor {self.anchor.type}>"


def constraint(description):
    """Decorator naming a predicate for explanations: ``@constraint("is 2-D")``."""
    def wrap(predicate):
        predicate.description = description
        return predicate
    return wrap


def _describe_predicate(predicate):
    return getattr(predicate, "description", None) or getattr(predicate, "__name__", repr(predicate))


class _Tracing:
    """The pattern graph `op(...)` records into (a stack, for nested traces)."""

    def __init__(self):
        self.graphs = []

    def push(self, graph):
        self.graphs.append(graph)
        return len(self.graphs)

    def pop(self, token):
        del self.graphs[token - 1:]

    def current(self):
        if not self.graphs:
            raise RewriteError("op(...) records pattern ops only inside Pattern.trace")
        return self.graphs[-1]


_TRACING = _Tracing()


class _Value:
    """A symbolic tensor while a pattern function is traced."""

    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor

    def output(self, index):
        """Another output of the op that produced this value."""
        producer = self.tensor.producer
        if producer is None or index >= len(producer.outputs):
            raise RewriteError(f"%{self.tensor.name} has no sibling output {index}")
        return _Value(producer.outputs[index])


class PatternOps:
    """Records pattern ops while a function is traced by `Pattern.trace`.

    ``op(type, *inputs, num_outputs=1, name=None, extra_inputs=False, **attrs)``
    records one op; ``op.Type(*inputs, ...)`` is the same with the type as an
    attribute name. Attrs given become requirements on the matched op.
    """

    def __call__(self, type, *inputs, num_outputs=1, name=None, extra_inputs=False, **attrs):
        graph = _TRACING.current()
        for value in inputs:
            if not isinstance(value, _Value):
                raise RewriteError(f"pattern op {type!r}: inputs must be wildcards or op results, "
                                   f"got {value!r} (put constants in constraints)")
        if extra_inputs:
            attrs[EXTRA_INPUTS] = True
        op = graph.create_op(type, [v.tensor for v in inputs], num_outputs=max(num_outputs, 1),
                             attrs=attrs, name=name or type.split("|")[0].split(".")[-1])
        return _Value(op.outputs[0])

    def __getattr__(self, type):
        if type.startswith("__"):
            raise AttributeError(type)
        return lambda *inputs, **kw: self(type, *inputs, **kw)


#: The recorder used inside pattern functions: ``op.Conv2D(x, w)``.
op = PatternOps()


# ---------------------------------------------------------------------------
# Matching
# ---------------------------------------------------------------------------


class Match:
    """A match of a pattern in a graph.

    Attributes:
        pattern: the `Pattern`.
        graph: the graph matched in.
        ops: pattern op -> graph op.
        bindings: pattern input (wildcard) -> graph tensor.
    """

    def __init__(self, pattern, graph):
        self.pattern = pattern
        self.graph = graph
        self.ops = {}
        self.bindings = {}

    @property
    def anchor(self):
        """The graph op matched by the pattern's anchor."""
        return self.ops[self.pattern.anchor]

    @property
    def outputs(self):
        """The graph tensors standing for the pattern's outputs."""
        return [self.ops[t.producer].outputs[t.index] for t in self.pattern.graph.outputs]

    @property
    def inputs(self):
        """The graph tensors bound to the wildcards, in pattern input order."""
        return [self.bindings[t] for t in self.pattern.graph.inputs]

    def __getitem__(self, name):
        """The graph op (for a pattern op name) or tensor (for a wildcard name)."""
        for p, g in self.ops.items():
            if p.name == name:
                return g
        for p, g in self.bindings.items():
            if p.name == name:
                return g
        raise KeyError(f"pattern {self.pattern.name!r} has no op or input named {name!r}")

    def matched_ops(self):
        """The matched graph ops in graph order."""
        return sorted(self.ops.values(), key=_position_key(self.graph))

    def _snapshot(self):
        return dict(self.ops), dict(self.bindings)

    def _restore(self, snapshot):
        self.ops, self.bindings = dict(snapshot[0]), dict(snapshot[1])

    def __repr__(self):
        return f"<Match {self.pattern.name!r} at {self.anchor.name!r}: {len(self.ops)} ops>"


class MatchFailure(Exception):
    """Why a pattern does not match (internal; see `explain`).

    Attributes:
        node: the pattern op or wildcard that failed.
        target: the graph op or tensor it was compared with (None if none).
        reason: the failed condition, in words.
    """

    def __init__(self, node, target, reason):
        super().__init__(reason)
        self.node, self.target, self.reason = node, target, reason


def match_at(pattern, graph, op):
    """Matches ``pattern`` with its anchor at ``op``.

    Returns:
        A `Match`, or a `MatchFailure` describing the first condition that failed.
    """
    match = Match(pattern, graph)
    try:
        _match_op(pattern.anchor, op, match)
        for output in pattern.graph.outputs:
            _match_op(output.producer, _producer_or_fail(output, match), match)
        _check_closed(match)
    except MatchFailure as failure:
        _note_depth(failure, match)
        return failure
    return match


def _producer_or_fail(pattern_tensor, match):
    graph_op = match.ops.get(pattern_tensor.producer)
    if graph_op is None:
        raise MatchFailure(pattern_tensor.producer, None, "not reached from the anchor")
    return graph_op


def _match_op(p_op, g_op, match):
    known = match.ops.get(p_op)
    if known is not None:
        if known is not g_op:
            raise MatchFailure(p_op, g_op, f"already matched op {known.name!r}; the graph does not share it here")
        return
    if any(g is g_op for g in match.ops.values()):
        raise MatchFailure(p_op, g_op, "this graph op is already matched by another pattern op")
    _check_op_fields(p_op, g_op)
    match.ops[p_op] = g_op
    _match_inputs(p_op, g_op, match)
    _check_constraints(p_op, g_op, match)


def _check_op_fields(p_op, g_op):
    types = p_op.type.split("|")
    if g_op.type not in types:
        raise MatchFailure(p_op, g_op, f"type is {g_op.type!r}, expected {' or '.join(map(repr, types))}")
    if p_op.namespace and not (g_op.namespace == p_op.namespace
                               or g_op.namespace.startswith(p_op.namespace.rstrip("/") + "/")):
        raise MatchFailure(p_op, g_op, f"namespace {g_op.namespace!r} is not under {p_op.namespace!r}")
    for key, expected in p_op.attrs.items():
        if key in _CONTROL_KEYS or expected is ANY:
            continue
        if key not in g_op.attrs:
            raise MatchFailure(p_op, g_op, f"attr {key!r} is missing (expected {expected!r})")
        if g_op.attrs[key] != expected:
            raise MatchFailure(p_op, g_op, f"attr {key!r} is {g_op.attrs[key]!r}, expected {expected!r}")
    n_p, n_g = len(p_op.inputs), len(g_op.inputs)
    if n_g < n_p or (n_g > n_p and not p_op.attrs.get(EXTRA_INPUTS)):
        raise MatchFailure(p_op, g_op, f"has {n_g} inputs, expected {n_p}")


def _match_inputs(p_op, g_op, match, orders=None):
    orders = [range(len(p_op.inputs))]
    if len(p_op.inputs) == 2 and g_op.type in match.pattern.commutative:
        orders.append([1, 0])
    failure = None
    for order in orders:
        snapshot = match._snapshot()
        try:
            for p_pos, g_pos in enumerate(order):
                _match_tensor(p_op.inputs[p_pos], g_op.inputs[g_pos], match)
            return
        except MatchFailure as error:
            _note_depth(error, match)
            match._restore(snapshot)
            if failure is None or error.depth > failure.depth:
                failure = error  # explain the order that got furthest
    raise failure


def _note_depth(failure, match):
    """How far matching got when ``failure`` was raised (ops and bindings matched)."""
    if not hasattr(failure, "depth"):
        failure.depth = len(match.ops) + len(match.bindings)


def _match_tensor(p_t, g_t, match):
    if p_t.producer is None:  # a wildcard
        bound = match.bindings.get(p_t)
        if bound is not None:
            if bound is not g_t:
                raise MatchFailure(p_t, g_t, f"wildcard already bound to %{bound.name}, here it would be %{g_t.name}")
            return
        match.bindings[p_t] = g_t
        _check_constraints(p_t, g_t, match)
        return
    if g_t.producer is None:
        raise MatchFailure(p_t.producer, g_t, f"expected an op of type {p_t.producer.type!r} producing "
                           f"%{g_t.name}, found a graph input")
    if g_t.index != p_t.index:
        raise MatchFailure(p_t.producer, g_t.producer, f"reads output {g_t.index} of this op, pattern reads "
                           f"output {p_t.index}")
    _match_op(p_t.producer, g_t.producer, match)


def _check_constraints(p_node, target, match):
    for predicate in match.pattern.constraints.get(p_node.name, ()):
        try:
            ok = predicate(target, match)
        except Exception as exc:  # a predicate that cannot decide does not match
            raise MatchFailure(p_node, target, f"constraint {_describe_predicate(predicate)!r} raised "
                               f"{type(exc).__name__}: {exc}") from exc
        if not ok:
            raise MatchFailure(p_node, target, f"constraint {_describe_predicate(predicate)!r} failed")


def _check_closed(match):
    inside = set(match.ops.values())
    outputs = {id(t) for t in match.outputs}
    for p_op, g_op in match.ops.items():
        for tensor in g_op.outputs:
            if id(tensor) in outputs:
                continue
            for user, _ in tensor.uses:
                if user not in inside:
                    raise MatchFailure(p_op, g_op, f"its output %{tensor.name} is also read by op "
                                       f"{user.name!r} outside the match")
            if tensor.is_graph_output:
                raise MatchFailure(p_op, g_op, f"its output %{tensor.name} is a graph output")
        if g_op is not match.anchor and g_op.control_users:
            raise MatchFailure(p_op, g_op, f"op {g_op.control_users[0].name!r} waits on it (control edge)")


def find_matches(pattern, graph):
    """All matches of ``pattern`` in ``graph`` (possibly overlapping), anchors in graph order."""
    types = pattern.anchor_types
    found = []
    for g_op in graph:
        if g_op.type in types:
            result = match_at(pattern, graph, g_op)
            if isinstance(result, Match):
                found.append(result)
    return found


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
class RewriteResult:
    """What `apply_rules` did.

    Attributes:
        graph: the rewritten graph.
        modified: whether anything was replaced.
        applied: ``(rule name, anchor op name, iteration)`` per replacement, in order.
        iterations: how many iterations ran.
        converged: False if ``max_iterations`` stopped the driver while rules
            still matched.
    """

    graph: Graph
    modified: bool
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
    for g_op in reversed(match.matched_ops()):
        if _unused(g_op):
            graph.remove_op(g_op)
    for t in match.inputs if rule.prune else ():
        if t.producer is not None and t.producer.type in rule.prune and _unused(t.producer):
            graph.remove_op(t.producer)
    return True


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


def _position_key(graph):
    positions = {op: i for i, op in enumerate(graph.ops)}
    return lambda op: positions[op]
