"""The one cache rule on PyTorch's three paths (eager, ``torch.compile``,
a captured program): inside ``amanda.cache_disabled()`` the tools' analysis
runs at every execution, and the executions of (op id, point) and the
results are those of the cached runs. The same test runs on TensorFlow
(tests/tensorflow/test_cache_rule_tf.py) and onnxruntime
(tests/onnx/test_cache_rule_onnx.py).

An execution is an op's call on the eager path, and a call of the
program on the graph paths (a compiled call inside ``cache_disabled()``
runs eagerly, docs/pytorch-compiled.md; a captured program is analysed
again at each call: before, it kept its first analysis)."""

import contextlib
import warnings

import pytest

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda.runtime.pytorch.capture import capture  # noqa: E402
from tests.cache_rule import Recording, assert_one_rule  # noqa: E402

RUNS = 3


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


X = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))


def eager():
    return model()


def compiled():
    torch._dynamo.reset()
    return torch.compile(model(), backend="aot_eager")


def captured():
    return capture(model(), (X,))


@pytest.mark.parametrize("program", [eager, compiled, captured])
def test_cache_disabled_analyses_every_execution_and_changes_nothing_else(program):
    plain = program()(X)
    results = {}
    for cached in (True, False):
        run = program()
        tool = Recording()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # the compiled call's eager fallback is announced
            with amanda.apply(tool), (contextlib.nullcontext() if cached
                                      else amanda.cache_disabled()):
                outputs = [run(X) for _ in range(RUNS)]
        for output in outputs:
            assert torch.equal(output, plain)
        results[cached] = tool
    cached, uncached = results[True], results[False]
    assert all(n == RUNS for n in cached.executions.values())
    assert_one_rule(cached, uncached, RUNS)
