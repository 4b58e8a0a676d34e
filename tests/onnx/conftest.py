"""Fixtures for the ONNX tests: the backend test data shipped inside the onnx
package, and small hand-built models.

``onnx/backend/test/data/`` holds real models with their inputs and expected
outputs: ``light/`` (ResNet-50, DenseNet-121, Inception v1/v2, VGG-19,
SqueezeNet, ShuffleNet, AlexNet, ZFNet with constant "light" weights; inputs
are generated as the onnx backend runner does), ``pytorch-converted/``,
``pytorch-operator/`` and ``simple/`` (``model.onnx`` plus
``test_data_set_*/input_*.pb`` / ``output_*.pb``). Nothing is downloaded.
"""

import glob
import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_extensions")

import numpy as np
from onnx import TensorProto, helper, numpy_helper

ort.set_default_logger_severity(3)   # opset-6 models make onnxruntime chatty

import amanda.frontends.onnx as _frontend   # noqa: E402

_frontend.VERIFY_LIFTED = True   # the tests check every graph the lifter makes

DATA = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data")
SUITES = ("simple", "pytorch-converted", "pytorch-operator")


def model_dirs(suite):
    """Directories of one suite that hold a model, sorted."""
    return sorted(d for d in glob.glob(os.path.join(DATA, suite, "*"))
                  if os.path.isfile(os.path.join(d, "model.onnx")))


def _numbered(directory, kind):
    paths = glob.glob(os.path.join(directory, f"{kind}_*.pb"))
    return sorted(paths, key=lambda p: int(p.rsplit("_", 1)[1][:-3]))


def light_models():
    return sorted(glob.glob(os.path.join(DATA, "light", "*.onnx")))


def read_tensor(path):
    tensor = onnx.TensorProto()
    with open(path, "rb") as f:
        tensor.ParseFromString(f.read())
    return numpy_helper.to_array(tensor)


def data_sets(model_dir, model):
    """[(feeds, expected outputs)] of a backend-test model directory."""
    initializers = {i.name for i in model.graph.initializer}
    names = [i.name for i in model.graph.input if i.name not in initializers]
    result = []
    for directory in sorted(glob.glob(os.path.join(model_dir, "test_data_set_*"))):
        inputs = [read_tensor(p) for p in _numbered(directory, "input")]
        outputs = [read_tensor(p) for p in _numbered(directory, "output")]
        result.append((dict(zip(names, inputs)), outputs))
    return result


def light_feeds(model):
    """The inputs the onnx backend runner feeds a light model (arange / n)."""
    initializers = {i.name for i in model.graph.initializer}
    feeds = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        shape = tuple(d.dim_value if d.HasField("dim_value") else 1
                      for d in value.type.tensor_type.shape.dim)
        n = int(np.prod(shape))
        feeds[value.name] = (np.arange(n).reshape(shape) / n).astype(np.float32)
    return feeds


def session(model, level=None, options=None):
    """A CPU session for a ModelProto (optionally at a graph optimization level)."""
    options = options or ort.SessionOptions()
    if level is not None:
        options.graph_optimization_level = level
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CPUExecutionProvider"])


def same(a, b):
    """Bit-identical arrays (NaNs in the same places count as equal)."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype.kind in "fc":
        return np.array_equal(a, b, equal_nan=True)
    return np.array_equal(a, b)


def mlp(opset=13, ir_version=8, seed=0):
    """x[2,4] -> Gemm(W, B) "fc" -> Relu "relu" -> y, with random weights."""
    rng = np.random.default_rng(seed)
    weight = rng.standard_normal((4, 3)).astype(np.float32)
    bias = rng.standard_normal(3).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "B"], ["h"], name="fc"),
         helper.make_node("Relu", ["h"], ["y"], name="relu")], "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(bias, "B")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    return model


@pytest.fixture
def mlp_model():
    return mlp()


@pytest.fixture
def x24():
    return np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
