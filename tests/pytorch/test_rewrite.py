"""Subgraph rewriting: matching, explanations, the driver, and example rewrites on PyTorch captures and ONNX."""

import importlib.util

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from amanda.ir import Graph
from amanda.passes.rewrite import RewriteError, match_at
from amanda.tools import rewrite
from amanda.tools.rewrite import Pattern, Rule, constraint, explain, op

# ---------------------------------------------------------------------------
# Backend-free: matching and the driver on hand-built IR graphs
# ---------------------------------------------------------------------------


def conv_bn_chain(n, with_relu=False, name="g"):
    """x -> (Conv -> BN [-> Relu]) * n; weights as graph inputs."""
    g = Graph(name, namespace="test/1/graph")
    y = g.add_input("x")
    for i in range(n):
        w = g.add_input(f"w{i}")
        conv = g.create_op("Conv", [y, w], name=f"conv{i}")
        bn = g.create_op("BN", [conv.outputs[0], g.add_input(f"s{i}")], name=f"bn{i}")
        y = bn.outputs[0]
        if with_relu:
            y = g.create_op("Relu", [y], name=f"relu{i}").outputs[0]
    g.set_outputs([y])
    return g


def conv_bn(x, w, s):
    return op.BN(op.Conv(x, w, name="conv"), s, name="bn")


def fused(match):
    made = match.graph.create_op("FusedConv", match.inputs, name=match["conv"].name + "_fused")
    return [made.outputs[0]]


def test_pattern_function_builds_an_ir_pattern():
    p = rewrite.pattern(conv_bn)
    assert [t.name for t in p.graph.inputs] == ["x", "w", "s"]
    assert [o.type for o in p.graph] == ["Conv", "BN"] and p.anchor.name == "bn"


def test_back_to_back_matches_are_all_replaced_and_rewired():
    g = conv_bn_chain(3)
    result = rewrite.rewrite(g, [Rule(rewrite.pattern(conv_bn), fused)])
    out = result.graph
    assert [o.type for o in out] == ["FusedConv"] * 3
    # each fused conv reads the previous one's output, not a removed tensor
    ops = out.ops
    assert ops[1].inputs[0] is ops[0].outputs[0] and ops[2].inputs[0] is ops[1].outputs[0]
    assert out.outputs[0] is ops[2].outputs[0]
    assert result.applied == [("conv_bn", "bn0", 1), ("conv_bn", "bn1", 1), ("conv_bn", "bn2", 1)]
    assert result.converged and result.iterations == 2
    assert [o.type for o in g] == ["Conv", "BN"] * 3  # the input graph is untouched


def test_matches_never_overlap_and_the_earliest_anchor_wins():
    # Relu(Relu(Relu(x))): the pattern Relu(Relu(a)) matches at relu1 and relu2;
    # relu1's match claims relu0 and relu1, so relu2 is matched in the next iteration.
    g = Graph("g")
    y = g.add_input("x")
    for i in range(3):
        y = g.create_op("Relu", [y], name=f"relu{i}").outputs[0]
    g.set_outputs([y])
    p = rewrite.pattern(lambda a: op.Relu(op.Relu(a, name="inner"), name="outer"), name="double_relu")
    one = Rule(p, lambda m: [m.graph.create_op("Relu", m.inputs, name="merged").outputs[0]])
    result = rewrite.rewrite(g, [one])
    assert result.applied == [("double_relu", "relu1", 1), ("double_relu", "relu2", 2)]
    assert [o.type for o in result.graph] == ["Relu"]


def test_earlier_rule_wins_at_the_same_op():
    g = conv_bn_chain(1)
    first = Rule(rewrite.pattern(conv_bn), fused, name="first")
    second = Rule(rewrite.pattern(lambda a, s: op.BN(a, s, name="bn")),
                  lambda m: [m.graph.create_op("Other", m.inputs).outputs[0]], name="second")
    assert rewrite.rewrite(g, [first, second]).counts() == {"first": 1}
    assert rewrite.rewrite(g, [second, first]).counts() == {"second": 1}


