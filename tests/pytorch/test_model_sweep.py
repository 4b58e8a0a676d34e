"""Real-model sweep (issue 11): amanda on tiny random-weight models of many
``transformers`` families, plus gradient checkpointing, ``generate()``, bf16
autocast and double backward.

For every case (see :mod:`tests.sweep_models`; ``FAMILIES`` lists the model
families covered):

* ``test_counts_at_every_point``: a tool counting executions at the four
  points (before/after forward ops, before/after backward ops) sees every
  point run during a training step, and each op's before and after routines
  run equally often;
* ``test_identity_is_bit_exact``: identity routines before and after every
  forward and backward op, returning the same tensors (``IdentityTool``) or
  clones of them (``CloneIdentityTool`` below), leave outputs and parameter
  gradients bit-identical to the vanilla run — over two steps, the first
  analysing and the second replaying cached actions;
* ``test_scope_exits_clean``: leaving ``apply`` restores torch's function mode
  stack, the global module hooks and every module's (and parameter's) hooks,
  also when a routine raised;
* ``test_cache_is_consistent``: two steps in one ``apply`` scope run the same
  routines at each (op id, point), and so does a step under
  ``amanda.cache_disabled()``.

A case whose model cannot be built or run *without* amanda (a configuration
error, a missing dependency) or that is not deterministic even without amanda
is skipped with the reason. The whole sweep is marked slow.
"""

import collections

import pytest
import torch

import amanda
from amanda.tools.identity import IdentityTool
from tests.sweep_models import CASES, FAMILIES

pytestmark = pytest.mark.slow

#: The model families this sweep covers.
COVERED_FAMILIES = FAMILIES

POINTS = ("before_op", "after_op", "before_backward_op", "after_backward_op")
_CASES = {case.name: case for case in CASES}
NAMES = list(_CASES)


# -- tools -------------------------------------------------------------------------------

