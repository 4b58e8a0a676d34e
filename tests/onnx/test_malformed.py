"""Malformed or unsupported ONNX models give amanda errors naming the node."""

import pytest

import amanda
from amanda.frontends.onnx import lift
from tests.onnx.conftest import TensorProto, helper, mlp, onnx


def model_of(nodes, inputs=("x",), outputs=("y",), initializers=()):
    graph = helper.make_graph(
        nodes, "bad", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in inputs],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2]) for n in outputs],
        list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_dangling_input_names_the_node():
    model = model_of([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")])
    with pytest.raises(amanda.BackendError, match="node 'adder' \\(Add\\) reads 'ghost'"):
        lift(model)


def test_duplicate_output_names_both_nodes():
    model = model_of([helper.make_node("Relu", ["x"], ["y"], name="first"),
                      helper.make_node("Neg", ["x"], ["y"], name="second")])
    with pytest.raises(amanda.BackendError,
                       match="node 'second' \\(Neg\\) outputs 'y', which node 'first'"):
        lift(model)


def test_output_shadowing_a_graph_input():
    model = model_of([helper.make_node("Relu", ["x"], ["x"], name="loop")], outputs=("x",))
    with pytest.raises(amanda.BackendError, match="node 'loop' \\(Relu\\) outputs 'x'"):
        lift(model)


def test_unknown_attribute_type_names_node_and_attribute():
    node = helper.make_node("Relu", ["x"], ["y"], name="odd")
    attr = node.attribute.add()
    attr.name, attr.f = "mystery", 1.0   # a value, but type UNDEFINED
    with pytest.raises(amanda.BackendError,
                       match="node 'odd' \\(Relu\\): attribute 'mystery' has unknown type 0"):
        lift(model_of([node]))
    # a type number this onnx does not know reads back as UNDEFINED too
    data = bytearray(model_of([node]).SerializeToString())
    with pytest.raises(amanda.BackendError, match="attribute 'mystery' has unknown type"):
        lift(bytes(data))


def test_cycle_names_a_node():
    model = model_of([helper.make_node("Add", ["x", "b"], ["a"], name="one"),
                      helper.make_node("Relu", ["a"], ["b"], name="two"),
                      helper.make_node("Identity", ["b"], ["y"], name="three")])
    with pytest.raises(amanda.BackendError, match="node 'one' \\(Add\\) is part of a cycle"):
        lift(model)


def test_missing_graph_output():
    model = model_of([helper.make_node("Relu", ["x"], ["z"], name="r")])
    with pytest.raises(amanda.BackendError, match="output 'y' is produced by no node"):
        lift(model)


def test_dangling_input_inside_a_subgraph_names_both_nodes():
    then = helper.make_graph([helper.make_node("Neg", ["nowhere"], ["t"], name="inner")], "then",
                             [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    model = model_of([helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then,
                                       else_branch=other)], inputs=("x", "c"))
    with pytest.raises(amanda.BackendError,
                       match="node 'branch' \\(If\\) reads 'nowhere' \\(in its subgraph 'then_branch'\\)"):
        lift(model)


def test_bad_files_and_objects(tmp_path):
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\x00\xffnot a model at all\x13")
    with pytest.raises(amanda.BackendError, match="cannot read an ONNX model from"):
        lift(garbage)
    with pytest.raises(amanda.BackendError, match="no ONNX model file at"):
        lift(tmp_path / "missing.onnx")
    with pytest.raises(amanda.BackendError, match="cannot lift a int"):
        lift(3)
    with pytest.raises(amanda.BackendError, match="has no graph"):
        lift(onnx.ModelProto())


def test_malformed_model_in_a_session_inside_apply_is_an_amanda_error():
    model = model_of([helper.make_node("Add", ["x", "ghost"], ["y"], name="adder")])
    ort = pytest.importorskip("onnxruntime")
    with pytest.raises(amanda.BackendError, match="adder"):
        with amanda.apply(amanda.tools.identity.IdentityTool()):
            ort.InferenceSession(model.SerializeToString())


def test_lift_records_subgraphs_and_captures():
    """If branches become nested IR graphs; outer values they read are captured."""
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"], name="neg")], "then", [],
                             [helper.make_tensor_value_info("t", TensorProto.FLOAT, [2])])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"], name="abs")], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, [2])])
    model = model_of([helper.make_node("Relu", ["x0"], ["x"], name="relu"),
                      helper.make_node("If", ["c"], ["y"], name="branch", then_branch=then,
                                       else_branch=other)], inputs=("x0", "c"))
    graph = lift(model)
    branch = next(op for op in graph.ops if op.type == "If")
    assert [t.name for t in branch.inputs] == ["c", "x"]
    assert branch.attrs["_onnx"]["captures"] == ["x"]
    nested = branch.attrs["then_branch"]
    assert [op.type for op in nested.ops] == ["Neg"]
    assert nested.inputs[0].attrs["captured"] == "x"
    assert graph.namespace == "onnx/13/graph"
    assert mlp().graph.node[0].name == "fc"
