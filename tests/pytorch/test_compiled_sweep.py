"""Compiled PyTorch on the real-model sweep's models, by difference with eager
(amanda.runtime.pytorch.compiled, on by default).

Every forward case of tests/sweep_models.py (eval mode, or train mode where
the case asks for it, under ``torch.no_grad()``; bf16 autocast where the
case has it) is compiled with ``torch.compile(model, backend="aot_eager")``
and, inside ``amanda.apply``:

* a counting tool (before and after every forward op, keyed by (op id, op
  name, point); a portable identity routine at the same points, so one
  instrumented compilation checks both) sees over two calls the multiset of
  executions that the same compiled callable gives with the compiled path off
  (``pytorch_compiled.ENABLED = False``: every op runs eagerly). transformers
  builds other code under compilation (``is_torchdynamo_compiling()``: a
  causal mask built from ``arange`` instead of a ``torch.all`` check that
  skips it), so a call that ran compiled is compared with the eager run of
  that code: ``torch.compiler.is_compiling`` patched to return True. A call
  that fell back to eager (`EAGER_FALLBACKS` grew) is compared with the
  plain eager run, and its reasons must be the ones listed in `FALLBACKS`;
* identity routines (a Python ``@portable.hosted`` one; the portable one
  beside the counting routines) before and after every op keep the outputs
  bit-identical to the vanilla compiled model's;
* after the scope, torch's function-mode stack is empty and the global
  module hooks are those from before.

A model that fails with plain ``torch.compile`` (no amanda) is skipped with
the reason. Backend inductor is checked (counting) on BERT and GPT-2. The
small tests at the end pin each bug the sweep found. docs/pytorch-compiled.md
("Real-model sweep") lists the results.
"""

import collections
import contextlib
import functools
import types
import unittest.mock

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402
from tests.sweep_models import CASES  # noqa: E402
from tests.pytorch.test_compiled_models import CountPoints, Identity, _same, _tensors  # noqa: E402


pytestmark = pytest.mark.usefixtures("compiled_path_fresh_dynamo")   # tests/conftest.py


#: The forward cases: generate (its loop recompiles per length), double
#: backward and checkpointing (training only) are left to the eager sweep.
_FORWARD = {case.name: case for case in CASES
            if case.kind == "step" and not case.checkpointing}
QUICK = "resnet"
SLOW = [name for name in _FORWARD if name != QUICK]

#: Models that run (partly) eagerly inside apply, and why: every reason in
#: `EAGER_FALLBACKS` during a model's test must contain one of its strings,
#: and each string must be met (a model that starts or stops falling back
#: fails its test).
FALLBACKS = {
    # Dynamo breaks the graph (data-dependent Python control flow)
    "longformer": ["graph break"],
    "reformer": ["graph break"],
    "encodec": ["graph break"],
    # associative_scan's generic mode, traced as torch.func.vmap
    "mamba": ["functorch transform"],
    # a Python routine that may replace after `x[i] = v` (returns None):
    # only the identity check with the hosted routine
    "bart": ["which returns None, with a routine that may replace its output"],
    "mixtral": ["which returns None, with a routine that may replace its output"],
}


class CountAndPortableIdentity(CountPoints):
    """Counts before and after every op (``amanda::observe``) and runs a
    portable identity routine there too (traced into the graph)."""

    def analysis(self, context):
        super().analysis(context)
        context.insert_before_op(_same)
        context.insert_after_op(_same)


def _scope(case):
    if case.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def _hooks():
    from torch.nn.modules import module
    return [dict(getattr(module, name)) for name in (
        "_global_forward_pre_hooks", "_global_forward_hooks", "_global_backward_pre_hooks",
        "_global_backward_hooks", "_global_module_registration_hooks",
        "_global_parameter_registration_hooks", "_global_buffer_registration_hooks")]


def _points(case, compiled, inputs, compiled_path, compiling=False, calls=2, outputs=None):
    """(op id, op name, point) -> executions over ``calls`` calls of
    `CountAndPortableIdentity` (the calls' output tensors appended to
    ``outputs``); with ``compiling``, transformers takes the branches it
    takes under Dynamo."""
    pytorch_compiled.ENABLED = compiled_path
    tool = CountAndPortableIdentity()
    patch = unittest.mock.patch("torch.compiler.is_compiling", lambda: True) if compiling \
        else contextlib.nullcontext()
    try:
        with patch, torch.no_grad(), _scope(case), amanda.apply(tool):
            for _ in range(calls):
                out = compiled(**inputs)
                if outputs is not None:
                    outputs.append(_tensors(out))
    finally:
        pytorch_compiled.ENABLED = True
    return tool.executions


