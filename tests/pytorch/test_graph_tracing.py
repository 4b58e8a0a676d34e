"""Graph tracing tool: the same graph every eager iteration, look-back from
the op being analysed (producers, module path, forward op of a backward op),
exports (JSON, DOT, SVG, networkx, PNG), and torch vs ONNX export."""

import json
import pathlib
import re
import shutil

import pytest
import torch

import amanda
from amanda.errors import ToolError
from amanda.ir import Graph
from amanda.runtime import vocabulary
from amanda.tools import mapping_rules
from amanda.tools.graph import (
    GraphTracingTool,
    forward_op_of,
    forward_subgraph,
    module_path,
)
from amanda.tools.mapping import MappingTool


def train_step(model):
    torch.manual_seed(0)
    model(torch.rand(2, 3, 32, 32)).sum().backward()


def wiring(graph):
    """Op types and wiring, independent of names: for each op, its type and
    where each input comes from (producer position and output index, or the
    graph input's kind), and its control inputs' positions."""
    position = {op: i for i, op in enumerate(graph.ops)}
    rows = []
    for op in graph.ops:
        sources = [(position[t.producer], t.index) if t.producer is not None
                   else ("input", t.attrs.get("kind")) for t in op.inputs]
        rows.append((op.type, sources, [position[c] for c in op.control_inputs]))
    return rows


class LookBack(amanda.Tool):
    """Looks at the traced graph from every forward and backward op."""

    def __init__(self):
        super().__init__()
        self.tracer = GraphTracingTool()
        self.depends_on(self.tracer, MappingTool(rules=mapping_rules.RULES))
        self.seen = []
        self.add_inst_for_op(self.before)
        self.add_inst_for_op(self.after, require_outputs=True)
        self.add_inst_for_op(self.backward, backward=True)

    def before(self, context):
        so_far = self.tracer.current(context)
        last = so_far.ops[-1] if len(so_far) else None
        self.seen.append(("before", context["type"], self.tracer.ir_op(context), last))

    def after(self, context):
        op = context.get_ir_op()
        self.seen.append(("after", context["type"], op, self.tracer.current(context).ops[-1]))

    def backward(self, context):
        self.seen.append(("backward", context.get_backward_op().__name__,
                          self.tracer.ir_op(context), self.tracer.forward_op(context)))


def test_same_graph_across_two_eager_iterations(cnn):
    tool = LookBack()
    with amanda.cache_disabled(), amanda.apply(tool):
        train_step(cnn)
        first = list(tool.seen)
        train_step(cnn)
    one, two = tool.tracer.graphs
    assert one is not two
    one.verify()
    assert wiring(one) == wiring(two)
    assert one.structural_hash() == two.structural_hash()
    types = [op.type for op in one.ops if not op.attrs.get("backward")]
    assert types == ["rand", "conv2d", "conv2d", "max_pool2d", "conv2d", "conv2d",
                     "max_pool2d", "reshape", "linear", "relu", "linear", "sum"]

    # first iteration: the graph so far; ops not traced yet are not found
    befores = [s for s in first if s[0] == "before"]
    assert all(ir_op is None for _, _, ir_op, _ in befores)
    afters = [s for s in first if s[0] == "after"]
    assert all(ir_op is last and ir_op.type == mapping_type(ir_op) == t
               for _, t, ir_op, last in afters if t in ("conv2d", "linear"))
    # each op sees the op before it as the last one traced so far
    for (_, _, _, last), (_, _, previous, _) in zip(befores[1:], afters):
        assert last is previous
    # backward contexts: the forward op of this step; the backward IR op is
    # only known from a complete graph (none before the first step ended)
    backwards = [s for s in first if s[0] == "backward"]
    assert backwards and all(op is None for _, _, op, _ in backwards)
    conv_back = [f for _, name, _, f in backwards if name == "ConvolutionBackward0"]
    assert len(conv_back) == 4 and all(f.type == "conv2d" and f.graph is one for f in conv_back)

    # second iteration: the previous iteration's complete graph fills the gaps
    second = tool.seen[len(first):]
    for kind, name, ir_op, _ in second:
        if kind == "before":
            assert ir_op.graph is one and mapping_type(ir_op) == name
        if kind == "backward":
            assert ir_op.graph is one and ir_op.type == name
            assert forward_op_of(ir_op) is not None


