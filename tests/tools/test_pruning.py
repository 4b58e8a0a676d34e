"""Pruner on PyTorch eager: the masks reach the requested sparsity and
pattern; in a training loop the pruned weights are zero where the op reads
them, their gradients are zero and the parameters never move there; dynamic
masks follow the weights; the docs page runs."""

import contextlib
import io
import os
import pathlib
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

torch = pytest.importorskip("torch")

import amanda  # noqa: E402
from amanda import portable  # noqa: E402
from amanda.models import tutorial_cnn  # noqa: E402
from amanda.tools import mapping_rules  # noqa: E402
from amanda.tools.mapping import MappingTool  # noqa: E402
from amanda.tools.pruning import (Pruner, channel_mask, magnitude_mask, mask_grad,  # noqa: E402
                                  mask_weight, nm_mask)

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "tools" / "pruning.md"
F = torch.nn.functional


# -- masks -----------------------------------------------------------------------------

@settings(max_examples=40, deadline=None)
@given(st.integers(1, 300), st.floats(0, 1), st.integers(0, 2 ** 31))
def test_magnitude_mask_prunes_the_smallest(size, sparsity, seed):
    weight = np.random.default_rng(seed).standard_normal(size).astype(np.float32)
    mask = magnitude_mask(weight, sparsity)
    pruned = int(np.round(sparsity * size))
    assert int((mask == 0).sum()) == pruned
    if 0 < pruned < size:
        assert np.abs(weight[mask == 0]).max() <= np.abs(weight[mask == 1]).min()


@settings(max_examples=30, deadline=None)
@given(st.sampled_from([(2, 4), (1, 4), (4, 8), (1, 2)]), st.integers(0, 3),
       st.integers(0, 2 ** 31))
def test_nm_mask_keeps_n_largest_of_every_m_along_the_axis(nm, axis, seed):
    n, m = nm
    shape = [3, 2, 2, 2]
    shape[axis] = 2 * m
    weight = np.random.default_rng(seed).standard_normal(shape)
    mask = nm_mask(weight, n, m, axis)
    groups = np.moveaxis(mask, axis, -1).reshape(-1, m)
    magnitudes = np.moveaxis(np.abs(weight), axis, -1).reshape(-1, m)
    assert (groups.sum(axis=1) == n).all()
    kept = np.where(groups == 1, magnitudes, np.inf).min(axis=1)
    dropped = np.where(groups == 0, magnitudes, -np.inf).max(axis=1)
    assert (kept >= dropped).all()
    shape[axis] = 2 * m + 1
    assert nm_mask(np.ones(shape), n, m, axis) is None


def test_channel_mask_zeroes_whole_channels_of_smallest_l1():
    weight = np.random.default_rng(0).standard_normal((8, 3, 3, 3)).astype(np.float32)
    weight[[1, 6]] *= 0.01
    mask = channel_mask(weight, 0.25, axis=0)
    assert mask.shape == weight.shape
    channels = mask.reshape(8, -1)
    assert (channels.min(axis=1) == channels.max(axis=1)).all()   # all or nothing
    assert list(np.flatnonzero(channels[:, 0] == 0)) == [1, 6]
    tf_layout = np.transpose(weight, (2, 3, 1, 0))   # HWIO: output channels last
    np.testing.assert_array_equal(channel_mask(tf_layout, 0.25, axis=3),
                                  np.transpose(mask, (2, 3, 1, 0)))


def test_routines_are_portable_and_bad_arguments_are_errors():
    assert portable.is_portable(mask_weight) and portable.is_portable(mask_grad)
    for kwargs in ({"pattern": "3:2"}, {"pattern": "blocks"}, {"sparsity": 1.5},
                   {"update_every": 0}, {"sparsity": lambda step: 0.5}):
        with pytest.raises(amanda.AmandaError, match="Pruner"):
            Pruner(**kwargs)


# -- a training loop -------------------------------------------------------------------

class WeightProbe(amanda.Tool):
    """Sees each pruned op's weight as the op receives it (applied after the
    pruner, its routine runs after the pruner's)."""

    def __init__(self):
        super().__init__()
        self.depends_on(MappingTool(rules=mapping_rules.RULES))
        self.seen = []
        self.add_inst_for_op(self.analysis)

    def analysis(self, context):
        if context.get("weight_input") is not None:
            context.insert_before_op(self.look, inputs=[context["weight_input"]],
                                     op_id=context.get_op_id())

    def look(self, weight, op_id):
        self.seen.append((op_id, weight.detach().clone()))


