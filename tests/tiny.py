"""Tiny random targets built in code, for fast unit tests (no hub, no files)."""

from __future__ import annotations

import string
from pathlib import Path

import torch

from draftsmith.target import Target, fingerprint

CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are tiny.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>"]


def make_tokenizer(vocab_size: int = 96):
    """A character-level fast tokenizer with SmolLM's chat template.

    Ids: 0 <pad>, 1 <|im_start|>, 2 <|im_end|> (eos), then characters.
    """
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    chars = list(string.ascii_lowercase + " \n" + string.ascii_uppercase + string.digits + string.punctuation)
    vocab = SPECIALS + chars[: max(0, vocab_size - len(SPECIALS))]
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<|im_end|>",
                                  bos_token="<|im_start|>", unk_token="<pad>")
    tok.add_special_tokens({"additional_special_tokens": SPECIALS[1:]})
    tok.chat_template = CHAT_TEMPLATE
    return tok


def make_tiny_model(vocab_size: int = 96, hidden_size: int = 32, layers: int = 2, heads: int = 4,
                    kv_heads: int = 2, seed: int = 0, init_std: float = 0.02, max_positions: int = 512):
    """A random Llama with tied embeddings, like SmolLM2 but tiny."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, tie_word_embeddings=True,
                      initializer_range=init_std, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).eval().requires_grad_(False)
    return model


def make_tiny_target(vocab_size: int = 96, seed: int = 0, init_std: float = 0.02, save_to: Path | None = None,
                     **kw) -> Target:
    """A tiny random target; ``save_to`` also writes it as a local HF directory."""
    tok = make_tokenizer(vocab_size)
    model = make_tiny_model(vocab_size=vocab_size, seed=seed, init_std=init_std, **kw)
    path = Path(save_to) if save_to else Path(f"<tiny-{seed}>")
    if save_to:
        model.save_pretrained(path)
        tok.save_pretrained(path)
    return Target(model=model, tokenizer=tok, name=f"tiny-{seed}", path=path, fingerprint=fingerprint(model, tok))


def greedy_reference(model, prompt, max_new, eos) -> tuple[list[int], bool]:
    """Greedy one token at a time, no cache, no batch: the ground truth, on the model's device. Returns (tokens,
    ended on eos)."""
    ids = list(prompt)
    out = []
    dev = next(model.parameters()).device
    with torch.no_grad():
        for _ in range(max_new):
            t = int(model(input_ids=torch.tensor([ids], device=dev)).logits[0, -1].argmax())
            out.append(t)
            ids.append(t)
            if t in eos:
                return out, True
    return out, False


def random_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of 2-29 token ids in [3, 90) (a tiny model's vocabulary), seeded."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 90, (int(torch.randint(2, 30, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]

