"""The paper's Tbl. 4 projects as amanda tools (amanda/tools/pruning_projects):
each tool against its baseline written the original's way
(benchmarks/pruning_baselines): the same masks and a bit-identical short
training run; each tool on every model family listed; the docs' examples."""

import copy

import numpy as np
import pytest
import torch

import amanda
from amanda import pruning_models as models
from amanda.tools.pruning_projects.activation import ActivationPruner
from amanda.tools.pruning_projects.block_skim import BlockSkim
from amanda.tools.pruning_projects.feature_boosting import FeatureBoosting
from amanda.tools.pruning_projects.tile_wise import TileWisePruner
from amanda.tools.pruning_projects.vector_wise import VectorWisePruner
from benchmarks.pruning_baselines import activation as activation_baseline
from benchmarks.pruning_baselines import block_skim as block_skim_baseline
from benchmarks.pruning_baselines import feature_boosting as fbs_baseline
from benchmarks.pruning_baselines import vector_wise as asp_baseline

CNNS = [models.vgg_style, models.squeezenet_style, models.resnet_style]


def digits_batch(n=16, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 8, 8, generator=generator), torch.randint(0, 10, (n,),
                                                                      generator=generator)


def train(model, step_context, x, y, steps=3, extra=()):
    """``steps`` SGD steps (momentum) inside ``step_context()``; the losses."""
    optimizer = torch.optim.SGD(list(model.parameters()) + list(extra), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        with step_context():
            loss = torch.nn.functional.cross_entropy(model(x), y)
            loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, optimizer


# -- tile-wise -------------------------------------------------------------------------

def test_tile_wise_tf_graph_matches_the_session_hook_baseline_bit_for_bit():
    tf = pytest.importorskip("tensorflow")
    from benchmarks.pruning_baselines.tile_wise import TileWiseHook
    rng = np.random.default_rng(0)
    x, y = rng.random((8, 8, 8, 1), np.float32), rng.integers(0, 10, 8)
    base = models.keras_vgg_style_graph(batch=8)
    with base["graph"].as_default():
        hook = TileWiseHook(base["kernels"], 0.5, 16)
        hook.begin()
    s1 = tf.compat.v1.Session(graph=base["graph"])
    s1.run(base["init"])
    initial = s1.run(base["variables"])
    hook.after_create_session(s1, None)
    feed = {base["images"]: x, base["labels"]: y}
    base_losses = []
    for _ in range(3):
        base_losses.append(s1.run(base["loss"], feed))
        s1.run(base["train"], feed)
        hook.after_run(tf.compat.v1.train.SessionRunContext((base["train"],), s1), None)
    base_kernels = s1.run(base["kernels"])

    # a graph of its own: amanda's variable sync trips over the hook's
    # `kernel.assign(kernel * placeholder)` ops in the same graph
    net = models.keras_vgg_style_graph(batch=8)
    s2 = tf.compat.v1.Session(graph=net["graph"])
    s2.run(net["init"])
    net["assign"](s2, initial)
    tool, losses = TileWisePruner(0.5, tile=16), []
    feed = {net["images"]: x, net["labels"]: y}
    with amanda.apply(tool):
        for _ in range(3):
            losses.append(s2.run(net["loss"], feed))
            s2.run(net["train"], feed)
    kernels = s2.run(net["kernels"])
    masks = list(tool.masks().values())
    assert len(masks) == 5
    assert all(np.array_equal(m, h) for m, h in zip(masks, hook.masks))
    assert losses == base_losses
    assert all(np.array_equal(b, k * m) for b, k, m in zip(base_kernels, kernels, masks))


@pytest.mark.parametrize("build", CNNS + [lambda: models.bert_family("bert")])
def test_tile_wise_pytorch_prunes_rows_per_tile_and_only_masks_weights(build):
    model = build()
    tool = TileWisePruner(0.5, tile=8)
    x = digits_batch(2)[0] if not hasattr(model, "config") else torch.randint(5, 500, (2, 16))
    with amanda.apply(tool):
        out = model(x) if not hasattr(model, "config") else model(input_ids=x).logits
    assert tool.layers
    for layer in tool.layers.values():
        matrix = np.moveaxis(layer.mask, 0, -1).reshape(-1, layer.shape[0])   # (K, N)
        for start in range(0, matrix.shape[1], 8):
            tile = matrix[:, start:start + 8]
            assert (tile == tile[:, :1]).all()                # whole rows per tile
            assert (tile[:, 0] == 0).sum() == round(0.5 * matrix.shape[0])
    masked = copy.deepcopy(model)
    with torch.no_grad():
        for name, module in masked.named_modules():
            for layer in tool.layers.values():
                if layer.module == name:
                    module.weight.mul_(torch.from_numpy(layer.mask))
    expected = masked(x) if not hasattr(model, "config") else masked(input_ids=x).logits
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


# -- feature boosting and suppression -----------------------------------------------------

def test_feature_boosting_matches_the_gated_vgg_source_edit_bit_for_bit():
    x, y = digits_batch()
    dense = models.vgg_style()
    baseline = fbs_baseline.GatedVGG(density=0.5).load_dense(dense)
    tool = FeatureBoosting(density=0.5)
    with amanda.apply(tool):      # creates the predictors
        dense(x)
    base_losses, _ = train(baseline, amanda.disabled, x, y)
    losses, _ = train(dense, lambda: amanda.apply(tool), x, y, extra=tool.parameters())
    assert losses == base_losses
    gated = [m for m in baseline.modules() if isinstance(m, fbs_baseline.GatedConv2d)]
    assert all(torch.equal(a, g.mask) for a, g in zip(tool.masks.values(), gated))
    for g, conv in zip(gated, [m for m in dense.modules() if isinstance(m, torch.nn.Conv2d)]):
        assert torch.equal(g.conv.weight, conv.weight)


def _hf_resnet():
    import transformers
    return transformers.ResNetModel(transformers.ResNetConfig(
        num_channels=1, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1]))


