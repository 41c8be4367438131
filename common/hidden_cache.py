"""The training cache's format, read side: what every drafter kind reads while it trains.

A cache stores, per token of the self-distilled data, the target states a drafter kind needs
(``"final"``: the last hidden state after the final norm; ``"layer:N"``: the output of decoder layer N)
in fp16/bf16/fp32 ``.npy`` shards, memory-mapped on read, next to the token ids and the loss mask.
Full-vocabulary logits are never stored: teacher distributions are recomputed from the cached final
state through the target's frozen output head (`teacher_logits`).

Layout: ``DIR/index.json`` and ``DIR/shard-NNNNN/{tokens,mask,starts,<need>}.npy``. Position t's state is
the state after consuming token t (it predicts token t+1), exactly as the target computes it.
Writing a cache is the cache stage's job (`draftsmith.train.data.cache`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from draftsmith.target import Target, check_fingerprint

NP_DTYPE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def field_file(need: str) -> str:
    return need.replace(":", "_") + ".npy"


def decoder_of(model) -> torch.nn.Module:
    """The base transformer (embeddings, layers, final norm) of a causal LM."""
    return getattr(model, model.base_model_prefix)


@torch.no_grad()
def target_states(target: Target, ids: torch.Tensor, attn: torch.Tensor, needs: list[str]) -> dict[str, torch.Tensor]:
    """The requested states for a right-padded batch, [B, T, d] each."""
    base = decoder_of(target.model)
    layers = sorted({int(n.split(":")[1]) for n in needs if n.startswith("layer:")})
    out = base(input_ids=ids, attention_mask=attn, output_hidden_states=bool(layers), use_cache=False)
    res = {}
    if "final" in needs:
        res["final"] = out.last_hidden_state
    for n in layers:
        # hidden_states[0] is the embedding output, hidden_states[n] the output of layer n.
        res[f"layer:{n}"] = out.hidden_states[n]
    return res


def head_logits(head: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """fp32 logits of ``hidden`` through ``head``, computed where the head lives and returned where the states
    are: a target on a GPU projects states read from the cache on the CPU (the batch moves to the device later)."""
    w = head.weight
    return head(hidden.to(device=w.device, dtype=w.dtype)).float().to(hidden.device)


def teacher_logits(target: Target, final_hidden: torch.Tensor) -> torch.Tensor:
    """Target logits recomputed from cached final hidden states (fp32, on the states' device)."""
    return head_logits(target.lm_head, final_hidden)


@dataclass
class _Shard:
    tokens: np.ndarray
    mask: np.ndarray
    starts: np.ndarray
    fields: dict


class HiddenCache:
    """Read side of a cache: sequences of (tokens, mask, states), memory-mapped."""

    def __init__(self, path: str | Path, target: Target | None = None):
        self.path = Path(path)
        idx = self.path / "index.json"
        if not idx.exists():
            raise FileNotFoundError(f"{self.path} is not a finished cache (no index.json); run `draftsmith cache`")
        self.index = json.loads(idx.read_text())
        if target is not None and self.index["target_fingerprint"] != target.fingerprint:
            check_fingerprint(self.index["target_fingerprint"], target, what=f"cache {self.path}")
        self.dtype = self.index["dtype"]
        self.shards = []
        self.seqs: list[tuple[int, int, int]] = []  # (shard, start, length)
        for si, name in enumerate(self.index["shards"]):
            sd = self.path / name
            fields = {nd: np.load(sd / field_file(nd), mmap_mode="r") for nd in self.index["needs"]}
            sh = _Shard(np.load(sd / "tokens.npy"), np.load(sd / "mask.npy"), np.load(sd / "starts.npy"), fields)
            self.shards.append(sh)
            for a, b in zip(sh.starts[:-1], sh.starts[1:]):
                self.seqs.append((si, int(a), int(b - a)))

    def __len__(self) -> int:
        return len(self.seqs)

    def tokens(self, i: int) -> np.ndarray:
        si, a, n = self.seqs[i]
        return self.shards[si].tokens[a: a + n]

    def mask(self, i: int) -> np.ndarray:
        si, a, n = self.seqs[i]
        return self.shards[si].mask[a: a + n]

    def states(self, i: int, need: str, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """States of sequence i at positions [lo, hi), as fp32."""
        si, a, n = self.seqs[i]
        hi = n if hi is None else min(hi, n)
        arr = np.asarray(self.shards[si].fields[need][a + lo: a + hi])
        t = torch.from_numpy(arr.copy())
        if self.dtype == "bfloat16":
            t = t.view(torch.bfloat16)
        return t.float()
