"""Compiled PyTorch: Dynamo refusing a frame part-way through a call that
amanda started compiled (amanda.runtime.pytorch.compiled).

Each program below makes Dynamo give up on a frame after amanda's compiled
call began (its eager machinery taken out): the recompile limit (guarded by
amanda, the control, and unguarded), config settings that make Dynamo skip
frames, an error in the compiler under ``suppress_errors``, an unsupported
call in a nested function, a ``torch._dynamo.disable``d submodule, shapes
that force recompiles, a module that mutates its attributes, an exception
raised in compiled code and caught by the caller or inside. With the compiled
path on, the multiset of (op id, op name, point) executions of a counting
tool over several calls in one session must equal eager's (``torch.compile``
not used), and identity routines must leave outputs bit-identical.

The programs call torch functions written in Python (``F.layer_norm``,
``F.dropout``, ``F.softmax``, ``torch.split``): the interpreter calls them
inline, except while a frame evaluator (Dynamo's) is installed, and the two
ways leave the calling frame's ``f_lasti`` on different instructions; ops
keyed by that offset got other ids on the calls after a fallback
(docs/pytorch-compiled.md, "Refusals in the middle of a call").
"""

import collections
import contextlib
import zlib

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402

F = torch.nn.functional


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    saved = pytorch_compiled.ENABLED
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack:
        _CONFIG.append(stack)
        yield
        _CONFIG.pop()
    torch._dynamo.reset()
    pytorch_compiled.ENABLED = saved


_CONFIG = []    # the test's ExitStack, where Dynamo config patches are undone


class CountPoints(amanda.Tool):
    """Counts every (op id, op name, point) execution, before and after every forward op."""

    def __init__(self):
        super().__init__()
        self.executions = collections.Counter()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        key = (context.get_op_id(), context.get_op_name())
        context.insert_before_op(self.count, key=key + ("before",))
        context.insert_after_op(self.count, key=key + ("after",))

    def count(self, *tensors, key):
        self.executions[key] += 1


class Identity(amanda.Tool):
    """A Python routine before and after every op that gives its tensors back."""

    def __init__(self):
        super().__init__()
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        context.insert_before_op(self.same)
        context.insert_after_op(self.same)

    @portable.hosted    # a Python routine (amanda::replace in compiled graphs)
    def same(self, *tensors):
        return list(tensors)


# -- the programs ---------------------------------------------------------------------------

