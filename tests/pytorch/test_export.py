"""amanda.export: instrumented PyTorch models exported to ONNX run in
onnxruntime with the outputs of the instrumented eager run."""

import io
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.errors import AmandaError, BackendError, ToolError  # noqa: E402


class PruneAndScale(amanda.Tool):
    """Masks every linear/conv weight (mask computed from the weight by the
    analysis routine) and scales every ReLU's output."""

    def __init__(self, keep=0.5, factor=0.75):
        super().__init__()
        self.keep, self.factor = keep, factor
        self.masked, self.scaled = [], []
        self.add_inst_for_op(self.before)
        self.add_inst_for_op(self.after, require_outputs=True)

    def before(self, context):
        if context.get_op_name() in ("linear", "conv2d"):
            weight = context.get_inputs()[1]
            mask = (weight.abs() >= self.keep * weight.abs().mean()).to(weight.dtype)
            context.insert_before_op(self.mask_weight, inputs=[1], mask=mask)
            self.masked.append((context.get_module_path(), context.get_op_id()))

    def after(self, context):
        if context.get_op_name() == "relu":
            context.insert_after_op(self.scale, factor=self.factor)
            self.scaled.append((context.get_module_path(), context.get_op_id()))

    @portable.routine
    def mask_weight(self, weight, mask):
        return weight * mask

    @portable.routine
    def scale(self, x, factor):
        return x * factor


def flatten(output):
    """The tensors of a model output, in the order amanda.export lists them."""
    if isinstance(output, torch.Tensor):
        return [output.detach().numpy()]
    if isinstance(output, dict):
        output = list(output.values())
    return [a for item in output if item is not None for a in flatten(item)]


def run_onnx(proto, *inputs):
    session = ort.InferenceSession(proto.SerializeToString())
    feeds = {i.name: np.asarray(a) for i, a in zip(session.get_inputs(), inputs)}
    return session.run(None, feeds)


def assert_matches(got, expected, rtol=1e-4):
    """Every output within ``rtol`` of the reference, relative to its largest value."""
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.shape == e.shape
        scale = max(float(np.abs(e).max()), 1e-30)
        assert float(np.abs(g - e).max()) <= rtol * scale, (np.abs(g - e).max(), scale)


def relative_difference(a, b):
    return max(float(np.abs(x - y).max() / np.abs(y).max()) for x, y in zip(a, b))


def state_of(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def backend_is_clean(model):
    from torch.nn.modules import module
    return (torch._C._len_torch_function_stack() == 0
            and not module._global_forward_hooks and not module._global_forward_pre_hooks
            and all(not m._forward_hooks and not m._forward_pre_hooks
                    for m in model.modules()))


def eager(model, inputs, *tools, kwargs=None):
    with torch.no_grad():
        if not tools:
            return flatten(model(*inputs, **(kwargs or {})))
        with amanda.apply(*tools):
            return flatten(model(*inputs, **(kwargs or {})))


# -- real models ---------------------------------------------------------------

@pytest.fixture(scope="module")
def bert():
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, intermediate_size=256,
                                     hidden_act="relu", attn_implementation="eager")
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 1000, (2, 16))
    attention = torch.ones(2, 16, dtype=torch.int64)
    attention[1, 11:] = 0
    return model, ids, attention


@pytest.fixture(scope="module")
def bert_export(bert):
    model, ids, attention = bert
    before = state_of(model)
    tool = PruneAndScale()
    proto = amanda.export(model, (ids,), tool, kwargs={"attention_mask": attention})
    return proto, tool, before


def test_bert_export_matches_the_instrumented_eager_run(bert, bert_export):
    model, ids, attention = bert
    proto, tool, _ = bert_export
    assert len(tool.masked) == 2 * 6 + 1 and len(tool.scaled) == 2   # Q K V O, FFN x2, pooler
    expected = eager(model, (ids,), PruneAndScale(), kwargs={"attention_mask": attention})
    got = run_onnx(proto, ids.numpy(), attention.numpy())
    assert_matches(got, expected)
    assert relative_difference(got, eager(model, (ids,), kwargs={"attention_mask": attention})) > 1e-2
    assert [i.name for i in proto.graph.input] == ["input_ids", "attention_mask"]
    assert [o.name for o in proto.graph.output] == ["last_hidden_state", "pooler_output"]
    assert proto.ir_version <= 10
    onnx.checker.check_model(proto, full_check=True)


