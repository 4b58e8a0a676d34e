"""Numeric diff: a TF graph (tf.compat.v1) vs its ONNX conversion (tf2onnx), op by op."""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
pytest.importorskip("tf2onnx")
pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from amanda.errors import ToolError  # noqa: E402
from amanda.models import KerasGraphModel  # noqa: E402
from amanda.tools.diff import diff_tf_onnx, tf_to_onnx  # noqa: E402


def _cnn():
    """A Keras CNN whose biases and batch-norm statistics are not trivial (so
    the converter cannot drop them), with a depthwise convolution and a batch
    norm the converter cannot fold into a convolution (it follows a pooling)."""
    layers, init = tf.keras.layers, tf.keras.initializers
    return tf.keras.Sequential([
        tf.keras.Input((16, 16, 3)),
        layers.Conv2D(8, 3, bias_initializer=init.RandomNormal(seed=1), name="conv_a"),
        layers.ReLU(),
        layers.DepthwiseConv2D(3, bias_initializer=init.RandomNormal(seed=2), name="depthwise"),
        layers.MaxPooling2D(2),
        layers.BatchNormalization(
            name="norm", beta_initializer=init.RandomNormal(seed=3),
            gamma_initializer=init.RandomUniform(0.5, 1.5, seed=4),
            moving_mean_initializer=init.RandomNormal(seed=5),
            moving_variance_initializer=init.RandomUniform(0.5, 1.5, seed=6)),
        layers.Conv2D(16, 3, bias_initializer=init.RandomNormal(seed=7), name="conv_b"),
        layers.GlobalAveragePooling2D(),
        layers.Dense(10, bias_initializer=init.RandomNormal(seed=8))])


class Converted:
    """A Keras model in a tf.compat.v1 graph, an input and its ONNX conversion."""

    def __init__(self, build, size):
        self.model = KerasGraphModel(build, [1, size, size, 3])
        self.image = np.random.default_rng(0).random((1, size, size, 3), np.float32)
        self.onnx = tf_to_onnx(self.model.session, [self.model.x], [self.model.y])

    def diff(self, onnx_model=None):
        return diff_tf_onnx(self.model.session, {self.model.x: self.image}, self.model.y,
                            onnx_model=self.onnx if onnx_model is None else onnx_model)

    def node(self, predicate):
        return next(n for n in self.onnx.graph.node if predicate(n))


@pytest.fixture(scope="module")
def cnn():
    return Converted(_cnn, 16)


@pytest.fixture(scope="module")
def mobilenet():
    return Converted(lambda: tf.keras.applications.MobileNetV2(
        weights=None, input_shape=(32, 32, 3), alpha=0.35), 32)


def tampered(model_proto, node_name, position, change):
    """A copy of the ONNX model with the initializer at ``position`` among the
    node's inputs changed."""
    copy = onnx.ModelProto()
    copy.CopyFrom(model_proto)
    node = next(n for n in copy.graph.node if n.name == node_name)
    tensor = next(t for t in copy.graph.initializer if t.name == node.input[position])
    tensor.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(tensor).copy()),
                                            tensor.name))
    return copy


def _data_ops(converted, op_type):
    graph = converted.model.graph
    return [op for op in graph.get_operations() if op.type == op_type
            and not op.name.startswith("gradients") and "/Initializer" not in op.name]


@pytest.mark.parametrize("name", ["cnn", "mobilenet"])
def test_a_faithful_conversion_has_no_divergence(name, request):
    converted = request.getfixturevalue(name)
    report = converted.diff()
    assert report.first is None, report.describe()
    assert report.output_error < 1e-5
    # every convolution of the graph is compared (on its own or fused with the
    # bias/batch norm after it), NHWC moved to the ONNX node's NCHW
    convolutions = _data_ops(converted, "Conv2D") + _data_ops(converted, "DepthwiseConv2dNative")
    covered = {op for match in report.compared for op in match.covered}
    assert convolutions and {op.name for op in convolutions} <= covered
    conv_matches = [m for m in report.compared if m.onnx_type == "Conv"]
    assert conv_matches and all(m.layout == "NHWC->NCHW" for m in conv_matches)
    assert all(m.tensor in {t.name for t in converted.model.graph.get_operation_by_name(
        m.tf_op).outputs} for m in report.compared)
    # what was not compared is listed
    covered_later = {op for match in report.compared for op in match.covered[:-1]}
    assert report.unmatched and set(report.unmatched) <= covered_later
    assert set(report.unmatched).isdisjoint({m.tf_op for m in report.compared})


def _group(node):
    return next((a.i for a in node.attribute if a.name == "group"), 1)