def _mix(x, weight):
    """Torch functions written in Python (called inline by the interpreter
    unless a frame evaluator is installed) and builtins."""
    h = F.layer_norm(x, x.shape[-1:])
    h = F.dropout(h, 0.1, training=False) + torch.sin(x)
    a, b = torch.split(F.softmax(h @ weight, -1), x.shape[-1] // 2, dim=-1)
    return F.relu(torch.cat([b, a], -1)) * 2


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.drop = torch.nn.Dropout(0.1)
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.drop(F.gelu(self.fc(self.norm(x)))) + x


class Net(torch.nn.Module):
    """Two layers and a function of Python torch calls between them."""

    def __init__(self):
        super().__init__()
        self.first, self.second = Layer(), Layer()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        return self.second(_mix(self.first(x), self.weight))


def _untraceable(h):
    n = zlib.crc32(b"amanda")        # a builtin Dynamo cannot trace: Unsupported here
    return F.softmax(h, -1) + n % 3


class NestedUnsupported(Net):
    def forward(self, x):
        return self.second(_untraceable(_mix(self.first(x), self.weight)))


class DisabledLayer(Layer):
    @torch._dynamo.disable
    def forward(self, x):
        return super().forward(x)


class CallsDisabled(Net):
    def __init__(self):
        super().__init__()
        self.second = DisabledLayer()


class Mutating(Net):
    """Changes an attribute on every call: Dynamo's guard on it fails, and it recompiles."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x) * self.calls


class Raising(Net):
    """Raises after some ops when the input is negative."""

    def forward(self, x):
        h = self.first(x)
        if x.sum() < 0:               # data-dependent: a graph break
            raise ValueError("negative input")
        return self.second(_mix(h, self.weight))


class RaisingStatic(Net):
    """Raises after some ops when the batch is odd (a static condition)."""

    def forward(self, x):
        h = self.first(x)
        if x.shape[0] % 2:
            raise ValueError("odd batch")
        return self.second(_mix(h, self.weight))


def _raise_on_odd(h):
    if h.shape[0] % 2:
        raise ValueError("odd batch")
    return h


class CatchesInside(Net):
    def forward(self, x):
        h = self.first(x)
        try:
            h = _raise_on_odd(h) * 2
        except ValueError:
            h = F.softmax(h, -1)
        return self.second(_mix(h, self.weight))


class OwnHooks(Net):
    """A pre-hook of its own that calls a layer the forward calls too: Dynamo
    skips ``torch.compiler.is_compiling``, which ``Module.__call__`` calls
    before it runs the hooks (amanda's pre-hook among them)."""

    def __init__(self):
        super().__init__()
        self.register_forward_pre_hook(lambda module, args: (module.first(args[0]) * 2,))


class FailingBackend:
    """A compiler that fails on every graph that holds a ``layer_norm``
    (Dynamo runs the frame as plain Python under ``suppress_errors``)."""

    def __init__(self):
        from torch._dynamo.backends.registry import lookup_backend
        self.inner = lookup_backend("eager")

    def __call__(self, gm, example_inputs):
        if any("layer_norm" in str(node.target) for node in gm.graph.nodes):
            raise RuntimeError("this compiler refuses layer_norm")
        return self.inner(gm, example_inputs)


def _same_shape(x):
    return [x] * 5


def _growing_batch(x):
    return [x[:2], x[:3], x[:4], x[:5], x[:2], x[:4]]


def _calls_catching(compiled, inputs):
    outputs = []
    for x in inputs:
        try:
            outputs.append(compiled(x))
        except ValueError:
            outputs.append(None)
    return outputs


#: name -> (model factory, torch.compile kwargs, Dynamo config, inputs from x, expect a fallback)
PROGRAMS = {
    "recompile limit (unguarded)": (Net, {}, {"recompile_limit": 1}, _same_shape, True),
    "accumulated recompile limit": (Mutating, {"dynamic": False}, {"accumulated_recompile_limit": 2},
                                    _same_shape, True),
    "recompile limit, no recursive skip": (Mutating, {"dynamic": False},
                                           {"recompile_limit": 3,
                                            "skip_code_recursive_on_recompile_limit_hit": False},
                                           _same_shape, True),
    "compiler error, suppress_errors": (Net, {"backend": "failing"}, {"suppress_errors": True},
                                        _same_shape, True),
    "Dynamo disabled by its config": (Net, {}, {"disable": True}, _same_shape, True),
    "unsupported call in a nested function": (NestedUnsupported, {}, {}, _same_shape, True),
    "disabled submodule": (CallsDisabled, {}, {}, _same_shape, True),
    "module with a hook of its own": (OwnHooks, {}, {}, _same_shape, True),
    "shapes force recompiles": (Net, {"dynamic": False}, {"recompile_limit": 3}, _growing_batch, True),
    "automatic dynamic shapes": (Net, {}, {}, _growing_batch, False),
    "attribute mutation": (Mutating, {"dynamic": False}, {"recompile_limit": 3}, _same_shape, True),
    "exception caught by the caller (data-dependent)": (
        Raising, {}, {}, lambda x: [x, -x, x], True),
    "exception caught by the caller (static)": (
        RaisingStatic, {}, {}, lambda x: [x[:2], x[:3], x[:2], x[:3]], False),
    "exception caught inside compiled code": (
        CatchesInside, {}, {}, lambda x: [x[:2], x[:3], x[:2]], False),
}


def _compile(name, model):
    kwargs = dict(PROGRAMS[name][1])
    backend = kwargs.pop("backend", "eager")
    return torch.compile(model, backend=FailingBackend() if backend == "failing" else backend,
                         **kwargs)


def _points(compiled, inputs, compiled_path):
    pytorch_compiled.ENABLED = compiled_path
    tool = CountPoints()
    with torch.no_grad(), amanda.apply(tool):
        _calls_catching(compiled, inputs)
    return tool.executions


def _program(name, monkeypatch):
    factory, _, config, inputs, fallback = PROGRAMS[name]
    if name == "recompile limit (unguarded)":
        monkeypatch.setattr(pytorch_compiled, "_within_dynamo_limit", lambda *args: True)
    _CONFIG[-1].enter_context(torch._dynamo.config.patch(**config))
    torch.manual_seed(0)
    model = factory().eval()
    return model, inputs(torch.randn(5, 8)), fallback


def _sessions(name):
    """The recompile-limit programs need more sessions than Dynamo's limit."""
    return 3 if "unguarded" in name else 1


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_refusals_give_the_points_of_eager(name, monkeypatch):
    model, inputs, fallback = _program(name, monkeypatch)
    plain = _points(model, inputs, compiled_path=False)
    assert len(plain) >= 20
    compiled = _compile(name, model)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    for _ in range(_sessions(name)):
        observed = _points(compiled, inputs, compiled_path=True)
        assert observed == plain
    if fallback:     # Dynamo did refuse a frame of a call amanda started compiled
        assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) > before


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_refusals_identity_routines_keep_outputs(name, monkeypatch):
    model, inputs, _ = _program(name, monkeypatch)
    with torch.no_grad():
        expected = _calls_catching(model, inputs)
        if isinstance(model, Mutating):
            model.calls = 0
        compiled = _compile(name, model)
        pytorch_compiled.ENABLED = True
        for _ in range(_sessions(name)):
            if isinstance(model, Mutating):
                model.calls = 0
            with amanda.apply(Identity()):
                outputs = _calls_catching(compiled, inputs)
            assert len(outputs) == len(expected)
            for out, want in zip(outputs, expected):
                assert (out is None) == (want is None)
                assert out is None or torch.equal(out, want)


def test_recompile_limit_guarded_control():
    """The control: past Dynamo's recompile limit amanda runs the calls
    eagerly from the start (no refusal in the middle of a call)."""
    _CONFIG[-1].enter_context(torch._dynamo.config.patch(recompile_limit=3))
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 8)
    plain = _points(model, [x, x], compiled_path=False)
    compiled = torch.compile(model, backend="eager")
    for _ in range(4):
        assert _points(compiled, [x, x], compiled_path=True) == plain
    assert pytorch_compiled.EAGER_FALLBACKS[pytorch_compiled._TOO_MANY] >= 1