@pytest.mark.parametrize("build, size", [(b, 8) for b in CNNS] + [(_hf_resnet, 32)])
def test_feature_boosting_suppresses_channels_on_every_cnn(build, size):
    torch.manual_seed(0)
    model, tool = build().eval(), FeatureBoosting(density=0.25)
    outputs = {}

    class Outputs(amanda.Tool):     # the gated conv outputs, seen after the gate
        def __init__(self):
            super().__init__()
            self.add_inst_for_op(self.analysis, require_outputs=True)

        def analysis(self, context):
            if context.get_op().__name__ == "conv2d":
                context.insert_after_op(self.keep, outputs=[0], key=context.get_op_id())

        def keep(self, y, key):
            outputs[key] = y

    with amanda.apply(tool, Outputs()):
        model(torch.rand(2, 1, size, size))
    assert len(tool.masks) == len(outputs) > 0
    for (_, key), mask in tool.masks.items():
        assert (mask.sum(1) == round(0.25 * mask.shape[1])).all()
        silent = outputs[key].abs().sum((2, 3)) == 0
        assert silent[mask == 0].all()


# -- activation pruning ---------------------------------------------------------------------

def test_activation_pruning_matches_the_resnet_source_edit_bit_for_bit():
    x, y = digits_batch()
    dense = models.resnet_style()
    baseline = activation_baseline.PrunedResNet(sparsity=0.6)
    baseline.load_state_dict(dense.state_dict())
    tool = ActivationPruner(sparsity=0.6)
    base_losses, _ = train(baseline, amanda.disabled, x, y)
    losses, _ = train(dense, lambda: amanda.apply(tool), x, y)
    assert losses == base_losses
    for a, b in zip(dense.parameters(), baseline.parameters()):
        assert torch.equal(a, b)
    assert len(tool.sparsities) == 5 and min(tool.sparsities.values()) >= 0.6 - 0.005   # round(s*n)/n


@pytest.mark.parametrize("build", CNNS)
def test_activation_pruning_reaches_the_sparsity_and_masks_gradients(build):
    model, tool = build(), ActivationPruner(sparsity=0.7)
    x = digits_batch(4)[0].requires_grad_()
    with amanda.apply(tool):
        model(x).sum().backward()
    assert tool.sparsities and min(tool.sparsities.values()) >= 0.7 - 0.005   # round(s*n)/n
    assert x.grad is not None and torch.isfinite(x.grad).all()


# -- attention pruning (block skim) ----------------------------------------------------------

