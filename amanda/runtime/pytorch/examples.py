"""Small PyTorch models the documentation's figures are rendered with.

(``python -m amanda.tools.profiler docs/figures/trace.png`` profiles
:func:`random_bert`.) Imports torch and transformers when called.
"""

from __future__ import annotations

__all__ = ["random_bert"]


def random_bert(hidden_size, layers, heads, intermediate_size, vocab_size, batch, tokens, seed=0):
    """A randomly initialised ``transformers.BertModel`` in eval mode and a
    batch of random token ids, both seeded.

    Returns:
        ``(model, ids)``: ``ids`` has shape ``(batch, tokens)``.
    """
    import torch
    import transformers
    torch.manual_seed(seed)
    config = transformers.BertConfig(hidden_size=hidden_size, num_hidden_layers=layers,
                                     num_attention_heads=heads,
                                     intermediate_size=intermediate_size, vocab_size=vocab_size)
    model = transformers.BertModel(config).eval()
    return model, torch.randint(0, vocab_size, (batch, tokens))
