"""Shared fixtures: environment, the tutorial's models, and seeded steps.

Imports no framework: the framework-free tests (``tests/ir``,
``tests/passes``, the structure rules) run where none is installed; the
folders of each backend skip themselves without it (their own conftest)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import pytest  # noqa: E402


@pytest.fixture
def cnn():
    torch = pytest.importorskip("torch")
    from tests.models import ConvNeuralNet
    torch.manual_seed(0)
    return ConvNeuralNet(10)


@pytest.fixture
def functional_cnn():
    torch = pytest.importorskip("torch")
    from tests.models import FunctionalReluNet
    torch.manual_seed(0)
    return FunctionalReluNet(10)


@pytest.fixture
def compiled_path_fresh_dynamo():
    """The compiled PyTorch path on (the default; set again in case a test
    changed it) between two ``torch._dynamo.reset()``: no compiled code or
    recompilation count carried from one test to the next. Used by the
    tests/pytorch/test_compiled_*.py files (``pytestmark``)."""
    torch = pytest.importorskip("torch")
    from amanda.runtime.pytorch import compiled as pytorch_compiled
    saved, pytorch_compiled.ENABLED = pytorch_compiled.ENABLED, True
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    pytorch_compiled.ENABLED = saved
