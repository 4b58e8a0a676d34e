"""Compiled PyTorch: analysis routines receive the real tensors an eager op's
first execution gives them, and the run that produces them leaves nothing
behind (amanda.runtime.pytorch.compiled.probe._Probe). Checked by difference with
eager (the values a tool reads, the masks and FLOPs tools compute) and with
the same compiled model outside amanda (outputs, buffers, parameters, the
random number generator, the caller's input)."""

import collections
import copy
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402
from amanda.tools.flops import FlopsProfiler  # noqa: E402
from amanda.tools.pruning import Pruner  # noqa: E402

BACKENDS = ["eager", "aot_eager", "inductor"]


pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py


class ReadValues(amanda.Tool):
    """Keeps a copy of every tensor its analysis routines receive, per op id
    and point, and counts the executions of a routine before every op."""

    def __init__(self):
        super().__init__()
        self.values = {}
        self.calls = collections.Counter()
        self.add_inst_for_op(self.before)
        self.add_inst_for_op(self.after, require_outputs=True)

    @staticmethod
    def _copies(tensors):
        return [t.detach().clone() for t in tensors]

    def before(self, context):
        inputs = context.get_inputs()
        assert all(isinstance(t, torch.Tensor) for t in inputs), inputs
        self.values[context.get_op_id(), "inputs"] = self._copies(inputs)
        context.insert_before_op(self.count, key=context.get_op_id())

    def after(self, context):
        self.values[context.get_op_id(), "outputs"] = self._copies(context.get_outputs())

    def count(self, *tensors, key):
        self.calls[key] += 1


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.down = torch.nn.Linear(16, 8)
        self.conv = torch.nn.Conv1d(2, 2, 3, padding=1)

    def forward(self, x):
        h = self.down(torch.nn.functional.gelu(self.norm(self.up(x))))
        h = h + x
        a, b = h.split(4, dim=-1)
        return self.conv(torch.cat([a * 2, b], dim=-1).view(-1, 2, 4)).flatten(1)


def _read(model, x, compiled_path):
    pytorch_compiled.ENABLED = compiled_path
    tool = ReadValues()
    with torch.no_grad(), amanda.apply(tool):
        out = model(x)
    return tool, out


@pytest.mark.parametrize("backend", BACKENDS)
def test_analysis_receives_the_tensors_eager_gives(backend):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(4, 8)
    compiled = torch.compile(model, backend=backend)
    eager, _ = _read(compiled, x, compiled_path=False)
    fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    seen, _ = _read(compiled, x, compiled_path=True)
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks          # it ran compiled
    assert len(eager.values) >= 16 and seen.values.keys() == eager.values.keys()
    for key, expected in eager.values.items():
        got = seen.values[key]
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected], key
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, rtol=0, atol=0, msg=str(key))
    assert seen.calls == eager.calls and set(seen.calls.values()) == {1}


class StatefulModel(torch.nn.Module):
    """Everything a second, hidden run of the graph would change: batch-norm
    statistics, dropout's draws, a parameter updated in place, the caller's
    input modified in place."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.bn = torch.nn.BatchNorm1d(4)
        self.drop = torch.nn.Dropout(0.5)
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(1.5)
        x.add_(1)
        h = self.drop(self.bn(self.lin(x))) * self.scale
        h += 1
        return h


class Observe(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.get_inputs()
        context.insert_before_op(self.look)

    def look(self, *tensors):
        pass


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_analysis_run_leaves_nothing_behind(backend):
    torch.manual_seed(0)
    plain, instrumented = StatefulModel().train(), None
    instrumented = copy.deepcopy(plain)
    x = torch.randn(6, 4)
    x_plain, x_instrumented = x.clone(), x.clone()
    torch.manual_seed(1)
    expected = torch.compile(plain, backend=backend)(x_plain)
    draw_plain = torch.rand(8)
    torch.manual_seed(1)
    fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    with amanda.apply(Observe()):
        got = torch.compile(instrumented, backend=backend)(x_instrumented)
    draw_instrumented = torch.rand(8)
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    assert torch.equal(got, expected)
    assert torch.equal(draw_instrumented, draw_plain)          # the generator moved as far
    assert torch.equal(x_instrumented, x_plain)                # the input written once
    for (name, a), b in zip(plain.state_dict().items(), instrumented.state_dict().values()):
        assert torch.equal(a, b), name                         # statistics, scale: updated once


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                               torch.nn.Linear(8 * 6 * 6, 16), torch.nn.ReLU(),
                               torch.nn.Linear(16, 4)), torch.randn(2, 3, 8, 8)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_a_pruner_computes_the_masks_of_eager(backend):
    """Masks are computed in analysis from the weights a routine reads: the
    compiled path must hand the real weights (it handed fake tensors)."""
    model, x = _mlp()
    results = {}
    for compiled_path in (False, True):
        pytorch_compiled.ENABLED = compiled_path
        torch._dynamo.reset()
        pruner = Pruner("unstructured", sparsity=0.5, mask_grads=False)
        fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
        with torch.no_grad(), amanda.apply(pruner):
            out = torch.compile(model, backend=backend)(x)
        assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
        masks = {layer.op_id: np.asarray(layer.mask) for layer in pruner.layers.values()}
        results[compiled_path] = out, masks
    (eager_out, eager_masks), (out, masks) = results[False], results[True]
    assert len(eager_masks) == 3 and masks.keys() == eager_masks.keys()
    for key in masks:
        np.testing.assert_array_equal(masks[key], eager_masks[key])
        assert 0.4 < 1 - masks[key].mean() <= 0.6
    torch.testing.assert_close(out, eager_out)
    assert not torch.equal(out, model(x))                      # the masks took effect


def _flops(model, x, compiled_path, backend):
    pytorch_compiled.ENABLED = compiled_path
    torch._dynamo.reset()
    profiler = FlopsProfiler(backward=False)
    fallbacks = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    with torch.no_grad(), amanda.apply(profiler):
        compiled = torch.compile(model, backend=backend)
        compiled(x)
        compiled(x)
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    records = {op_id: (r["type"], r["module"], r["flops"], r["calls"])
               for (_, op_id), r in profiler.records.items()}
    return profiler.total(), records


def test_flops_of_a_compiled_model_equal_eager():
    model, x = _mlp()
    eager = _flops(model, x, False, "aot_eager")
    compiled = _flops(model, x, True, "aot_eager")
    assert eager[0] > 0 and compiled == eager


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    "bert",
    # 140 s here: in `make sweep` only (AMANDA_TORCH_SWEEP=1), for CI's time
    pytest.param("resnet50", marks=pytest.mark.skipif(
        os.environ.get("AMANDA_TORCH_SWEEP") != "1", reason="the whole sweep: make sweep"))])
def test_full_size_models_compiled_with_flops_and_pruning_tools_equal_eager(name):
    """BERT-base and ResNet-50 (random weights), inductor: the FLOPs table
    and the pruning masks equal eager's, with no eager fallback."""
    from tests.models import build_model
    model, x = build_model(name)
    eager = _flops(model, x, False, "inductor")
    compiled = _flops(model, x, True, "inductor")
    assert eager[0] > 1e9 and compiled == eager
    masks = {}
    for compiled_path in (False, True):
        pytorch_compiled.ENABLED = compiled_path
        torch._dynamo.reset()
        pruner = Pruner("2:4", mask_grads=False)
        with torch.no_grad(), amanda.apply(pruner):
            torch.compile(model, backend="inductor")(x)
        masks[compiled_path] = {layer.op_id: np.asarray(layer.mask) for layer in pruner.layers.values()}
    assert len(masks[False]) >= 50 and masks[True].keys() == masks[False].keys()
    for key, mask in masks[False].items():
        np.testing.assert_array_equal(masks[True][key], mask)


