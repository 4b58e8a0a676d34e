"""One tool, three backends: the same analysis on a PyTorch CNN, its Keras twin
in TF graph mode and its ONNX export run in onnxruntime, written once with the
mapping rules and tables."""

import io

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")
torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("amanda.runtime.onnx")

import onnx  # noqa: E402

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.tools import mapping_rules, mapping_tables  # noqa: E402
from amanda.tools.mapping import MappingTool  # noqa: E402

from .test_mapping_rules import twins, nhwc  # noqa: E402,F401  (fixture)

CANONICAL_LAYOUT = {4: "OIHW", 2: "OI"}


class WeightCensus(amanda.Tool):
    """Per op with a weight: its canonical type and the weight in PyTorch's
    layout (through the mapping tables); and a portable routine that doubles
    the activation entering every convolution, lowered natively on graph
    backends (the input, not the output: a TF ``Conv2D`` has no bias, its
    ``BiasAdd`` is a separate op)."""

    def __init__(self):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.WEIGHT_RULES))
        self.seen = []
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.is_backward() or context.get("weight_input") is None:
            return
        weight = context["weight"]
        layout = context["weight_layout"]
        canonical = mapping_tables.convert_layout(weight, layout, CANONICAL_LAYOUT[weight.ndim])
        self.seen.append((context["type"], canonical))
        if context["type"] == "conv2d":
            context.insert_before_op(self.double, inputs=[0])

    @portable.routine
    def double(self, y):
        return y * 2.0


def test_the_same_tool_sees_the_same_weights_and_changes_outputs_alike(twins):
    net, model, _, session, image = twins
    tools = {name: WeightCensus() for name in ("pytorch", "tensorflow", "onnx")}
    with torch.no_grad():
        plain = net(torch.from_numpy(image)).numpy()
        with amanda.apply(tools["pytorch"]):
            torch_out = net(torch.from_numpy(image)).numpy()
    with amanda.apply(tools["tensorflow"]):
        tf_out = session.run(model.y, {model.x: nhwc(image)})
    buffer = io.BytesIO()
    torch.onnx.export(net, (torch.from_numpy(image),), buffer, dynamo=False)
    exported = onnx.load_from_string(buffer.getvalue())
    with amanda.apply(tools["onnx"]):
        onnx_session = ort.InferenceSession(exported.SerializeToString(),
                                            providers=["CPUExecutionProvider"])
        onnx_out = onnx_session.run(None, {exported.graph.input[0].name: image})[0]

    types = {name: [t for t, _ in tool.seen] for name, tool in tools.items()}
    assert types["pytorch"] == types["tensorflow"] == types["onnx"] == ["conv2d", "conv2d", "linear"]
    for name in ("tensorflow", "onnx"):
        for (_, ours), (_, theirs) in zip(tools["pytorch"].seen[:2], tools[name].seen[:2]):
            np.testing.assert_array_equal(ours, theirs)   # conv filters, moved to OIHW
        assert tools[name].seen[2][1].shape == tools["pytorch"].seen[2][1].shape
    np.testing.assert_allclose(tools["onnx"].seen[2][1], tools["pytorch"].seen[2][1])
    # doubling both convolutions' inputs changes the logits the
    # same way on every backend, and the uninstrumented model is untouched
    assert not np.allclose(torch_out, plain, atol=1e-3)
    np.testing.assert_allclose(tf_out, torch_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(onnx_out, torch_out, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(session.run(model.y, {model.x: nhwc(image)}), plain,
                               rtol=1e-4, atol=1e-4)