def train(model, pruner, steps=3, probe=None, lr=0.05):
    torch.manual_seed(1)
    x, target = torch.rand(4, 3, 32, 32), torch.randint(0, 10, (4,))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    losses, grads = [], None
    tools = (pruner,) if probe is None else (pruner, probe)
    for _ in range(steps):
        optimizer.zero_grad()
        with amanda.apply(*tools):
            loss = F.cross_entropy(model(x), target)
            loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        optimizer.step()
        losses.append(loss.item())
    return losses, grads


@pytest.mark.parametrize("pattern, sparsity", [("unstructured", 0.5), ("unstructured", 0.9),
                                               ("2:4", None), ("channel", 0.5)])
def test_training_keeps_pruned_weights_at_zero(pattern, sparsity):
    torch.manual_seed(0)
    model = tutorial_cnn()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    pruner, probe = Pruner(pattern, sparsity=sparsity or 0.5), WeightProbe()
    losses, grads = train(model, pruner, probe=probe)
    assert len(set(losses)) == 3
    params = dict(model.named_parameters())
    expected_layers = 5 if pattern == "2:4" else 6   # conv_layer1 has 3 input channels
    assert len(pruner.layers) == expected_layers
    masks = {layer.op_id: torch.from_numpy(layer.mask) for layer in pruner.layers.values()}
    for layer in pruner.layers.values():
        name = f"{layer.module}.weight"
        mask = masks[layer.op_id]
        assert torch.equal(params[name].detach()[mask == 0], before[name][mask == 0])
        assert (params[name].detach()[mask == 1] != before[name][mask == 1]).any()
        assert (grads[name][mask == 0] == 0).all() and (grads[name][mask == 1] != 0).any()
        if pattern == "2:4":
            groups = mask.reshape(mask.shape[0], mask.shape[1] // 4, 4, -1)
            assert (groups.sum(dim=2) == 2).all()    # 2 of every 4 input channels
        elif pattern == "channel":
            flat = mask.reshape(mask.shape[0], -1)
            assert ((flat == 0).all(1) | (flat == 1).all(1)).all()
            assert int((flat[:, 0] == 0).sum()) == round(0.5 * mask.shape[0])
        else:
            assert layer.sparsity == pytest.approx(sparsity, abs=0.5 / mask.numel())
    # the ops computed with the pruned weights, at every step
    seen = [(op_id, w) for op_id, w in probe.seen if op_id in masks]
    assert len(seen) == 3 * expected_layers
    assert all((w[masks[op_id] == 0] == 0).all() for op_id, w in seen)
    report = pruner.report()
    assert report["total"]["pruned"] == sum(r["pruned"] for r in report["layers"])
    if pattern == "2:4":
        assert report["skipped"][0]["module"] == "conv_layer1"
        assert report["total"]["sparsity"] == 0.5
    assert "total" in pruner.table()


def test_pruned_model_matches_masked_weights():
    torch.manual_seed(0)
    model = tutorial_cnn()
    x = torch.rand(2, 3, 32, 32)
    pruner = Pruner("channel", sparsity=0.25)
    with amanda.apply(pruner):
        pruned = model(x)
    reference = tutorial_cnn()
    reference.load_state_dict(model.state_dict())
    with torch.no_grad():
        for layer in pruner.layers.values():
            getattr(reference, layer.module).weight.mul_(torch.from_numpy(layer.mask))
    torch.testing.assert_close(pruned, reference(x))
    assert not torch.allclose(pruned, model(x))          # the parameters are untouched


def test_dynamic_masks_follow_the_weights():
    torch.manual_seed(0)
    model = tutorial_cnn()
    schedule = [0.25, 0.5, 0.75]
    pruner = Pruner("unstructured", sparsity=lambda update: schedule[min(update, 2)],
                    update_every=2, mask_grads=False)
    torch.manual_seed(1)
    x, target = torch.rand(4, 3, 32, 32), torch.randint(0, 10, (4,))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    snapshots = []
    for _ in range(5):
        snapshots.append(model.fc1.weight.detach().clone())   # the weight this step reads
        optimizer.zero_grad()
        with amanda.apply(pruner):
            F.cross_entropy(model(x), target).backward()
        optimizer.step()
    fc1 = next(layer for layer in pruner.layers.values() if layer.module == "fc1")
    # masks computed at executions 0, 2 and 4, with the growing sparsity
    assert fc1.updates == 3 and fc1.calls == 5
    np.testing.assert_array_equal(fc1.mask, magnitude_mask(snapshots[4].numpy(), 0.75))
    assert fc1.sparsity == pytest.approx(0.75)
    # without gradient masks, pruned weights keep training
    moved = model.fc1.weight.detach() != snapshots[0]
    assert moved[torch.from_numpy(magnitude_mask(snapshots[0].numpy(), 0.25)) == 0].any()


def test_bert_linear_layers_are_pruned_2_of_4_along_the_input():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=128, vocab_size=500)
    model = transformers.BertModel(config)
    ids = torch.randint(0, 500, (2, 8))
    pruner = Pruner("2:4")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    direction = torch.randn(2, 8, 64)   # a loss that LayerNorm does not flatten out
    for _ in range(2):
        optimizer.zero_grad()
        with amanda.apply(pruner):
            (model(ids).last_hidden_state * direction).sum().backward()
        optimizer.step()
    # 6 linear layers per encoder layer, and the pooler's
    assert len(pruner.layers) == 2 * 6 + 1 and not pruner.skipped
    params = dict(model.named_parameters())
    for layer in pruner.layers.values():
        mask = torch.from_numpy(layer.mask)
        out_features, in_features = layer.shape
        assert (mask.reshape(out_features, in_features // 4, 4).sum(-1) == 2).all()
        weight = params[f"{layer.module}.weight"].detach()
        if layer.module != "pooler.dense":   # the loss does not reach the pooler
            assert torch.equal(weight[mask == 0], before[f"{layer.module}.weight"][mask == 0])
            assert (weight[mask == 1] != before[f"{layer.module}.weight"][mask == 1]).any()
    assert pruner.report()["total"]["sparsity"] == 0.5


def test_gpt2_conv1d_layers_are_pruned_like_linear_ones():
    """transformers' GPT-2 projects with ``Conv1D``: ``torch.addmm(b, x, W)``
    with ``W`` laid out (in, out). They used to be left dense with no word
    (0 layers, 0 skipped): a matrix product whose operand is a 2-D parameter
    is pruned, N:M along its input axis (0), its gradient masked; the
    pruned run equals the same model with the masks written into its
    weights by hand, and pruned weights do not move in training."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = transformers.GPT2Model(config)
    ids = torch.randint(0, 300, (2, 8))
    reference = transformers.GPT2Model(config)
    reference.load_state_dict(model.state_dict())
    pruner = Pruner("2:4")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    with amanda.apply(pruner):
        pruned = model(ids).last_hidden_state
        pruned.sum().backward()
    optimizer.step()
    # c_attn, attn.c_proj, c_fc, mlp.c_proj per block
    assert len(pruner.layers) == 2 * 4 and not pruner.skipped
    assert {layer.type for layer in pruner.layers.values()} == {"addmm"}
    params = dict(model.named_parameters())
    with torch.no_grad():
        for layer in pruner.layers.values():
            mask = torch.from_numpy(layer.mask)
            in_features, out_features = layer.shape
            assert (mask.reshape(in_features // 4, 4, out_features).sum(1) == 2).all()
            name = f"{layer.module}.weight"
            assert torch.equal(params[name][mask == 0], before[name][mask == 0])
            assert (params[name][mask == 1] != before[name][mask == 1]).any()
            dict(reference.named_parameters())[name].mul_(mask)
    torch.testing.assert_close(pruned, reference(ids).last_hidden_state)
    assert pruner.report()["total"]["sparsity"] == 0.5


@pytest.mark.slow
def test_docs_page_examples_run_and_print_what_they_show(monkeypatch, tmp_path):
    blocks = re.findall(r"```(\w+)\n(.*?)```", DOCS.read_text(), re.S)
    examples = [(body, blocks[i + 1][1] if i + 1 < len(blocks) and blocks[i + 1][0] == "text"
                 else None) for i, (lang, body) in enumerate(blocks) if lang == "python"]
    assert len(examples) >= 3
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for number, (code, expected) in enumerate(examples, 1):
        with contextlib.redirect_stdout(io.StringIO()) as out:
            exec(compile(code, f"{DOCS.name} example {number}", "exec"), namespace)
        if expected is not None:
            assert out.getvalue() == expected, f"example {number} printed:\n{out.getvalue()}"
    assert namespace["tf_pruner"].report()["total"]["sparsity"] == pytest.approx(0.9, abs=1e-3)
