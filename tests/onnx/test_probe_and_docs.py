"""The probe tool, and the runnable examples of docs/onnx.md and docs/tools/probe.md."""

import os
import re

import numpy as np
import pytest

import amanda
from amanda.tools.probe import ProbeTool
from tests.onnx.conftest import DATA, light_feeds, mlp, onnx, ort, same, session

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_probe_returns_intermediate_values_per_run(x24):
    model = mlp()
    probe = ProbeTool(tensors=["h"])
    with amanda.apply(probe):
        instrumented = ort.InferenceSession(model.SerializeToString())
    y = instrumented.run(None, {"x": x24})[0]
    weight, bias = (onnx.numpy_helper.to_array(t) for t in model.graph.initializer)
    np.testing.assert_allclose(probe.values["h"], x24 @ weight + bias, rtol=1e-6, atol=1e-6)
    assert same(y, session(model).run(None, {"x": x24})[0])
    instrumented.run(None, {"x": 2 * x24})
    assert probe.counts == {"h": 2}
    np.testing.assert_allclose(probe.values["h"], 2 * x24 @ weight + bias, rtol=1e-5, atol=1e-5)


def test_probe_every_conv_of_a_light_model_matches_an_extra_output():
    path = os.path.join(DATA, "light", "light_squeezenet.onnx")
    model = onnx.load(path)
    feeds = light_feeds(model)
    probe = ProbeTool(op_types=["Conv"], inputs=True)
    # onnxruntime's layout rewrites (level ALL) fuse Conv with what follows;
    # compare at EXTENDED, where the plain model computes the same Conv
    level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    with amanda.apply(probe):
        instrumented = ort.InferenceSession(path, options)
    instrumented.run(None, feeds)
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert set(probe.values) >= {n.output[0] for n in convs}
    # reference: the same tensor exposed as a graph output of the original model
    target = convs[3].output[0]
    exposed = onnx.ModelProto()
    exposed.CopyFrom(model)
    exposed.graph.output.add().name = target
    reference = session(exposed, level).run([target], feeds)[0]
    assert same(probe.values[target], reference)


def python_blocks(relative):
    with open(os.path.join(ROOT, relative)) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), re.DOTALL)


@pytest.mark.parametrize("page", ["docs/tools/probe.md", "docs/onnx.md"])
def test_docs_examples_run(page):
    blocks = python_blocks(page)
    assert blocks
    namespace = {"__name__": "docs_example"}   # later blocks continue earlier ones
    for block in blocks:
        exec(compile(block, page, "exec"), namespace)
