"""PyTorch graph capture: torch.export -> amanda IR -> GraphModule, instrumented by tools."""

import copy
import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import amanda  # noqa: E402
from amanda.errors import BackendError  # noqa: E402
from amanda.frontends.pytorch.graph import NAMESPACE  # noqa: E402
from amanda.ir import graph_from_json, graph_to_json  # noqa: E402
from amanda.passes.lower_actions import ROUTINE  # noqa: E402
from amanda.runtime.pytorch.capture import capture, lower_to_graph_module  # noqa: E402
from amanda.tools.mapping import MappingTool  # noqa: E402
from amanda.tools.mapping_rules import RULES  # noqa: E402


def small_bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=256, attn_implementation="eager")
    return transformers.BertModel(config).eval()


@pytest.fixture(scope="module")
def bert():
    model = small_bert()
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, ids, capture(model, (ids,))


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    return model, x, capture(model, (x,))


def grads(model, outputs):
    loss = sum(o.float().square().sum() for o in outputs)
    return torch.autograd.grad(loss, [p for p in model.parameters() if p.requires_grad], allow_unused=True)


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


def test_bert_lowers_back_with_identical_outputs_and_gradients(bert):
    model, ids, program = bert
    ours, theirs = program(ids), model(ids)
    assert type(ours) is type(theirs)  # the output structure comes back (a ModelOutput)
    pair = [(ours.last_hidden_state, theirs.last_hidden_state), (ours.pooler_output, theirs.pooler_output)]
    for a, b in pair:
        assert torch.equal(a, b)
    assert_same(grads(model, [a for a, _ in pair]), grads(model, [b for _, b in pair]))


def test_resnet_train_mode_outputs_gradients_and_buffer_updates(resnet):
    model, x, _ = resnet
    ours_model = copy.deepcopy(model).train()
    theirs_model = copy.deepcopy(model).train()
    program = capture(ours_model, (x,))
    ours, theirs = program(x), theirs_model(x)
    assert torch.equal(ours.pooler_output, theirs.pooler_output)
    assert_same(grads(ours_model, [ours.pooler_output]), grads(theirs_model, [theirs.pooler_output]))
    # training-mode batch norm updated the model's own running statistics, identically
    for (name, a), (_, b) in zip(ours_model.named_buffers(), theirs_model.named_buffers()):
        assert torch.equal(a, b), name
    assert int(ours_model.embedder.embedder.normalization.num_batches_tracked) == 1


def test_lifted_graph_describes_the_program(resnet):
    model, x, program = resnet
    graph = program.graph
    graph.verify()
    assert graph.namespace == NAMESPACE and NAMESPACE.endswith("/graph")
    types = [op.type for op in graph]
    assert types.count("conv2d") == 53 and types.count("batch_norm") == 53
    kinds = [t.attrs["kind"] for t in graph.inputs]
    assert kinds.count("parameter") == len(list(model.parameters()))
    assert kinds[-1] == "input" and graph.inputs[-1].attrs["shape"] == [2, 3, 64, 64]
    conv = next(graph.find(type="conv2d"))
    assert conv.attrs["target"] == "aten.conv2d.default"
    assert conv.outputs[0].attrs == {"dtype": "float32", "shape": [2, 64, 32, 32]}
    assert conv.attrs["module_path"].startswith("embedder")


def test_json_round_trip_keeps_hash_and_lowers_identically(bert):
    model, ids, program = bert
    restored = graph_from_json(json.loads(json.dumps(graph_to_json(program.graph))))
    assert restored.structural_hash() == program.graph.structural_hash()
    flat = program._flat_inputs((ids,), {})
    expected = program.graph_module(*flat)
    actual = lower_to_graph_module(restored)(*flat)
    for a, b in zip(actual, expected):
        assert torch.equal(a, b)


class CountConvs(amanda.Tool):
    """Counts conv2d executions; written against ``get_op().__name__`` as in eager mode."""

    def __init__(self):
        super().__init__()
        self.analysed = 0
        self.calls = 0
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get_op().__name__ == "conv2d":
            self.analysed += 1
            context.insert_before_op(self.count)

    def count(self, *inputs):
        self.calls += 1


def test_same_counting_tool_in_eager_and_graph_mode(resnet):
    model, x, program = resnet
    eager, graph = CountConvs(), CountConvs()
    with amanda.apply(eager), torch.no_grad():
        model(x)
    with amanda.apply(graph):
        ours = program(x)
        program(x)
    assert eager.calls == 53
    assert graph.calls == 2 * 53 and graph.analysed == 53  # analysis ran once: cached by hash + tools
    assert torch.equal(ours.pooler_output, model(x).pooler_output)