def test_interior_tensor_read_outside_blocks_the_match_and_is_explained():
    g = conv_bn_chain(1)
    conv = g.ops[0]
    extra = g.create_op("Probe", [conv.outputs[0]], name="probe")
    g.set_outputs(list(g.outputs) + list(extra.outputs))
    p = rewrite.pattern(conv_bn)
    assert rewrite.rewrite(g, [Rule(p, fused)]).modified is False
    why = explain(p, g, at="bn0")
    assert not why and why.node == "conv"
    assert "read by op 'probe' outside the match" in str(why)


def test_commutative_inputs_and_consistent_wildcards():
    g = Graph("g")
    x = g.add_input("x")
    relu = g.create_op("Relu", [x], name="relu")
    add = g.create_op("Add", [x, relu.outputs[0]], name="add")  # x + relu(x): operands swapped
    g.set_outputs(add.outputs)
    p = rewrite.pattern(lambda a: op.Add(op.Relu(a, name="r"), a, name="add"), name="residual")
    assert not explain(p, g, at="add")  # order matters by default
    p2 = rewrite.pattern(lambda a: op.Add(op.Relu(a, name="r"), a, name="add"), commutative=["Add"],
                         name="residual")
    assert explain(p2, g, at="add").matched
    # the same wildcard must bind the same tensor
    g2 = Graph("g2")
    x, y = g2.add_input("x"), g2.add_input("y")
    add2 = g2.create_op("Add", [g2.create_op("Relu", [x], name="r").outputs[0], y], name="add")
    g2.set_outputs(add2.outputs)
    why = explain(p2, g2, at="add")
    assert why.node == "a" and "already bound to %x" in why.reason


def test_explainer_names_the_failing_node_and_condition():
    g = conv_bn_chain(2, with_relu=True)

    @constraint("scale is the input named s0")
    def is_s0(tensor, match):
        return tensor.name == "s0"

    p = rewrite.pattern(lambda x, w, s: op.Relu(op.BN(op.Conv(x, w, name="conv"), s, name="bn"), name="relu"),
                        constraints={"s": is_s0}, name="conv_bn_relu")
    assert explain(p, g, at="relu0").matched
    why = explain(p, g, at="relu1")
    assert (why.node, why.target) == ("s", "%s1")
    assert str(why) == ("pattern 'conv_bn_relu' does not match at op 'relu1': pattern node 's' (wildcard) "
                        "against '%s1': constraint 'scale is the input named s0' failed")
    wrong_type = rewrite.pattern(lambda x, w: op.Relu(op.Pool(op.Conv(x, w, name="conv"), name="pool"),
                                                      name="relu"), name="conv_pool_relu")
    why = explain(wrong_type, g, at="relu0")
    assert why.node == "pool" and why.node_type == "Pool" and why.target == "bn0"
    assert "type is 'BN', expected 'Pool'" in str(why)
    assert "no op of type Softmax" in str(explain(rewrite.pattern(lambda a: op.Softmax(a)), g))
    with pytest.raises(RewriteError, match="not an op of graph"):
        explain(p, g, at="nope")


def test_explaining_a_rule_set_reports_the_furthest_pattern():
    g = conv_bn_chain(1, with_relu=True)
    near = rewrite.pattern(lambda x, w, s: op.Relu(op.BN(op.Pool(x, name="pool"), s, name="bn"), name="relu"),
                           name="near")
    far = rewrite.pattern(lambda a: op.Relu(op.Softmax(a, name="softmax"), name="relu"), name="far")
    rules = [Rule(far, fused), Rule(near, fused)]
    why = explain(rules, g)
    assert why.pattern == "near" and why.node == "pool" and "type is 'Conv'" in why.reason
    assert explain(rules + [rewrite.pattern(lambda x, w, s: op.Relu(conv_bn(x, w, s)))], g, at="relu0")
    assert explain([rewrite.pattern(lambda a: op.Softmax(a)), far], g).pattern == "far"
    with pytest.raises(RewriteError, match="no pattern"):
        explain([], g)