def mapping_type(op):
    return vocabulary.canonical_type(op.namespace, op.type)


# -- ResNet-50: the residual add's two producers ---------------------------------------

class ResidualLookBack(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.tracer = GraphTracingTool()
        self.depends_on(self.tracer, MappingTool(rules=mapping_rules.RULES))
        self.adds = []
        self.add_inst_for_op(self.after, require_outputs=True)

    def after(self, context):
        if context["type"] == "add":
            op = context.get_ir_op()
            self.adds.append((self.tracer.module_path(context), op,
                              self.tracer.producers(op), self.tracer.producers(op, depth=3)))


@pytest.fixture(scope="module")
def resnet50():
    from transformers import ResNetConfig, ResNetModel
    torch.manual_seed(0)
    return ResNetModel(ResNetConfig()).eval()


def test_look_back_reaches_both_producers_of_resnet50_residual_adds(resnet50):
    tool = ResidualLookBack()
    with torch.no_grad(), amanda.apply(tool):
        resnet50(torch.rand(1, 3, 64, 64))
    assert len(tool.adds) == 16            # 3 + 4 + 6 + 3 bottleneck blocks
    projections = 0
    for block, op, (branch, shortcut), deeper in tool.adds:
        assert module_path(op) == block and block.startswith("encoder.stages.")
        # the residual branch ends in the block's last batch norm
        assert branch.type == "batch_norm"
        assert module_path(branch) == f"{block}.layer.2.normalization"
        if shortcut.type == "batch_norm":      # projection shortcut (first block of a stage)
            projections += 1
            assert module_path(shortcut) == f"{block}.shortcut.normalization"
        else:                                  # identity shortcut: the previous block's output
            assert shortcut.type == "relu" and module_path(shortcut).endswith(".activation")
            assert module_path(shortcut) != f"{block}.activation"
        assert [t.producer for t in op.inputs] == [branch, shortcut]
        # transitively: the convolutions feeding both batch norms, nearest first
        assert deeper[:2] == [branch, shortcut] and len(deeper) > 4
        assert any(p.type == "conv2d" for p in deeper[2:])
    assert projections == 4


def test_producers_are_bounded():
    graph = Graph("chain")
    x = graph.add_input("x")
    ops = [graph.create_op("a", [x])]
    for _ in range(5):
        ops.append(graph.create_op("b", [ops[-1].outputs[0], ops[0].outputs[0]]))
    last = ops[-1]
    assert GraphTracingTool.producers(last) == [ops[-2], ops[0]]
    # breadth first, each op once: level 1 is (ops[4], ops[0]), then the chain
    assert GraphTracingTool.producers(last, depth=10) == [ops[4], ops[0], ops[3], ops[2], ops[1]]
    assert GraphTracingTool.producers(last, depth=2) == [ops[4], ops[0], ops[3]]
    assert GraphTracingTool.producers(last, depth=10, limit=3) == [ops[-2], ops[0], ops[-3]]


def test_graph_backend_conventions_forward_op_and_name_scope():
    graph = Graph("tf_like", namespace="tensorflow/2.21.0/graph")
    x = graph.add_input("x")
    matmul = graph.create_op("MatMul", [x], name="dense/MatMul")
    grad = graph.create_op("MatMul", [matmul.outputs[0]], name="gradients/dense/MatMul_grad",
                           attrs={"backward": True, "forward_op": "dense/MatMul"})
    assert forward_op_of(grad) is matmul and forward_op_of(matmul) is None
    assert module_path(matmul) == "dense"
    assert [op.name for op in forward_subgraph(graph).ops] == ["dense/MatMul"]
    assert len(graph) == 2   # untouched


# -- exports ----------------------------------------------------------------------------

def test_exports(cnn, tmp_path):
    tracer = GraphTracingTool()
    with pytest.raises(ToolError, match="no graph was traced"):
        tracer.to_dot()
    with amanda.apply(tracer):
        train_step(cnn)
    graph = tracer.graph

    data = tracer.to_json(path=tmp_path / "step.json")
    again = Graph.from_json(json.loads((tmp_path / "step.json").read_text()))
    assert again.structural_hash() == graph.structural_hash() and data["ops"]

    dot = tracer.to_dot(path=tmp_path / "step.dot")
    assert dot.startswith("digraph") and "ConvolutionBackward0" in dot
    forward = tracer.to_dot(forward_only=True)
    assert "conv2d" in forward and "Backward" not in forward and "AccumulateGrad" not in forward

    view = tracer.to_networkx()
    assert view.number_of_nodes() == len(graph)
    assert sum(1 for _, d in view.nodes(data=True) if d["type"] == "conv2d") == 4

    png = tracer.render_png(tmp_path / "step.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    if shutil.which("dot") is None:
        with pytest.raises(ToolError, match="render_png"):
            tracer.to_svg(tmp_path / "step.svg")
    else:
        assert "<svg" in tracer.to_svg(tmp_path / "step.svg").read_text()


# -- docs ---------------------------------------------------------------------------------

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tools" / "graph-tracing.md"


def test_docs_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL)
    assert blocks
    namespace = {"__name__": "__docs__"}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)  # noqa: S102 (the docs example)
    assert (tmp_path / "cnn.png").exists()


