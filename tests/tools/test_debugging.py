"""Debugging tools on PyTorch eager: NanDetector and OpStatistics."""

import math

import numpy as np
import pytest
import torch

import amanda
from amanda.models import tutorial_cnn
from amanda.tools.debugging import NanDetector, NanError, OpStatistics, tensor_stats


def cnn():
    torch.manual_seed(0)
    return tutorial_cnn()


def test_tensor_stats_torch_and_numpy_agree():
    a = np.array([0.0, 1.0, -2.0, np.nan, np.inf, 0.0], np.float32)
    s_np, s_t = tensor_stats(a), tensor_stats(torch.from_numpy(a))
    for s in (s_np, s_t):
        assert s["nan"] == 1 and s["inf"] == 1 and s["numel"] == 6
        assert s["min"] == -2.0 and s["max"] == 1.0
        assert s["mean"] == pytest.approx(-0.25)
        assert s["sparsity"] == pytest.approx(2 / 6)
    assert tensor_stats(None) is None


def test_no_nan_no_report():
    model = cnn()
    tool = NanDetector()
    with amanda.apply(tool):
        y = model(torch.rand(1, 3, 32, 32))
        y.sum().backward()
    assert tool.report is None
    assert tool.executions > 10


def test_forward_nan_in_fc1_weight_names_fc1_linear():
    model = cnn()
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    tool = NanDetector()
    with amanda.apply(tool):
        y = model(torch.rand(1, 3, 32, 32))
        y.sum().backward()
    report = tool.report
    assert report is not None
    assert report.op_name == "linear"
    assert report.module_path == "fc1"
    assert report.backward is False
    assert report.output_index == 0
    assert report.output_stats["nan"] == 1          # only output feature 0 is NaN
    assert report.namespace.startswith("pytorch/")
    # inputs: activation (finite), weight (one NaN), bias (finite)
    assert [s["nan"] for s in report.input_stats] == [0, 1, 0]
    assert report.input_stats[1]["shape"] == (128, 1600)
    assert len(tool.reports) == 1
    # later ops (relu, fc2) also produce NaN but are not reported
    all_tool = NanDetector(record_all=True)
    with amanda.apply(all_tool):
        model(torch.rand(1, 3, 32, 32))
    assert [(r.op_name, r.module_path) for r in all_tool.reports][:3] == [
        ("linear", "fc1"), ("relu", "relu1"), ("linear", "fc2")]


def test_backward_only_inf_names_sqrt_backward():
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.rand(4, 4))
    x = torch.rand(2, 4)
    tool = NanDetector()
    with amanda.apply(tool):
        h = (x @ w) * 0.0                   # all zeros
        out = torch.sqrt(h).sum()            # forward finite
        assert math.isfinite(out.item())
        out.backward()
    report = tool.report
    assert report is not None and report.backward is True
    assert report.backward_op_name == "SqrtBackward0"
    assert report.op_name == "sqrt"
    assert report.output_stats["inf"] == 8
    assert report.input_stats[0]["inf"] == 0 and report.input_stats[0]["nan"] == 0
    assert torch.isnan(w.grad).all()     # 0 * inf downstream; the tool only observed


def test_raise_on_nan_names_the_op_and_leaves_the_backend_clean():
    model = cnn()
    with torch.no_grad():
        model.fc1.weight[0, 0] = float("nan")
    tool = NanDetector(raise_on_nan=True)
    with pytest.raises(NanError) as info:
        with amanda.apply(tool):
            model(torch.rand(1, 3, 32, 32))
    message = str(info.value)
    assert "'linear'" in message and "'fc1'" in message and "forward" in message
    assert str(tool.report.op_id) in message
    assert isinstance(info.value, amanda.AmandaError)
    assert info.value.report is tool.report
    # backend clean: plain forward and an instrumented forward work
    clean = cnn()
    y = clean(torch.rand(1, 3, 32, 32))
    assert torch.isfinite(y).all()
    detector = NanDetector(raise_on_nan=True)
    with amanda.apply(detector):
        clean(torch.rand(1, 3, 32, 32)).sum().backward()
    assert detector.report is None