def test_mapping_rules_and_contexts_on_captured_graphs(bert):
    _, _, program = bert
    seen = {}

    class Types(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.depends_on(MappingTool(rules=RULES))
            self.add_inst_for_op(self.analysis, require_outputs=True)

        def analysis(self, context):
            seen.setdefault(context["type"], context)
            if context["type"] == "linear" and "weight" not in seen:
                seen["weight"] = context.get_inputs()[1]  # the fx node of the weight

    instrumented = program.instrument(Types())
    assert seen["linear"].namespace == NAMESPACE
    linear = seen["linear"]
    assert linear.get_op() is torch.ops.aten.linear
    assert linear.get_ir_op().type == "linear" and linear.get_graph() is program.graph
    node = seen["weight"]  # an fx node, with its fake value
    assert list(node.meta["val"].shape) == list(linear.get_ir_op().inputs[1].attrs["shape"])
    assert not any(op.type == ROUTINE for op in instrumented.graph)  # nothing recorded


def test_graph_tracing_tool_gets_the_captured_graph(resnet):
    from amanda.tools.graph import GraphTracingTool

    _, x, program = resnet
    tracer = GraphTracingTool()
    with amanda.apply(tracer):
        program(x)
    assert tracer.graph is program.graph


def test_routines_replace_values_straight_through_or_differentiated():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    x = torch.randn(3, 4)
    program = capture(model, (x,))

    class Double(amanda.Tool):
        def __init__(self, ad):
            super().__init__()
            self.ad = ad
            self.add_inst_for_op(self.analysis)

        def analysis(self, context):
            if context.get_op().__name__ == "relu":
                if self.ad:
                    with amanda.ad_enabled():
                        context.insert_after_op(self.double)
                else:
                    context.insert_after_op(self.double)

        def double(self, y):
            return y * 2

    def reference(scale_grad):
        hidden = torch.relu(model[0](x))
        doubled = hidden * 2 if scale_grad else hidden + hidden.detach()
        return model[2](doubled)

    for ad in (False, True):
        instrumented = program.instrument(Double(ad))
        assert sum(op.type == ROUTINE for op in instrumented.graph) == 1
        ours, theirs = instrumented(x), reference(scale_grad=ad)
        assert torch.allclose(ours, theirs)
        g_ours = grads(model, [ours])
        g_ref = grads(model, [theirs])
        for a, b in zip(g_ours, g_ref):
            assert torch.allclose(a, b)


def test_portable_routine_traces_to_aten_ops():
    portable = pytest.importorskip("amanda.portable")
    from torch.fx.experimental.proxy_tensor import make_fx

    @portable.routine
    def clip(y, limit):
        return portable.clip(y, -limit, limit)

    class Clip(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: c.insert_after_op(clip, limit=0.1) if c.get_op().__name__ == "linear"
                                 else None)

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    x = torch.randn(2, 4)
    program = capture(model, (x,)).instrument(Clip())
    assert torch.allclose(program(x), model(x).clamp(-0.1, 0.1))
    traced = make_fx(program.graph_module)(*program._flat_inputs((x,), {}))
    targets = {str(n.target) for n in traced.graph.nodes if n.op == "call_function"}
    assert any("clamp" in t or "clip" in t or "minimum" in t for t in targets), targets


def test_capture_errors_are_backend_errors():
    def data_dependent(x):
        if x.sum() > 0:  # control flow on a value: torch.export refuses it
            return x
        return -x

    with pytest.raises(BackendError, match="torch.export could not capture"):
        capture(data_dependent, (torch.randn(3),), strict=True)
    from amanda.ir import Graph
    g = Graph("g", namespace=NAMESPACE)
    g.set_outputs(g.create_op("mystery", [g.add_input("x")]).outputs)
    with pytest.raises(BackendError, match="op 'mystery'.*no 'target' attr"):
        lower_to_graph_module(g)


def test_wrong_input_structure_is_reported(bert):
    _, ids, program = bert
    with pytest.raises(BackendError, match="structure the program was captured with"):
        program(ids, ids)


def test_docs_page_examples_run():
    from tests.markdown import run_examples

    namespace = run_examples("docs/pytorch-graph.md")
    assert namespace["graph_mode"].calls == 4


def test_amanda_instrument_dispatches_a_captured_program():
    import amanda
    from amanda.runtime.pytorch.capture import capture
    from tests.models import build_model
    model, x = build_model("cnn")

    class Double(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analysis)

        def analysis(self, context):
            if context.get_op().__name__ == "relu":
                context.insert_after_op(self.double)

        @amanda.portable.routine
        def double(self, y):
            return y * 2

    program = capture(model.eval(), (x,))
    instrumented = amanda.instrument(program, Double())
    assert instrumented is not program
    with torch.no_grad():
        assert not torch.allclose(instrumented(x), program(x))
