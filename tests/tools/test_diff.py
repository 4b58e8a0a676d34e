"""Numeric diff: PyTorch vs its ONNX export, the first diverging module."""

import io

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime")
import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from amanda.tools.diff import diff_torch_onnx  # noqa: E402


@pytest.fixture(scope="module")
def resnet():
    from transformers import ResNetConfig, ResNetModel
    torch.manual_seed(0)
    model = ResNetModel(ResNetConfig(depths=[1, 1, 1, 1])).eval()
    x = torch.rand(1, 3, 64, 64)
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, dynamo=False)
    return model, x, onnx.load_from_string(buffer.getvalue())


def tampered(model_proto, node_name, change):
    copy = onnx.ModelProto()
    copy.CopyFrom(model_proto)
    node = next(n for n in copy.graph.node if n.name == node_name)
    weight = next(t for t in copy.graph.initializer if t.name == node.input[1])
    weight.CopyFrom(numpy_helper.from_array(change(numpy_helper.to_array(weight).copy()),
                                            weight.name))
    return copy


def test_a_faithful_export_has_no_divergence(resnet):
    model, x, exported = resnet
    report = diff_torch_onnx(model, (x,), onnx_model=exported)
    assert report.first is None, report.describe()
    assert len(report.compared) > 40
    assert report.output_error < 1e-4


@pytest.mark.parametrize("where", ["/encoder/stages.1/layers.0/shortcut/convolution/Conv",
                                   "/encoder/stages.3/layers.0/layer/layer.0/convolution/Conv"])
def test_a_planted_mismatch_is_named(resnet, where):
    model, x, exported = resnet
    report = diff_torch_onnx(model, (x,), onnx_model=tampered(exported, where, lambda w: -w))
    module = where.split("/", 1)[1].rsplit("/", 1)[0]
    expected = module.replace("/layer/layer.", "/layer.").replace("/", ".")
    assert report.first is not None
    assert report.first.module == expected, report.describe()
    assert report.first.onnx_node == where and report.first.torch_op == "conv2d"
    assert report.first.max_abs_error > 1e-3
    # every module before it agreed
    before = report.compared[:report.compared.index(expected)]
    assert before and expected in report.describe()


def test_the_default_export_of_the_tutorial_cnn_matches():
    from tests.models import build_model
    model, x = build_model("cnn")
    report = diff_torch_onnx(model.eval(), (x,))
    assert report.first is None and report.output_error < 1e-5
    assert {"conv1", "conv2", "fc1"} <= set(report.compared) or len(report.compared) >= 4
    assert np.isfinite(report.output_error)


def test_the_docs_page_example_runs():
    from tests.markdown import run_examples
    run_examples("docs/tools/diff.md")


def test_the_op_output_recorder_is_backend_neutral():
    """The recorder diff_tf_onnx uses on TF graphs also records PyTorch ops
    (NumPy copies keyed "<op id>:<position>")."""
    import amanda
    from amanda.tools.diff import OpOutputRecorder
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU()).eval()
    x = torch.rand(1, 3, 8, 8)
    recorder = OpOutputRecorder()
    with torch.no_grad(), amanda.apply(recorder):
        out = model(x)
    with torch.no_grad():
        conv = model[0](x).numpy()
    values = list(recorder.values.values())
    assert all(isinstance(v, np.ndarray) for v in values)
    assert any(v.shape == conv.shape and np.array_equal(v, conv) for v in values)
    assert any(np.array_equal(v, out.numpy()) for v in values)
    assert all(key.rsplit(":", 1)[1].isdigit() for key in recorder.values)
