"""Subgraph rewriting on ONNX models: gelu -> tanh approximation, a QuantizeLinear /
DequantizeLinear pair around every matrix product; lifted, rewritten, lowered and
run in onnxruntime, checked against NumPy.

Models: a small transformers BERT (random weights) exported by torch.onnx at
opset 17 (the TorchScript exporter writes gelu as Div/Erf/Add/Mul/Mul) and at
opset 20 (a ``Gelu`` op), and a Linear-GELU-Linear MLP exported by both
exporters (the dynamo exporter multiplies the gelu out in another order).
"""

import io
import warnings

import numpy as np
import pytest

from tests.onnx.conftest import onnx, ort, session

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from amanda.frontends.onnx import lift
from amanda.runtime.onnx import lower
from amanda.tools import rewrite
from amanda.tools.rewrite import explain

LAYERS = 2
SEQ = 12


def numpy_tanh_gelu(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def numpy_fake_quant(x, scale):
    """QuantizeLinear -> DequantizeLinear to int8, zero point 0 (round half to even, like np.round)."""
    return (np.clip(np.round(x / np.float32(scale)), -128, 127) * np.float32(scale)).astype(np.float32)


class LastHidden(torch.nn.Module):
    """BERT's last hidden state from input ids (the tracing exporter passes positional args only)."""

    def __init__(self, act):
        super().__init__()
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=LAYERS,
                                         num_attention_heads=2, intermediate_size=128, hidden_act=act,
                                         attn_implementation="eager", initializer_range=0.5)
        self.bert = transformers.BertModel(config).eval()

    def forward(self, ids):
        return self.bert(input_ids=ids).last_hidden_state


def export(module, args, opset, dynamo=False):
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, buffer, dynamo=dynamo, opset_version=opset, input_names=["x"])
    model = onnx.load_from_string(buffer.getvalue())
    model.ir_version = min(model.ir_version, 10)
    return model


def run(model, feeds, outputs=()):
    """Runs ``model`` as written (no graph optimizations); extra intermediate ``outputs``
    (tensor names) are fetched after the model's own.

    onnxruntime's optimizer treats Q/DQ pairs as a quantized model: from level
    basic on it also quantizes a Gemm's bias to int32 (scale = input scale *
    weight scale), which moves values by up to one quantization step downstream.
    """
    if outputs:
        copy = onnx.ModelProto()
        copy.CopyFrom(model)
        copy.graph.output.extend(onnx.ValueInfoProto(name=name) for name in outputs)
        model = copy
    return session(model, level=ort.GraphOptimizationLevel.ORT_DISABLE_ALL).run(None, feeds)


def rewrite_and_lower(model, rules):
    result = rewrite.rewrite(lift(model), rules)
    lowered = lower(result.graph)
    lowered.ir_version = min(lowered.ir_version, 10)
    onnx.checker.check_model(lowered, full_check=True)
    return result, lowered


@pytest.fixture(scope="module")
def bert():
    ids = torch.randint(0, 500, (1, SEQ), generator=torch.Generator().manual_seed(5))
    exact, tanh = LastHidden("gelu"), LastHidden("gelu_pytorch_tanh")
    return {"feeds": {"x": ids.numpy()}, "exact": export(exact, (ids,), 17),
            "tanh": export(tanh, (ids,), 17), "exact20": export(exact, (ids,), 20)}


@pytest.mark.parametrize("opset", [17, 20])
def test_gelu_tanh_rewrite_onnx_bert(bert, opset):
    """initializer_range=0.5 puts the gelu inputs at O(1), where tanh and exact gelu differ visibly."""
    model = bert["exact" if opset == 17 else "exact20"]
    gelus = sum(n.op_type in ("Erf", "Gelu") for n in model.graph.node)
    assert gelus == LAYERS
    rules = rewrite.gelu_tanh_rules("onnx")
    graph = lift(model)
    matches = [m for rule in rules for m in rewrite.find_matches(rule.pattern, graph)]
    result, lowered = rewrite_and_lower(model, rules)
    assert result.counts() == {"gelu_tanh": gelus} and len(matches) == gelus and result.converged
    types = [n.op_type for n in lowered.graph.node]
    read = {name for n in lowered.graph.node for name in n.input} | {o.name for o in lowered.graph.output}
    assert all(out in read for n in lowered.graph.node for out in n.output)  # the gelus' constants went too
    if opset == 17:
        assert "Erf" not in types and types.count("Tanh") == gelus
    else:
        assert [a.s for n in lowered.graph.node if n.op_type == "Gelu" for a in n.attribute] == [b"tanh"] * gelus

    # every replacement computes the tanh formula on its own input
    suffix = "/tanh_approx/output" if opset == 17 else "/tanh_approx"
    outs = [result.graph.ops[[o.name for o in result.graph].index(m.anchor.name + suffix)].outputs[0].name
            for m in matches]
    actual, *values = run(lowered, bert["feeds"], [m["x"].name for m in matches] + outs)
    for x, out in zip(values[:gelus], values[gelus:]):
        np.testing.assert_allclose(out, numpy_tanh_gelu(x), rtol=1e-5, atol=1e-6)
    # the rewritten model is the tanh-gelu model torch exports, not the exact one
    (expected,), (exact,) = run(bert["tanh"], bert["feeds"]), run(model, bert["feeds"])
    to_tanh, to_exact = np.abs(actual - expected).max(), np.abs(actual - exact).max()
    assert to_tanh < 1e-4 and to_tanh * 10 < to_exact


