"""Matching patterns against a graph: `Match`, `match_at` and `find_matches`.

Part of `amanda.passes.rewrite` (import the names from there); see its docstring
for when a pattern op matches a graph op and what a closed match is.
"""

from __future__ import annotations

from amanda.passes.rewrite_patterns import _CONTROL_KEYS, ANY, EXTRA_INPUTS, _describe_predicate


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



def _position_key(graph):
    positions = {op: i for i, op in enumerate(graph.ops)}
    return lambda op: positions[op]
