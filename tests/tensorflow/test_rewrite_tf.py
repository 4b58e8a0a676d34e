"""Subgraph rewriting on TensorFlow graphs: lift, rewrite, lower to a GraphDef, run.

Keras ResNet50 (random weights, 64x64 input, inference) in a tf.compat.v1 graph;
batch-norm statistics and affine weights are set away from the identity so that
folding them into the convolutions changes every weight. A Keras transformer
block (attention, Dense with gelu) for the gelu -> tanh and fake-quant rewrites,
checked op by op and end to end against NumPy.
"""

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from amanda.errors import BackendError
from amanda.frontends.tensorflow import lift_graph
from amanda.ir import Graph
from amanda.runtime.tensorflow.graphdef import lower_to_graph_def
from amanda.tools import rewrite
from amanda.tools.rewrite import explain, op


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
    """docs/tools/rewrite.md: IR, TensorFlow, PyTorch and ONNX examples, with their printed output."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from tests.markdown import run_examples

    namespace = run_examples("docs/tools/rewrite.md")
    assert namespace["folded"].counts() == {"fold_batchnorm": 1}
    # the last examples: both rewrites on the ONNX export of the PyTorch block
    assert namespace["tanh"].counts() == {"gelu_tanh": 1} and namespace["quant"].counts() == {"fake_quant_matmul": 3}


# ---------------------------------------------------------------------------
# gelu -> tanh and fake-quant around every matmul on a Keras transformer block
# ---------------------------------------------------------------------------

_PRODUCT_TYPES = ("MatMul", "BatchMatMulV2", "Einsum")


def numpy_tanh_gelu(x):
    x = x.astype("float64")
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def numpy_fake_quant(x, scale):
    """TensorFlow's FakeQuantWithMinMaxArgs with min = -128 * scale, max = 127 * scale (round half up)."""
    return (np.floor(np.clip(x, -128 * scale, 127 * scale) / scale + 0.5) * scale).astype("float32")


def numpy_product(op_, a, b):
    """What a TF matrix-product op computes, in float64."""
    a, b = a.astype("float64"), b.astype("float64")
    if op_.type == "Einsum":
        return np.einsum(op_.attrs["equation"], a, b)
    ta = op_.attrs.get("transpose_a", op_.attrs.get("adj_x", False))
    tb = op_.attrs.get("transpose_b", op_.attrs.get("adj_y", False))
    return np.matmul(np.swapaxes(a, -1, -2) if ta else a, np.swapaxes(b, -1, -2) if tb else b)


class TransformerBlock:
    """A Keras transformer block (attention, layer norms, Dense with gelu) followed by a
    hand-written erf gelu, as in older TensorFlow and TF ports of transformers models."""

    def __init__(self):
        import math

        layers = tf.keras.layers
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.x = tf.compat.v1.placeholder(tf.float32, [2, 8, 16], name="x")
            inputs = tf.keras.Input((8, 16))
            attended = layers.MultiHeadAttention(num_heads=2, key_dim=8)(inputs, inputs)
            hidden = layers.LayerNormalization()(inputs + attended)
            ff = layers.Dense(16)(layers.Dense(32, activation="gelu")(hidden))
            block = tf.keras.Model(inputs, layers.LayerNormalization()(hidden + ff))
            head = layers.Dense(16)
            h = head(block(self.x))
            self.y = tf.identity(h * (0.5 * (1.0 + tf.math.erf(h / math.sqrt(2.0)))), name="y")
            self.init = tf.compat.v1.variables_initializer([w.value for w in block.weights + head.weights],
                                                           name="init")
        self.data = np.random.default_rng(0).normal(size=(2, 8, 16)).astype("float32")
        self.ir = lift_graph(self.graph)

    def run(self, graph_def, fetches, feeds=None):
        graph = tf.Graph()
        with graph.as_default():
            tf.graph_util.import_graph_def(graph_def, name="")
        with tf.compat.v1.Session(graph=graph) as session:
            session.run(graph.get_operation_by_name(self.init.name))
            return session.run(fetches, {self.x.name: self.data, **(feeds or {})})

    def run_original_with(self, replace):
        """The original graph's output with each matched op's output fed by ``replace(op, session values)``,
        in graph order: an independent reference for a rewritten graph."""
        graph_def = self.graph.as_graph_def()
        feeds = {}
        for anchor, inputs, compute in replace:
            values = self.run(graph_def, inputs, feeds)
            feeds[anchor] = compute(*values)
        return self.run(graph_def, self.y.name, feeds)


@pytest.fixture(scope="module")
def block():
    return TransformerBlock()


def tf_name(tensor):
    """The TensorFlow name of an IR tensor (tensors of ops a rewrite made have no TF name of their own)."""
    return f"{tensor.producer.name}:{tensor.index}" if tensor.producer is not None else tensor.name


def matches_of(rules, graph):
    found = [m for rule in rules for m in rewrite.find_matches(rule.pattern, graph)]
    return sorted(found, key=lambda m: graph.ops.index(m.anchor))