def _plain(case, compiled, inputs):
    with torch.no_grad(), _scope(case):
        return _tensors(compiled(**inputs))


def _compile(case, backend):
    model, inputs = case.make()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend)
    try:
        expected = _plain(case, compiled, inputs)
    except Exception as error:      # no amanda involved: not amanda's to answer
        pytest.skip(f"plain torch.compile fails: {type(error).__name__}: {error}"[:300])
    assert expected
    return compiled, inputs, expected


def _new_fallbacks(before):
    return {reason for reason, n in pytorch_compiled.EAGER_FALLBACKS.items()
            if n > before.get(reason, 0)}


def _check(name):
    case = _FORWARD[name]
    compiled, inputs, expected = _compile(case, "aot_eager")
    hooks = _hooks()
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)

    # counting, by difference with eager
    eager = _points(case, compiled, inputs, compiled_path=False)
    counted = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    outputs = []
    observed = _points(case, compiled, inputs, compiled_path=True, outputs=outputs)
    fell_back = bool(_new_fallbacks(counted))
    reference = eager if fell_back else \
        _points(case, compiled, inputs, compiled_path=False, compiling=True)
    assert len(reference) >= 20
    missing, extra = reference - observed, observed - reference
    assert not missing and not extra, (
        f"{name}: eager-only {sorted(set(k[1] for k in missing))}, "
        f"compiled-only {sorted(set(k[1] for k in extra))}")

    # identity routines keep the vanilla compiled outputs bit-identical:
    # portable ones (beside the counting routines above), then Python ones
    with torch.no_grad(), _scope(case), amanda.apply(Identity(False)):
        hosted = [_tensors(compiled(**inputs)) for _ in range(2)]
    for kind, runs in (("portable", outputs), ("python", hosted)):
        for out in runs:
            assert len(out) == len(expected)
            assert all(torch.equal(a, b) for a, b in zip(out, expected)), \
                f"{name}: identity routines ({kind}) changed the compiled outputs"
    assert all(torch.equal(a, b) for a, b in zip(_plain(case, compiled, inputs), expected))

    # no state left behind
    assert torch.overrides._get_current_function_mode_stack() == []
    assert _hooks() == hooks

    # every fallback is a listed one
    reasons = _new_fallbacks(before)
    listed = FALLBACKS.get(name, [])
    unlisted = [r for r in reasons if not any(s in r for s in listed)]
    unmet = [s for s in listed if not any(s in r for r in reasons)]
    assert not unlisted and not unmet, f"{name}: fallbacks {reasons}, listed {listed}"


def test_quick_model_matches_eager():
    _check(QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_model_matches_eager(name):
    _check(name)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "gpt2"])
def test_inductor_model_has_the_points_of_eager(name):
    case = _FORWARD[name]
    compiled, inputs, _ = _compile(case, "inductor")
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    observed = _points(case, compiled, inputs, compiled_path=True)
    assert not _new_fallbacks(before)
    assert observed == _points(case, compiled, inputs, compiled_path=False, compiling=True)


# -- the bugs the sweep found, on small programs ---------------------------------------------

def _count(fn, *args, compiled_path, compiling=False):
    pytorch_compiled.ENABLED = compiled_path
    tool = CountPoints()
    try:
        with torch.no_grad(), amanda.apply(tool):
            for _ in range(2):
                fn(*args)
    finally:
        pytorch_compiled.ENABLED = True
    return tool.executions


def _unused_index(x):
    x[:, None]               # eager runs it: a point
    return x + 1


def test_unused_indexing_is_a_point():
    """Dynamo erases an unused ``operator.getitem`` node before the backend
    sees the graph (transformers' mask builders: LLaMA, GPT-2, BART...)."""
    compiled = torch.compile(_unused_index, backend="aot_eager")
    x = torch.rand(3)
    eager = _count(compiled, x, compiled_path=False)
    assert {k[1] for k in eager} == {"__getitem__", "add"}
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)
    assert torch.equal(compiled(x), x + 1)


def _real(x):
    return x.real * 2


