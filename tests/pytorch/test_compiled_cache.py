"""Compiled PyTorch cached vs under ``amanda.cache_disabled()``, by difference.

DESIGN: the cache never changes which routines run; the executions of (op
id, point) with and without the cache are the same. On the compiled path a
graph is analysed once, when Dynamo compiles it, and its actions run in
every later call; under ``cache_disabled()`` analysis must run at every
execution of an op, which an analysed-once graph cannot do, so a compiled
callable called there runs eagerly (`pytorch_compiled._UNCACHED`, counted in
``EAGER_FALLBACKS``, one ``EagerFallbackWarning``), with eager's op ids, and
runs compiled again once the cache is back on (docs/pytorch-compiled.md,
"cache_disabled()").

Each program below (branches on the input's shape, a module called twice,
functional calls and operators, a compiled function calling a module, a
compiled layer inside an eager model) runs four steps with a tool that has
analysis-time counters, Python before/after routines and a portable routine
that changes outputs, once cached (where it must run compiled) and once under
``cache_disabled()``, with one ``apply`` scope around the steps or one per
step: the (op id, op name, point) executions of each step, the outputs and
the tool's analysis counts (each op analysed once cached, at every execution
uncached) are compared.
"""

import collections
import contextlib
import warnings

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402
from tests.pytorch.test_compiled_sweep import _new_fallbacks  # noqa: E402


pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py


@portable.routine
def _shift(x, offset):
    return x + offset


class Recorder(amanda.Tool):
    """Logs (op id, op name, point) at every forward op's before and after
    points (Python observers), counts its analyses per op id, and adds a
    per-op constant (a tensor argument of a portable routine) to every
    ``relu``'s and ``gelu``'s output, so dropped or doubled actions change
    the outputs."""

    def __init__(self):
        super().__init__()
        self.log = []
        self.analysed = collections.Counter()
        self.offsets = {}
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        op_id, name = context.get_op_id(), context.get_op_name()
        self.analysed[op_id, name] += 1
        context.insert_before_op(self.seen, key=(op_id, name, "before"))
        context.insert_after_op(self.seen, key=(op_id, name, "after"))
        if name in ("relu", "gelu"):
            offset = self.offsets.setdefault(op_id, torch.full((), 0.25 * (1 + len(self.offsets))))
            context.insert_after_op(_shift, offset=offset)

    def seen(self, *tensors, key):
        self.log.append(key)


class _Branches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wide = torch.nn.Linear(6, 6)
        self.narrow = torch.nn.Linear(6, 6)

    def forward(self, x):
        if x.shape[0] > 2:                  # Dynamo guards on it: one graph per branch
            return torch.relu(self.wide(x)) * 2
        return torch.nn.functional.gelu(self.narrow(x)) - 1


class _Twice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(6, 6)
        self.act = torch.nn.ReLU()

    def forward(self, x):
        x = self.act(self.shared(x))
        return self.act(self.shared(x)) + x      # the same modules, second occurrences


