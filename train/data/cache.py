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

The data stage may write the shards itself from the states its generator
computed (``data.fused_cache``, `StreamingCacheWriter`): same split, same files.
A shard it wrote is ``done``, or ``partial`` when some sequences' states are
missing (listed in its ``origin.json`` with the reason); `build_cache` then
checks every existing shard against the sequences it expects, fills the missing
states with its normal forward, recomputes any shard that does not match, and
writes the index.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from draftsmith.common.hidden_cache import NP_DTYPE, TORCH_DTYPE, field_file, target_states
from draftsmith.target import Target, dtype_name

log = logging.getLogger(__name__)

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


def shard_split(lengths: list[int], shard_tokens: int) -> list[list[int]]:
    """Sequences per shard: consecutive, a shard closed once it holds ``shard_tokens`` tokens.

    Fixed by the sequence order alone, so a resumed run, and the data stage's `StreamingCacheWriter`,
    make the same shards.
    """
    shards, cur, n = [], [], 0
    for i, length in enumerate(lengths):
        cur.append(i)
        n += length
        if n >= shard_tokens:
            shards.append(cur)
            cur, n = [], 0
    if cur:
        shards.append(cur)
    return shards


def _shard_arrays(seqs: list[dict]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lens = [len(s["ids"]) for s in seqs]
    starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    tokens = np.concatenate([np.asarray(s["ids"], np.int32) for s in seqs])
    mask = np.concatenate([np.asarray(s["mask"], np.uint8) for s in seqs])
    return starts, tokens, mask


#: the largest finite float16
FP16_MAX = 65504.0


def _state_rows(st: torch.Tensor, dtype: str, what: str = "a state") -> np.ndarray:
    """fp32 (or already converted) states -> the array stored, rounded as the cache pass rounds. States past
    float16's range are a ValueError for a float16 cache, naming the state, rather than infinities on disk."""
    if dtype == "float16" and st.dtype != torch.float16:
        peak = float(st.abs().max()) if st.numel() else 0.0
        if not peak <= FP16_MAX:
            raise ValueError(f"the target's {what} reaches |x| = {peak:.4g}, past float16's {FP16_MAX:.0f}: a float16 "
                             "cache would store infinities (a model whose residual stream is that large, such as "
                             "Gemma 3's middle layers); set cache.dtype: bfloat16 (or float32)")
    st = st.to(TORCH_DTYPE[dtype]).cpu()
    if dtype == "bfloat16":
        return st.view(torch.int16).numpy().view(np.uint16)
    return st.numpy()


def _matches(sdir: Path, starts: np.ndarray, tokens: np.ndarray, mask: np.ndarray, needs: list[str],
             dtype: str, hidden: int) -> bool:
    """A shard on disk holds exactly these sequences and every needed field in the right dtype and shape."""
    try:
        if not (np.array_equal(np.load(sdir / "starts.npy"), starts)
                and np.array_equal(np.load(sdir / "tokens.npy"), tokens)
                and np.array_equal(np.load(sdir / "mask.npy"), mask)):
            return False
        for nd in needs:
            a = np.load(sdir / field_file(nd), mmap_mode="r")
            if a.shape != (len(tokens), hidden) or a.dtype != NP_DTYPE[dtype]:
                return False
        return True
    except (OSError, ValueError, EOFError):
        return False


def _fill(target: Target, seqs: list[dict], members: list[int], starts: np.ndarray, mms: dict, needs: list[str],
          dtype: str, batch_tokens: int, bar) -> None:
    """The normal forward (right-padded batches of similar lengths) over ``members`` (indices into the
    shard), written at their rows of the shard's memory maps."""
    dev = target.model.device
    lens = [len(seqs[j]["ids"]) for j in members]
    for batch in token_batches(lens, batch_tokens):
        ids, attn = pad_batch([seqs[members[b]]["ids"] for b in batch])
        out = target_states(target, ids.to(dev), attn.to(dev), needs)
        for nd, st in out.items():
            arr = _state_rows(st, dtype, f"'{nd}' state")
            for r, b in enumerate(batch):
                j = members[b]
                mms[nd][starts[j]: starts[j + 1]] = arr[r, : lens[b]]
        bar.update(sum(lens[b] for b in batch))


def build_cache(target: Target, sequences: list[dict], needs: list[str], out_dir: str | Path, *,
                dtype: str = "float16", batch_tokens: int = 8192, shard_tokens: int = 200_000,
                provenance: dict | None = None) -> dict:
    """Run the target once over ``sequences`` ({ids, mask}) and store ``needs``.

    Resumable: finished shards that hold the expected sequences are kept (also those the data stage
    wrote from its generator's states); a ``partial`` one gets only its missing states; any other is
    (re)computed. Returns the index dict (with ``bytes_per_token``); its provenance says how many
    sequences' states came from generation and why the others were computed here (``states``).
    """
    if dtype not in NP_DTYPE:
        raise ValueError(f"cache dtype must be one of {sorted(NP_DTYPE)}, got {dtype!r}")
    if not sequences:
        raise ValueError("cannot cache an empty dataset (0 sequences)")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = target.hidden_size
    # Shards are fixed up front by a deterministic split, so a resumed run rebuilds the same ones.
    shards = shard_split([len(s["ids"]) for s in sequences], shard_tokens)
    t0 = time.time()
    total = sum(len(s["ids"]) for s in sequences)
    bar = tqdm(total=total, desc="cache target states", unit="tok")
    from_generation, computed, reused = 0, Counter(), 0
    for si, members in enumerate(shards):
        sdir = out_dir / f"shard-{si:05d}"
        seqs = [sequences[i] for i in members]
        starts, tokens, mask = _shard_arrays(seqs)
        ntok = int(starts[-1])
        done, partial = (sdir / "done").exists(), (sdir / "partial").exists()
        if (done or partial) and _matches(sdir, starts, tokens, mask, needs, dtype, d):
            origin = json.loads((sdir / "origin.json").read_text()) if (sdir / "origin.json").exists() else {}
            missing = origin.get("missing", []) if partial else []
            if missing:  # written by the data stage without these sequences' states: the normal forward
                mms = {nd: np.load(sdir / field_file(nd), mmap_mode="r+") for nd in needs}
                _fill(target, seqs, missing, starts, mms, needs, dtype, batch_tokens, bar)
                for mm in mms.values():
                    mm.flush()
                del mms
            (sdir / "done").write_text("ok")
            (sdir / "partial").unlink(missing_ok=True)
            from_generation += origin.get("from_generation", 0)
            computed.update(origin.get("reasons", {}))
            reused += int(not origin) * len(members)  # a shard an earlier cache pass finished
            bar.update(ntok - sum(len(seqs[j]["ids"]) for j in missing))
            continue
        if done or partial:
            log.warning("%s does not hold the sequences this cache pass expects (or lacks a field): recomputed", sdir)
            computed["shard_mismatch"] += len(members)
        else:
            computed["cache_pass"] += len(members)
        tmp = out_dir / f".tmp-shard-{si:05d}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        np.save(tmp / "starts.npy", starts)
        np.save(tmp / "tokens.npy", tokens)
        np.save(tmp / "mask.npy", mask)
        mms = {nd: np.lib.format.open_memmap(tmp / field_file(nd), mode="w+", dtype=NP_DTYPE[dtype], shape=(ntok, d))
               for nd in needs}
        _fill(target, seqs, list(range(len(seqs))), starts, mms, needs, dtype, batch_tokens, bar)
        for mm in mms.values():
            mm.flush()
        del mms
        (tmp / "done").write_text("ok")
        shutil.rmtree(sdir, ignore_errors=True)
        os.replace(tmp, sdir)
    bar.close()
    size = sum(f.stat().st_size for i in range(len(shards)) for f in (out_dir / f"shard-{i:05d}").glob("*.npy"))
    states = {"from_generation": from_generation, "forward": dict(computed)}
    if reused:
        states["earlier_cache_pass"] = reused
    index = {
        "target_fingerprint": target.fingerprint, "needs": needs, "dtype": dtype, "hidden_size": d,
        "target_dtype": dtype_name(target.dtype),  # what the target computed the features in (stored in `dtype`)
        "shards": [f"shard-{i:05d}" for i in range(len(shards))], "sequences": len(sequences),
        "tokens": total, "loss_tokens": int(sum(sum(s["mask"]) for s in sequences)),
        "bytes": size, "bytes_per_token": size / max(total, 1),
        "seconds": round(time.time() - t0, 2), "provenance": {**(provenance or {}), "states": states},
    }
    (out_dir / "index.json").write_text(json.dumps(index, indent=2))
    return index


class StreamingCacheWriter:
    """Cache shards written as the data stage's conversations arrive, exactly as `build_cache` would.

    Sequences come in the order of the training file (the order `build_cache` caches them in), each
    with its states ([len(ids), hidden], from the generator) or None and a reason; shards are cut by
    `shard_split`'s rule and written whole (``done``), or ``partial`` with the missing sequences listed
    for `build_cache` to compute. Only the shard being filled is open: its tokens in memory, its states
    appended to a file on disk.

    ``prior``: the sequences the training file already holds (a resumed data stage). Shards they fill
    are left as they are on disk (`build_cache` checks them); those after the last full shard lost their
    states with the kill and start the next shard as missing (reason ``"resumed"``).
    """

    def __init__(self, out_dir: str | Path, hidden_size: int, *, dtype: str = "float16", shard_tokens: int = 200_000,
                 prior: list[dict] = ()):
        if dtype not in NP_DTYPE:
            raise ValueError(f"cache dtype must be one of {sorted(NP_DTYPE)}, got {dtype!r}")
        self.out_dir, self.hidden, self.dtype, self.shard_tokens = (
            Path(out_dir), int(hidden_size), dtype, int(shard_tokens))
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.stats: Counter = Counter()
        for stray in self.out_dir.glob(".fused-shard-*"):  # a shard being filled when the last run stopped
            shutil.rmtree(stray, ignore_errors=True)
        full = shard_split([len(s["ids"]) for s in prior], self.shard_tokens)
        if full and sum(len(prior[i]["ids"]) for i in full[-1]) < self.shard_tokens:
            tail = full.pop()  # the last group did not fill its shard: it goes on from here
        else:
            tail = []
        self.index = len(full)
        kept = self._written(prior, tail)
        self._open()
        for k, i in enumerate(tail):
            if kept is not None and kept[k] is not None:
                self.add(prior[i], kept[k])
                self.stats["resumed_with_states"] += 1
            else:
                self.add(prior[i], None, "resumed")

    def _written(self, prior: list[dict], tail: list[int]) -> list | None:
        """States of the ``tail`` sequences if the last run wrote them as its final (short) shard."""
        sdir = self.out_dir / f"shard-{self.index:05d}"
        partial = (sdir / "partial").exists()
        if not tail or not ((sdir / "done").exists() or partial):
            return None
        starts, tokens, mask = _shard_arrays([prior[i] for i in tail])
        if not _matches(sdir, starts, tokens, mask, ["final"], self.dtype, self.hidden):
            return None
        origin = json.loads((sdir / "origin.json").read_text()) if (sdir / "origin.json").exists() else {}
        missing = set(origin.get("missing", [])) if partial else set()
        arr = np.load(sdir / field_file("final"), mmap_mode="r")
        return [None if k in missing else np.array(arr[starts[k]:starts[k + 1]]) for k in range(len(tail))]

    def _open(self) -> None:
        self.tmp = self.out_dir / f".fused-shard-{self.index:05d}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        self.tmp.mkdir()
        self.raw = (self.tmp / "states.raw").open("wb")
        self.seqs: list[dict] = []
        self.missing: list[int] = []
        self.reasons: Counter = Counter()
        self.ntok = 0

    def add(self, seq: dict, states: torch.Tensor | np.ndarray | None, reason: str | None = None) -> None:
        """Append one sequence ({ids, mask}) with its states (a tensor, or an array already in the stored
        dtype), or None: computed later by the cache pass, for ``reason``."""
        n = len(seq["ids"])
        if states is not None and tuple(states.shape) != (n, self.hidden):
            raise ValueError(f"states of shape {tuple(states.shape)} for a sequence of {n} tokens")
        if states is None:
            self.missing.append(len(self.seqs))
            self.reasons[reason or "no_states"] += 1
            self.stats[f"fallback_{reason or 'no_states'}"] += 1
            self.raw.write(np.zeros((n, self.hidden), NP_DTYPE[self.dtype]).tobytes())
        else:
            arr = states if isinstance(states, np.ndarray) else _state_rows(states, self.dtype, "'final' state")
            self.raw.write(np.ascontiguousarray(arr, dtype=NP_DTYPE[self.dtype]).tobytes())
            self.stats["from_generation"] += 1
        self.seqs.append({"ids": seq["ids"], "mask": seq["mask"]})
        self.ntok += n
        if self.ntok >= self.shard_tokens:
            self._close()
            self._open()

    def _close(self) -> None:
        self.raw.close()
        if not self.seqs:
            shutil.rmtree(self.tmp, ignore_errors=True)
            return
        starts, tokens, mask = _shard_arrays(self.seqs)
        np.save(self.tmp / "starts.npy", starts)
        np.save(self.tmp / "tokens.npy", tokens)
        np.save(self.tmp / "mask.npy", mask)
        raw = self.tmp / "states.raw"
        np.save(self.tmp / field_file("final"),
                np.memmap(raw, dtype=NP_DTYPE[self.dtype], mode="r", shape=(self.ntok, self.hidden)))
        raw.unlink()
        (self.tmp / "origin.json").write_text(json.dumps({
            "writer": "data stage (fused_cache)", "from_generation": len(self.seqs) - len(self.missing),
            "missing": self.missing, "reasons": dict(self.reasons)}))
        (self.tmp / ("partial" if self.missing else "done")).write_text("ok")
        sdir = self.out_dir / f"shard-{self.index:05d}"
        shutil.rmtree(sdir, ignore_errors=True)
        os.replace(self.tmp, sdir)
        self.stats["shards"] += 1
        self.index += 1

    def close(self) -> Counter:
        """Write the last (short) shard; returns the counts (from generation, fallbacks by reason, shards)."""
        self._close()
        return self.stats


def merge_caches(out_dir: str | Path, sources: list[str | Path]) -> dict:
    """One cache over the shards of several finished caches (same target, states and dtype), in order.

    Shards are linked, not copied (relative symlinks ``shard-NNNNN`` -> the source shard), so merging
    the data of several runs costs nothing; the index lists them and sums the counts. Used to train on
    data made by several data runs (e.g. two single-core jobs side by side): `draftsmith merge`.
    """
    out_dir = Path(out_dir)
    if not sources:
        raise ValueError("merge_caches needs at least one source cache")
    idx = []
    for s in sources:
        p = Path(s) / "index.json"
        if not p.exists():
            raise FileNotFoundError(f"{s} is not a finished cache (no index.json)")
        idx.append((Path(s), json.loads(p.read_text())))
    first = idx[0][1]
    for s, ix in idx[1:]:
        for key in ("target_fingerprint", "needs", "dtype", "hidden_size"):
            if ix[key] != first[key]:
                raise ValueError(f"cannot merge {s}: its {key} {ix[key]!r} differs from {idx[0][0]}'s {first[key]!r}")
    if (out_dir / "index.json").exists():
        raise FileExistsError(f"{out_dir} already holds a cache (index.json); merge into a new directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    names = []
    for s, ix in idx:
        for sh in ix["shards"]:
            name = f"shard-{len(names):05d}"
            link = out_dir / name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(os.path.relpath((s / sh).resolve(), out_dir.resolve()), target_is_directory=True)
            names.append(name)
    total = lambda k: sum(int(ix[k]) for _, ix in idx)  # noqa: E731
    index = {key: first[key] for key in ("target_fingerprint", "needs", "dtype", "hidden_size")}
    dtypes = {ix.get("target_dtype") for _, ix in idx}
    if len(dtypes) == 1 and None not in dtypes:  # the target dtype the features were computed in, when one
        index["target_dtype"] = dtypes.pop()
    index.update({"shards": names, "sequences": total("sequences"), "tokens": total("tokens"),
                  "loss_tokens": total("loss_tokens"), "bytes": total("bytes"),
                  "bytes_per_token": total("bytes") / max(total("tokens"), 1), "seconds": 0.0,
                  "provenance": {"merged": [{"cache": str(s), "sequences": ix["sequences"], "tokens": ix["tokens"],
                                             "provenance": ix.get("provenance", {})} for s, ix in idx]}})
    (out_dir / "index.json").write_text(json.dumps(index, indent=2))
    return index