class CountingTool(amanda.Tool):
    """Counts executions of a routine at each (op id, point), registered with
    the four combinations of ``backward`` and ``require_outputs``."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()
        self.names = {}
        self.add_inst_for_op(self.before_analysis)
        self.add_inst_for_op(self.after_analysis, require_outputs=True)
        self.add_inst_for_op(self.backward_before_analysis, backward=True)
        self.add_inst_for_op(self.backward_after_analysis, backward=True, require_outputs=True)

    def _key(self, context, point):
        if context.is_backward():
            op_id = context.get_backward_op_id()
            self.names[op_id] = (f"{context.get_backward_op().__name__} "
                                 f"(of {context.get_op_name()})")
        else:
            op_id = context.get_op_id()
            self.names[op_id] = context.get_op_name()
        return (op_id, point)

    def before_analysis(self, context):
        context.insert_before_op(self.count, key=self._key(context, "before_op"))

    def after_analysis(self, context):
        context.insert_after_op(self.count, key=self._key(context, "after_op"))

    def backward_before_analysis(self, context):
        context.insert_before_backward_op(self.count,
                                          key=self._key(context, "before_backward_op"))

    def backward_after_analysis(self, context):
        context.insert_after_backward_op(self.count,
                                         key=self._key(context, "after_backward_op"))

    def count(self, *tensors, key):
        self.counts[key] += 1

    def per_point(self, counts=None):
        totals = dict.fromkeys(POINTS, 0)
        for (_, point), n in (self.counts if counts is None else counts).items():
            totals[point] += n
        return totals


_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__",
                    "__ixor__", "__ilshift__", "__irshift__", "__imatmul__"}


def _inplace(name):
    return name in _INPLACE_DUNDERS or (name.endswith("_") and not name.endswith("__"))


def _clone(tensor):
    """A copy with the same strides (so kernels take the same path); tensors
    whose clone would get other strides (expanded, overlapping) are kept."""
    if not isinstance(tensor, torch.Tensor):
        return tensor
    copy = tensor.clone()
    return copy if copy.stride() == tensor.stride() else tensor


class CloneIdentityTool(amanda.Tool):
    """Identity routines at all four points that return *copies*: every
    tensor an op produces, every gradient, and every input that needs no
    gradient is replaced by an equal tensor (so replacements, their
    straight-through wiring and backward replacements are exercised).

    Kept as they are, because a copy would change the program, not only
    amanda: the tensor an in-place op mutates; outputs that alias an input
    (views, ``to()`` of a tensor that already has the dtype); and inputs
    that require grad: their copy would be wired straight-through to the
    original, and when the op returns an alias of it (``h.to(float32)`` in
    LLaMA's RMSNorm, views) the gradients of all that alias's uses are summed
    before they reach the original instead of one by one with its other uses
    — a reassociated float sum (LLaMA's embedding gradient moves by 2e-6)."""

    def __init__(self):
        super().__init__()
        self.calls = dict.fromkeys(POINTS, 0)
        self.add_inst_for_op(self.before_analysis)
        self.add_inst_for_op(self.after_analysis, require_outputs=True)
        self.add_inst_for_op(self.backward_analysis, backward=True)

    def before_analysis(self, context):
        inplace = _inplace(context.get_op_name())
        keep = tuple(i for i, t in enumerate(context.get_inputs())
                     if (inplace and i == 0) or getattr(t, "requires_grad", False))
        context.insert_before_op(self.copy, point="before_op", keep=keep)

    def after_analysis(self, context):
        inputs = [t for t in context.get_inputs() if isinstance(t, torch.Tensor)]
        storages = {t.untyped_storage().data_ptr() for t in inputs}
        keep = tuple(i for i, t in enumerate(context.get_outputs())
                     if not isinstance(t, torch.Tensor) or t._is_view()
                     or any(t is x for x in inputs)
                     or t.untyped_storage().data_ptr() in storages)
        context.insert_after_op(self.copy, point="after_op", keep=keep)

    def backward_analysis(self, context):
        context.insert_before_backward_op(self.copy, point="before_backward_op", keep=())
        context.insert_after_backward_op(self.copy, point="after_backward_op", keep=())

    def copy(self, *tensors, point, keep):
        self.calls[point] += 1
        return tuple(t if i in keep or t is None else _clone(t) for i, t in enumerate(tensors))


# -- helpers -----------------------------------------------------------------------------

def _torch_globals():
    import torch.nn.modules.module as module_module
    return {name: (dict(value) if isinstance(value, dict) else value)
            for name, value in vars(module_module).items() if name.startswith("_global_")}


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """The models are tiny: on a shared machine torch's intra-op threads only
    contend (a 100x slowdown seen on 2 busy cores). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _no_leak_between_cases():
    """A case that leaves a torch function mode or a global module hook behind
    errors here, and what it left is removed, so that the next case's vanilla
    run is really vanilla (a leaked mode would make it fail and be skipped
    as "fails without amanda")."""
    import torch.nn.modules.module as module_module
    modes, hooks = torch._C._len_torch_function_stack(), _torch_globals()
    yield
    leaked = []
    while torch._C._len_torch_function_stack() > modes:
        leaked.append(type(torch._C._pop_torch_function_stack()).__name__)
    now = _torch_globals()
    for name, value in hooks.items():
        if now[name] != value:
            leaked.append(name)
            if isinstance(value, dict):
                getattr(module_module, name).clear()
                getattr(module_module, name).update(value)
            else:
                setattr(module_module, name, value)
    assert not leaked, f"left behind after the test (removed now): {leaked}"


def _make(name):
    """The case, its model and inputs, and a vanilla step's result; skips
    (with the reason) a case that fails without amanda."""
    from tests.sweep_models import run_step
    case = _CASES[name]
    try:
        model, inputs = case.make()
        reference = run_step(case, model, inputs)
    except Exception as error:  # noqa: BLE001  (any failure without amanda: skip, say why)
        pytest.skip(f"{name} fails without amanda: {type(error).__name__}: {error}")
    return case, model, inputs, reference


def _step(case, model, inputs):
    from tests.sweep_models import run_step
    return run_step(case, model, inputs)


def _first_difference(got, want, model):
    """None if ``got`` and ``want`` (outputs, grads) are bit-identical,
    otherwise a description of the first difference."""
    (out, grads), (ref_out, ref_grads) = got, want
    for i, (a, b) in enumerate(zip(out, ref_out)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return f"output {i}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            return f"output {i} differs (max abs diff {diff:.3g})"
    names = [n for n, _ in model.named_parameters()]
    for name, a, b in zip(names, grads, ref_grads):
        if (a is None) != (b is None):
            return f"grad of {name}: {'None' if a is None else 'set'} vs " \
                   f"{'None' if b is None else 'set'}"
        if a is not None and not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            return f"grad of {name} differs (max abs diff {diff:.3g})"
    return None


def _backend_state(model):
    """Everything amanda may touch in torch, as comparable values."""
    import torch.nn.modules.module as module_module

    def hook_dicts(obj):
        return {attr: list(value) for attr, value in vars(obj).items()
                if "hook" in attr and isinstance(value, dict)}

    return {
        "function mode stack": torch._C._len_torch_function_stack(),
        "dispatch mode stack": torch._C._len_torch_dispatch_stack(),
        "grad enabled": torch.is_grad_enabled(),
        "global module hooks": {name: (list(value) if isinstance(value, dict) else value)
                                for name, value in vars(module_module).items()
                                if name.startswith("_global_")},
        "module hooks": {path or "<root>": hook_dicts(m) for path, m in model.named_modules()},
        "parameter hooks": {name: (list(p._backward_hooks or ()),
                                   list(getattr(p, "_post_accumulate_grad_hooks", None) or ()))
                            for name, p in model.named_parameters()},
    }


def _state_diff(before, after):
    return [key for key in before if before[key] != after[key]]


def _count_diff(tool, got, want):
    """A readable list of (op, point) whose counts differ."""
    lines = []
    for key in sorted(set(got) | set(want), key=str):
        if got.get(key, 0) != want.get(key, 0):
            op_id, point = key
            lines.append(f"{tool.names.get(op_id, op_id)} {point}: "
                         f"{got.get(key, 0)} vs {want.get(key, 0)}")
    return lines


# -- the checks --------------------------------------------------------------------------

def test_families_covered():
    assert len([f for f in COVERED_FAMILIES if "CNN" not in f]) >= 25, COVERED_FAMILIES


@pytest.mark.parametrize("name", NAMES)
def test_counts_at_every_point(name):
    case, model, inputs, _ = _make(name)
    tool = CountingTool()
    with amanda.apply(tool):
        _step(case, model, inputs)
    totals = tool.per_point()
    expected = POINTS if case.kind != "generate" else POINTS[:2]  # generate: no grad
    missing = [point for point in expected if totals[point] == 0]
    assert not missing, f"no routine ran at {missing}; counts {totals}"
    if case.kind == "generate":
        assert totals["before_backward_op"] == totals["after_backward_op"] == 0, totals
    # every op's before and after routines run equally often. With activation
    # checkpointing, torch stops a recomputation (by raising inside it) as
    # soon as the last tensor backward needs is saved again ("early stop"), so
    # the last recomputed op of a segment starts but never returns: there, one
    # "before" more than "after" is vanilla behaviour.
    aborted = 1 if case.checkpointing else 0
    unequal = []
    for before, after in (("before_op", "after_op"),
                          ("before_backward_op", "after_backward_op")):
        ids = {op_id for op_id, point in tool.counts if point in (before, after)}
        for op_id in sorted(ids):
            b, a = tool.counts[(op_id, before)], tool.counts[(op_id, after)]
            if not a <= b <= a + (aborted if before == "before_op" else 0):
                unequal.append(f"{tool.names[op_id]}: {before} {b}, {after} {a}")
    assert not unequal, (f"{len(unequal)} ops ran before and after routines unequally "
                         f"(totals {totals}): " + "; ".join(unequal[:10]))


@pytest.mark.parametrize("variant", ["same", "clone"])
@pytest.mark.parametrize("name", NAMES)
def test_identity_is_bit_exact(name, variant):
    case, model, inputs, reference = _make(name)
    again = _step(case, model, inputs)
    if _first_difference(again, reference, model) is not None:
        pytest.skip(f"{name} is not deterministic even without amanda: "
                    f"{_first_difference(again, reference, model)}")
    tool = IdentityTool() if variant == "same" else CloneIdentityTool()
    with amanda.apply(tool):
        first = _step(case, model, inputs)     # analyses every op
        second = _step(case, model, inputs)    # replays the cached actions
    assert _first_difference(first, reference, model) is None, \
        f"first step: {_first_difference(first, reference, model)}"
    assert _first_difference(second, reference, model) is None, \
        f"second step: {_first_difference(second, reference, model)}"
    expected = POINTS if case.kind != "generate" else POINTS[:2]
    assert all(tool.calls[point] > 0 for point in expected), tool.calls


@pytest.mark.parametrize("name", NAMES)
def test_scope_exits_clean(name):
    case, model, inputs, _ = _make(name)
    before = _backend_state(model)
    error = None
    try:
        with amanda.apply(CountingTool()):
            _step(case, model, inputs)
    except Exception as raised:  # noqa: BLE001  (cleanliness first, the error after)
        error = raised
    assert not _state_diff(before, _backend_state(model)), \
        f"left behind after apply: {_state_diff(before, _backend_state(model))}"

    class Boom(Exception):
        pass

    class RaisingTool(CountingTool):
        """Raises in a routine halfway through the step's forward ops."""

        def __init__(self, after):
            super().__init__()
            self.after = after

        def count(self, *tensors, key):
            super().count(*tensors, key=key)
            if sum(self.counts.values()) == self.after:
                raise Boom("a routine raised")

    tool = CountingTool()
    with amanda.apply(tool):
        _step(case, model, inputs)
    ops = tool.per_point()["before_op"]
    with pytest.raises(Exception) as raised:  # noqa: PT011  (amanda may wrap it)
        with amanda.apply(RaisingTool(after=max(1, ops // 2))):
            _step(case, model, inputs)
    assert raised.errisinstance(Boom) or "a routine raised" in str(raised.value), raised.value
    assert not _state_diff(before, _backend_state(model)), \
        f"left behind after a routine raised: {_state_diff(before, _backend_state(model))}"
    if error is not None:
        raise AssertionError(f"the step under apply raised (the scope exited clean): "
                             f"{type(error).__name__}: {error}") from error


@pytest.mark.parametrize("name", NAMES)
def test_cache_is_consistent(name):
    case, model, inputs, _ = _make(name)
    tool = CountingTool()
    with amanda.apply(tool):
        _step(case, model, inputs)
        first = collections.Counter(tool.counts)
        _step(case, model, inputs)
    second = {key: n - first.get(key, 0) for key, n in tool.counts.items()}
    diff = _count_diff(tool, second, first)
    assert not diff, (f"second step vs first: {len(diff)} (op, point) counts differ "
                      f"(totals {tool.per_point(second)} vs {tool.per_point(first)}): "
                      + "; ".join(diff[:10]))
    uncached = CountingTool()
    with amanda.cache_disabled(), amanda.apply(uncached):
        _step(case, model, inputs)
    uncached.names.update(tool.names)
    diff = _count_diff(uncached, uncached.counts, first)
    assert not diff, (f"cache_disabled() vs cached: {len(diff)} (op, point) counts differ "
                      f"(totals {uncached.per_point()} vs {tool.per_point(first)}): "
                      + "; ".join(diff[:10]))