def test_block_skim_matches_the_edited_bert_attention_bit_for_bit():
    ids = torch.randint(5, 500, (4, 16), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(4, 16, dtype=torch.long)
    mask[:2, 8:] = 0
    labels = torch.tensor([0, 1, 2, 0])
    dense, baseline = models.bert_family("bert"), models.bert_family("bert")
    tool = BlockSkim(block=4, threshold=0.8)

    def run(model, context):
        return train(_TextModel(model, mask), context, ids, labels)[0]

    with block_skim_baseline.block_skim_bert(block=4, threshold=0.8) as masks:
        masks.clear()
        base_losses = run(baseline, amanda.disabled)
        base_masks = masks[-2:]
    losses = run(dense, lambda: amanda.apply(tool))
    assert losses == base_losses
    assert all(torch.equal(a, b) for a, b in zip(tool.masks.values(), base_masks))
    assert (base_masks[0][:2, 0, 0, 8:] == 0).all()    # padding blocks are skipped


class _TextModel(torch.nn.Module):
    def __init__(self, model, mask):
        super().__init__()
        self.model, self.mask = model, mask

    def forward(self, ids):
        return self.model(input_ids=ids, attention_mask=self.mask).logits


@pytest.mark.parametrize("family", sorted(models.BERT_FAMILY))
def test_block_skim_runs_unchanged_on_the_bert_family(family):
    model = models.bert_family(family)
    ids = torch.randint(5, 500, (2, 16), generator=torch.Generator().manual_seed(1))
    attention = torch.ones(2, 16, dtype=torch.long)
    attention[0, 12:] = 0
    dense = model(input_ids=ids, attention_mask=attention).logits
    keep_all, skim = BlockSkim(threshold=0.0), BlockSkim(threshold=0.8)
    with amanda.apply(keep_all):
        same = model(input_ids=ids, attention_mask=attention).logits
    with amanda.apply(skim):
        skimmed = model(input_ids=ids, attention_mask=attention).logits
    assert len(skim.masks) == 2                                   # one per layer
    torch.testing.assert_close(same, dense, rtol=1e-5, atol=1e-6)  # nothing skipped
    assert all((m[0, 0, 0, 12:] == 0).all() for m in skim.masks.values())
    assert 0 < skim.skipped_fraction() < 1 and not torch.equal(skimmed, dense)


# -- vector-wise 2:4 (ASP) ---------------------------------------------------------------------

def test_vector_wise_matches_asp_masks_and_training_bit_for_bit():
    x, y = digits_batch()
    dense = models.vgg_style()
    baseline = copy.deepcopy(dense)
    optimizer = torch.optim.SGD(baseline.parameters(), lr=0.05, momentum=0.9)
    asp = asp_baseline.ASP(baseline, optimizer).prune()
    base_losses = []
    for _ in range(3):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(baseline(x), y)
        loss.backward()
        optimizer.step()
        base_losses.append(loss.item())
    tool = VectorWisePruner()
    losses, _ = train(dense, lambda: amanda.apply(tool), x, y)
    assert losses == base_losses
    assert [layer.module for layer in tool.layers.values()] == list(asp.masks)
    for layer in tool.layers.values():
        weight, mask = asp.masks[layer.module]
        assert torch.equal(torch.from_numpy(layer.mask), mask)
        assert torch.equal(weight, dict(dense.named_modules())[layer.module].weight * mask)
    assert {entry["module"] for entry in tool.skipped.values()} == {"features.0", "classifier"}


@pytest.mark.parametrize("family", sorted(models.BERT_FAMILY))
def test_vector_wise_keeps_two_of_four_on_the_bert_family(family):
    model, tool = models.bert_family(family), VectorWisePruner()
    with amanda.apply(tool):
        model(input_ids=torch.randint(5, 500, (2, 16))).logits.sum().backward()
    assert tool.layers
    for layer in tool.layers.values():
        groups = layer.mask.reshape(-1, 4)
        assert (groups.sum(1) == 2).all()


def test_the_zoo_is_still_reachable_from_the_pruning_projects_package():
    from amanda.tools.pruning_projects import models as old_home
    assert all(getattr(old_home, name) is getattr(models, name) for name in models.__all__)
    assert set(models.__all__) <= set(old_home.__all__)


def test_docs_examples_run():
    from tests.markdown import run_examples
    run_examples("docs/tools/pruning-projects.md")


def test_docs_show_the_current_loc_table():
    import pathlib
    from benchmarks.pruning_projects import loc_table
    page = pathlib.Path(__file__).resolve().parents[2] / "docs/tools/pruning-projects.md"
    assert loc_table() in page.read_text()
