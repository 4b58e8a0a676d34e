"""FlopsProfiler on ONNX models run by onnxruntime.

* a transformers ResNet-50 exported from PyTorch counts the same convolution
  and linear FLOPs as the profiler on the eager model, module by module;
* the light ResNet-50 shipped with onnx: every Conv's FLOPs equal a hand
  computation from its weight's dims and the conv arithmetic;
* a model with a symbolic batch dimension is counted at run time;
* ONNX spellings (Gemm transA, MatMul weights (in, out), variadic Sum) and
  unknown ops; ``amanda flops model.onnx``; the docs page's examples.
"""

import io
import json
import os
from collections import Counter

import numpy as np
import pytest

import amanda
from amanda.tools.flops import FlopsProfiler
from tests.onnx.conftest import (
    TensorProto,
    helper,
    light_feeds,
    light_models,
    numpy_helper,
    onnx,
    ort,
)

torch = pytest.importorskip("torch")

LIGHT_RESNET50 = next(p for p in light_models() if p.endswith("light_resnet50.onnx"))


def profile_onnx(model, feeds_list):
    """Run the model once per feeds dict inside amanda.apply(FlopsProfiler())."""
    profiler = FlopsProfiler()
    data = model if isinstance(model, str) else model.SerializeToString()
    with amanda.apply(profiler):
        session = ort.InferenceSession(data, providers=["CPUExecutionProvider"])
        outputs = [session.run(None, feeds) for feeds in feeds_list]
    return profiler, outputs


def profile_torch(model, inputs):
    profiler = FlopsProfiler()
    with torch.no_grad(), amanda.apply(profiler):
        for x in inputs:
            model(x)
    return profiler


def export(model, x, **kwargs):
    buffer = io.BytesIO()
    with torch.no_grad():
        torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=13,
                          input_names=["x"], **kwargs)
    exported = onnx.load_from_string(buffer.getvalue())
    exported.ir_version = min(exported.ir_version, 10)
    return exported


def conv_by_module(profiler):
    return {r["module"]: r["flops"] for r in profiler.records.values() if r["type"] == "conv2d"}


@pytest.fixture(scope="module")
def resnet50():
    """(eager profiler, ONNX profiler, exported model) for transformers ResNet-50."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(
        transformers.ResNetConfig(num_labels=10)).eval()
    x = torch.rand(1, 3, 224, 224)
    eager = profile_torch(model, [x])
    exported = export(model, x)
    profiler, _ = profile_onnx(exported, [{"x": x.numpy()}])
    return eager, profiler, exported


def test_exported_resnet50_matches_eager_conv_and_linear(resnet50):
    eager, exported, model = resnet50
    pt, ox = eager.by_type("forward"), exported.by_type("forward")
    assert not eager.unknown and not exported.unknown
    # exact: same convolutions (biases are not counted) and the same classifier
    assert ox["conv2d"] == pt["conv2d"] > 8e9
    assert ox["linear"] == pt["linear"] == 2 * 2048 * 10
    # module by module: exporter node names ("/resnet/.../convolution/Conv")
    # give the eager module paths
    assert len(conv_by_module(exported)) == 53
    assert conv_by_module(exported) == conv_by_module(eager)
    # totals: the exporter folds eval-mode BatchNormalization into the Conv
    # weights and biases, so the ONNX graph has no batch_norm FLOPs (5 per
    # element in eager); everything else (relu, residual adds, pooling,
    # global average pool vs adaptive_avg_pool2d) is counted identically
    folded = pt.get("batch_norm", 0) - ox.get("batch_norm", 0)
    if "BatchNormalization" not in {n.op_type for n in model.graph.node}:
        assert folded == pt["batch_norm"] > 0
    assert exported.total("forward") == eager.total("forward") - folded
    assert exported.total("forward") == pytest.approx(eager.total("forward"), rel=0.01)
    assert exported.total("backward") == 0   # ONNX graphs are inference only


def _attr(node, name, default):
    for attr in node.attribute:
        if attr.name == name:
            return helper.get_attribute_value(attr)
    return default


def hand_conv_flops(model):
    """FLOPs of each Conv node of a light model, in node order: 2 x output
    elements x (Cin/groups x kernel area). The weight's dims come from the
    ConstantOfShape that produces it; the output's spatial size from the conv
    arithmetic on the input's inferred shape."""
    initializers = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    producers = {o: n for n in model.graph.node for o in n.output}
    inferred = onnx.shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
              for v in list(inferred.graph.value_info) + list(inferred.graph.input)}
    result = []
    for node in model.graph.node:
        if node.op_type != "Conv":
            continue
        weight_node = producers[node.input[1]]
        assert weight_node.op_type == "ConstantOfShape"
        cout, cin_per_group, kh, kw = (int(d) for d in initializers[weight_node.input[0]])
        n, cin, h, w = shapes[node.input[0]]
        assert cin == cin_per_group * _attr(node, "group", 1)
        strides = _attr(node, "strides", [1, 1])
        dilations = _attr(node, "dilations", [1, 1])
        pads = _attr(node, "pads", [0, 0, 0, 0])
        assert _attr(node, "auto_pad", b"NOTSET") in (b"NOTSET", "NOTSET")
        ho = (h + pads[0] + pads[2] - dilations[0] * (kh - 1) - 1) // strides[0] + 1
        wo = (w + pads[1] + pads[3] - dilations[1] * (kw - 1) - 1) // strides[1] + 1
        assert shapes[node.output[0]] == [n, cout, ho, wo]
        result.append(2 * n * cout * ho * wo * cin_per_group * kh * kw)
    return result


