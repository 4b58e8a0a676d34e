"""Debugging tools in TensorFlow graph mode (tf.compat.v1 sessions)."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

import amanda  # noqa: E402
from amanda.tools.debugging import NanDetector, OpStatistics  # noqa: E402


def dense_kernel(graph):
    """The Dense layer's kernel variable op. Keras numbers layer names per
    process (``dense``, ``dense_1``...), so it is found by shape of name."""
    (op,) = [op for op in graph.get_operations() if op.type == "VarHandleOp"
             and op.name.split("/")[-2].startswith("dense") and op.name.endswith("/kernel")]
    return op


def assign_op_of(variable_op, graph):
    """The initializer's assign op of the variable (no op is added)."""
    op = graph.get_operation_by_name(variable_op.name + "/Assign")
    return op, op.inputs[1]


def test_nan_in_dense_kernel_names_the_dense_matmul(keras_cnn_graph):
    model = keras_cnn_graph()
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        variable = dense_kernel(model.graph)
        assign, value = assign_op_of(variable, model.graph)
        kernel = session.run(model.graph.get_tensor_by_name(
            variable.name + "/Read/ReadVariableOp:0"))
        kernel[3, 2] = np.nan
        session.run(assign, {value: kernel})
        tool = NanDetector()
        with amanda.apply(tool):
            y = session.run(model.y, {model.x: image})
    assert np.isnan(y[:, 2]).all() and np.isfinite(np.delete(y, 2, axis=1)).all()
    report = tool.report
    assert report is not None, "no NaN found"
    assert report.backward is False
    assert report.op_name == "MatMul"
    assert "dense" in report.op_id and report.op_id.endswith("MatMul")
    assert report.namespace.startswith("tensorflow/")
    assert report.output_stats["nan"] == 2          # column 2 of both images
    # inputs: the flattened activations (finite) and the kernel (one NaN)
    numeric = [s for s in report.input_stats if s is not None]
    assert sorted(s["nan"] for s in numeric) == [0, 1]


def test_backward_inf_of_sqrt_names_the_sqrt_gradient():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [2, 4], name="x")
        w = tf.compat.v1.get_variable("w", initializer=tf.ones([4, 4]))
        h = tf.matmul(x, w, name="matmul") * 0.0
        loss = tf.reduce_sum(tf.sqrt(h, name="root"), name="loss")
        grads = tf.compat.v1.gradients(loss, [w])
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=graph) as session:
        session.run(init)
        tool = NanDetector()
        with amanda.apply(tool):
            value, (grad,) = session.run([loss, grads], {x: np.ones((2, 4), np.float32)})
    assert value == 0.0 and np.isnan(grad).all()
    report = tool.report
    assert report is not None and report.backward is True
    assert report.op_id == "root"
    assert report.backward_op_type == "SqrtGrad"
    assert "root_grad" in report.backward_op_name
    assert report.output_stats["inf"] == 8


def test_op_statistics_relu_sparsity(keras_cnn_graph):
    model = keras_cnn_graph()
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32) - 0.5
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        relu = [op for op in model.graph.get_operations() if op.type == "Relu"]
        assert len(relu) == 1
        expected = session.run(relu[0].outputs[0], {model.x: image})
        tool = OpStatistics(op_types="Relu", dump_ops="Relu")
        with amanda.apply(tool):
            session.run(model.y, {model.x: image})
    (row,) = tool.report()
    assert row["op_id"] == relu[0].name and row["calls"] == 1
    assert row["sparsity"] > 0
    assert row["sparsity"] == pytest.approx(float((expected == 0).mean()))
    assert row["mean"] == pytest.approx(float(expected.mean()), rel=1e-5)
    np.testing.assert_array_equal(tool.dumped()[(relu[0].name, 0)], expected)


class PlantAfterConv(amanda.Tool):
    """Another tool's after-routine turns the second Conv2D's output into NaN."""

    def __init__(self):
        super().__init__()
        self.convs = 0
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get_op().type == "Conv2D":
            if self.convs == 1:
                context.insert_after_op(lambda y: y * np.float32("nan"))
            self.convs += 1


def test_detector_sees_a_nan_planted_by_an_earlier_tool(keras_cnn_graph):
    """After-routines of several tools chain: the detector (applied second)
    reads the planted output, so it names the Conv2D, not its reader."""
    model = keras_cnn_graph()
    image = np.random.default_rng(0).random((2, 16, 16, 3), np.float32)
    detector = NanDetector()
    with tf.compat.v1.Session(graph=model.graph) as session:
        session.run(model.init)
        with amanda.apply(PlantAfterConv(), detector):
            y = session.run(model.y, {model.x: image})
    assert np.isnan(y).all()
    convs = [op.name for op in model.graph.get_operations() if op.type == "Conv2D"]
    assert detector.report is not None
    assert detector.report.op_name == "Conv2D"
    assert detector.report.op_id == convs[1]
