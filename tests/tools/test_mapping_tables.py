"""The mapping tables: one common op set across the three namespaces."""

import numpy as np
import pytest
import torch

from amanda.tools import mapping_tables as T

# TensorFlow has no single gelu/layer_norm op (Keras composes them)
COMPOSED_IN_TF = {"gelu", "layer_norm"}
COMMON = ["conv2d", "linear", "matmul", "relu", "gelu", "layer_norm", "softmax", "add", "mul", "max_pool2d",
          "avg_pool2d", "batch_norm", "reshape", "transpose", "concat", "embedding"]


@pytest.mark.parametrize("canonical", COMMON)
def test_every_common_op_has_a_row_per_backend_with_consistent_roles(canonical):
    rows = T.specs(canonical)
    expected = set(T.BACKENDS) - ({"tensorflow"} if canonical in COMPOSED_IN_TF else set())
    assert set(rows) == expected, f"{canonical} is missing a backend"
    for backend, spec in rows.items():
        assert spec.canonical == canonical and spec.backend == backend and spec.ops
        for role, layout in spec.layouts.items():
            assert role in spec.inputs, (backend, role)
        if "weight" in rows["pytorch"].inputs:
            assert "weight" in spec.inputs, (backend, canonical)


def test_lookup_by_backend_or_namespace_and_ambiguous_names():
    assert T.lookup("onnx/21/graph", "Conv").canonical == "conv2d"
    assert T.lookup("tensorflow", "Conv2D").attr("stride") == "strides"
    assert T.lookup("pytorch", "conv2d").position("bias") == 2
    assert T.lookup("onnx", "MatMul", canonical="matmul").canonical == "matmul"
    assert T.lookup("onnx", "MatMul", canonical="relu") is None
    assert T.lookup("onnx", "NoSuchOp") is None


def test_layouts_convert_real_weights_between_frameworks():
    """A torch conv and a TF conv with the weight moved through the table's
    layouts compute the same function."""
    tf = pytest.importorskip("tensorflow")
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, 3, bias=False)
    x = np.random.default_rng(0).random((1, 3, 8, 8), np.float32)
    expected = conv(torch.from_numpy(x)).detach().numpy()
    torch_spec, tf_spec = T.lookup("pytorch", "conv2d"), T.lookup("tensorflow", "Conv2D")
    filters = T.convert_layout(conv.weight.detach().numpy(), torch_spec.layout("weight"),
                               tf_spec.layout("weight"))
    image = T.convert_layout(x, torch_spec.layout("input"), tf_spec.layout("input"))
    y = tf.nn.conv2d(image, filters, strides=1, padding="VALID").numpy()
    np.testing.assert_allclose(T.convert_layout(y, "NHWC", "NCHW"), expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        T.convert_layout(x, "NCHW", "OI")
