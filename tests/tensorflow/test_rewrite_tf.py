"""Subgraph rewriting on TensorFlow graphs: lift, rewrite, lower to a GraphDef, run.

Keras ResNet50 (random weights, 64x64 input, inference) in a tf.compat.v1 graph;
batch-norm statistics and affine weights are set away from the identity so that
folding them into the convolutions changes every weight.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from amanda.errors import BackendError  # noqa: E402
from amanda.frontends.tensorflow import lift_graph  # noqa: E402
from amanda.ir import Graph  # noqa: E402
from amanda.runtime.tensorflow_graphdef import lower_to_graph_def  # noqa: E402
from amanda.tools import rewrite  # noqa: E402
from amanda.tools.rewrite import explain, op  # noqa: E402


class InferenceResNet:
    """The graph, its input, the tensors compared, and the values to load into any copy."""

    def __init__(self):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = tf.compat.v1.placeholder(tf.float32, [1, 64, 64, 3], name="x")
            model = tf.keras.applications.ResNet50(weights=None, input_shape=(64, 64, 3))
            self.y = model(self.x)
            self.init = tf.compat.v1.variables_initializer([w.value for w in model.weights], name="init")
        # the pooled features and the logits before the softmax, besides the probabilities
        self.fetches = [self.y.name, next(o for o in self.graph.get_operations() if o.type == "Mean").outputs[0].name,
                        self.y.op.inputs[0].name]
        rng = np.random.default_rng(0)
        self.assigns = {}
        for op_ in self.graph.get_operations():
            if op_.type != "AssignVariableOp" or "_bn/" not in op_.name:
                continue
            shape = op_.inputs[1].shape.as_list()
            if "moving_mean" in op_.name or "beta" in op_.name:
                self.assigns[op_.name] = rng.normal(0, 0.1, shape).astype("float32")
            else:  # moving_variance, gamma
                self.assigns[op_.name] = rng.uniform(0.5, 1.5, shape).astype("float32")
        self.data = rng.normal(size=(1, 64, 64, 3)).astype("float32")

    def run(self, graph_def):
        """Import ``graph_def`` into a new graph, load the weights, return the fetched values."""
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(graph.get_operation_by_name(self.init.name))
            assigns = [graph.get_operation_by_name(name) for name in self.assigns]
            session.run(assigns, {a.inputs[1]: self.assigns[a.name] for a in assigns})
            return session.run(self.fetches, {self.x.name: self.data})


@pytest.fixture(scope="module")
def resnet():
    model = InferenceResNet()
    model.ir = lift_graph(model.graph)
    model.expected = model.run(model.graph.as_graph_def())
    return model


def test_lowering_without_rewrites_reproduces_the_graph(resnet):
    graph_def = lower_to_graph_def(resnet.ir, base=resnet.graph)
    assert len(graph_def.node) == len(resnet.graph.as_graph_def().node)
    for actual, expected in zip(resnet.run(graph_def), resnet.expected):
        assert np.array_equal(actual, expected)


def test_fold_batchnorm_into_conv_tensorflow_resnet50(resnet):
    result = rewrite.rewrite(resnet.ir, rewrite.fold_batchnorm_rules("tensorflow"))
    assert result.counts() == {"fold_batchnorm": 53} and result.converged
    folded = result.graph
    # every convolution now reads a scaled weight; no activation goes through the batch-norm multiply
    convs = [o for o in folded if o.type == "Conv2D"]
    assert len(convs) == 53 and all(c.inputs[1].producer.type == "Mul" for c in convs)
    assert not any(o.name.endswith("batchnorm/mul_1") for o in folded)
    graph_def = lower_to_graph_def(folded, base=resnet.graph)
    for actual, expected in zip(resnet.run(graph_def), resnet.expected):
        assert float(np.abs(actual - expected).max() / np.abs(expected).max()) < 1e-4
    assert len(rewrite.find_matches(rewrite.fold_batchnorm_rules("tensorflow")[0].pattern, folded)) == 0


def test_explainer_on_a_deliberately_failing_tensorflow_pattern(resnet):
    # Keras 3 does not emit FusedBatchNormV3 here: the explainer says where the pattern goes wrong
    fused = rewrite.pattern(lambda x, w, s, o, m, v: op.Relu(op.FusedBatchNormV3(op.Conv2D(x, w, name="conv"), s, o,
                                                                                    m, v, name="bn"), name="relu"),
                            name="conv_fusedbn_relu")
    relu = next(o for o in resnet.ir if o.type == "Relu")
    why = explain(fused, resnet.ir, at=relu)
    assert why.node == "bn" and why.target.endswith("batchnorm/add_1")
    assert "pattern node 'bn' (FusedBatchNormV3)" in str(why) and "type is 'AddV2'" in str(why)
    # a constraint failure is named too: require a scale of 7 channels
    strict = rewrite.fold_batchnorm_rules("tensorflow")[0].pattern
    strict.constraints["scale"] = [rewrite.constraint("the scale has 7 channels")(
        lambda t, m: t.attrs["shape"][-1] == 7)]
    why = explain(strict, resnet.ir)
    assert why.node == "scale" and "constraint 'the scale has 7 channels' failed" in why.reason


def test_lowering_errors_name_the_op():
    g = Graph("g")
    g.create_op("NoSuchTFOp", [], name="weird")
    with pytest.raises(BackendError, match="op 'weird': 'NoSuchTFOp' is not a registered"):
        lower_to_graph_def(g)
    g = Graph("g")
    g.create_op("Const", [], attrs={"dtype": "float32", "value": {"dtype": "float32", "shape": [100]}}, name="big")
    with pytest.raises(BackendError, match="without its value"):
        lower_to_graph_def(g)


def test_new_ops_get_their_attrs_from_the_op_def():
    g = Graph("g")
    c = g.create_op("Const", [], attrs={"dtype": "float32", "value": np.arange(6, dtype="float32").reshape(2, 3)},
                    name="c")
    m = g.create_op("Mul", [c.outputs[0], c.outputs[0]], attrs={"T": "float32"}, name="square")
    s = g.create_op("Sum", [m.outputs[0], g.create_op("Const", [], attrs={"dtype": "int32", "value": {
        "dtype": "int32", "shape": [1], "value": [1]}}, name="axis").outputs[0]],
        attrs={"T": "float32", "Tidx": "int32", "keep_dims": True}, name="total")
    graph_def = lower_to_graph_def(g)
    graph = tf.Graph()
    with graph.as_default():
        tf.graph_util.import_graph_def(graph_def, name="")
    with tf.compat.v1.Session(graph=graph) as session:
        value = session.run(s.name + ":0")
    assert value.tolist() == [[5.0], [50.0]]


def test_docs_page_examples_run():
    """docs/tools/rewrite.md: IR, TensorFlow and PyTorch examples, with their printed output."""
    pytest.importorskip("torch")
    from tests.markdown import run_examples

    namespace = run_examples("docs/tools/rewrite.md")
    assert namespace["folded"].counts() == {"fold_batchnorm": 1}
