"""Activation checkpointing: a recomputed op runs whole, so every op's
after-routines run as often as its before-routines (non-reentrant
checkpoint's early stop used to cut the last ops of a segment short), the
values stay those of the plain step, and leaving ``apply`` puts the user's
early-stop setting back."""

import collections

import pytest
import torch
import torch.utils.checkpoint as checkpoint

import amanda


class Counter(amanda.Tool):
    def __init__(self):
        super().__init__()
        self.before, self.after = collections.Counter(), collections.Counter()
        self.add_inst_for_op(self.analyse)

    def analyse(self, context):
        op_id = context.get_op_id()
        context.insert_before_op(self.count, inputs=[], counter=self.before, key=op_id)
        context.insert_after_op(self.count, outputs=[], counter=self.after, key=op_id)

    def count(self, *, counter, key):
        counter[key] += 1


class Segmented(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))

    def block(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x

    def forward(self, x):
        return checkpoint.checkpoint(self.block, x, use_reentrant=False).sum()


def _step(model, x):
    model.zero_grad()
    loss = model(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def _check(model, x):
    want = _step(model, x)
    tool = Counter()
    with amanda.apply(tool):
        got = _step(model, x)
    assert torch.equal(got[0], want[0])
    assert all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    assert tool.before == tool.after, {k: (tool.before[k], tool.after[k])
                                       for k in tool.before if tool.before[k] != tool.after[k]}
    assert 2 in tool.before.values()    # the segment's ops ran again in backward


def test_a_checkpointed_segment_runs_every_after_routine():
    torch.manual_seed(0)
    _check(Segmented(), torch.randn(4, 8, requires_grad=True))


@pytest.mark.slow
def test_llama_with_gradient_checkpointing_counts_before_and_after_alike():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    model = transformers.LlamaForCausalLM(config)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    ids = torch.randint(0, 64, (2, 8))

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, ids):
            return self.model(ids, labels=ids).loss

    _check(Wrapped(), ids)


def test_leaving_apply_puts_the_early_stop_setting_back():
    saved = checkpoint._enable_checkpoint_early_stop
    with checkpoint.set_checkpoint_early_stop(True):
        with amanda.apply(Counter()):
            assert checkpoint._enable_checkpoint_early_stop is False
        assert checkpoint._enable_checkpoint_early_stop is True
    assert checkpoint._enable_checkpoint_early_stop is saved
