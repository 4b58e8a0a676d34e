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


def test_unknown_element_type_is_an_amanda_error():
    model = model_of([helper.make_node("Relu", ["x"], ["y"], name="r")])
    model.graph.input[0].type.tensor_type.elem_type = 99
    with pytest.raises(amanda.BackendError, match="unknown ONNX element type 99"):
        lift(model)


def test_no_default_domain_opset_is_an_amanda_error():
    model = model_of([helper.make_node("Relu", ["x"], ["y"], name="r")])
    del model.opset_import[:]
    model.opset_import.add(domain="com.example", version=1)
    with pytest.raises(amanda.BackendError, match="imports no version of the default domain"):
        lift(model)
    with pytest.raises(amanda.BackendError, match="default domain"):
        amanda.instrument(model, amanda.tools.identity.IdentityTool())


# -- fuzzing: every malformed model ends in an onnx/onnxruntime error or an
# AmandaError, never a crash, a hang or a silently different result

hypothesis = pytest.importorskip("hypothesis")
st = hypothesis.strategies
np = pytest.importorskip("numpy")
ort = pytest.importorskip("onnxruntime")
from google.protobuf.message import DecodeError  # noqa: E402

from tests.onnx.conftest import numpy_helper  # noqa: E402


class _Look(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        context.insert_before_op(self.look)
        context.insert_after_op(self.look)

    def look(self, *arrays):
        pass


_EXPECTED = (amanda.AmandaError, onnx.checker.ValidationError, DecodeError,
             ort.capi.onnxruntime_pybind11_state.Fail,
             ort.capi.onnxruntime_pybind11_state.InvalidGraph,
             ort.capi.onnxruntime_pybind11_state.InvalidArgument,
             ort.capi.onnxruntime_pybind11_state.InvalidProtobuf,
             ort.capi.onnxruntime_pybind11_state.NotImplemented,
             ort.capi.onnxruntime_pybind11_state.RuntimeException)


def _structural(kind, k):
    """A small model broken in one way (``k`` varies the details)."""
    model = mlp()
    graph = model.graph
    if kind == "dangling":
        graph.node[k % 2].input[0] = f"ghost{k}"
    elif kind == "cycle":
        graph.node[0].input[0] = graph.node[1].output[0]
    elif kind == "dtype":
        graph.input[0].type.tensor_type.elem_type = 30 + k
    elif kind == "huge_dim":
        graph.input[0].type.tensor_type.shape.dim[k % 2].dim_value = 2 ** 62 + k
    elif kind == "duplicate":
        graph.node[1].output[0] = graph.node[0].output[0]
    elif kind == "missing_initializer":
        del graph.initializer[k % 2]
    elif kind == "no_opset":
        del model.opset_import[:]
    elif kind == "duplicate_initializer":
        graph.initializer.add().CopyFrom(graph.initializer[k % 2])
    return model.SerializeToString()


def _check(data):
    """amanda.instrument and a session inside apply either fail with an
    expected error or give the plain session's results."""
    x = np.random.default_rng(0).standard_normal((2, 4)).astype(np.float32)
    try:
        amanda.instrument(data, _Look())
    except _EXPECTED:
        pass
    try:
        plain = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        expected = plain.run(None, {"x": x})
    except Exception:   # noqa: BLE001 - onnxruntime rejects it without amanda
        expected = None
    try:
        with amanda.apply(_Look()):
            session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        got = session.run(None, {"x": x})
    except _EXPECTED:
        return
    assert expected is not None, "amanda ran a model onnxruntime rejects"
    assert all(np.array_equal(a, b, equal_nan=True) for a, b in zip(expected, got))


@hypothesis.settings(max_examples=100, deadline=None, derandomize=True)
@hypothesis.given(kind=st.sampled_from(["truncate", "flip", "dangling", "cycle", "dtype",
                                        "huge_dim", "duplicate", "missing_initializer",
                                        "no_opset", "duplicate_initializer"]),
                  k=st.integers(0, 10_000), value=st.integers(0, 255))
def test_fuzzed_models_end_in_an_expected_error_or_the_plain_result(kind, k, value):
    data = mlp().SerializeToString()
    if kind == "truncate":
        data = data[:k % len(data)]
    elif kind == "flip":
        mutable = bytearray(data)
        mutable[k % len(mutable)] ^= value or 1
        data = bytes(mutable)
    else:
        data = _structural(kind, k)
    _check(data)
