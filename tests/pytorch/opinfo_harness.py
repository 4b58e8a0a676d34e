"""Running one of PyTorch's own OpInfo samples plainly and under amanda tools.

The conformance sweep (``test_opinfo_sweep.py``) calls :func:`check_sample`
for every float32 CPU sample it takes from
``torch.testing._internal.common_methods_invocations.op_db``: the same call,
from identical copies of the sample's tensors and the same random seed, once
plainly and once under each tool, forward and (where the op is
differentiable) backward; everything compared bit for bit.
"""

from __future__ import annotations

import collections
import warnings

import torch

import amanda
from amanda.errors import NotBitExactWarning

SEED = 1234


class Identity(amanda.Tool):
    """Routines at all four points of every op handing back what they got
    (``copy=False``) or fresh copies of it (``copy=True``)."""

    def __init__(self, copy):
        super().__init__()
        self.copy = copy
        self.calls = collections.Counter()
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True, require_outputs=True)

    def forward(self, context):
        context.insert_before_op(self.routine, point="before")
        context.insert_after_op(self.routine, point="after")

    def backward(self, context):
        context.insert_before_backward_op(self.routine, point="before_backward")
        context.insert_after_backward_op(self.routine, point="after_backward")

    def routine(self, *tensors, point):
        self.calls[point] += 1
        if self.copy:
            return [t.clone() if isinstance(t, torch.Tensor) else t for t in tensors]
        return tensors


class Counter(amanda.Tool):
    """Counts the executions of every (op id, point); routines select nothing."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()
        self.add_inst_for_op(self.forward)
        self.add_inst_for_op(self.backward, backward=True, require_outputs=True)

    def forward(self, context):
        op_id = context.get_op_id()
        context.insert_before_op(self.count, inputs=[], key=(op_id, "before"))
        context.insert_after_op(self.count, outputs=[], key=(op_id, "after"))

    def backward(self, context):
        op_id = (context.get_op_id(), context.get_backward_op_id())
        context.insert_before_backward_op(self.count, grad_outputs=[],
                                          key=(op_id, "before_backward"))
        context.insert_after_backward_op(self.count, grad_inputs=[],
                                         key=(op_id, "after_backward"))

    def count(self, *, key):
        self.seen[key] += 1


def _copy(value):
    """A fresh copy of a sample's argument: tensors cloned with their
    strides and ``requires_grad``; containers rebuilt."""
    if isinstance(value, torch.Tensor):
        copy = value.detach().clone()
        if value.requires_grad:
            copy.requires_grad_(True)
        return copy
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    return value


def _tensors(value):
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def run_once(op, sample, backward):
    """One plain-or-instrumented run of ``sample``: what it returns, the
    gradients of its inputs, and its inputs afterwards (in-place writes), or
    the exception type it raised."""
    inp, args, kwargs = _copy(sample.input), _copy(sample.args), _copy(sample.kwargs)
    leaves = [t for t in _tensors([inp, args, kwargs]) if t.requires_grad]
    torch.manual_seed(SEED)
    try:
        out = op(inp, *args, **kwargs)
        outputs = [t for t in _tensors(out)]
        grads = None
        differentiable = [t for t in outputs if t.requires_grad]
        if backward and leaves and differentiable:
            gen = torch.Generator().manual_seed(SEED)
            cotangents = [torch.randn(t.shape, generator=gen, dtype=t.dtype)
                          if not t.is_complex() else
                          torch.randn(t.shape, generator=gen, dtype=t.dtype)
                          for t in differentiable]
            grads = torch.autograd.grad(differentiable, leaves, cotangents, allow_unused=True)
    except Exception as error:   # the same refusal is expected under amanda
        return type(error)
    inputs = _tensors([inp, args, kwargs])
    return ([t.detach() for t in outputs], grads, [t.detach() for t in inputs])


def _same(a, b):
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_sparse or a.layout != torch.strided:
        a, b = a.to_dense(), b.to_dense()
    if a.dtype in (torch.complex32, torch.float16, torch.bfloat16):
        a, b = a.to(torch.complex64 if a.is_complex() else torch.float32), \
            b.to(torch.complex64 if b.is_complex() else torch.float32)
    if a.dtype.is_floating_point or a.is_complex():
        return bool(torch.equal(a, b) or ((a == b) | (a.isnan() & b.isnan())).all())
    return bool(torch.equal(a, b))


def differences(want, got):
    """What differs between two `run_once` results, as short strings."""
    if isinstance(want, type) or isinstance(got, type):
        return [] if want is got else [f"plain gave {_name(want)}, amanda {_name(got)}"]
    found = []
    for label, w, g in zip(("output", "gradient", "input after the call"), want, got):
        w, g = w or [], g or []
        if len(w) != len(g):
            found.append(f"{label}: {len(w)} plain vs {len(g)} under amanda")
            continue
        found += [f"{label} {i} differs" for i, (a, b) in enumerate(zip(w, g)) if not _same(a, b)]
    return found


def _name(value):
    return value.__name__ if isinstance(value, type) else "a result"


def deterministic(op, sample, backward):
    """Whether two plain runs from the same seed agree (else values cannot be compared)."""
    return not differences(run_once(op, sample, backward), run_once(op, sample, backward))


def check_sample(op, sample, backward, values_defined=True):
    """Run ``sample`` plainly and under the identity tools and the counter;
    returns ``(problems, warned)``: what differs, and whether amanda said
    (with a NotBitExactWarning) that bits may differ. ``values_defined``:
    False for ops whose results are uninitialised memory (``empty_like``),
    whose values are then not compared."""
    problems = []
    compare_values = values_defined and deterministic(op, sample, backward)
    plain = run_once(op, sample, backward)
    warned = False
    for copy in (False, True):
        tool = Identity(copy)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amanda.apply(tool):
                got = run_once(op, sample, backward)
        said = any(issubclass(w.category, NotBitExactWarning) for w in caught)
        warned |= said
        if compare_values and not said:
            problems += [f"identity(copy={copy}): {d}" for d in differences(plain, got)]
        elif isinstance(plain, type) or isinstance(got, type):
            problems += [f"identity(copy={copy}): {d}" for d in differences(plain, got)]
        if not isinstance(got, type) and tool.calls["before"] != tool.calls["after"]:
            problems.append(f"identity(copy={copy}): {tool.calls['before']} before-routines "
                            f"but {tool.calls['after']} after-routines")
    cached, uncached = Counter(), Counter()
    with amanda.apply(cached):
        raised = isinstance(run_once(op, sample, backward), type)
    with amanda.cache_disabled(), amanda.apply(uncached):
        run_once(op, sample, backward)
    if cached.seen != uncached.seen:
        problems.append(f"counts cached {dict(cached.seen)} != cache_disabled {dict(uncached.seen)}")
    before = sum(n for (_, point), n in cached.seen.items() if point == "before")
    after = sum(n for (_, point), n in cached.seen.items() if point == "after")
    if before != after and not raised:   # an op that raised ran no after-routine
        problems.append(f"counter: {before} before-routines but {after} after-routines")
    return problems, warned


def backend_clean():
    """Whether leaving ``apply`` left no mode, hook or patch behind."""
    from torch.nn.modules import module
    return (torch._C._len_torch_function_stack() == 0
            and not module._global_forward_hooks and not module._global_forward_pre_hooks
            and not module._global_backward_hooks)