def test_op_statistics_relu_sparsity_and_npz(tmp_path):
    model = cnn()
    x = torch.rand(2, 3, 32, 32)
    tool = OpStatistics(op_types={"relu", "linear"}, dump_ops="relu")
    with amanda.apply(tool):
        y = model(x)
        model(x)
    rows = tool.report()
    assert [(r["op_name"], r["module_path"]) for r in rows] == [
        ("linear", "fc1"), ("relu", "relu1"), ("linear", "fc2")]
    # by hand
    with torch.no_grad():
        flat = model.max_pool2(model.conv_layer4(model.conv_layer3(model.max_pool1(
            model.conv_layer2(model.conv_layer1(x)))))).reshape(2, -1)
        hidden = model.fc1(flat)
        relu = torch.relu(hidden)
    relu_row = rows[1]
    assert relu_row["calls"] == 2
    expected = (relu == 0).float().mean().item()
    assert relu_row["sparsity"] > 0
    assert relu_row["sparsity"] == pytest.approx(expected)
    assert relu_row["mean"] == pytest.approx(relu.double().mean().item(), rel=1e-5)
    assert relu_row["std"] == pytest.approx(relu.double().std(unbiased=False).item(), rel=1e-5)
    assert relu_row["min"] == 0.0
    assert relu_row["max"] == pytest.approx(relu.max().item(), rel=1e-6)
    fc2 = rows[2]
    assert fc2["min"] == pytest.approx(y.min().item(), rel=1e-5)
    assert fc2["max"] == pytest.approx(y.max().item(), rel=1e-5)
    assert fc2["sparsity"] == 0.0
    keys = tool.to_npz(tmp_path / "dump.npz")
    assert keys == [tool.npz_key(relu_row["op_id"])]
    with np.load(tmp_path / "dump.npz") as data:
        assert list(data.keys()) == keys
        np.testing.assert_allclose(data[keys[0]], relu.numpy(), rtol=1e-5, atol=1e-6)


def test_op_statistics_all_ops_counts_every_op():
    model = cnn()
    x = torch.rand(1, 3, 32, 32)
    tool = OpStatistics()
    with amanda.apply(tool):
        model(x)
    names = [r["op_name"] for r in tool.report()]
    assert names == ["conv2d", "conv2d", "max_pool2d", "conv2d", "conv2d", "max_pool2d",
                     "reshape", "linear", "relu", "linear"]


@pytest.mark.slow
def test_bert_nan_in_layer3_query_weight():
    from transformers import BertConfig, BertModel
    torch.manual_seed(0)
    bert = BertModel(BertConfig()).eval()
    with torch.no_grad():
        bert.encoder.layer[3].attention.self.query.weight[5, 7] = float("nan")
    tool = NanDetector()
    with amanda.apply(tool):
        bert(torch.randint(0, 10, (1, 8)))
    report = tool.report
    assert report is not None and not report.backward
    assert report.op_name == "linear"
    assert report.module_path == "encoder.layer.3.attention.self.query"
    assert report.output_stats["nan"] == 8      # feature 5 of each token


def test_sparse_and_nested_tensors_are_checked_like_their_dense_form():
    """NanDetector and OpStatistics read the values a sparse or nested tensor
    stores (its implicit zeros counted): an ``Embedding(sparse=True)``
    gradient used to raise torch's 'not implemented for SparseCPU' as a
    ToolError out of the backward pass."""
    torch.manual_seed(0)
    dense = torch.randn(6, 5)
    dense[dense.abs() < 0.7] = 0
    dense[0, 0], dense[1, 1] = math.nan, math.inf
    expected = tensor_stats(dense)
    forms = [dense.to_sparse(), dense.to_sparse_csr(),
             torch.nested.nested_tensor([dense[:2], dense[2:]], layout=torch.jagged)]
    for form in forms:
        stats = tensor_stats(form)
        for key in ("numel", "nan", "inf", "min", "max"):
            assert stats[key] == expected[key], (form.layout, key)
        for key in ("mean", "std", "sparsity"):
            assert stats[key] == pytest.approx(expected[key]), (form.layout, key)

    def train(tool):
        torch.manual_seed(0)
        embedding = torch.nn.Embedding(10, 4, sparse=True)
        optimizer = torch.optim.SparseAdam(embedding.parameters())
        with amanda.apply(tool) if tool else amanda.disabled():
            for _ in range(2):
                embedding(torch.tensor([1, 2, 3, 2])).square().sum().backward()
                optimizer.step()
                optimizer.zero_grad()
        return embedding.weight.detach()

    detector = NanDetector()
    assert torch.equal(train(detector), train(None))
    assert not detector.reports and detector.executions > 0

    # an Inf that only the sparse gradient carries: sqrt's gradient at a zero row
    embedding = torch.nn.Embedding(4, 3, sparse=True)
    with torch.no_grad():
        embedding.weight[1] = 0
    detector = NanDetector(record_all=True)
    with amanda.apply(detector):
        embedding(torch.tensor([1, 2])).abs().sqrt().sum().backward()
    assert embedding.weight.grad.is_sparse
    assert {r.backward_op_name for r in detector.reports} >= {"EmbeddingBackward0"}