def test_tensor_property_is_named_as_eagerly():
    """``x.real`` is ``getattr(x, 'real')`` in FX; eager names it ``real`` (FNet)."""
    compiled = torch.compile(_real, backend="aot_eager")
    x = torch.rand(4, dtype=torch.complex64)
    eager = _count(compiled, x, compiled_path=False)
    assert {k[1] for k in eager} == {"real", "mul"}
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)


def test_library_module_forward_has_eagers_site():
    """A module whose ``forward`` is torch library code outside
    ``torch/nn/modules`` (weight norm's parametrization, Wav2Vec2): eager's
    site is ``Module._call_impl``'s ``inner``."""
    torch.manual_seed(0)
    model = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(2, 3, 3))
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.rand(1, 2, 8)
    eager = _count(compiled, x, compiled_path=False)
    assert "_weight_norm" in {k[1] for k in eager}
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)             # it ran compiled


class _Slice(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv1d(32, 32, 3, padding=1)
        self.norm = torch.nn.LayerNorm(32)

    def forward(self, x):                   # Wav2Vec2's positional convolution
        y = self.conv(x.transpose(1, 2))[:, :, :-1]     # clone() would make it contiguous
        y = torch.nn.functional.gelu(y).transpose(1, 2)
        return self.norm(x[:, :-1] + y)


def test_python_identity_keeps_a_slices_layout():
    """A Python routine's replacement (``amanda::replace``) has the layout of
    the tensor it replaces: a contiguous copy of Wav2Vec2's
    ``hidden_states[:, :, :-1]`` moved its outputs by 5e-7."""
    torch.manual_seed(0)
    model, x = _Slice().eval(), torch.rand(2, 50, 32)
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        expected = compiled(x)
        with amanda.apply(Identity(False)):
            got = [compiled(x) for _ in range(2)]
    assert all(torch.equal(g, expected) for g in got)


def _vmapped(x):
    return torch.func.vmap(lambda row: row * 2 + 1)(x)


def test_vmap_in_a_graph_runs_eagerly():
    """Ops inside a traced ``torch.func.vmap`` run on batched tensors, which
    amanda's custom ops cannot take (Mamba's associative scan failed): the
    call runs eagerly with a reason in EAGER_FALLBACKS."""
    compiled = torch.compile(_vmapped, backend="aot_eager")
    x = torch.rand(3, 4)
    eager = _count(compiled, x, compiled_path=False)
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert any("functorch transform" in r for r in _new_fallbacks(before))
    with amanda.apply(Identity(False)):
        assert torch.equal(compiled(x), x * 2 + 1)


def test_checkpointed_region_runs_eagerly():
    """Ops in a higher-order op's body (here ``torch.utils.checkpoint``'s) are
    a subgraph the compiled path does not lift; eager sees each of them, so
    the call runs eagerly, with a reason (before: their points were missing)."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(4, 4)

    def body(x):
        return torch.relu(linear(x)) * 2

    def step(x):
        return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum()

    compiled = torch.compile(step, backend="aot_eager")
    x = torch.rand(3, 4, requires_grad=True)
    pytorch_compiled.ENABLED = False
    eager = CountPoints()
    with amanda.apply(eager):
        for _ in range(2):
            compiled(x)
    pytorch_compiled.ENABLED = True
    assert {"linear", "relu", "mul", "sum"} <= {k[1] for k in eager.executions}
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    observed = CountPoints()
    with pytest.warns(amanda.EagerFallbackWarning), amanda.apply(observed):
        for _ in range(2):
            compiled(x)
    assert observed.executions == eager.executions
    assert any("tag_activation_checkpoint" in r for r in _new_fallbacks(before))


def _keyword_renamer(func):
    """A decorator like transformers 5.24's ``deprecate_kwarg``: the module
    reaches its ``forward`` as ``args[0]`` of a ``wrapper(*args, **kwargs)``,
    the frame Dynamo compiles for ``torch.compile(module)``."""
    @functools.wraps(func)
    def wrapped(*args, **kwargs):
        if "hidden" in kwargs:
            kwargs["x"] = kwargs.pop("hidden")
        return func(*args, **kwargs)
    return wrapped


class _Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)

    @_keyword_renamer
    def forward(self, x):
        return torch.relu(self.proj(x)) * 2


class _Wrapped(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList([_Block(), _Block()])
        self.head = torch.nn.Linear(8, 4)

    @_keyword_renamer
    def forward(self, x):
        x = x + 1                              # an op of the root module itself
        for block in self.blocks:
            x = block(hidden=x)
        return self.head(self.blocks[0](x))    # a module called twice


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_module_reached_through_a_wrappers_args_has_eagers_paths(backend):
    """A ``forward`` decorated by a ``wrapper(*args, **kwargs)`` (transformers
    5.24 put ``deprecate_kwarg`` on LLaMA's and Bloom's): the compiled
    module is ``L['args'][0]`` to Dynamo, and every op had the path
    ``0.<eager's path>`` (another id) before module paths were read below
    the compiled module's own place in the frame (`_owner`)."""
    torch.manual_seed(0)
    model = _Wrapped().eval()
    compiled = torch.compile(model, backend=backend)
    x = torch.rand(3, 8)
    eager = _count(compiled, x, compiled_path=False)
    assert {"linear", "relu", "mul", "add"} <= {k[1] for k in eager}
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)             # it ran compiled
    with torch.no_grad():
        expected = model(x)
        with amanda.apply(Identity(False)):
            assert torch.equal(compiled(x), expected)


