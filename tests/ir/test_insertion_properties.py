"""Property-based tests of op insertion and removal against a reference list model.

Random sequences of inserts at the cursor (before/after an op, nested blocks),
appends and removals must leave the graph's op order equal to what the same
edits do to a plain Python list, keep use-def consistent and pass the verifier.
"""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amanda.ir import Graph
from amanda.ir._order import OpOrder

from .strategies import assert_use_def

FAST = settings(max_examples=80, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


class Model:
    """A graph under test and the list its op order must equal."""

    def __init__(self, data):
        self.data = data
        self.graph = Graph("g")
        self.order = []
        x = self.graph.add_input("x")
        self.graph.set_outputs([x])

    def defined_before(self, index):
        """Tensors usable by an op inserted at ``index`` of the order."""
        tensors = list(self.graph.inputs)
        for op in self.order[:index]:
            tensors.extend(op.outputs)
        return tensors

    def new_op(self, index):
        """Creates an op at the graph's cursor, reading tensors defined before ``index``."""
        tensors = self.defined_before(index)
        inputs = self.data.draw(st.lists(st.sampled_from(tensors), max_size=2))
        num_outputs = self.data.draw(st.sampled_from([0, 1, 1, 2]))
        op = self.graph.create_op("op", inputs, num_outputs=num_outputs)
        self.order.insert(index, op)
        return op

    def check(self):
        graph, order = self.graph, self.order
        assert graph.ops == order
        assert list(graph) == order
        assert len(graph) == len(order)
        for i, op in enumerate(order):
            assert op in graph
            assert graph.prev_op(op) is (order[i - 1] if i else None)
            assert graph.next_op(op) is (order[i + 1] if i + 1 < len(order) else None)
        graph.verify()
        assert_use_def(graph)


def _append(model):
    model.new_op(len(model.order))


def _insert_before(model):
    if not model.order:
        return _append(model)
    anchor = model.data.draw(st.sampled_from(model.order))
    with model.graph.inserting_before(anchor):
        for _ in range(model.data.draw(st.integers(1, 3))):
            model.new_op(model.order.index(anchor))


def _insert_after(model):
    if not model.order:
        return _append(model)
    anchor = model.data.draw(st.sampled_from(model.order))
    with model.graph.inserting_after(anchor):
        last = anchor
        for _ in range(model.data.draw(st.integers(1, 3))):
            last = model.new_op(model.order.index(last) + 1)


def _nested(model):
    """An inner block inside an outer one; the outer cursor resumes after it."""
    if not model.order:
        return _append(model)
    outer = model.data.draw(st.sampled_from(model.order))
    inner = model.data.draw(st.sampled_from(model.order))
    with model.graph.inserting_after(outer):
        last = model.new_op(model.order.index(outer) + 1)
        with model.graph.inserting_before(inner):
            model.new_op(model.order.index(inner))
        model.new_op(model.order.index(last) + 1)


def _remove(model):
    graph = model.graph
    removable = [op for op in model.order
                 if not op.users and not op.control_users and not any(t.is_graph_output for t in op.outputs)]
    if not removable:
        return
    op = model.data.draw(st.sampled_from(removable))
    graph.remove_op(op)
    model.order.remove(op)
    assert op.graph is None and op not in graph


def _rewire_output(model):
    """Makes the graph return the output of a random op (so it cannot be removed)."""
    tensors = model.defined_before(len(model.order))
    model.graph.set_outputs([model.data.draw(st.sampled_from(tensors))])


ACTIONS = [_append, _insert_before, _insert_after, _nested, _remove, _rewire_output]


@FAST
@given(st.data())
def test_random_edits_match_a_list_model(data):
    model = Model(data)
    for _ in range(data.draw(st.integers(1, 25))):
        data.draw(st.sampled_from(ACTIONS))(model)
        model.check()


@FAST
@given(st.data())
def test_edits_while_iterating_follow_the_snapshot_rule(data):
    """Ops inserted during a walk are not visited; ops removed before it reaches them are skipped."""
    model = Model(data)
    for _ in range(data.draw(st.integers(1, 10))):
        _append(model)
    snapshot = list(model.order)
    visited, removed = [], set()
    for op in model.graph:
        visited.append(op)
        action = data.draw(st.sampled_from(ACTIONS))
        before = set(model.order)
        action(model)
        removed |= before - set(model.order)
        model.check()
    expected = [op for op in snapshot if op not in removed or op in visited]
    assert visited == expected


@FAST
@given(st.lists(st.tuples(st.sampled_from(["append", "before", "after", "remove"]), st.integers(0, 50)),
                max_size=60))
def test_op_order_matches_a_list(steps):
    order, model = OpOrder(), []
    for kind, pick in steps:
        item = object()
        if kind == "append" or not model:
            if kind == "remove":
                continue
            order.append(item)
            model.append(item)
        elif kind == "before":
            anchor = model[pick % len(model)]
            order.insert_before(anchor, item)
            model.insert(model.index(anchor), item)
        elif kind == "after":
            anchor = model[pick % len(model)]
            order.insert_after(anchor, item)
            model.insert(model.index(anchor) + 1, item)
        else:
            victim = model.pop(pick % len(model))
            order.remove(victim)
            assert victim not in order
        assert list(order) == model and len(order) == len(model)
        assert order.snapshot() == tuple(model) and order.snapshot() is order.snapshot()
        assert order.first() is (model[0] if model else None)
        assert order.last() is (model[-1] if model else None)
