"""Running one of PyTorch's own ModuleInfo inputs plainly and under amanda tools.

The module sweep (``test_module_sweep.py``) calls :func:`check_module_input`
for the first inputs of every float32 CPU ModuleInfo of
``torch.testing._internal.common_modules.module_db``: one module is built
from the input's constructor arguments, and each run takes a deep copy of it
and fresh copies of the forward arguments, from the same random seed; it
calls the module in training mode and, where an output is differentiable,
back-propagates the sum of the outputs' floating elements into the
parameters' and inputs' ``.grad``. The plain run and the runs under the
identity tools must agree bit for bit: outputs, parameter and input
gradients, parameters and buffers afterwards (batch norm's running
statistics), and the inputs afterwards. The tools are the OpInfo harness's.
"""

from __future__ import annotations

import copy
import warnings

import torch

import amanda
from amanda.errors import NotBitExactWarning
from tests.pytorch.opinfo_harness import SEED, Counter, Identity, _copy, _same, _tensors


def build(module_info, module_input):
    """The module of ``module_input``'s constructor arguments, float32, training."""
    torch.manual_seed(SEED)
    args, kwargs = module_input.constructor_input.args, module_input.constructor_input.kwargs
    module = module_info.module_cls(*args, **kwargs)
    module.to(dtype=torch.float32)
    module.train()
    return module


def run_once(module, module_input, backward=True):
    """One plain-or-instrumented run of a deep copy of ``module``: a dict of
    its outputs, gradients, parameters, buffers and inputs afterwards, or the
    exception type it raised."""
    module = copy.deepcopy(module)
    forward = module_input.forward_input
    args, kwargs = _copy(forward.args), _copy(forward.kwargs)
    torch.manual_seed(SEED)
    try:
        out = module(*args, **kwargs)
        outputs = _tensors(out)
        differentiable = [t for t in outputs if t.requires_grad and t.is_floating_point()]
        if backward and differentiable:
            sum(t.sum() for t in differentiable).backward()
    except Exception as error:   # the same refusal is expected under amanda
        return type(error)
    inputs = _tensors([args, kwargs])
    return {
        "output": [t.detach() for t in outputs],
        "input gradient": [t.grad for t in inputs if t.requires_grad],
        "parameter gradient": {n: p.grad for n, p in module.named_parameters()},
        "parameter": {n: p.detach() for n, p in module.named_parameters()},
        "buffer": {n: b for n, b in module.named_buffers()},
        "input after the call": [t.detach() for t in inputs],
    }


def differences(want, got, values=True):
    """What differs between two `run_once` results, as short strings;
    ``values=False`` compares shapes and dtypes only."""
    if isinstance(want, type) or isinstance(got, type):
        return [] if want is got else [f"plain gave {_name(want)}, amanda {_name(got)}"]
    found = []
    for label in want:
        w, g = want[label], got[label]
        if isinstance(w, dict):
            if w.keys() != g.keys():
                found.append(f"{label}: names {sorted(w)} plain vs {sorted(g)} under amanda")
                continue
            pairs = [(n, w[n], g[n]) for n in w]
        else:
            if len(w) != len(g):
                found.append(f"{label}: {len(w)} plain vs {len(g)} under amanda")
                continue
            pairs = list(zip(range(len(w)), w, g))
        found += [f"{label} {key} differs" for key, a, b in pairs if not _alike(a, b, values)]
    return found


def _alike(a, b, values):
    if values:
        return _same(a, b)
    if a is None or b is None:
        return a is None and b is None
    return a.shape == b.shape and a.dtype == b.dtype


def _name(value):
    return value.__name__ if isinstance(value, type) else "a result"


def deterministic(module, module_input):
    """Whether two plain runs from the same seed agree (else only shapes are compared)."""
    return not differences(run_once(module, module_input), run_once(module, module_input))


def check_module_input(module_info, module_input):
    """Run one module input plainly and under the identity tools and the
    counter; returns ``(problems, warned, compared)``: what differs, whether
    amanda said (with a NotBitExactWarning) that bits may differ, and whether
    values were compared (False: the plain run does not repeat itself, so
    shapes and dtypes only)."""
    module = build(module_info, module_input)
    problems = []
    compared = deterministic(module, module_input)
    plain = run_once(module, module_input)
    warned = False
    for copies in (False, True):
        tool = Identity(copies)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with amanda.apply(tool):
                got = run_once(module, module_input)
        said = any(issubclass(w.category, NotBitExactWarning) for w in caught)
        warned |= said
        found = differences(plain, got, values=compared and not said)
        problems += [f"identity(copy={copies}): {d}" for d in found]
        if not isinstance(got, type) and tool.calls["before"] != tool.calls["after"]:
            problems.append(f"identity(copy={copies}): {tool.calls['before']} before-routines "
                            f"but {tool.calls['after']} after-routines")
    cached, uncached = Counter(), Counter()
    with amanda.apply(cached):
        raised = isinstance(run_once(module, module_input), type)
    with amanda.cache_disabled(), amanda.apply(uncached):
        run_once(module, module_input)
    if cached.seen != uncached.seen:
        problems.append(f"counts cached {dict(cached.seen)} != cache_disabled {dict(uncached.seen)}")
    before = sum(n for (_, point), n in cached.seen.items() if point == "before")
    after = sum(n for (_, point), n in cached.seen.items() if point == "after")
    if before != after and not raised:
        problems.append(f"counter: {before} before-routines but {after} after-routines")
    if not cached.seen and not raised:
        problems.append("counter: no op counted")
    return problems, warned, compared
