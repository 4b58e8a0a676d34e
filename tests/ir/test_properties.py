"""Property-based tests of the IR invariants over random DAGs."""

import importlib.util
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from amanda.ir import Graph, IRError, graph_from_json, graph_to_json, structural_hash, to_networkx

from .strategies import all_tensors, assert_use_def, graphs, snapshot, tensors_before

# No example database: the suite must not write files outside tests/ir.
FAST = settings(max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(graphs())
def test_random_graphs_verify(graph):
    graph.verify()
    assert_use_def(graph)


@FAST
@given(graphs())
def test_json_round_trip_preserves_hash_and_text(graph):
    data = graph_to_json(graph)
    back = graph_from_json(json.loads(json.dumps(data, allow_nan=False)))
    assert structural_hash(back) == structural_hash(graph)
    assert str(back) == str(graph)
    assert graph_to_json(back) == data
    back.verify()


@FAST
@given(graphs())
def test_copy_preserves_hash_and_text(graph):
    clone = graph.copy()
    assert structural_hash(clone) == structural_hash(graph) and str(clone) == str(graph)
    clone.verify()


@FAST
@given(graphs())
def test_renaming_everything_preserves_hash(graph):
    before = structural_hash(graph)
    graph.name = "other"
    for i, op in enumerate(graph):
        op.name = f"renamed_op_{i}"
    for i, tensor in enumerate(all_tensors(graph)):
        tensor.name = f"renamed_tensor_{i}"
    assert structural_hash(graph) == before
    graph.verify()


@FAST
@given(graphs(), st.data())
def test_mutating_one_attr_changes_hash(graph, data):
    targets = list(graph) + list(graph.inputs)
    target = data.draw(st.sampled_from(targets)) if targets else graph
    before = structural_hash(graph)
    key = data.draw(st.sampled_from(["stride", "fresh_key"]))
    old = target.attrs.get(key, object())
    target.attrs[key] = [old] if key in target.attrs else 0  # always a different value
    assert structural_hash(graph) != before


@FAST
@given(graphs(), st.data())
def test_mutating_one_wire_changes_hash(graph, data):
    slots = [(op, position) for op in graph for position in range(len(op.inputs))]
    if not slots:
        graph.create_op("probe", [graph.inputs[0]])
        slots = [(graph.ops[-1], 0)]
    op, position = data.draw(st.sampled_from(slots))
    choices = [t for t in tensors_before(graph, op) if t is not op.inputs[position]]
    if not choices:
        # only one tensor exists before op: offer a new input (hashed before the rewire)
        choices = [graph.add_input()]
    before = structural_hash(graph)
    op.replace_input_with(position, data.draw(st.sampled_from(choices)))
    assert structural_hash(graph) != before
    graph.verify()


@FAST
@given(graphs(), st.data())
def test_use_def_invariant_survives_random_mutations(graph, data):
    for _ in range(data.draw(st.integers(1, 12))):
        action = data.draw(st.sampled_from([_replace_input, _replace_all_uses, _remove_unused, _refuse_removal]))
        action(graph, data)
        assert_use_def(graph)
        graph.verify()


def _replace_input(graph, data):
    slots = [(op, position) for op in graph for position in range(len(op.inputs))]
    if slots:
        op, position = data.draw(st.sampled_from(slots))
        op.replace_input_with(position, data.draw(st.sampled_from(tensors_before(graph, op))))


def _replace_all_uses(graph, data):
    tensor = data.draw(st.sampled_from(all_tensors(graph)))
    # the replacement must be defined before the tensor, hence before all its uses
    earlier = list(graph.inputs) if tensor.producer is None else tensors_before(graph, tensor.producer)
    tensor.replace_all_uses_with(data.draw(st.sampled_from(earlier)))


def _removable(op):
    return not op.control_users and not any(t.uses or t.is_graph_output for t in op.outputs)


def _remove_unused(graph, data):
    candidates = [op for op in graph if _removable(op)]
    if candidates:
        graph.remove_op(data.draw(st.sampled_from(candidates)))


def _refuse_removal(graph, data):
    candidates = [op for op in graph if not _removable(op)]
    if candidates:
        before = snapshot(graph)
        try:
            graph.remove_op(data.draw(st.sampled_from(candidates)))
        except IRError:
            pass
        else:
            raise AssertionError("removal of a used op was not refused")
        assert snapshot(graph) == before


@pytest.mark.skipif(importlib.util.find_spec("networkx") is None, reason="networkx is not installed")
@FAST
@given(graphs())
def test_networkx_edges_match_op_fed_slots(graph):
    view = to_networkx(graph)
    fed_by_ops = sum(1 for op in graph for t in op.inputs if t.producer is not None)
    assert view.number_of_edges() == fed_by_ops
    assert view.number_of_nodes() == len(graph)


@FAST
@given(graphs(max_ops=6), graphs(max_ops=6))
def test_nested_graph_attrs_round_trip(outer, body):
    outer.create_op("loop", [outer.inputs[0]], attrs={"body": body, "cases": [body]})
    back = Graph.from_json(json.loads(json.dumps(outer.to_json())))
    assert structural_hash(back) == structural_hash(outer)
    assert str(back) == str(outer)
    back.verify()
