"""Negative tests for Graph.verify: hand-corrupted graphs give a readable error."""

import pytest

from amanda.ir import Graph, VerificationError


def chain(n=5):
    """x -> op0 -> op1 -> ... -> op{n-1} -> output."""
    g = Graph("chain")
    value = g.add_input("x")
    for i in range(n):
        value = g.create_op("relu", [value], name=f"op{i}").outputs[0]
    g.set_outputs([value])
    return g


def verify_error(graph):
    with pytest.raises(VerificationError) as info:
        graph.verify()
    return info.value


def test_valid_graph_passes():
    chain().verify()


def test_use_before_definition_names_op_and_shows_window():
    g = chain(6)
    ops = g.ops
    # op1 reads op3's output: hand-corrupt both sides of use-def consistently
    late = ops[3].outputs[0]
    del ops[1].inputs[0]._uses[(ops[1], 0)]
    ops[1]._inputs = (late,)
    late._uses[(ops[1], 0)] = None
    error = verify_error(g)
    message = str(error)
    assert error.op is ops[1]
    assert "op 'op1'" in message and "used before it is defined" in message
    assert ">>> %1 = relu(%3)  # op1" in message
    # a window of neighbours, not the whole graph
    assert "# op0" in message and "# op3" in message and "# op5" not in message


def test_missing_use_is_reported():
    g = chain()
    op = g.ops[2]
    del op.inputs[0]._uses[(op, 0)]
    error = verify_error(g)
    assert error.op is op and "does not record this use" in str(error)


def test_stale_use_is_reported():
    g = chain()
    x = g.inputs[0]
    x._uses[(g.ops[3], 0)] = None
    error = verify_error(g)
    assert "records a use by op 'op3'" in str(error)


def test_foreign_input_is_reported():
    g = chain()
    foreign = Graph().add_input("f")
    op = g.ops[1]
    op._inputs = (foreign,)
    foreign._uses[(op, 0)] = None
    error = verify_error(g)
    assert error.op is op and "does not belong to this graph" in str(error)


def test_input_from_removed_op_is_reported():
    g = chain()
    dead = g.create_op("dead", [g.inputs[0]])
    out = dead.outputs[0]
    g.remove_op(dead)
    op = g.ops[0]
    op._inputs = (out,)
    out._uses[(op, 0)] = None
    assert "does not belong" in str(verify_error(g))


def test_wrong_output_producer_is_reported():
    g = chain()
    g.ops[2].outputs[0]._index = 1
    error = verify_error(g)
    assert error.op is g.ops[2] and "output 0" in str(error)


def test_duplicate_op_names_are_reported():
    g = chain()
    g.ops[3]._name = "op1"
    error = verify_error(g)
    assert "two ops are named 'op1'" in str(error) and error.op is g.ops[3]


def test_duplicate_tensor_names_are_reported():
    g = chain()
    g.ops[2].outputs[0]._name = "x"
    assert "two tensors are named 'x'" in str(verify_error(g))


def test_foreign_graph_output_is_reported():
    g = chain()
    g._outputs = (Graph().add_input("stranger"),)
    error = verify_error(g)
    assert "graph output 0 %stranger does not belong" in str(error) and error.op is None


def test_output_of_removed_op_as_graph_output_is_reported():
    g = chain()
    dead = g.create_op("dead")
    g.remove_op(dead)
    g._outputs = dead.outputs
    assert "graph output 0" in str(verify_error(g))


def test_control_input_after_op_is_reported():
    g = chain()
    first, last = g.ops[0], g.ops[-1]
    first._control_inputs = (last,)
    last._control_users[first] = None
    error = verify_error(g)
    assert error.op is first and "control input 'op4' comes after it" in str(error)


def test_op_with_wrong_graph_is_reported():
    g = chain()
    g.ops[1]._graph = Graph()
    assert "its graph is another one" in str(verify_error(g))


def test_errors_in_nested_graphs_name_the_attr():
    body = chain()
    body.ops[0]._name = "op2"
    g = Graph("outer")
    g.create_op("loop", attrs={"body": body}, name="while")
    message = str(verify_error(g))
    assert "in attr 'body' of op 'while' of graph 'outer'" in message
    assert "two ops are named 'op2'" in message