def test_prune_removes_constants_the_match_no_longer_reads():
    g = Graph("g")
    x = g.add_input("x")
    half = g.create_op("Const", [], name="half")
    shared = g.create_op("Const", [], name="shared")
    y = g.create_op("Mul", [x, half.outputs[0]], name="scale").outputs[0]
    y = g.create_op("Add", [y, shared.outputs[0]], name="shift").outputs[0]
    g.set_outputs([g.create_op("Sub", [y, shared.outputs[0]], name="again").outputs[0]])
    scale = rewrite.pattern(lambda a, c: op.Mul(a, c, name="mul"), name="scale")
    shift = rewrite.pattern(lambda a, c: op.Add(a, c, name="add"), name="shift")

    def identity(m):
        return [m.graph.create_op("Identity", [m.inputs[0]], name="id").outputs[0]]

    result = rewrite.rewrite(g, [Rule(scale, identity, prune=("Const",))])
    assert [o.name for o in result.graph] == ["shared", "id", "shift", "again"]
    # a constant still read elsewhere (or of a type not listed) stays
    result = rewrite.rewrite(g, [Rule(shift, identity, prune=("Const",))])
    assert [o.name for o in result.graph] == ["half", "shared", "scale", "id", "again"]
    result = rewrite.rewrite(g, [Rule(scale, identity, prune=("Constant",))])
    assert "half" in [o.name for o in result.graph]


def test_attrs_and_input_counts_are_conditions():
    g = Graph("g")
    x = g.add_input("x")
    c = g.create_op("Conv", [x, g.add_input("w"), g.add_input("b")], attrs={"group": 2}, name="c")
    g.set_outputs(c.outputs)
    assert "has 3 inputs, expected 2" in str(explain(rewrite.pattern(lambda a, b: op.Conv(a, b)), g, at="c"))
    assert explain(rewrite.pattern(lambda a, b: op.Conv(a, b, extra_inputs=True)), g, at="c")
    assert "attr 'group' is 2, expected 1" in str(explain(rewrite.pattern(
        lambda a, b: op.Conv(a, b, extra_inputs=True, group=1)), g, at="c"))
    assert explain(rewrite.pattern(lambda a, b: op.Conv(a, b, extra_inputs=True, group=rewrite.ANY)), g, at="c")


def test_template_graph_replacement():
    template = Graph("fused")
    x, w, s = (template.add_input(n) for n in "xws")
    template.set_outputs(template.create_op("FusedConv", [x, w, s], name="fused").outputs)
    result = rewrite.rewrite(conv_bn_chain(2), [Rule(rewrite.pattern(conv_bn), template)])
    assert [o.type for o in result.graph] == ["FusedConv", "FusedConv"]


def test_driver_is_bounded_and_reports_non_convergence():
    # A rule whose replacement matches again forever.
    g = conv_bn_chain(1)
    p = rewrite.pattern(lambda a, s: op.BN(a, s, name="bn"))
    again = Rule(p, lambda m: [m.graph.create_op("BN", m.inputs, name="bn_again").outputs[0]])
    result = rewrite.rewrite(g, [again], max_iterations=4)
    assert result.iterations == 4 and not result.converged and len(result.applied) == 4


def test_bad_patterns_and_replacements_are_refused():
    with pytest.raises(RewriteError, match="not ancestors of the anchor"):
        g = Graph("p")
        a = g.add_input("a")
        g.create_op("Stray", [a])
        g.set_outputs(g.create_op("Relu", [a]).outputs)
        Pattern(g)
    with pytest.raises(RewriteError, match="constraints name"):
        rewrite.pattern(conv_bn, constraints={"nothing": lambda t, m: True})
    g = conv_bn_chain(1)
    bad = Rule(rewrite.pattern(conv_bn), lambda m: [])
    with pytest.raises(RewriteError, match="gave 0 tensors for 1 pattern outputs"):
        rewrite.rewrite(g, [bad])
    assert [o.type for o in g] == ["Conv", "BN"]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=12))
def test_property_every_conv_bn_is_fused_exactly_once(relus):
    """Chains mixing Conv->BN and Conv->BN->Relu: every pair is fused, Relus stay, the result verifies."""
    g = Graph("g")
    y = g.add_input("x")
    for i, relu in enumerate(relus):
        conv = g.create_op("Conv", [y, g.add_input(f"w{i}")], name=f"conv{i}")
        y = g.create_op("BN", [conv.outputs[0], g.add_input(f"s{i}")], name=f"bn{i}").outputs[0]
        if relu:
            y = g.create_op("Relu", [y], name=f"relu{i}").outputs[0]
    g.set_outputs([y])
    result = rewrite.rewrite(g, [Rule(rewrite.pattern(conv_bn), fused)])
    types = [o.type for o in result.graph]
    assert types.count("FusedConv") == len(relus) and types.count("Relu") == sum(relus)
    assert "Conv" not in types and "BN" not in types and result.iterations == 2
    result.graph.verify()
    assert len(rewrite.find_matches(rewrite.pattern(conv_bn), result.graph)) == 0
    assert match_at(rewrite.pattern(conv_bn), g, g.ops[1]).anchor is g.ops[1]


