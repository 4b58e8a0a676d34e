"""Eager PyTorch's inlined routine call checks what the kernel's does.

The eager fast path (`amanda.runtime.pytorch.eager.routines._invoke`) calls a
routine without going through `amanda.runtime.routines.call_routine`: the
call, the "it returned None" and "it handed back the one tensor" cases are
inlined, the rest goes to the kernel's `checked_result`. Issue 27 allows
that only if both give the same checks: for every kind of return value a
routine may give, right or wrong, both must return the same replacements or
raise the same `ToolError` (same message, same chained cause).
"""

import pytest
import torch

import amanda
from amanda.context import BEFORE_OP, Action
from amanda.runtime.pytorch.eager.routines import _invoke, _is_tensor, _meta
from amanda.runtime.routines import call_routine

WHERE = ("relu", "model/relu", "pytorch/2.13.0/eager")


class Owner(amanda.Tool):
    pass


def _results(selected):
    """Routines returning each kind of value for ``selected`` (name, routine)."""
    first = selected[0]
    return [
        ("none", lambda *t: None),
        ("same tensor", lambda *t: t[0] if len(t) == 1 else None),
        ("same sequence", lambda *t: list(t)),
        ("same tuple", lambda *t: tuple(t)),
        ("new tensor", lambda *t: t[0] + 1),
        ("new sequence", lambda *t: [x * 2 for x in t]),
        ("sequence with None", lambda *t: [None] * len(t)),
        ("wrong shape", lambda *t: torch.zeros(7)),
        ("wrong dtype", lambda *t: t[0].to(torch.float64)),
        ("too many", lambda *t: list(t) + [first]),
        ("not a tensor", lambda *t: 3.0),
        ("sequence of ints", lambda *t: [1] * len(t)),
        ("raises", lambda *t: (_ for _ in ()).throw(ValueError("boom"))),
        ("amanda error", lambda *t: (_ for _ in ()).throw(amanda.ToolError("own"))),
    ]


def _outcome(call):
    try:
        result = call()
    except amanda.AmandaError as error:
        cause = error.__cause__
        return ("raised", type(error).__name__, str(error),
                None if cause is None else (type(cause).__name__, str(cause)))
    if result is None:
        return ("kept",)
    return ("replaced", [None if r is None else (tuple(r.shape), r.dtype, r.tolist())
                         for r in result])


@pytest.mark.parametrize("count", [1, 2])
def test_the_inlined_eager_call_gives_the_kernels_checks(count):
    selected = [torch.arange(4, dtype=torch.float32) + i for i in range(count)]
    seen = 0
    for name, func in _results(selected):
        action = Action(BEFORE_OP, func, None, {}, False, Owner())
        eager = _outcome(lambda: _invoke(action, list(selected), WHERE))
        kernel = _outcome(lambda: call_routine(action, list(selected), _is_tensor, WHERE, _meta))
        assert eager == kernel, (name, eager, kernel)
        seen += eager[0] == "raised"
    assert seen >= 6   # the wrong values above are refused, on both paths
