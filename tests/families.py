"""Tiny random targets of each model family draftsmith is tested on, built in code (no hub, no files).

Each has what sets its family apart, at a size where it shows: Qwen2's q/k/v biases, Qwen3's per-head q/k norms
and head size of its own, Mistral's config class (with and without its sliding window on every layer), Gemma 3's
sliding-window layers (a window of 8 tokens, so that a prompt and a few new tokens pass it), its per-layer-type
RoPE, scaled embeddings, four norms a layer and its query scaling, Phi-3's fused q/k/v and gate/up projections.
Biases and norms are moved away from their initial zeros and ones, so that a path which drops one shows.
"""

from __future__ import annotations

import torch

from draftsmith.target import Target, fingerprint
from tests.tiny import make_tokenizer

VOCAB = 48
FAMILIES = ("llama", "mistral", "mistral-window", "qwen2", "qwen3", "gemma3", "phi3")
WINDOW = 8  # Gemma 3's sliding window here: a prompt of 13 tokens is already past it


def family_config(family: str, window: int = WINDOW):
    import transformers
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.3, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    return {"llama": lambda: transformers.LlamaConfig(tie_word_embeddings=True, **common),
            "mistral": lambda: transformers.MistralConfig(sliding_window=None, **common),
            "mistral-window": lambda: transformers.MistralConfig(sliding_window=window, **common),  # every layer
            "qwen2": lambda: transformers.Qwen2Config(**common),
            "qwen3": lambda: transformers.Qwen3Config(head_dim=16, **common),
            "phi3": lambda: transformers.Phi3Config(**common),  # fused q/k/v and gate/up projections
            "gemma3": lambda: transformers.Gemma3TextConfig(
                head_dim=8, sliding_window=window, query_pre_attn_scalar=8,
                layer_types=["sliding_attention"] * 3 + ["full_attention"], **common)}[family]()


def off_initial(model):
    """``model`` with its biases and norms moved off their initial zeros and ones (seeded by the caller), so that
    a path which drops or copies one wrongly shows."""
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("bias") or "norm" in n:
                p.add_(torch.randn_like(p) * 0.3)
    return model


def family_target(family: str, seed: int = 0, window: int = WINDOW) -> Target:
    import transformers
    torch.manual_seed(seed)
    model = off_initial(transformers.AutoModelForCausalLM.from_config(family_config(family, window)).eval()
                        .requires_grad_(False))
    tok = make_tokenizer(VOCAB)
    return Target(model=model, tokenizer=tok, name=f"tiny-{family}", path=None, fingerprint=fingerprint(model, tok))
