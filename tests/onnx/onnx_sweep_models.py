"""Tiny ``transformers`` models exported to ONNX for the ONNX sweep
(``tests/onnx/test_identity_sweep_onnx.py``).

Every model is built from a small configuration (2 layers, hidden size 32-64,
a vocabulary of 100, a few tokens / a 32x32 image / a few hundred audio
samples / an 8x32 log-mel spectrogram) with random weights under a fixed seed;
nothing is downloaded. Configurations are those of the eager sweep
(:mod:`tests.sweep_models`) where they fit; a few families it does not have
(RoBERTa, DistilBERT, ELECTRA, the CLIP text tower, the Whisper encoder) are
added here. Models run with eager attention (``attn_implementation="eager"``):
the TorchScript exporter traces it into plain ONNX ops.

:func:`export` traces a model with ``torch.onnx.export(dynamo=False)`` at
opset 17 into the bytes of a ``ModelProto`` (IR version capped at 10, which
onnxruntime reads), with the inputs as graph inputs (``input_0``, ...) and the
tensors of the model's output tuple as graph outputs (``output_0``, ...).
"""

from __future__ import annotations

import dataclasses
import io
import warnings
from collections.abc import Callable

import numpy as np

from tests.sweep_models import _BERT, _DECODER, _GPT2, _LLAMA, _VIT, VOCAB

OPSET = 17
IR_VERSION = 10


@dataclasses.dataclass(frozen=True)
class OnnxCase:
    name: str                       # the test id
    family: str                     # the model family it covers
    config: str                     # transformers configuration class
    model: str                      # transformers model class
    kwargs: dict                    # configuration
    inputs: Callable[[], dict]      # name -> NumPy array (the model's keyword arguments)
    extra: dict = dataclasses.field(default_factory=dict)   # non-tensor keyword arguments
    part: str | None = None         # export this submodule (e.g. "encoder")

    def build(self):
        import torch
        import transformers
        torch.manual_seed(0)
        config = getattr(transformers, self.config)(**self.kwargs)
        try:
            config._attn_implementation = "eager"
        except Exception:  # noqa: BLE001  (a configuration without the attribute)
            pass
        model = getattr(transformers, self.model)(config)
        if self.part:
            model = getattr(model, self.part)
        model.eval()
        return model


def _flat(value):
    """The tensors of a (nested) model output, in order."""
    import torch
    if isinstance(value, torch.Tensor):
        return [value]
    if hasattr(value, "to_tuple"):
        value = value.to_tuple()
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _flat(v)]
    return []