# ---------------------------------------------------------------------------
# PyTorch graph capture
# ---------------------------------------------------------------------------

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def randomize_batch_norms(model):
    """Running statistics and affine parameters away from the identity, so folding is not trivial."""
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                n = module.num_features
                module.running_mean.copy_(torch.randn(n, generator=generator) * 0.1)
                module.running_var.copy_(torch.rand(n, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(n, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(n, generator=generator) * 0.1)
    return model


@pytest.fixture(scope="module")
def torch_resnet():
    from amanda.runtime.pytorch.capture import capture

    torch.manual_seed(0)
    model = randomize_batch_norms(transformers.ResNetModel(transformers.ResNetConfig()).eval())
    x = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(4))
    return model, x, capture(model, (x,))


def relative_error(actual, expected):
    return float((actual - expected).abs().max() / expected.abs().max())


def test_fold_batchnorm_into_conv_pytorch_resnet50(torch_resnet):
    model, x, program = torch_resnet
    folded, result = program.rewrite(rewrite.fold_batchnorm_rules("pytorch"))
    assert result.counts() == {"fold_batchnorm": 53} and result.converged
    types = [o.type for o in folded.graph]
    assert "batch_norm" not in types and types.count("conv2d") == 53
    with torch.no_grad():
        expected, actual = model(x), folded(x)
    # activations reach ~1e3 after 50 layers: compare relative to the output's scale
    assert relative_error(actual.last_hidden_state, expected.last_hidden_state) < 1e-4
    assert relative_error(actual.pooler_output, expected.pooler_output) < 1e-4
    assert not torch.equal(actual.last_hidden_state, expected.last_hidden_state)  # it really was rewritten


def test_explainer_on_a_deliberately_failing_pytorch_pattern(torch_resnet):
    _, _, program = torch_resnet
    conv_ln_relu = rewrite.pattern(
        lambda x, w: op.relu(op.layer_norm(op.conv2d(x, w, name="conv", extra_inputs=True), name="norm",
                                           extra_inputs=True), name="relu"), name="conv_layernorm_relu")
    why = explain(conv_ln_relu, program.graph, at="relu")
    assert why.node == "norm" and why.target == "batch_norm"
    assert "pattern node 'norm' (layer_norm) against 'batch_norm': type is 'batch_norm'" in str(why)
    training_only = rewrite.fold_batchnorm_rules("pytorch")[0].pattern
    train_program = __import__("amanda.runtime.pytorch.capture", fromlist=["capture"]).capture(
        torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4)).train(), (torch.randn(2, 3, 8, 8),))
    why = explain(training_only, train_program.graph)
    assert why.node == "bn" and "inference mode" in why.reason


def test_gelu_tanh_rewrite_matches_the_tanh_model():
    from amanda.runtime.pytorch.capture import capture

    def bert(act):
        torch.manual_seed(0)
        config = transformers.BertConfig(vocab_size=500, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                         intermediate_size=128, hidden_act=act, attn_implementation="eager")
        return transformers.BertModel(config).eval()

    exact, tanh = bert("gelu"), bert("gelu_pytorch_tanh")
    ids = torch.randint(0, 500, (1, 12), generator=torch.Generator().manual_seed(5))
    program = capture(exact, (ids,))
    rewritten, result = program.rewrite(rewrite.gelu_tanh_rules())
    assert result.counts() == {"gelu_tanh": 2}
    assert not any(o.type == "gelu" for o in rewritten.graph)
    with torch.no_grad():
        ours, approx, original = rewritten(ids), tanh(ids), exact(ids)
    to_tanh = (ours.last_hidden_state - approx.last_hidden_state).abs().max()
    to_exact = (ours.last_hidden_state - original.last_hidden_state).abs().max()
    assert to_tanh < 1e-5 and to_tanh * 10 < to_exact  # it is the tanh model, not the exact one


