"""Tiny real models for the real-model sweep (tests/pytorch/test_model_sweep.py).

Every model is built from a small ``transformers`` configuration (2 layers,
hidden size 32-64, vocabulary of 100, inputs of a few tokens / a 32x32 image /
a few hundred audio samples) with random weights under a fixed seed; nothing is
downloaded. A :class:`Case` says how to build the model and its inputs and
what kind of step to run:

* ``"step"``: a training step: forward, a scalar loss from the first
  floating-point output (weighted by a fixed random tensor so that gradients
  are not degenerate), backward;
* ``"generate"``: ``model.generate`` of a few tokens (greedy), no backward;
* ``"double"``: double backward: ``torch.autograd.grad(create_graph=True)``,
  then backward on the sum of the squared gradients.

Variants: ``checkpointing`` (``model.train()`` +
``gradient_checkpointing_enable()``; dropout is zero in those configurations
so the step stays deterministic), ``train`` (Reformer: its reversible layers
only backpropagate in ``train()`` mode; dropout is zero) and ``autocast`` (the forward runs under
``torch.autocast("cpu", dtype=torch.bfloat16)``). Every other model runs in
``eval()`` mode (no dropout), gradients still flow.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable

import torch

from amanda.models import first_tensor

VOCAB = 100
SEQ = 8


@dataclasses.dataclass(frozen=True)
class Case:
    name: str                       # the test id
    family: str                     # the model family it covers
    build: Callable[[], torch.nn.Module]
    inputs: Callable[[], dict]      # keyword inputs of model(...) / model.generate(...)
    kind: str = "step"              # "step", "generate" or "double"
    checkpointing: bool = False
    autocast: bool = False
    train: bool = False             # train() mode (configured without dropout)

    def make(self):
        """The model (seeded, eval mode unless checkpointing) and its inputs."""
        torch.manual_seed(0)
        model = self.build()
        if self.checkpointing:
            model.train()
            model.gradient_checkpointing_enable()
        elif self.train:
            model.train()
        else:
            model.eval()
        torch.manual_seed(1)
        return model, self.inputs()


# -- steps ----------------------------------------------------------------------------

def _forward_scope(case):
    if case.autocast:
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def run_step(case, model, inputs, seed=2):
    """Run the case's step once; return ``(outputs, grads)``: a list of tensors
    to compare (the output, the loss, generated tokens/scores) and a copy of
    every parameter's gradient (None where no gradient reached it)."""
    torch.manual_seed(seed)   # models with random ops in eval mode (Reformer's LSH)
    for p in model.parameters():
        p.grad = None
    if case.kind == "generate":
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False,
                             output_scores=True, return_dict_in_generate=True)
        return [out.sequences.clone(), *[s.clone() for s in out.scores]], []
    if case.kind == "double":
        y = model(**inputs)
        loss = (y * _weight(y)).sum()
        params = [p for p in model.parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, params, create_graph=True)
        penalty = sum((g * g).sum() for g in grads)
        penalty.backward()
        return ([y.detach().clone(), penalty.detach().clone(),
                 *[g.detach().clone() for g in grads]], _grads(model))
    with _forward_scope(case):
        y = first_tensor(model(**inputs))
    loss = (y.float() * _weight(y)).sum()
    loss.backward()
    return [y.detach().clone(), loss.detach().clone()], _grads(model)


def _weight(y):
    generator = torch.Generator().manual_seed(3)
    return torch.rand(y.shape, generator=generator)


def _grads(model):
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


# -- builders -------------------------------------------------------------------------

def _tokens(n=SEQ, vocab=VOCAB):
    generator = torch.Generator().manual_seed(4)
    return torch.randint(3, vocab, (1, n), generator=generator)


def _image(size=32, channels=3):
    generator = torch.Generator().manual_seed(5)
    return torch.rand(1, channels, size, size, generator=generator)


def _ids(**extra):
    return lambda: {"input_ids": _tokens(), **extra}


def _pixels(size=32):
    return lambda: {"pixel_values": _image(size)}


def _hf(config_name, model_name, **config):
    def build():
        import transformers
        cfg = getattr(transformers, config_name)(**config)
        return getattr(transformers, model_name)(cfg)
    return build


_DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                pad_token_id=0, bos_token_id=1, eos_token_id=2)
_BERT = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
             intermediate_size=37, max_position_embeddings=64)