def test_bert_plain_export_differs_from_the_instrumented_one(bert, bert_export):
    model, ids, attention = bert
    plain = amanda.export(model, (ids,), kwargs={"attention_mask": attention})
    plain_out = run_onnx(plain, ids.numpy(), attention.numpy())
    assert_matches(plain_out, eager(model, (ids,), kwargs={"attention_mask": attention}))
    instrumented_out = run_onnx(bert_export[0], ids.numpy(), attention.numpy())
    assert relative_difference(instrumented_out, plain_out) > 1e-2
    # the masks are folded into the weights: no extra op but the ReLU scalings
    extra = len(bert_export[0].graph.node) - len(plain.graph.node)
    assert extra <= 2 * len(bert_export[1].scaled)


def test_export_leaves_the_model_as_it_was(bert, bert_export):
    model, _, _ = bert
    before = bert_export[2]
    after = state_of(model)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert backend_is_clean(model)


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    return model, torch.rand(1, 3, 64, 64)


@pytest.mark.slow
def test_resnet50_export_matches_the_instrumented_eager_run(resnet):
    model, x = resnet
    tool = PruneAndScale()
    proto = amanda.export(model, (x,), tool)
    assert len(tool.masked) == 53 and len(tool.scaled) == 49   # 53 convs, 49 ReLUs
    got = run_onnx(proto, x.numpy())
    assert_matches(got, eager(model, (x,), PruneAndScale()))
    assert relative_difference(got, eager(model, (x,))) > 1e-2
    assert [o.name for o in proto.graph.output] == ["last_hidden_state", "pooler_output"]
    assert backend_is_clean(model)


# -- small models: semantics ---------------------------------------------------

class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3)
        self.conv2 = torch.nn.Conv2d(8, 8, 3)
        self.fc = torch.nn.Linear(8 * 4 * 4, 10)

    def forward(self, x):
        x = torch.relu(self.conv1(x))
        x = torch.relu(self.conv2(x))
        return self.fc(x.flatten(1))


def small_cnn():
    torch.manual_seed(0)
    return SmallCNN()


class Relu6(amanda.Tool):
    """Replaces every ReLU by a clipped one."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        if context.get_op_name() == "relu":
            context.replace_op(self.relu6, inputs=[0], top=0.05)

    @portable.routine
    def relu6(self, x, top):
        return portable.clip(x, 0.0, top)


def test_replaced_ops_are_exported():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    proto = amanda.export(model, (x,), Relu6())
    types = {n.op_type for n in proto.graph.node}
    assert "Relu" not in types and {"Min", "Max"} <= types   # portable.clip
    got = run_onnx(proto, x.numpy())
    assert_matches(got, eager(model, (x,), Relu6()))
    assert relative_difference(got, eager(model, (x,))) > 1e-2


def test_tools_of_an_enclosing_apply_scope_are_exported_too():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    with amanda.apply(Relu6()):
        proto = amanda.export(model, (x,), PruneAndScale())
    assert "Relu" not in {n.op_type for n in proto.graph.node}
    with torch.no_grad(), amanda.apply(Relu6()), amanda.apply(PruneAndScale()):
        expected = flatten(model(x))
    assert_matches(run_onnx(proto, x.numpy()), expected)
    assert relative_difference(expected, eager(model, (x,), Relu6())) > 1e-2
    assert backend_is_clean(model)


class Observer(amanda.Tool):
    """An observe-only routine with a Python side effect: not portable."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.add_inst_for_op(self.analyse, require_outputs=True)

    def analyse(self, context):
        if context.get_op_name() == "linear":
            context.insert_after_op(self.count)

    def count(self, y):
        self.calls += 1


class ValueReader(Observer):
    """Marked portable, but reads a tensor's value in an ``if``."""

    def analyse(self, context):
        if context.get_op_name() == "linear":
            context.insert_after_op(self.count_positives)

    @portable.routine
    def count_positives(self, y):
        if (y > 0).any():
            self.calls += 1