# -- torch CNN vs its ONNX export, up to the mapping ------------------------------------

class TypedGraph(amanda.Tool):
    """Records the graph and every op's canonical type, on any backend."""

    def __init__(self):
        super().__init__()
        self.tracer = GraphTracingTool()
        self.depends_on(self.tracer, MappingTool(rules=mapping_rules.RULES))
        self.types, self.graph = {}, None
        self.add_inst_for_op(self.note, require_outputs=True)

    def note(self, context):
        op = self.tracer.ir_op(context)
        self.graph = self.tracer.current(context)
        self.types[op.name] = context["type"]


def wiring_up_to_mapping(graph, types):
    """Canonical op types and op-to-op edges; constants (ONNX shape operands)
    and graph inputs (weights, the model input) left out."""
    ops = [op for op in graph.ops if types.get(op.name) not in (None, "constant")]
    position = {op: i for i, op in enumerate(ops)}
    return [(types[op.name], [position[t.producer] for t in op.inputs if t.producer in position])
            for op in ops]


def test_torch_cnn_and_its_onnx_export_give_the_same_graph_up_to_the_mapping(cnn):
    try:
        import onnxruntime

        import amanda.runtime.onnx
        from amanda.frontends.onnx import lift  # noqa: F401  (the ONNX frontend)
    except ImportError as error:
        pytest.skip(f"the ONNX frontend/runtime is not available: {error}")
    import io
    import warnings
    x = torch.rand(2, 3, 32, 32)
    buffer = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the TorchScript exporter's deprecation notice
        torch.onnx.export(cnn.eval(), (x,), buffer, dynamo=False, opset_version=13,
                          input_names=["x"], output_names=["y"])
    on_torch, on_onnx = TypedGraph(), TypedGraph()
    with torch.no_grad(), amanda.apply(on_torch):
        cnn(x)
    with amanda.apply(on_onnx):
        session = onnxruntime.InferenceSession(buffer.getvalue())
        session.run(None, {"x": x.numpy()})
    assert on_onnx.graph.namespace.startswith("onnx/")
    torch_wiring = wiring_up_to_mapping(on_torch.tracer.graph, on_torch.types)
    onnx_wiring = wiring_up_to_mapping(on_onnx.graph, on_onnx.types)
    assert [t for t, _ in torch_wiring] == ["conv2d", "conv2d", "max_pool2d", "conv2d", "conv2d",
                                            "max_pool2d", "reshape", "linear", "relu", "linear"]
    assert torch_wiring == onnx_wiring