class _Inner(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return torch.relu(self.fc(x))


def _through_an_attribute(holder, x):
    return holder.net(x) * 2      # the root module call: eager's path "", its layer "fc"


def test_function_reaching_a_module_through_an_attribute_has_eagers_paths():
    """A compiled function calling ``holder.net``: eager names that module
    "" (the root module call) and its layer "fc"; the paths were read below
    the first two parts of Dynamo's source (``L.holder``), ``net`` and
    ``net.fc``, other ids. They are now read below the root call's source."""
    torch.manual_seed(0)
    holder = types.SimpleNamespace(net=_Inner())
    compiled = torch.compile(_through_an_attribute, backend="aot_eager")
    x = torch.rand(2, 4)
    eager = _count(compiled, holder, x, compiled_path=False)
    assert {"linear", "relu", "mul"} <= {k[1] for k in eager}
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, holder, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)             # it ran compiled


_LOOSE = _Inner()


class _CallsALooseModule(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x):
        return _LOOSE(self.proj(x)) + 1           # a module that is no attribute of the model


def test_module_outside_the_model_has_eagers_path():
    """Eager names a module called from ``forward`` that is not below the
    model (a global) by its class (``_Inner``, then ``_Inner.fc``); Dynamo's
    source is ``G['_LOOSE']``. Paths are now eager's own naming of the
    module objects the sources name (before: a part of the global's name
    or "", other ids, silently)."""
    torch.manual_seed(0)
    compiled = torch.compile(_CallsALooseModule(), backend="aot_eager")
    x = torch.rand(2, 4)
    eager = _count(compiled, x, compiled_path=False)
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)             # it ran compiled


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4)
        self.second = self.first                  # one module, two names

    def forward(self, x):
        return torch.relu(self.second(x)) + self.first(x)


def test_module_with_two_names_has_eagers_path():
    """A module registered under two names and called through the second:
    eager names it by the first name ``named_modules()`` gives (``first``),
    Dynamo's source by the attribute used (``second``): other ids before."""
    torch.manual_seed(0)
    compiled = torch.compile(_Tied(), backend="aot_eager")
    x = torch.rand(2, 4)
    eager = _count(compiled, x, compiled_path=False)
    before = collections.Counter(pytorch_compiled.EAGER_FALLBACKS)
    assert _count(compiled, x, compiled_path=True) == eager
    assert not _new_fallbacks(before)


def test_eager_keeps_a_library_forwards_module_on_the_stack():
    """Eager alone: the op of a module whose ``forward`` is torch library
    code (weight norm's ``_WeightNorm``, called by the parametrization) is
    in that module, ``parametrizations.weight.0``. Its site is the
    ``Module._call_impl`` ``inner`` frame the module's call was recorded
    with, and the eager runtime took the module for finished (walking the
    stack from above that frame) and named the op by its parent
    (``parametrizations.weight``), another id than compiled (Wav2Vec2)."""
    torch.manual_seed(0)
    model = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv1d(2, 3, 3))
    seen = {}

    class Paths(amanda.Tool):
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(lambda c: seen.setdefault(c.get_op_name(), c.get_module_path()))

    with torch.no_grad(), amanda.apply(Paths()):
        model(torch.rand(1, 2, 8))
    assert seen["_weight_norm"] == "parametrizations.weight.0"
    assert seen["conv1d"] == ""