_GPT2 = dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=2, n_positions=64,
             resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
_LLAMA = dict(_DECODER, attention_dropout=0.0)
_VIT = dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
            num_attention_heads=2, intermediate_size=37)


def _detr():
    import transformers
    backbone = transformers.ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                         layer_type="basic", out_features=["stage2"])
    cfg = transformers.DetrConfig(use_timm_backbone=False, use_pretrained_backbone=False,
                                  backbone_config=backbone, d_model=32, encoder_layers=2,
                                  decoder_layers=2, encoder_attention_heads=2,
                                  decoder_attention_heads=2, encoder_ffn_dim=64,
                                  decoder_ffn_dim=64, num_queries=5)
    return transformers.DetrModel(cfg)


def _clip():
    import transformers
    cfg = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                         num_attention_heads=2, intermediate_size=37,
                         max_position_embeddings=16),
        vision_config=dict(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=2, intermediate_size=37),
        projection_dim=16)
    return transformers.CLIPModel(cfg)


class TinyCNN(torch.nn.Module):
    """Double backward needs twice-differentiable ops: conv, tanh, linear."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(torch.tanh(self.conv(x)).flatten(1))


def _whisper_inputs():
    generator = torch.Generator().manual_seed(6)
    return {"input_features": torch.rand(1, 8, 32, generator=generator),
            "decoder_input_ids": _tokens(4)}


def _audio(n=400):
    generator = torch.Generator().manual_seed(7)
    return torch.rand(1, n, generator=generator) * 2 - 1


CASES = [
    Case("bert", "BERT", _hf("BertConfig", "BertModel", **_BERT), _ids()),
    Case("gpt2", "GPT-2", _hf("GPT2Config", "GPT2LMHeadModel", **_GPT2), _ids(use_cache=False)),
    Case("t5", "T5", _hf("T5Config", "T5Model", vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64,
                         num_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0),
         lambda: {"input_ids": _tokens(), "decoder_input_ids": _tokens(4), "use_cache": False}),
    Case("bart", "BART", _hf("BartConfig", "BartModel", vocab_size=VOCAB, d_model=32,
                             encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                             decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                             max_position_embeddings=64),
         _ids(use_cache=False)),
    Case("llama", "LLaMA", _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
         _ids(use_cache=False)),
    Case("mistral", "Mistral", _hf("MistralConfig", "MistralModel", **_DECODER),
         _ids(use_cache=False)),
    Case("mixtral", "Mixtral", _hf("MixtralConfig", "MixtralModel", num_local_experts=4,
                                   num_experts_per_tok=2, **_DECODER), _ids(use_cache=False)),
    Case("qwen2", "Qwen2", _hf("Qwen2Config", "Qwen2Model", **_DECODER), _ids(use_cache=False)),
    Case("gemma2", "Gemma2", _hf("Gemma2Config", "Gemma2Model", head_dim=8, **_DECODER),
         _ids(use_cache=False)),
    Case("bloom", "Bloom", _hf("BloomConfig", "BloomModel", vocab_size=VOCAB, hidden_size=32,
                               n_layer=2, n_head=2), _ids(use_cache=False)),
    Case("albert", "ALBERT", _hf("AlbertConfig", "AlbertModel", embedding_size=16, **_BERT),
         _ids()),
    Case("deberta-v2", "DeBERTa-v2", _hf("DebertaV2Config", "DebertaV2Model", **_BERT), _ids()),
    Case("xlnet", "XLNet", _hf("XLNetConfig", "XLNetModel", vocab_size=VOCAB, d_model=32,
                               n_layer=2, n_head=2, d_inner=64), _ids(use_mems=False)),
    Case("longformer", "Longformer", _hf("LongformerConfig", "LongformerModel",
                                         attention_window=[4, 4], **_BERT), _ids()),
    Case("fnet", "FNet", _hf("FNetConfig", "FNetModel", vocab_size=VOCAB, hidden_size=32,
                             num_hidden_layers=2, intermediate_size=37,
                             max_position_embeddings=64), _ids()),
    Case("reformer", "Reformer", _hf(
        "ReformerConfig", "ReformerModel", vocab_size=VOCAB, hidden_size=32,
        attention_head_size=8, num_attention_heads=2, attn_layers=["local", "lsh"],
        axial_pos_shape=[4, 4], axial_pos_embds_dim=[16, 16], feed_forward_size=64,
        local_attn_chunk_length=4, lsh_attn_chunk_length=4, num_buckets=2, num_hashes=1,
        max_position_embeddings=16, is_decoder=False, hash_seed=0, hidden_dropout_prob=0.0,
        local_attention_probs_dropout_prob=0.0, lsh_attention_probs_dropout_prob=0.0),
         lambda: {"input_ids": _tokens(16)}, train=True),  # backward needs train()
    Case("vit", "ViT", _hf("ViTConfig", "ViTModel", **_VIT), _pixels()),
    Case("convnext", "ConvNeXt", _hf("ConvNextConfig", "ConvNextModel", hidden_sizes=[8, 16],
                                     depths=[1, 1], num_stages=2), _pixels()),
    Case("resnet", "ResNet", _hf("ResNetConfig", "ResNetModel", embedding_size=8,
                                 hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
         _pixels()),
    Case("swin", "Swin", _hf("SwinConfig", "SwinModel", image_size=32, patch_size=4, embed_dim=16,
                             depths=[1, 1], num_heads=[1, 2], window_size=4), _pixels()),
    Case("mobilevit", "MobileViT", _hf(
        "MobileViTConfig", "MobileViTModel", image_size=32, patch_size=2,
        hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
        num_attention_heads=2), _pixels()),
    Case("segformer", "Segformer", _hf(
        "SegformerConfig", "SegformerModel", num_encoder_blocks=2, depths=[1, 1],
        sr_ratios=[2, 1], hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
        num_attention_heads=[1, 2], mlp_ratios=[2, 2]), _pixels()),
    Case("detr", "DETR", _detr, _pixels()),
    Case("wav2vec2", "Wav2Vec2", _hf(
        "Wav2Vec2Config", "Wav2Vec2Model", hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, intermediate_size=37, conv_dim=(16, 16), conv_stride=(5, 2),
        conv_kernel=(10, 3), num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
        vocab_size=VOCAB), lambda: {"input_values": _audio()}),
    Case("whisper", "Whisper", _hf(
        "WhisperConfig", "WhisperModel", vocab_size=VOCAB, num_mel_bins=8, d_model=32,
        encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1,
        eos_token_id=2, decoder_start_token_id=1), _whisper_inputs),
    Case("clip", "CLIP", _clip, lambda: {"input_ids": _tokens(), "pixel_values": _image()}),
    Case("encodec", "Encodec", _hf(
        "EncodecConfig", "EncodecModel", audio_channels=1, hidden_size=16, num_filters=4,
        num_residual_layers=1, upsampling_ratios=[4, 2], codebook_size=16,
        codebook_dim=16, target_bandwidths=[1.5], sampling_rate=2000, num_lstm_layers=1),
         lambda: {"input_values": _audio(64).unsqueeze(0)}),
    Case("mamba", "Mamba", _hf("MambaConfig", "MambaModel", vocab_size=VOCAB, hidden_size=32,
                               state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4),
         _ids(use_cache=False)),
    # -- variants
    Case("gpt2-checkpointing", "GPT-2", _hf("GPT2Config", "GPT2LMHeadModel", **_GPT2),
         _ids(use_cache=False), checkpointing=True),
    Case("llama-checkpointing", "LLaMA", _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
         _ids(use_cache=False), checkpointing=True),
    Case("gpt2-generate", "GPT-2", _hf("GPT2Config", "GPT2LMHeadModel", **_GPT2),
         lambda: {"input_ids": _tokens(4)}, kind="generate"),
    Case("llama-generate", "LLaMA", _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
         lambda: {"input_ids": _tokens(4)}, kind="generate"),
    Case("bert-autocast-bf16", "BERT", _hf("BertConfig", "BertModel", **_BERT), _ids(),
         autocast=True),
    Case("llama-autocast-bf16", "LLaMA", _hf("LlamaConfig", "LlamaForCausalLM", **_LLAMA),
         _ids(use_cache=False), autocast=True),
    Case("cnn-double-backward", "CNN (conv/tanh/linear)", TinyCNN,
         lambda: {"x": _image(8)}, kind="double"),
]

#: The model families the sweep covers (a case whose model cannot be built or
#: run without amanda is skipped with the reason, never dropped).
FAMILIES = sorted({case.family for case in CASES})