class _Functional(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = torch.nn.functional.gelu(self.proj(x))
        h += 1
        y = torch.cat([h, 1 - x], dim=1)
        y[:, 0] = 0.5                              # an in-place item assignment
        a, b = y.split(6, dim=1)
        return a * b + a + b


def _function_calling_a_module():
    layer = _Twice()

    def step(x):
        return torch.relu(layer(x) * 3).sum(dim=1, keepdim=True) + x
    return layer, step


class _EagerWithCompiledLayer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(6, 6)
        self.layer = torch.compile(_Functional(), backend="aot_eager")   # compiled part

    def forward(self, x):
        return self.layer(torch.relu(self.first(x)))


def _programs():
    """name -> (callable the steps call, modules whose parameters it uses)."""
    torch.manual_seed(0)
    branches = _Branches()
    twice = _Twice()
    functional = _Functional()
    layer, function = _function_calling_a_module()
    eager_model = _EagerWithCompiledLayer()
    return {
        "branches": torch.compile(branches, backend="aot_eager"),
        "module called twice": torch.compile(twice, backend="aot_eager"),
        "functional calls": torch.compile(functional, backend="aot_eager"),
        "function calling a module": torch.compile(function, backend="aot_eager"),
        "compiled layer in an eager model": eager_model,
    }


PROGRAMS = list(_programs())


def _inputs(step):
    torch.manual_seed(100 + step)
    return torch.rand(3 if step % 2 == 0 else 2, 6)    # both branches of _Branches


class _CountingBackend:
    """aot_eager, counting the runs of the graphs it compiled: whether a call ran compiled."""

    def __init__(self):
        self.runs = 0

    def __call__(self, gm, example_inputs):
        from torch._dynamo.backends.common import aot_autograd
        from functorch.compile import nop
        compiled = aot_autograd(fw_compiler=nop)(gm, example_inputs)

        def run(*args):
            self.runs += 1
            return compiled(*args)
        return run


def _run(fn, cached, per_step, steps=4):
    """Per step: (the tool's log, the output); and the tool."""
    tool = Recorder()
    result = []
    cache = amanda.cache_enabled() if cached else amanda.cache_disabled()
    with torch.no_grad(), cache, contextlib.ExitStack() as outer:
        if not per_step:
            outer.enter_context(amanda.apply(tool))
        for i in range(steps):
            start = len(tool.log)
            with amanda.apply(tool) if per_step else contextlib.nullcontext():
                out = fn(_inputs(i))
            result.append((collections.Counter(tool.log[start:]), tool.log[start:], out))
    return result, tool


@pytest.mark.parametrize("per_step", [False, True], ids=["one scope", "scope per step"])
@pytest.mark.parametrize("name", PROGRAMS)
def test_cache_disabled_runs_the_routines_of_the_cached_compiled_path(name, per_step):
    fn = _programs()[name]
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)   # cached: it runs compiled
        cached, cached_tool = _run(fn, cached=True, per_step=per_step)
    assert not _new_fallbacks(before)

    with pytest.warns(amanda.EagerFallbackWarning, match="cache_disabled"):
        uncached, uncached_tool = _run(fn, cached=False, per_step=per_step)
    assert pytorch_compiled._UNCACHED in _new_fallbacks(before)

    # the reference: the same calls with the compiled path off (eager, cached)
    pytorch_compiled.ENABLED = False
    try:
        eager, _ = _run(fn, cached=True, per_step=per_step)
    finally:
        pytorch_compiled.ENABLED = True

    for i, ((c_points, c_order, c_out), (u_points, u_order, u_out), (e_points, _, e_out)) in \
            enumerate(zip(cached, uncached, eager)):
        assert len(c_order) >= 8
        assert c_points == u_points == e_points, f"{name}: step {i}: other (op id, point) executions"
        assert c_order == u_order, f"{name}: step {i}: the points ran in another order"
        assert torch.equal(c_out, u_out), f"{name}: step {i}: outputs differ"
        assert torch.equal(u_out, e_out), f"{name}: step {i}: uncached outputs differ from eager's"

    # analysis: once per op and graph cached, at every execution uncached
    executed = collections.Counter()
    for points, _, _ in uncached:
        for (op_id, op_name, point), n in points.items():
            if point == "before":
                executed[op_id, op_name] += n
    assert uncached_tool.analysed == executed
    assert set(cached_tool.analysed) == set(executed)
    assert sum(cached_tool.analysed.values()) < sum(executed.values())


def test_compiled_again_when_the_cache_is_back_on():
    """Inside one ``apply`` scope: compiled (cached), eager under
    ``cache_disabled()``, compiled again in a nested ``cache_enabled()`` and
    after the block, without compiling anew; the points of every call are
    those of the first."""
    torch.manual_seed(0)
    backend = _CountingBackend()
    model = torch.compile(_Twice(), backend=backend)
    x = torch.rand(3, 6)
    tool = Recorder()
    runs, logs = [], []

    def call():
        start = len(tool.log)
        model(x)
        runs.append(backend.runs)
        logs.append(collections.Counter(tool.log[start:]))

    with torch.no_grad(), amanda.apply(tool):
        call()                                  # compiles, runs compiled
        with pytest.warns(amanda.EagerFallbackWarning, match="cache_disabled"), \
                amanda.cache_disabled():
            call()                              # eagerly
            with amanda.cache_enabled():
                call()                          # compiled
            call()                              # eagerly
        call()                                  # compiled
    assert runs == [1, 1, 2, 2, 3]
    assert all(log == logs[0] for log in logs) and len(logs[0]) >= 8