def test_a_non_portable_routine_is_refused_before_it_runs():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    before = state_of(model)
    tool = Observer()
    with pytest.raises(ToolError) as info:
        amanda.export(model, (x,), tool)
    message = str(info.value)
    assert "not portable" in message and "tool Observer" in message
    assert "routine Observer.count" in message and "op 'linear'" in message
    assert info.value.tool is tool and info.value.op_name == "linear"
    assert tool.calls == 0
    assert all(torch.equal(v, state_of(model)[k]) for k, v in before.items())
    assert backend_is_clean(model) and model.training


def test_a_portable_routine_leaving_the_vocabulary_is_refused():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    tool = ValueReader()
    with pytest.raises(ToolError, match=r"cannot be exported.*routine ValueReader.count_positi"):
        amanda.export(model, (x,), tool)
    assert tool.calls == 0
    assert backend_is_clean(model)


def test_module_paths_and_op_ids_are_those_of_the_eager_run():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    eager_tool, export_tool = PruneAndScale(), PruneAndScale()
    eager(model, (x,), eager_tool)
    amanda.export(model, (x,), export_tool)
    assert export_tool.masked == eager_tool.masked
    assert export_tool.scaled == eager_tool.scaled
    assert [path for path, _ in export_tool.masked] == ["conv1", "conv2", "fc"]


def test_train_flags_are_restored_and_export_runs_in_eval_mode():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    model.train()
    model.conv2.eval()
    proto = amanda.export(model, (x,), PruneAndScale())
    assert [m.training for m in model.modules()] == [True, True, False, True]
    with torch.no_grad():
        model.eval()
        assert_matches(run_onnx(proto, x.numpy()), eager(model, (x,), PruneAndScale()))


def test_actions_cached_by_an_eager_run_are_not_replayed():
    """Export analyses afresh: a tool that observed with Python routines
    while calibrating exports once it stops inserting them."""
    from amanda.tools.quantization import QuantizationTool
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8)).eval()
    x = torch.randn(32, 16)
    tool = QuantizationTool()          # 8-bit: int8 weights per channel, uint8 activations
    eager(model, (x,), tool)           # tracks ranges with Python routines
    tool.freeze()
    proto = amanda.export(model, (x,), tool)
    types = [n.op_type for n in proto.graph.node]
    assert types.count("QuantizeLinear") == 2 and types.count("DequantizeLinear") == 2
    got = run_onnx(proto, x.numpy())
    assert_matches(got, eager(model, (x,), tool), rtol=1e-5)
    assert relative_difference(got, eager(model, (x,))) > 1e-3


def test_export_writes_to_a_path_or_a_file(tmp_path):
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    path = tmp_path / "model.onnx"
    proto = amanda.export(model, x, PruneAndScale(), f=str(path))
    assert onnx.load(str(path)) == proto
    buffer = io.BytesIO()
    amanda.export(model, (x,), PruneAndScale(), f=buffer)
    assert onnx.load_from_string(buffer.getvalue()) == proto
    assert [i.name for i in proto.graph.input] == ["x"]
    assert [o.name for o in proto.graph.output] == ["output"]
    assert {p.key: p.value for p in proto.metadata_props}["amanda.tools"] == "PruneAndScale"


def test_bad_arguments_are_amanda_errors():
    model, x = small_cnn(), torch.rand(2, 3, 8, 8)
    with pytest.raises(BackendError, match="cannot export a function"):
        amanda.export(lambda t: t, (x,))
    with pytest.raises(AmandaError, match="container of tensors"):
        amanda.export(model, ([x],))
    with pytest.raises(AmandaError, match="args must be a tensor or a tuple"):
        amanda.export(model, "x")
    with pytest.raises(AmandaError, match="amanda.apply needs amanda.Tool"):
        amanda.export(model, (x,), "not a tool")


def test_importing_amanda_does_not_import_torch():
    code = "import sys, amanda; amanda.export; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docs_example_runs():
    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "export.md"
    blocks = re.findall(r"```python\n(.*?)```", docs.read_text(), re.S)
    assert blocks
    namespace = {"__name__": "__docs__"}
    for number, code in enumerate(blocks, 1):
        exec(compile(code, f"docs/export.md example {number}", "exec"), namespace)