@pytest.fixture(scope="module")
def light_resnet50():
    model = onnx.load(LIGHT_RESNET50)
    return model, hand_conv_flops(model)


def test_light_resnet50_convs_equal_hand_computation(light_resnet50):
    model, expected = light_resnet50
    feeds = light_feeds(model)
    profiler, outputs = profile_onnx(model, [feeds, feeds])
    reference = ort.InferenceSession(model.SerializeToString(),
                                     providers=["CPUExecutionProvider"]).run(None, feeds)
    for got in outputs:   # observe-only: the outputs are untouched
        np.testing.assert_array_equal(got[0], reference[0])
    convs = [r for r in profiler.records.values() if r["type"] == "conv2d"]
    assert len(convs) == len(expected) == 53
    assert [r["flops"] for r in convs] == expected     # node by node, in graph order
    assert all(r["calls"] == 2 for r in convs)
    forward = profiler.by_type("forward")
    assert forward["conv2d"] == 2 * sum(expected)
    # the classifier: a Gemm whose weight is not an initializer -> "matmul"
    gemm = next(n for n in model.graph.node if n.op_type == "Gemm")
    assert _attr(gemm, "transB", 0) == 1
    assert forward["matmul"] == 2 * 2 * 2048 * 1000
    # Caffe2's residual Sum nodes are element-wise additions
    assert forward["add"] > 0 and "sum" not in forward
    assert not profiler.unknown


def test_symbolic_batch_is_counted_at_run_time():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU(),
        torch.nn.MaxPool2d(2), torch.nn.Flatten(), torch.nn.Linear(8 * 8 * 8, 10)).eval()
    exported = export(model, torch.rand(1, 3, 16, 16), output_names=["y"],
                      dynamic_axes={"x": {0: "N"}, "y": {0: "N"}})
    batch = exported.graph.input[0].type.tensor_type.shape.dim[0]
    assert batch.dim_param and not batch.HasField("dim_value")
    inputs = [torch.rand(2, 3, 16, 16), torch.rand(5, 3, 16, 16)]
    profiler, _ = profile_onnx(exported, [{"x": x.numpy()} for x in inputs])
    # one eager profiler per batch size: PyTorch analysis runs once per op
    eager = [profile_torch(model, [x]).by_type("forward") for x in inputs]
    assert not profiler.unknown
    conv = next(r for r in profiler.records.values() if r["type"] == "conv2d")
    assert conv["dynamic"] and conv["calls"] == 2
    assert conv["flops"] == 2 * 5 * 8 * 16 * 16 * 3 * 3 * 3   # the latest run's
    pt, ox = Counter(eager[0]) + Counter(eager[1]), profiler.by_type("forward")
    assert ox["conv2d"] == pt["conv2d"] == 2 * 7 * 8 * 16 * 16 * 27
    assert ox["linear"] == pt["linear"] == 2 * 7 * 512 * 10
    for op_type in ("relu", "max_pool2d"):
        assert ox[op_type] == pt[op_type]


def small_model():
    """Gemm with transA, MatMul with an (in, out) weight, variadic Sum, LRN."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
             for n, s in (("B", (5, 3)), ("W", (3, 4)))]
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["a", "B"], ["g"], transA=1),       # (5,2)^T @ (5,3)
         helper.make_node("MatMul", ["g", "W"], ["m"]),               # (2,3) @ (3,4)
         helper.make_node("Sum", ["m", "m", "m"], ["s"]),
         helper.make_node("Unsqueeze", ["s", "axes"], ["u"]),
         helper.make_node("LRN", ["u"], ["y"], size=3)],
        "small", [helper.make_tensor_value_info("a", TensorProto.FLOAT, [5, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits + [numpy_helper.from_array(np.array([0, 3], np.int64), "axes")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model


def test_onnx_spellings_and_unknown_ops():
    a = np.ones((5, 2), np.float32)
    profiler, _ = profile_onnx(small_model(), [{"a": a}])
    forward = profiler.by_type("forward")
    assert forward == {"linear": 2 * 2 * 3 * 5 + 2 * 2 * 4 * 3,   # K = 5, then K = 3
                       "add": 2 * 2 * 4}                            # Sum of 3: two adds
    assert profiler.unknown == {"lrn": 1}   # listed, not counted as zero
    assert "unknown (not counted): lrn x1" in profiler.table()


def test_cli_flops_on_an_onnx_file(tmp_path, capsys, light_resnet50):
    from amanda.cli import main
    _, expected = light_resnet50
    assert main(["flops", LIGHT_RESNET50, "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "(onnx)" in out
    from amanda.tools.flops import format_count
    rows = {line.split()[0]: line.split()[1] for line in out.splitlines() if line.split()
            and line.split()[0] in ("conv2d", "total")}
    assert rows["conv2d"] == format_count(sum(expected))     # the table's scaled unit
    with open(tmp_path / "flops.json") as f:
        report = json.load(f)
    report = report[0] if isinstance(report, list) else report
    assert report["by_type"]["conv2d"]["forward"] == sum(expected)     # exact
    assert report["forward"] > sum(expected)
    assert f"forward {report['forward']:,}" in out       # the exact total line


def test_docs_examples_run():
    from tests.markdown import run_examples
    namespace = run_examples("docs/tools/flops.md")
    assert Counter(namespace["onnx_profiler"].by_type())["conv2d"] > 0
