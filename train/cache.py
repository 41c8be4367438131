"""One pass of the target over the data, storing only what drafters need.

A drafter kind declares its needs (``"final"``: last hidden state after the
final norm; ``"layer:N"``: output of decoder layer N). The cache stores those
per token in fp16/bf16/fp32 ``.npy`` shards, memory-mapped on read, next to
the token ids and loss mask. Full-vocabulary logits are never stored: teacher
distributions are recomputed from the cached final hidden state through the
frozen output head (``teacher_logits``).

Layout: ``DIR/index.json`` and ``DIR/shard-NNNNN/{tokens,mask,starts,<need>}.npy``.
Position t's hidden state is the state after consuming token t (it predicts
token t+1), exactly as the target computes it.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from draftsmith.target import Target

_NP_DTYPE = {"float16": np.float16, "bfloat16": np.uint16, "float32": np.float32}
_TORCH_DTYPE = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _field_file(need: str) -> str:
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


def teacher_logits(target: Target, final_hidden: torch.Tensor) -> torch.Tensor:
    """Target logits recomputed from cached final hidden states (fp32)."""
    head = target.lm_head
    return head(final_hidden.to(head.weight.dtype)).float()


def token_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    out, cur, width = [], [], 0
    for i in order:
        w = max(width, lengths[i])
        if cur and w * (len(cur) + 1) > batch_tokens:
            out.append(cur)
            cur, w = [], lengths[i]
        cur.append(i)
        width = w
    if cur:
        out.append(cur)
    return out


def pad_batch(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids and attention mask for a list of token-id rows."""
    width = max(len(r) for r in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        attn[i, : len(r)] = 1
    return ids, attn


def build_cache(target: Target, sequences: list[dict], needs: list[str], out_dir: str | Path, *,
                dtype: str = "float16", batch_tokens: int = 8192, shard_tokens: int = 200_000,
                provenance: dict | None = None) -> dict:
    """Run the target once over ``sequences`` ({ids, mask}) and store ``needs``.

    Resumable: finished shards are kept and skipped. Returns the index dict
    (with ``bytes_per_token``).
    """
    if dtype not in _NP_DTYPE:
        raise ValueError(f"cache dtype must be one of {sorted(_NP_DTYPE)}, got {dtype!r}")
    if not sequences:
        raise ValueError("cannot cache an empty dataset (0 sequences)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = target.hidden_size
    # Shards are fixed up front by a deterministic split, so a resumed run rebuilds the same ones.
    shards, cur, n = [], [], 0
    for i, s in enumerate(sequences):
        cur.append(i)
        n += len(s["ids"])
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    t0 = time.time()
    total = sum(len(s["ids"]) for s in sequences)
    bar = tqdm(total=total, desc="cache target states", unit="tok")
    dev = target.model.device
    for si, members in enumerate(shards):
        sdir = out_dir / f"shard-{si:05d}"
        if (sdir / "done").exists():
            bar.update(sum(len(sequences[i]["ids"]) for i in members))
            continue
        tmp = out_dir / f".tmp-shard-{si:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        lens = [len(sequences[i]["ids"]) for i in members]
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        ntok = int(starts[-1])
        np.save(tmp / "starts.npy", starts)
        np.save(tmp / "tokens.npy", np.concatenate([np.asarray(sequences[i]["ids"], np.int32) for i in members]))
        np.save(tmp / "mask.npy", np.concatenate([np.asarray(sequences[i]["mask"], np.uint8) for i in members]))
        mms = {nd: np.lib.format.open_memmap(tmp / _field_file(nd), mode="w+", dtype=_NP_DTYPE[dtype], shape=(ntok, d))
               for nd in needs}
        for batch in token_batches(lens, batch_tokens):
            ids, attn = pad_batch([sequences[members[j]]["ids"] for j in batch])
            states = target_states(target, ids.to(dev), attn.to(dev), needs)
            for nd, st in states.items():
                st = st.to(_TORCH_DTYPE[dtype]).cpu()
                for r, j in enumerate(batch):
                    row = st[r, : lens[j]]
                    if dtype == "bfloat16":
                        row = row.view(torch.int16)
                    mms[nd][starts[j]: starts[j + 1]] = row.numpy()
            bar.update(sum(lens[j] for j in batch))
        for mm in mms.values():
            mm.flush()
        del mms
        (tmp / "done").write_text("ok")
        shutil.rmtree(sdir, ignore_errors=True)
        os.replace(tmp, sdir)
    bar.close()
    size = sum(f.stat().st_size for f in out_dir.rglob("*.npy"))
    index = {
        "target_fingerprint": target.fingerprint, "needs": needs, "dtype": dtype, "hidden_size": d,
        "shards": [f"shard-{i:05d}" for i in range(len(shards))], "sequences": len(sequences),
        "tokens": total, "loss_tokens": int(sum(sum(s["mask"]) for s in sequences)),
        "bytes": size, "bytes_per_token": size / max(total, 1),
        "seconds": round(time.time() - t0, 2), "provenance": provenance or {},
    }
    (out_dir / "index.json").write_text(json.dumps(index, indent=2))
    return index


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
            from draftsmith.target import check_fingerprint
            check_fingerprint(self.index["target_fingerprint"], target, what=f"cache {self.path}")
        self.dtype = self.index["dtype"]
        self.shards = []
        self.seqs: list[tuple[int, int, int]] = []  # (shard, start, length)
        for si, name in enumerate(self.index["shards"]):
            sd = self.path / name
            fields = {nd: np.load(sd / _field_file(nd), mmap_mode="r") for nd in self.index["needs"]}
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
