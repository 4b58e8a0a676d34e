"""CoverageTool and module-hook coverage: amanda's points vs module hooks."""

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import amanda  # noqa: E402
from amanda import models  # noqa: E402
from amanda.tools.coverage import (CoverageTool, classify_forward_points,  # noqa: E402
                                   compare_coverage, module_hook_coverage)


def _step(model, x):
    return lambda: model(x).sum().backward()


def _count(model, x):
    tool = CoverageTool()
    with amanda.apply(tool):
        _step(model, x)()
    return tool


def test_tutorial_cnn_points_by_op():
    torch.manual_seed(0)
    model, x = models.tutorial_cnn(), torch.rand(1, 3, 32, 32)
    tool = _count(model, x)
    assert dict(tool.forward) == {"conv2d": 4, "max_pool2d": 2, "reshape": 1, "linear": 2,
                                  "relu": 1, "sum": 1}
    # 4 conv + 2 linear layers: 12 parameters, one gradient accumulator each
    assert tool.backward["AccumulateGrad"] == 12
    assert tool.backward["ConvolutionBackward0"] == 4
    assert tool.backward["AddmmBackward0"] == 2
    assert tool.forward_points == 11 and tool.backward_points == 25


def test_functional_relu_is_seen_by_amanda_not_by_module_hooks():
    torch.manual_seed(0)
    model, x = models.tutorial_cnn(functional_relu=True), torch.rand(1, 3, 32, 32)
    tool = _count(model, x)
    assert tool.forward["relu"] == 1
    assert tool.backward["ReluBackward0"] == 1
    assert tool.forward_by_module[("", "relu")] == 1  # run by the root module's forward

    hooks = module_hook_coverage(model, _step(model, x))
    assert "ReLU" not in hooks["forward_by_type"]
    assert hooks["forward_by_type"]["Conv2d"] == 4
    assert hooks["forward"] == 9          # 8 layers + the root module
    assert hooks["backward"] == 9

    kinds = classify_forward_points(tool.forward_by_module, model, hooks["forward_calls"])
    assert kinds["functional"] == {"relu": 1, "reshape": 1}
    assert kinds["covered"] == {"conv2d": 4, "linear": 2, "max_pool2d": 2}
    assert kinds["outside_model"] == {"sum": 1}


class _Stack(nn.Module):
    """Layers in a ModuleList, called from a loop, plus a functional residual."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x) + x
        return x


def test_layers_of_a_module_list_are_matched_to_their_hooks():
    # amanda names them layers.0..2, as named_modules() does, though the list
    # itself is never called
    torch.manual_seed(0)
    model, x = _Stack(), torch.rand(2, 4)
    tool = _count(model, x)
    hooks = module_hook_coverage(model, _step(model, x))
    assert hooks["forward_calls"] == {"": 1, "layers.0": 1, "layers.1": 1, "layers.2": 1}
    kinds = classify_forward_points(tool.forward_by_module, model, hooks["forward_calls"])
    assert kinds["covered"] == {"linear": 3}
    assert kinds["functional"] == {"add": 3}
    assert "unresolved" not in kinds


class _InplaceOnOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        y += 1  # like transformers' ResNet: in-place on a submodule's output
        return y


def test_failing_full_backward_hooks_are_reported_not_replaced():
    model, x = _InplaceOnOutput(), torch.rand(2, 4)
    hooks = module_hook_coverage(model, _step(model, x))
    assert hooks["forward"] == 2
    assert hooks["backward"] is None
    assert "BackwardHookFunction is a view and is being modified inplace" in hooks["backward_error"]
    assert hooks["backward_pre"] is None and hooks["backward_pre_error"]
    # the hooks were removed: the model runs normally again
    _step(model, x)()
    assert not model.lin._forward_hooks and not model.lin._backward_hooks


def test_points_are_counted_once_per_point_not_per_execution():
    torch.manual_seed(0)
    model, x = models.tutorial_cnn(), torch.rand(1, 3, 32, 32)
    tool = CoverageTool()
    step = _step(model, x)
    for _ in range(2):
        with amanda.apply(tool):
            step()
    assert tool.forward_points == 11 and tool.backward_points == 25


def test_compare_coverage_on_rnn_sees_the_backward_ops_of_one_forward_op():
    report = compare_coverage("rnn")
    assert report["amanda_forward_by_op"]["rnn_tanh"] == 1
    assert report["hooks_forward"] == report["hooks_backward"] == 1
    assert report["amanda_backward"] > 100   # 4 layers x 16 steps of autograd nodes
    assert report["partially_covered"] == {"rnn_tanh": 1, "zeros": 1}
    assert report["hooks_error"] is None


def test_importing_models_does_not_import_torch():
    code = "import sys, amanda.models, amanda.cli; assert 'torch' not in sys.modules, 'torch'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_models_are_seeded_and_in_eval_mode():
    a, b = models.load("cnn"), models.load("cnn")
    assert not a.model.training
    assert torch.equal(a.inputs[0], b.inputs[0])
    assert torch.equal(a.model.fc2.weight, b.model.fc2.weight)


def test_unknown_model_spec():
    with pytest.raises(models.ModelSpecError, match="unknown model 'nope'.*cnn"):
        models.load("nope")
