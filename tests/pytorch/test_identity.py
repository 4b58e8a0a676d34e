"""Identity routines at all four points of every op leave outputs and
gradients bit-identical (the DESIGN's first quality bar)."""

import pytest
import torch

import amanda
from amanda.tools.identity import IdentityTool
from tests.models import build_model, train_step

MODELS = ["cnn", "rnn",
          pytest.param("resnet50", marks=pytest.mark.slow),
          pytest.param("bert", marks=pytest.mark.slow),
          pytest.param("gpt2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name", MODELS)
def test_identity_everywhere_is_bit_exact(name):
    model, x = build_model(name)
    reference, reference_grads = train_step(model, x)
    tool = IdentityTool()
    for _ in range(2):  # first step analyses, second replays cached actions
        with amanda.apply(tool):
            out, grads = train_step(model, x)
        assert torch.equal(out, reference)
        for got, want in zip(grads, reference_grads):
            assert (got is None and want is None) or torch.equal(got, want)
    # the routines really ran at all four points, forward and backward
    assert all(count > 0 for count in tool.calls.values()), tool.calls
    assert tool.calls["before_backward_op"] == tool.calls["after_backward_op"]
