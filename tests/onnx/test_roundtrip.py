"""Lift -> lower, uninstrumented, over every model of the onnx backend test data.

Each lowered model must pass ``onnx.checker.check_model(full_check=True)``
and give bit-identical outputs in onnxruntime to the original model on the
shipped inputs. A model is skipped only when onnxruntime cannot run the
original itself (the reason is onnxruntime's own error).
"""

import os

import numpy as np
import pytest

from amanda.frontends.onnx import lift
from amanda.runtime.onnx import MAX_IR_VERSION, lower
from tests.onnx.conftest import (
    SUITES,
    data_sets,
    light_feeds,
    light_models,
    model_dirs,
    onnx,
    read_tensor,
    same,
    session,
)

CASES = [pytest.param(d, id=f"{suite}/{os.path.basename(d)}")
         for suite in SUITES for d in model_dirs(suite)]


def original_or_skip(model, feeds_list):
    """The original model's session and outputs, or a skip naming why it cannot run."""
    try:
        plain = session(model)
        outputs = [plain.run(None, feeds) for feeds in feeds_list]
    except Exception as exc:  # onnxruntime's own limits (old opsets, missing kernels)
        pytest.skip("onnxruntime cannot run the original model: "
                    + str(exc).strip().splitlines()[0][:160])
    return outputs


def check_roundtrip(model, feeds_list, expected):
    lowered = lower(lift(model))
    onnx.checker.check_model(lowered, full_check=True)
    assert [(o.domain, o.version) for o in lowered.opset_import] == \
        [(o.domain, o.version) for o in model.opset_import]
    assert lowered.ir_version == min(model.ir_version, MAX_IR_VERSION)
    assert [i.name for i in lowered.graph.input] == [i.name for i in model.graph.input]
    assert [o.name for o in lowered.graph.output] == [o.name for o in model.graph.output]
    candidate = session(lowered)
    for feeds, reference in zip(feeds_list, expected):
        outputs = candidate.run(None, feeds)
        assert len(outputs) == len(reference)
        for got, want in zip(outputs, reference):
            assert same(got, want)


@pytest.mark.parametrize("model_dir", CASES)
def test_roundtrip_backend_model(model_dir):
    model = onnx.load(os.path.join(model_dir, "model.onnx"))
    sets = data_sets(model_dir, model)
    feeds_list = [feeds for feeds, _ in sets]
    expected = original_or_skip(model, feeds_list)
    check_roundtrip(model, feeds_list, expected)


@pytest.mark.slow
@pytest.mark.parametrize("path", light_models(), ids=os.path.basename)
def test_roundtrip_light_model(path):
    model = onnx.load(path)
    feeds = light_feeds(model)
    expected = original_or_skip(model, [feeds])
    # the original also matches the output shipped with it (sanity of the feeds)
    shipped = read_tensor(path[:-len(".onnx")] + "_output_0.pb")
    np.testing.assert_allclose(expected[0][0], shipped, rtol=1e-3, atol=1e-5)
    check_roundtrip(model, [feeds], expected)


def test_every_suite_has_models():
    assert len(CASES) > 100 and len(light_models()) == 9