def test_fake_quant_around_every_matmul_onnx_bert(bert):
    scale = 1 / 64
    model = bert["exact"]
    products = sum(n.op_type in ("MatMul", "Gemm") for n in model.graph.node)
    assert products == LAYERS * 8  # q, k, v, scores, context, output, 2 feed-forward per layer
    result, lowered = rewrite_and_lower(model, rewrite.fake_quant_matmul_rules("onnx", scale=scale))
    assert result.counts() == {"fake_quant_matmul": products} and result.converged and result.iterations == 2
    producers = {out: n for n in lowered.graph.node for out in n.output}
    quantized = [n for n in lowered.graph.node if n.op_type == "MatMul"]
    assert len(quantized) == products
    fetches = []
    for n in quantized:
        dq = [producers[name] for name in n.input[:2]]
        assert [d.op_type for d in dq] == ["DequantizeLinear"] * 2
        q = [producers[d.input[0]] for d in dq]
        assert [p.op_type for p in q] == ["QuantizeLinear"] * 2
        fetches += [q[0].input[0], q[1].input[0], n.input[0], n.input[1], n.output[0]]
    # operands that are weights are initializers: read them from the model
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in lowered.graph.initializer}
    graph_fetches = [name for name in fetches if name not in weights]
    got = run(lowered, bert["feeds"], graph_fetches)
    values = dict(zip(graph_fetches, got[1:]), **weights)
    for i in range(products):
        a, b, qa, qb, out = (values[name] for name in fetches[5 * i:5 * i + 5])
        assert np.array_equal(qa, numpy_fake_quant(a, scale)) and np.array_equal(qb, numpy_fake_quant(b, scale))
        reference = np.matmul(qa.astype(np.float64), qb.astype(np.float64))
        assert np.abs(out - reference).max() < 1e-5 * max(np.abs(reference).max(), 1)
    # the model's output is computed from the quantized products (int8 at 1/64 clips BERT's activations)
    exact = run(model, bert["feeds"])[0]
    assert np.isfinite(got[0]).all() and not np.array_equal(got[0], exact)


class MLP(torch.nn.Module):
    def __init__(self, approximate="none"):
        super().__init__()
        torch.manual_seed(1)
        self.fc1, self.fc2 = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)
        self.act = torch.nn.GELU(approximate=approximate)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


@pytest.mark.parametrize("opset,dynamo", [(17, False), (18, True), (20, False)],
                         ids=["torchscript17", "dynamo18", "torchscript20"])
def test_both_rewrites_on_an_mlp_equal_numpy(opset, dynamo):
    mlp, x = MLP().eval(), np.random.default_rng(3).normal(size=(3, 8)).astype(np.float32)
    model = export(mlp, (torch.from_numpy(x),), opset, dynamo)
    w1, b1, w2, b2 = (p.detach().numpy().astype(np.float64) for p in mlp.parameters())
    rules = rewrite.gelu_tanh_rules("onnx") + rewrite.fake_quant_matmul_rules("onnx", scale=1 / 32)
    result, lowered = rewrite_and_lower(model, rules)
    assert result.counts() == {"gelu_tanh": 1, "fake_quant_matmul": 2}
    assert sum(n.op_type == "QuantizeLinear" for n in lowered.graph.node) == 4

    def fq(t):
        return numpy_fake_quant(t.astype(np.float32), 1 / 32).astype(np.float64)

    hidden = numpy_tanh_gelu(fq(x) @ fq(w1).T + b1)
    expected = fq(hidden) @ fq(w2).T + b2
    np.testing.assert_allclose(run(lowered, {"x": x})[0], expected, rtol=1e-5, atol=1e-5)


def test_explainer_says_why_the_onnx_gelu_pattern_does_not_match():
    x = torch.randn(3, 8)
    rules = rewrite.gelu_tanh_rules("onnx")
    # opset 20: Gelu is already the tanh approximation
    graph = lift(export(MLP("tanh").eval(), (x,), 20))
    gelu = next(o for o in graph if o.type == "Gelu")
    why = explain(rules, graph)
    assert not why and why.at == gelu.name and why.node == "gelu"
    assert "constraint \"Gelu is exact (approximate='none')\" failed" in str(why)
    # opset 17: the exporter spells the tanh gelu with Tanh where the exact one has Erf
    graph = lift(export(MLP("tanh").eval(), (x,), 17))
    assert rewrite.rewrite(graph, rules).counts() == {}
    why = explain(rules, graph)
    tanh = next(o for o in graph if o.type == "Tanh")
    assert why.node == "erf" and why.target == tanh.name and "type is 'Tanh', expected 'Erf'" in why.reason