def export(case):
    """``(model bytes, feeds, torch outputs)`` of a case, exported at opset 17."""
    import onnx
    import torch

    model = case.build()
    feeds = case.inputs()
    names = list(feeds)

    class Wrapper(torch.nn.Module):
        """Positional tensors in (the exporter traces positional arguments),
        keyword arguments to the model, a flat tuple of tensors out."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, *tensors):
            out = self.model(**dict(zip(names, tensors)), **case.extra)
            return tuple(_flat(out))

    wrapper = Wrapper().eval()
    args = tuple(torch.from_numpy(feeds[n]) for n in names)
    with torch.no_grad():
        expected = [t.numpy() for t in wrapper(*args)]
    input_names = [f"input_{i}" for i in range(len(names))]
    output_names = [f"output_{i}" for i in range(len(expected))]
    buffer = io.BytesIO()
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")       # TracerWarnings about Python control flow
        torch.onnx.export(wrapper, args, buffer, opset_version=OPSET, dynamo=False,
                          input_names=input_names, output_names=output_names)
    proto = onnx.load_from_string(buffer.getvalue())
    proto.ir_version = min(proto.ir_version, IR_VERSION)
    return proto.SerializeToString(), dict(zip(input_names, [a.numpy() for a in args])), expected


# -- inputs ------------------------------------------------------------------------------

SEQ = 8


def _tokens(n=SEQ, seed=4):
    return np.random.default_rng(seed).integers(3, VOCAB, (1, n)).astype(np.int64)


def _ids():
    return lambda: {"input_ids": _tokens()}


def _ids_mask():
    return lambda: {"input_ids": _tokens(), "attention_mask": np.ones((1, SEQ), np.int64)}


def _pixels(size=32):
    return lambda: {"pixel_values":
                    np.random.default_rng(5).random((1, 3, size, size)).astype(np.float32)}


def _audio(n=400):
    return lambda: {"input_values":
                    (np.random.default_rng(7).random((1, n)) * 2 - 1).astype(np.float32)}


def _mel():
    # the Whisper encoder expects 2 * max_source_positions frames
    return lambda: {"input_features":
                    np.random.default_rng(6).random((1, 8, 32)).astype(np.float32)}


_NO_CACHE = {"use_cache": False}

CASES = [
    OnnxCase("bert", "BERT", "BertConfig", "BertModel", _BERT, _ids_mask()),
    OnnxCase("gpt2", "GPT-2", "GPT2Config", "GPT2LMHeadModel", _GPT2, _ids_mask(), _NO_CACHE),
    OnnxCase("t5", "T5", "T5Config", "T5Model",
             dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                  dropout_rate=0.0, decoder_start_token_id=0),
             lambda: {"input_ids": _tokens(), "decoder_input_ids": _tokens(4, seed=8)},
             _NO_CACHE),
    OnnxCase("bart", "BART", "BartConfig", "BartModel",
             dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                  encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=64,
                  decoder_ffn_dim=64, max_position_embeddings=64),
             _ids(), _NO_CACHE),
    OnnxCase("roberta", "RoBERTa", "RobertaConfig", "RobertaModel",
             dict(_BERT, pad_token_id=1), _ids_mask()),
    OnnxCase("distilbert", "DistilBERT", "DistilBertConfig", "DistilBertModel",
             dict(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=2, hidden_dim=37,
                  max_position_embeddings=64), _ids_mask()),
    OnnxCase("albert", "ALBERT", "AlbertConfig", "AlbertModel",
             dict(_BERT, embedding_size=16), _ids_mask()),
    OnnxCase("electra", "ELECTRA", "ElectraConfig", "ElectraModel",
             dict(_BERT, embedding_size=16), _ids_mask()),
    OnnxCase("deberta-v2", "DeBERTa-v2", "DebertaV2Config", "DebertaV2Model", _BERT,
             _ids_mask()),
    OnnxCase("llama", "LLaMA", "LlamaConfig", "LlamaForCausalLM", _LLAMA, _ids_mask(), _NO_CACHE),
    OnnxCase("mistral", "Mistral", "MistralConfig", "MistralModel", _DECODER, _ids_mask(),
             _NO_CACHE),
    OnnxCase("qwen2", "Qwen2", "Qwen2Config", "Qwen2Model", _DECODER, _ids_mask(), _NO_CACHE),
    OnnxCase("vit", "ViT", "ViTConfig", "ViTModel", _VIT, _pixels()),
    OnnxCase("resnet", "ResNet", "ResNetConfig", "ResNetModel",
             dict(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic"),
             _pixels()),
    OnnxCase("convnext", "ConvNeXt", "ConvNextConfig", "ConvNextModel",
             dict(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2), _pixels()),
    OnnxCase("swin", "Swin", "SwinConfig", "SwinModel",
             dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[1, 2],
                  window_size=4), _pixels()),
    OnnxCase("clip-text", "CLIP (text)", "CLIPTextConfig", "CLIPTextModel",
             dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=37, max_position_embeddings=16), _ids()),
    OnnxCase("whisper-encoder", "Whisper (encoder)", "WhisperConfig", "WhisperModel",
             dict(vocab_size=VOCAB, num_mel_bins=8, d_model=32, encoder_layers=2,
                  decoder_layers=2, encoder_attention_heads=2, decoder_attention_heads=2,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=16,
                  max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  decoder_start_token_id=1), _mel(), part="encoder"),
    OnnxCase("wav2vec2", "Wav2Vec2", "Wav2Vec2Config", "Wav2Vec2Model",
             dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                  intermediate_size=37, conv_dim=(16, 16), conv_stride=(5, 2),
                  conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                  num_conv_pos_embedding_groups=2, vocab_size=VOCAB), _audio()),
]

#: The model families the ONNX sweep covers (a case whose export or plain
#: onnxruntime run fails is skipped with the reason, never dropped).
FAMILIES = sorted({case.family for case in CASES})