def test_gelu_tanh_rewrite_tensorflow_transformer_block(block):
    rules = rewrite.gelu_tanh_rules("tensorflow")
    gelus = sum(o.type in ("Erf", "Erfc") for o in block.ir)
    assert gelus == 2  # Keras's gelu (erfc) and the hand-written one (erf)
    matches = matches_of(rules, block.ir)
    result = rewrite.rewrite(block.ir, rules)
    assert result.counts() == {"gelu_tanh": gelus} and len(matches) == gelus and result.converged
    rewritten = result.graph
    assert not any(o.type in ("Erf", "Erfc") for o in rewritten)
    # Keras's gelu ops, its constants included, are gone
    assert not any("/Gelu/" in o.name and "/tanh_approx/" not in o.name for o in rewritten)
    assert sum(o.type == "Tanh" for o in rewritten) == gelus
    graph_def = lower_to_graph_def(rewritten, base=block.graph)

    # every replacement computes the tanh formula on its own input
    xs = [m["x"].name for m in matches]
    outs = [f"{m.anchor.name}/tanh_approx/output:0" for m in matches]
    *values, actual = block.run(graph_def, xs + outs + [block.y.name])
    for x, out in zip(values[:gelus], values[gelus:]):
        np.testing.assert_allclose(out, numpy_tanh_gelu(x), rtol=1e-5, atol=1e-6)
    # and the model is the original with tanh gelus: feed NumPy tanh gelus into the original graph
    expected = block.run_original_with([(m.anchor.outputs[0].name, [m["x"].name], numpy_tanh_gelu) for m in matches])
    exact = block.run(block.graph.as_graph_def(), block.y.name)
    assert np.abs(actual - expected).max() < 1e-5 * np.abs(expected).max()
    assert np.abs(actual - expected).max() * 10 < np.abs(actual - exact).max()  # not the exact gelu any more


def test_fake_quant_around_every_matmul_tensorflow_transformer_block(block):
    scale = 1 / 64
    rules = rewrite.fake_quant_matmul_rules("tensorflow", scale=scale)
    products = [o for o in block.ir if o.type in _PRODUCT_TYPES]
    # attention: 4 projections (BatchMatMulV2) and 2 einsums; 3 Dense layers (MatMul)
    assert len(products) == 9
    result = rewrite.rewrite(block.ir, rules)
    assert result.counts() == {"fake_quant_matmul": len(products)} and result.converged
    assert result.iterations == 2  # the second iteration finds every product quantized
    rewritten = result.graph
    quantized = [o for o in rewritten if o.type in _PRODUCT_TYPES]
    assert len(quantized) == len(products)
    assert all(t.producer.type == "FakeQuantWithMinMaxArgs" for o in quantized for t in o.inputs)
    graph_def = lower_to_graph_def(rewritten, base=block.graph)

    # each product reads the NumPy fake-quant of its operands
    fetches = []
    for o in quantized:
        fq_a, fq_b = o.inputs[0].producer, o.inputs[1].producer
        fetches += [tf_name(fq_a.inputs[0]), tf_name(fq_b.inputs[0]), tf_name(fq_a.outputs[0]),
                    tf_name(fq_b.outputs[0]), tf_name(o.outputs[0])]
    values = block.run(graph_def, fetches + [block.y.name])
    actual = values.pop()
    for i, o in enumerate(quantized):
        a, b, qa, qb, out = values[5 * i:5 * i + 5]
        assert np.array_equal(qa, numpy_fake_quant(a, scale)) and np.array_equal(qb, numpy_fake_quant(b, scale))
        reference = numpy_product(o, qa, qb)
        assert np.abs(out - reference).max() < 1e-5 * max(np.abs(reference).max(), 1)
    # the whole model against the original graph fed with NumPy products of fake-quantized operands
    replace = [(p.outputs[0].name, [p.inputs[0].name, p.inputs[1].name],
                lambda a, b, p=p: numpy_product(p, numpy_fake_quant(a, scale), numpy_fake_quant(b, scale)))
               for p in products]
    expected = block.run_original_with(replace)
    exact = block.run(block.graph.as_graph_def(), block.y.name)
    assert np.abs(actual - expected).max() < 1e-4 * np.abs(expected).max()
    assert np.abs(actual - expected).max() * 10 < np.abs(actual - exact).max()


def test_explainer_says_why_the_tensorflow_gelu_pattern_does_not_match():
    graph = tf.Graph()
    with graph.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [4], name="x")
        tf.nn.gelu(x, approximate=True, name="tanh_gelu")
        tf.multiply(0.5 * x, tf.math.erfc(-x * 0.5), name="wrong_constant")
    ir = lift_graph(graph)
    rules = rewrite.gelu_tanh_rules("tensorflow")
    assert rewrite.rewrite(ir, rules).counts() == {}
    tanh = next(o for o in ir if o.type == "Tanh")
    anchor = next(o for o in ir if o.type == "Mul" and o.name.startswith("tanh_gelu") and not o.users)
    why = explain(rules, ir, at=anchor)  # the furthest of the rule set's patterns
    assert not why and why.node == "erf" and why.target == tanh.name
    assert "pattern node 'erf' (Erf) against 'tanh_gelu/Tanh': type is 'Tanh', expected 'Erf'" in str(why)
    why = explain(rules, ir, at="wrong_constant")
    assert why.node == "c" and "constraint 'the erf argument is x / sqrt(2)" in why.reason
    assert explain(rules, ir).at in (anchor.name, "wrong_constant")  # without `at`: a gelu-like candidate