def test_a_changed_depthwise_weight_is_named_on_both_sides(cnn):
    # tf2onnx fuses the depthwise convolution with its bias into a grouped
    # Conv it renames (no TF tensor name): matched through the MaxPool's input
    node = cnn.node(lambda n: n.op_type == "Conv" and _group(n) > 1)
    report = cnn.diff(tampered(cnn.onnx, node.name, 1, lambda w: w * 1.5))
    first = report.first
    assert first is not None, report.describe()
    assert first.onnx_node == node.name and first.onnx_type == "Conv"
    (depthwise,) = _data_ops(cnn, "DepthwiseConv2dNative")
    assert (first.tf_op, first.tf_type) == (depthwise.name, "DepthwiseConv2dNative")
    assert first.max_abs_error > 1e-3 and first.layout == "NHWC->NCHW"
    # every tensor before it agreed; after it, the error reaches the output
    position = [m.tensor for m in report.compared].index(first.tensor)
    assert position > 0 and report.output_error > 1e-4
    assert first.tf_op in report.describe()


def test_a_changed_batch_norm_constant_is_named_on_both_sides(cnn):
    # the batch norm after the pooling stays a Mul and an Add in ONNX
    node = cnn.node(lambda n: n.op_type == "Mul" and "/norm" in n.name)
    tf_op = cnn.model.graph.get_operation_by_name(node.name)   # tf2onnx kept the name
    constant = next(i for i, name in enumerate(node.input)
                    if any(t.name == name for t in cnn.onnx.graph.initializer))
    report = cnn.diff(tampered(cnn.onnx, node.name, constant, lambda c: c + 0.25))
    assert report.first is not None, report.describe()
    assert (report.first.tf_op, report.first.tf_type) == (tf_op.name, "Mul")
    assert (report.first.onnx_node, report.first.onnx_type) == (node.name, "Mul")
    assert report.first.covered[-1] == tf_op.name


def test_a_conv_fused_with_its_batch_norm_is_named_through_the_mapping(mobilenet):
    # tf2onnx folds Conv2D + batch norm into one Conv named after the BN's Mul:
    # the mapping tables pick the Conv2D among the TF ops it covers
    fused = [n for n in mobilenet.onnx.graph.node if n.op_type == "Conv"
             and n.name.endswith("batchnorm/mul_1")]
    node = fused[len(fused) // 2]
    bn_mul = mobilenet.model.graph.get_tensor_by_name(node.output[0]).op
    (conv,) = [t.op for t in bn_mul.inputs if t.op.type == "Conv2D"]
    report = mobilenet.diff(tampered(mobilenet.onnx, node.name, 1, lambda w: -w))
    first = report.first
    assert first is not None, report.describe()
    assert (first.tf_op, first.tf_type) == (conv.name, "Conv2D")
    assert (first.onnx_node, first.onnx_type) == (node.name, "Conv")
    assert first.tensor == node.output[0] and bn_mul.name in first.covered


def test_the_users_graph_and_variables_are_untouched(cnn):
    graph, session = cnn.model.graph, cnn.model.session
    before = graph.as_graph_def().SerializeToString(deterministic=True)
    version = graph.version
    variables = [w.value for w in cnn.model.keras_model.weights]
    values = session.run(variables)
    output = session.run(cnn.model.y, {cnn.model.x: cnn.image})
    tf_to_onnx(session, [cnn.model.x], [cnn.model.y])
    cnn.diff(tampered(cnn.onnx, cnn.node(lambda n: n.op_type == "Conv").name, 1, lambda w: -w))
    assert graph.version == version
    assert graph.as_graph_def().SerializeToString(deterministic=True) == before
    for old, new in zip(values, session.run(variables)):
        np.testing.assert_array_equal(old, new)
    np.testing.assert_array_equal(output, session.run(cnn.model.y, {cnn.model.x: cnn.image}))


def test_names_and_errors(cnn):
    # feeds and outputs by name; the default conversion
    report = diff_tf_onnx(cnn.model.session, {"x:0": cnn.image}, [cnn.model.y.name])
    assert report.first is None and len(report.compared) >= 8
    with pytest.raises(ToolError, match="no tensor 'nope:0'"):
        diff_tf_onnx(cnn.model.session, {"x": cnn.image}, "nope:0", onnx_model=cnn.onnx)
    renamed = onnx.ModelProto()
    renamed.CopyFrom(cnn.onnx)
    renamed.graph.input[0].name = "other:0"
    with pytest.raises(ToolError, match="input 'other:0' is not among the fed tensors"):
        diff_tf_onnx(cnn.model.session, {"x": cnn.image}, cnn.model.y, onnx_model=renamed)


@pytest.mark.slow
def test_keras_resnet50_names_a_planted_conv():
    """ResNet50 (converting it takes tf2onnx 20-50 s on two cores)."""
    resnet = Converted(lambda: tf.keras.applications.ResNet50(
        weights=None, input_shape=(32, 32, 3)), 32)
    clean = resnet.diff()
    assert clean.first is None, clean.describe()
    assert len(clean.compared) > 100 and clean.output_error < 1e-5
    convs = [n for n in resnet.onnx.graph.node if n.op_type == "Conv"]
    node = convs[len(convs) // 2]
    report = resnet.diff(tampered(resnet.onnx, node.name, 1, lambda w: -w))
    assert report.first is not None and report.first.onnx_node == node.name
    assert report.first.tf_type == "Conv2D"
    expected = [op for op in report.first.covered
                if resnet.model.graph.get_operation_by_name(op).type == "Conv2D"]
    assert [report.first.tf_op] == expected