def test_op_ids_do_not_depend_on_a_frame_evaluator():
    """The mechanism: Dynamo's frame evaluator (PEP 523) installed, as in
    ``torch._dynamo.run``, makes the interpreter call Python functions
    through the C API; the ops' ids and occurrences stay those of the plain
    run (no compiled code runs: eager ops only)."""
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(4, 8)
    pytorch_compiled.ENABLED = True      # Dynamo's own stance for a run-only call
    plain = CountPoints()
    with torch.no_grad(), amanda.apply(plain):
        model(x)
        model(x)
    mixed = CountPoints()
    with torch.no_grad(), amanda.apply(mixed):
        torch._dynamo.run(lambda v: model(v))(x)      # under the frame evaluator, running no compiled code
        model(x)
    assert mixed.executions == plain.executions
    assert any(name == "layer_norm" for _, name, _ in plain.executions)


def _part(h):
    h = F.softmax(h, -1) * 2
    if h.shape[0] == 3:
        torch._dynamo.graph_break()      # only for this shape: the second call falls back
    return F.layer_norm(h, h.shape[-1:]) + torch.sin(h)


class CompiledParts(torch.nn.Module):
    """An eager module calling a compiled function twice in a step (the
    second call falls back) and a compiled layer twice."""

    def __init__(self, backend):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)
        self.part = torch.compile(_part, backend=backend)
        self.norm = torch.compile(torch.nn.LayerNorm(8), backend=backend)

    def forward(self, x):
        a = self.part(self.fc(x))
        b = self.part(self.fc(x[:3]))
        return self.norm(a).sum() + self.norm(b).sum() + _part(a).sum()


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_fallback_later_in_the_step_counts_the_compiled_calls_before_it(backend):
    """Eager counts an op's executions in the step (its occurrence, part of
    its id); the first call of the compiled function ran in a graph, so the
    second, which runs eagerly, must start counting after it."""
    torch.manual_seed(0)
    model, x = CompiledParts(backend), torch.randn(4, 8)
    plain = _points(model, [x, x], compiled_path=False)
    before = sum(pytorch_compiled.EAGER_FALLBACKS.values())
    assert _points(model, [x, x], compiled_path=True) == plain
    assert sum(pytorch_compiled.EAGER_FALLBACKS.values()) == before + 1
    with torch.no_grad():
        expected = model(x)
        pytorch_compiled.ENABLED = True
        with amanda.apply(Identity()):
            assert torch.equal(model(x), expected)