def test_explainer_on_a_gelu_that_is_already_tanh():
    from amanda.runtime.pytorch.capture import capture

    program = capture(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU(approximate="tanh")),
                      (torch.randn(2, 4),))
    rules = rewrite.gelu_tanh_rules()
    assert program.rewrite(rules)[1].counts() == {}
    why = explain(rules, program.graph)
    assert why.at == "gelu" and why.node == "gelu" and "constraint \"gelu is exact (approximate='none')\" failed" \
        in str(why)


class MatMulNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 8)
        self.fc2 = torch.nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2(h @ h.transpose(0, 1) @ h)


def test_fake_quant_pair_around_every_matmul():
    from amanda.runtime.pytorch.capture import capture

    torch.manual_seed(0)
    model = MatMulNet().eval()
    x = torch.randn(5, 8)
    program = capture(model, (x,))
    scale = 1 / 32
    quantized, result = program.rewrite(rewrite.fake_quant_matmul_rules(scale=scale))
    assert result.counts() == {"fake_quant_matmul": 4} and result.converged and result.iterations == 2
    fq_ops = [o for o in quantized.graph if o.type == "fake_quantize_per_tensor_affine"]
    assert len(fq_ops) == 8

    def fq(t):
        return torch.fake_quantize_per_tensor_affine(t, scale, 0, -128, 127)

    with torch.no_grad():
        h = torch.relu(torch.nn.functional.linear(fq(x), fq(model.fc1.weight), model.fc1.bias))
        hh = fq(h) @ fq(h.transpose(0, 1))
        hh = fq(hh) @ fq(h)
        expected = torch.nn.functional.linear(fq(hh), fq(model.fc2.weight), model.fc2.bias)
        actual = quantized(x)
    assert torch.equal(actual, expected)


# ---------------------------------------------------------------------------
# ONNX
# ---------------------------------------------------------------------------

_ONNX_READY = (importlib.util.find_spec("amanda.frontends.onnx") is not None
               and importlib.util.find_spec("amanda.runtime.onnx") is not None)


@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
@pytest.mark.skipif(not _ONNX_READY, reason="the ONNX frontend/runtime (amanda.frontends.onnx.lift, "
                    "amanda.runtime.onnx.lower) is not in this tree yet")
def test_fold_batchnorm_into_conv_onnx_resnet50(torch_resnet, tmp_path):
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from amanda.frontends.onnx import lift
    from amanda.runtime.onnx import lower

    model, x, _ = torch_resnet
    path = tmp_path / "resnet.onnx"
    # do_constant_folding=False and training=PRESERVE keep BatchNormalization nodes in the export
    torch.onnx.export(model, (x,), str(path), dynamo=False, do_constant_folding=False,
                      training=torch.onnx.TrainingMode.PRESERVE, input_names=["pixel_values"], opset_version=17)
    proto = onnx.load(str(path))
    graph = lift(proto)
    assert sum(o.type == "BatchNormalization" for o in graph) == 53
    result = rewrite.rewrite(graph, rewrite.fold_batchnorm_rules("onnx"))
    assert result.counts() == {"fold_batchnorm": 53}
    lowered = lower(result.graph)
    lowered.ir_version = min(lowered.ir_version, 10)
    assert not any(n.op_type == "BatchNormalization" for n in lowered.graph.node)
    names = [n.name for n in lowered.graph.node if n.name]
    assert len(names) == len(set(names))

    def run(m):
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        session = ort.InferenceSession(m.SerializeToString(), options, providers=["CPUExecutionProvider"])
        return session.run(None, {"pixel_values": x.numpy()})

    proto.ir_version = min(proto.ir_version, 10)
    for expected, actual in zip(run(proto), run(lowered)):
        assert float(abs(actual - expected).max() / abs(expected).max()) < 1e-4
    why = explain(rewrite.pattern(lambda a: op.Relu(op.Gemm(a, name="gemm", extra_inputs=True), name="relu"),
                                  name="gemm_relu"), graph)
    assert why.node == "gemm" and "type is 'BatchNormalization'" in why.reason