class Failing(amanda.Tool):
    """Fails in its analysis routine at ``relu``, or in the routine it puts
    before every other op."""

    def __init__(self, where):
        super().__init__()
        self.where = where
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if self.where == "analysis" and context.get_op_name() == "relu":
            raise ValueError("analysis failed")
        context.insert_before_op(self.routine)

    def routine(self, *tensors):
        if self.where == "routine":
            raise KeyError("routine failed")


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("where", ["analysis", "routine"])
def test_a_tool_error_is_the_tools_error_and_leaves_nothing_behind(where, backend):
    """An analysis routine fails while Dynamo compiles: the user gets the
    ToolError naming tool, routine and op (Dynamo wrapped it in its own
    BackendCompilerFailed), and the compiled model runs as before afterwards."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU())
    compiled, x = torch.compile(model, backend=backend), torch.randn(2, 4)
    with pytest.raises(amanda.ToolError) as raised:
        with amanda.apply(Failing(where)):
            compiled(x)
    message = str(raised.value)
    assert "tool Failing" in message and f"routine Failing.{where}" in message
    assert f"op '{'relu' if where == 'analysis' else 'linear'}'" in message
    assert "namespace 'pytorch/2.13.0/compiled'" in message and "While executing" not in message
    assert not torch.overrides._get_current_function_mode_stack()
    assert not torch.nn.modules.module._global_forward_pre_hooks
    torch.testing.assert_close(compiled(x), model(x))


class _Breaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x)
        return h[torch.nonzero(h > 0, as_tuple=True)].sum()     # a data-dependent shape: a graph break


class _Backward(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.add_inst_for_op(lambda context: None, backward=True)


@pytest.mark.parametrize("case", ["graph break", "backward routines"])
def test_running_eagerly_is_said_once_at_the_users_line(case):
    """A compiled callable that runs eagerly inside ``apply`` loses no point
    but its speed: one EagerFallbackWarning per callable and reason, naming
    the reason, at the line that called it. (Backward routines run compiled
    on ``aot_eager``, tests/pytorch/test_compiled_backward.py; a compiler
    without AOTAutograd, ``eager``, still runs them eagerly.)"""
    import warnings
    model = _Breaks() if case == "graph break" else Block()
    compiled = torch.compile(model, backend="aot_eager" if case == "graph break" else "eager")
    x = torch.randn(4, 4) if case == "graph break" else torch.randn(4, 8)
    tool = Observe() if case == "graph break" else _Backward()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with amanda.apply(tool):
            compiled(x).sum().backward()
            compiled(x).sum().backward()
    said = [w for w in caught if issubclass(w.category, amanda.EagerFallbackWarning)]
    assert len(said) == 1 and case in str(said[0].message)
    assert said[0].filename == __file__
    assert any(case in reason and reason in str(said[0].message)
               for reason in pytorch_compiled.EAGER_FALLBACKS)          # and counted
