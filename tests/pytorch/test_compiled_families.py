"""A compiled training step of the compiled sweep's families under a
backward tool, by difference with eager and with vanilla compiled.

Each family's sweep case (``tests/sweep_models.run_step``: forward, a
weighted sum of the first output, ``backward()``; random weights from a
small config) runs three ways: eagerly under a tool with a routine before
and after every backward op, compiled (``aot_eager``) without amanda, and
compiled under the same tool, where an eager fallback is an error.

* The gradients under the tool are vanilla compiled's, bit for bit.
* The backward points: every (op id, backward op, index, point) has the
  executions it has eagerly, and its routines see eager's values (within
  float tolerance: ``aot_eager`` computes some ops in another order). The
  rule where AOTAutograd's graph is not eager's (docs/pytorch-compiled.md,
  "Nine families"): view-like backward ops (``ViewBackward0``,
  ``ReshapeAliasBackward0``...) only reshape a gradient and are named
  from AOTAutograd's ``view`` where eager may have another view node, or
  folded into a neighbour's, so they are compared as a set of ops (each
  compiled one is an op that has one eagerly), not by name or count; and
  a gradient list may end in Nones for inputs of AOTAutograd's aten op
  that eager's call does not pass (an attention mask), compared without
  them.

Eager runs with ``torch.compiler.is_compiling`` patched True, as the
compiled sweep does: transformers takes other code paths when compiling.
"""

import collections
import copy
import os
import unittest.mock
import warnings

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import amanda  # noqa: E402
from amanda.runtime.pytorch import compiled as pytorch_compiled  # noqa: E402
from tests.pytorch.test_compiled_backward import CountBackward  # noqa: E402
from tests.sweep_models import CASES, run_step  # noqa: E402

pytestmark = pytest.mark.slow

VIEW_LIKE = frozenset({"ViewBackward0", "ReshapeAliasBackward0", "UnsafeViewBackward0",
                       "AliasBackward0", "AsStridedBackward0"})

#: `make test` runs these; `make sweep` (AMANDA_TORCH_SWEEP=1) all of them
SAMPLE = {"bert", "gpt2", "resnet", "convnext"}
FAMILIES = ["bert", "gpt2", "llama", "qwen2", "albert", "vit", "convnext", "resnet", "swin"]
_FULL = os.environ.get("AMANDA_TORCH_SWEEP") == "1"
_CASES = {case.name: case for case in CASES}


def _keys(tool):
    """(op id, backward op, index, point) -> executions, view-like ops apart."""
    exact, views = collections.Counter(), set()
    for key, count in tool.executions.items():
        op_id, _, point = key
        _, name, index = tool.names[key]
        if name in VIEW_LIKE:
            views.add(op_id)
        else:
            exact[(op_id, name, index, point)] += count
    return exact, views


def _values(tool):
    return {(key[0],) + tool.names[key][1:] + (key[2],): seen
            for key, seen in tool.values.items()}


def _untrailed(values):
    """``values`` without trailing Nones: an aten op may take an input
    eager's call does not pass (the attention mask of
    ``_scaled_dot_product_flash_attention_for_cpu``), whose gradient is
    None (the rule in the module docstring)."""
    values = list(values)
    while values and values[-1] is None:
        values.pop()
    return values


def _same(a, b):
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=() if name in SAMPLE or _FULL else pytest.mark.skip(
        reason="the whole sweep: make sweep")) for name in FAMILIES])
def test_compiled_training_step_has_eagers_backward_points(name):
    case = _CASES[name]
    model, inputs = case.make()
    vanilla, eager_model = copy.deepcopy(model), copy.deepcopy(model)
    eager = CountBackward()
    with unittest.mock.patch("torch.compiler.is_compiling", lambda: True), amanda.apply(eager):
        run_step(case, eager_model, inputs)
    torch._dynamo.reset()
    _, want = run_step(case, torch.compile(vanilla, backend="aot_eager"), inputs)
    torch._dynamo.reset()
    compiled = CountBackward()
    fallbacks = copy.copy(pytorch_compiled.EAGER_FALLBACKS)
    with warnings.catch_warnings():
        warnings.simplefilter("error", amanda.EagerFallbackWarning)
        with amanda.apply(compiled):
            _, got = run_step(case, torch.compile(model, backend="aot_eager"), inputs)
    torch._dynamo.reset()
    assert pytorch_compiled.EAGER_FALLBACKS == fallbacks
    assert len(got) == len(want) and all(_same(g, w) for g, w in zip(got, want))

    (eager_keys, eager_views), (compiled_keys, compiled_views) = _keys(eager), _keys(compiled)
    assert len(eager_keys) > 50
    missing = {k: n for k, n in eager_keys.items() if compiled_keys.get(k) != n}
    extra = {k: n for k, n in compiled_keys.items() if eager_keys.get(k) != n}
    assert not missing and not extra, (
        f"eager only: {collections.Counter(k[1] for k in missing)}; "
        f"compiled only: {collections.Counter(k[1] for k in extra)}")
    assert compiled_views <= eager_views

    eager_values, compiled_values = _values(eager), _values(compiled)
    for key in eager_keys:
        for want_seen, got_seen in zip(eager_values[key], compiled_values[key]):
            want_seen, got_seen = _untrailed(want_seen), _untrailed(got_seen)
            assert len(want_seen) == len(got_seen), key
            for a, b in zip(want_seen, got_seen):
                assert (a is None) == (b is None), key
                if a is not None:
                    assert a.shape == b.shape and torch.allclose(a, b, rtol=1e-4, atol=1e-5), key
