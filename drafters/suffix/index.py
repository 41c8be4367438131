"""Model-free draft indexes: token streams with suffix-match lookup, scored by counts.

A `TokenIndex` holds token streams (one per indexed response, or one growing
stream for a request's own context) in one flat array, streams separated by
-1 so that no match or continuation crosses a stream. Every position c (the
start of a continuation) is chained to the previous position whose preceding
token is the same (``key 1``) and whose three preceding tokens are the same
(``key 3``): a dict holds each key's newest position and an array the link
to the next older one, so the occurrences of a key are read newest first
without a list per key (memory: the tokens and two links per position, plus
one dict entry per distinct key).

Lookup (`TokenIndex.speculate`) follows SuffixDecoding's rule (docs/methods.md,
"SuffixDecoding"): the context's last ``max_depth`` tokens are matched against
every indexed occurrence (the newest ``max_candidates`` occurrences of its
last three tokens, or of its last token when those never occurred), giving
each occurrence a match length; for each match length m the occurrences
matching at least m tokens form the suffix-tree node of that suffix, whose
count is their number. From that node the draft follows the continuations:
a child's probability is count(child) / count(parent), a token's
probability is the product along its path, drafting stops under
``min_token_prob``, and at most ``min(max_spec_tokens, floor(m *
max_spec_factor + max_spec_offset), max_depth - m)`` tokens are drafted,
as a path (the most frequent child each time) or as a tree (best-first by
probability). The score is the sum of the drafted tokens' probabilities
(the expected number accepted under the counts); the best-scoring match
length wins, ties going to the longer match.

`SuffixIndex` is the global index over earlier responses: FIFO-bounded in
the number of responses (and their length), savable, rebuildable from the
server's request logs, with a memory report.
"""

from __future__ import annotations

import heapq
import json
import math
import os
import sys
import zlib
from array import array
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

from pydantic import Field

from draftsmith.schema import StrictModel
from draftsmith.traffic import LOG_GLOB, RecordError, parse_record

SEP = -1  # between streams: equal to no token
NONE = -1  # end of a key chain


class SuffixConfig(StrictModel):
    """SuffixDecoding's settings (names as in the reference implementation where one exists)."""

    max_depth: int = Field(24, ge=2, le=1024, description="longest suffix matched; match + draft <= max_depth")
    max_spec_tokens: int = Field(24, ge=1, le=256, description="most tokens drafted per step (the tree's nodes)")
    max_spec_factor: float = Field(1.0, gt=0, description="draft at most floor(match * factor + offset) tokens")
    max_spec_offset: float = Field(0.0, description="see max_spec_factor")
    min_token_prob: float = Field(0.1, ge=0, le=1, description="stop drafting under this path probability")
    tree: bool = Field(True, description="draft a tree (best-first by probability) instead of one path")
    min_score: float = Field(0.0, ge=0, description="SuffixDrafter drafts nothing (a plain step) when its best "
                                                    "draft's score, the expected accepted tokens, is under this")
    cost_aware: bool = Field(False, description="SuffixDrafter keeps the prefix of its best-first draft with the "
                                                "most expected tokens per unit of step time, from the verification "
                                                "costs it measures on the target once (1 + calibrated score over "
                                                "the step's cost; a plain step when no prefix beats 1)")
    max_cached_requests: int = Field(10000, ge=0, description="responses kept in the global index, FIFO "
                                                              "(0: no global index)")
    max_response_tokens: int = Field(8192, ge=1, description="tokens indexed per response (its first ones)")
    max_candidates: int = Field(256, ge=1, description="occurrences of the context's last tokens examined per "
                                                       "lookup, newest first (bounds the time of a lookup)")


@dataclass
class Draft:
    """A draft tree: ``tokens[i]`` hangs under ``parents[i]`` (-1: the root), parents before children."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    probs: list[float] = field(default_factory=list)
    score: float = 0.0
    match_len: int = 0
    counts_probs: list[float] | None = None  # the counts' path probabilities where ``probs`` are calibrated

    def __len__(self) -> int:
        return len(self.tokens)


def _key3(a: int, b: int, c: int) -> int:
    return (a << 40) | (b << 20) | c  # token ids < 2**20


class TokenIndex:
    """Token streams with newest-first occurrence chains (see the module docstring)."""

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.toks = array("i")
        self.link1 = array("q")  # per position: previous position with the same preceding token
        self.link3 = array("q")  # per position: previous position with the same 3 preceding tokens
        self.head1: dict[int, int] = {}
        self.head3: dict[int, int] = {}
        self.base = 0  # positions below base belong to evicted streams

    # ------------------------------------------------------------------ building
    def new_stream(self) -> None:
        """Start a stream: later tokens never match across the separator."""
        self._push(SEP)

    def _push(self, t: int) -> None:
        toks = self.toks
        c = len(toks)  # position of t; we index c as a continuation start keyed by the tokens before it
        toks.append(t)
        if c == 0 or t == SEP or toks[c - 1] == SEP:  # no key before it, or no continuation to index
            self.link1.append(NONE)
            self.link3.append(NONE)
            return
        k1 = toks[c - 1]
        self.link1.append(self.head1.get(k1, NONE))
        self.head1[k1] = c
        if c >= 3 and toks[c - 2] != SEP and toks[c - 3] != SEP:
            k3 = _key3(toks[c - 3], toks[c - 2], k1)
            self.link3.append(self.head3.get(k3, NONE))
            self.head3[k3] = c
        else:
            self.link3.append(NONE)

    def extend(self, tokens: Iterable[int]) -> None:
        """Append tokens to the current stream."""
        for t in tokens:
            if t < 0 or t >= 1 << 20:
                raise ValueError(f"token id {t} outside [0, 2**20)")
            self._push(int(t))

    def __len__(self) -> int:
        return len(self.toks)

    # ------------------------------------------------------------------ lookup
    def _candidates(self, ctx: Sequence[int]) -> list[int]:
        """Continuation starts whose preceding tokens match the context's last 3 (or last 1), newest first."""
        cap, base, n = self.config.max_candidates, self.base, len(self.toks)
        c = NONE
        link = self.link1
        if len(ctx) >= 3:
            c = self.head3.get(_key3(ctx[-3], ctx[-2], ctx[-1]), NONE)
            link = self.link3
        if c == NONE:
            c = self.head1.get(ctx[-1], NONE)
            link = self.link1
        out = []
        while c != NONE and c >= base and len(out) < cap:
            if c < n and self.toks[c] != SEP:  # a continuation exists
                out.append(c)
            c = link[c]
        return out

    def match_lengths(self, ctx: Sequence[int], cands: list[int]) -> list[int]:
        """How many of the context's last tokens (at most max_depth) precede each candidate position.

        Suffix matches are monotone (the last k tokens match only if the last k-1 do), so each length is a
        binary search over slice comparisons (done in C), a few per candidate whatever the length."""
        toks, D = self.toks, min(self.config.max_depth, len(ctx))
        tail = array("i", ctx[len(ctx) - D:])
        out = []
        for c in cands:
            d = min(D, c)
            m = 0
            while m < 4 and m < d and toks[c - 1 - m] == tail[D - 1 - m]:  # most matches are short
                m += 1
            if m < 4 or m == d:
                out.append(m)
                continue
            if toks[c - d:c] == tail[D - d:]:
                out.append(d)
                continue
            lo, hi = m, d - 1  # lo matches, d does not
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if toks[c - mid:c] == tail[D - mid:]:
                    lo = mid
                else:
                    hi = mid - 1
            out.append(lo)
        return out

    def speculate(self, ctx: Sequence[int], max_tokens: int | None = None) -> Draft:
        """The best draft after context ``ctx`` (empty Draft when nothing matches)."""
        cfg = self.config
        if not ctx or not self.toks:
            return Draft()
        ctx = ctx[-cfg.max_depth:]
        cands = self._candidates(ctx)
        if not cands:
            return Draft()
        lens = self.match_lengths(ctx, cands)
        cap = cfg.max_spec_tokens if max_tokens is None else min(cfg.max_spec_tokens, max_tokens)
        best = Draft()
        levels = sorted(set(lens), reverse=True) + [0]

        def room(m: int) -> int:
            return min(cap, math.floor(m * cfg.max_spec_factor + cfg.max_spec_offset), cfg.max_depth - m)

        for v, u in zip(levels, levels[1:]):
            # every match length m in (u, v] has the same occurrences (the node's count): the one with the most
            # room to draft is the best of them (the longer on ties)
            m = max(range(v, u, -1), key=room)
            n = room(m)
            if n <= 0:
                continue
            node = [c for c, ln in zip(cands, lens) if ln >= m]
            d = self._tree(node, n) if cfg.tree else self._path(node, n)
            d.match_len = m
            if d.score > best.score:  # strict: a tie keeps the longer match (visited first)
                best = d
        return best

    def _path(self, node: list[int], n: int) -> Draft:
        toks, pmin = self.toks, self.config.min_token_prob
        d, prob, alive, j = Draft(), 1.0, node, 0
        end = len(toks)
        while len(d) < n and alive:
            counts: dict[int, list[int]] = {}
            for c in alive:
                if c + j < end:
                    t = toks[c + j]
                    if t != SEP:
                        counts.setdefault(t, []).append(c)
            if not counts:
                break
            tok, nxt = max(counts.items(), key=lambda kv: len(kv[1]))  # ties: the newest (dicts keep order)
            p = prob * len(nxt) / len(alive)
            if p < pmin:
                break
            d.parents.append(len(d) - 1)
            d.tokens.append(tok)
            d.probs.append(p)
            d.score += p
            prob, alive, j = p, nxt, j + 1
        return d

    def _tree(self, node: list[int], n: int) -> Draft:
        """Best-first over the continuation trie of ``node`` (its occurrences), by path probability."""
        toks, pmin, end = self.toks, self.config.min_token_prob, len(self.toks)
        d = Draft()
        heap: list[tuple[float, int, int, int, list[int]]] = []  # (-prob, tiebreak, parent, depth, occurrences)
        tie = 0

        def children(parent: int, prob: float, depth: int, occ: list[int]) -> None:
            nonlocal tie
            counts: dict[int, list[int]] = {}
            for c in occ:
                if c + depth < end:
                    t = toks[c + depth]
                    got = counts.get(t)
                    if got is None:
                        counts[t] = [c]
                    else:
                        got.append(c)
            counts.pop(SEP, None)
            for tok, nxt in counts.items():
                p = prob * len(nxt) / len(occ)
                if p >= pmin:
                    heapq.heappush(heap, (-p, tie, parent, depth, nxt))
                    tie += 1

        children(-1, 1.0, 0, node)
        while heap and len(d) < n:
            negp, _, parent, depth, occ = heapq.heappop(heap)
            tok = toks[occ[0] + depth]
            d.tokens.append(tok)
            d.parents.append(parent)
            d.probs.append(-negp)
            d.score += -negp
            children(len(d) - 1, -negp, depth + 1, occ)
        return d

    # ------------------------------------------------------------------ prompt lookup
    def lookup(self, ctx: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
        """Prompt lookup: the ``k`` tokens that followed the newest earlier occurrence of the context's last
        n tokens, for the largest n in [min_ngram, max_ngram] that occurs (HF's prompt lookup, newest match)."""
        if not ctx or k <= 0:
            return []
        cands = self._candidates(ctx[-max_ngram:] if max_ngram < 3 else ctx)
        if not cands:
            return []
        lens = self.match_lengths(ctx[-max_ngram:], cands)
        best = max(lens)
        if best < min_ngram:
            return []
        c = cands[lens.index(best)]  # newest among the longest
        out = []
        for i in range(c, min(c + k, len(self.toks))):
            if self.toks[i] == SEP:
                break
            out.append(self.toks[i])
        return out

    # ------------------------------------------------------------------ memory
    def memory_bytes(self) -> int:
        """Bytes held: the arrays' buffers and the key dicts (entries and their int keys and values)."""
        arrays = sum(a.buffer_info()[1] * a.itemsize for a in (self.toks, self.link1, self.link3))
        dicts = sys.getsizeof(self.head1) + sys.getsizeof(self.head3)
        ints = 0
        for d in (self.head1, self.head3):
            if d:
                k, v = next(iter(d.items()))
                ints += len(d) * (sys.getsizeof(k) + sys.getsizeof(v))
        return arrays + dicts + ints


class SuffixIndex:
    """The global index over earlier responses (FIFO over ``max_cached_requests`` responses).

    `add_response` indexes a finished response; the oldest response is evicted when the bound is passed
    (its positions die at once; the arrays are rebuilt from the live responses once the dead part
    outgrows the live part, so memory stays proportional to what is kept). ``save`` / ``load`` keep it
    across restarts; `rebuild_from_logs` rebuilds it from the server's request logs.
    """

    FORMAT = "draftsmith.suffix-index/1"

    def __init__(self, config: SuffixConfig | None = None):
        self.config = config or SuffixConfig()
        self.index = TokenIndex(self.config)
        self.responses: deque[tuple[str, int, int]] = deque()  # (request id, start, end) in index positions
        self.added = 0
        self.evicted = 0

    def __len__(self) -> int:
        return len(self.responses)

    @property
    def indexed_tokens(self) -> int:
        return sum(e - s for _, s, e in self.responses)

    def add_response(self, tokens: Sequence[int], request_id: str | None = None) -> None:
        """Index one finished response (its first ``max_response_tokens`` tokens); evicts FIFO."""
        if self.config.max_cached_requests == 0 or not tokens:
            return
        toks = list(tokens)[: self.config.max_response_tokens]
        self.index.new_stream()
        start = len(self.index)
        self.index.extend(toks)
        self.responses.append((str(request_id if request_id is not None else self.added), start, len(self.index)))
        self.added += 1
        while len(self.responses) > self.config.max_cached_requests:
            self.responses.popleft()
            self.evicted += 1
            self.index.base = self.responses[0][1] - 1 if self.responses else len(self.index)
        dead = self.index.base
        if dead > 1024 and dead > len(self.index) - dead:
            self._compact()

    def _compact(self) -> None:
        kept = [(rid, list(self.index.toks[s:e])) for rid, s, e in self.responses]
        self.index = TokenIndex(self.config)
        self.responses.clear()
        added, evicted = self.added, self.evicted
        for rid, toks in kept:
            self.index.new_stream()
            s = len(self.index)
            self.index.extend(toks)
            self.responses.append((rid, s, len(self.index)))
        self.added, self.evicted = added, evicted

    def speculate(self, ctx: Sequence[int], max_tokens: int | None = None) -> Draft:
        if not self.responses:
            return Draft()
        return self.index.speculate(ctx, max_tokens)

    def memory_report(self) -> dict:
        """What the index holds and its memory, with bytes per million indexed tokens."""
        b = self.index.memory_bytes()
        n = self.indexed_tokens
        return {"responses": len(self.responses), "indexed_tokens": n, "array_positions": len(self.index),
                "bytes": b, "bytes_per_million_tokens": round(b / n * 1e6) if n else None,
                "added": self.added, "evicted": self.evicted,
                "max_cached_requests": self.config.max_cached_requests, "max_depth": self.config.max_depth}

    # ------------------------------------------------------------------ persistence
    def save(self, directory: str | Path, fingerprint: str | None = None) -> Path:
        """Write DIR/suffix_index.json (config, ids, lengths, the tokens' CRC-32 and, if given, the target's
        fingerprint) and DIR/suffix_index.bin (int32 tokens), each to a temporary file, fsynced, then renamed:
        a crash leaves the previous pair or a pair `load` refuses (its CRC does not match), never a torn file."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        toks = array("i")
        lens = []
        for _, s, e in self.responses:
            toks.extend(self.index.toks[s:e])
            lens.append(e - s)
        if sys.byteorder != "little":
            toks.byteswap()
        raw = toks.tobytes()
        meta = {"format": self.FORMAT, "config": self.config.model_dump(), "ids": [r for r, _, _ in self.responses],
                "lengths": lens, "added": self.added, "evicted": self.evicted, "crc32": zlib.crc32(raw),
                "fingerprint": fingerprint}
        for name, data in (("suffix_index.bin", raw), ("suffix_index.json", json.dumps(meta).encode())):
            tmp = d / f"{name}.tmp"
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(d / name)
        return d

    @classmethod
    def load(cls, directory: str | Path, config: SuffixConfig | None = None,
             fingerprint: str | None = None) -> "SuffixIndex":
        """Read what `save` wrote (``config`` overrides the saved one, e.g. a smaller bound). ValueError when
        the files disagree (lengths, CRC) or, with ``fingerprint``, when they were saved for another target."""
        d = Path(directory)
        meta = json.loads((d / "suffix_index.json").read_text())
        if not isinstance(meta, dict) or meta.get("format") != cls.FORMAT:
            got = meta.get("format") if isinstance(meta, dict) else type(meta).__name__
            raise ValueError(f"{d / 'suffix_index.json'} is not a {cls.FORMAT} file (format {got!r})")
        if fingerprint is not None and meta.get("fingerprint") != fingerprint:
            raise ValueError(f"{d / 'suffix_index.json'} was saved for target {meta.get('fingerprint')!r}, "
                             f"not {fingerprint!r}")
        toks = array("i")
        raw = (d / "suffix_index.bin").read_bytes()
        toks.frombytes(raw)
        if sys.byteorder != "little":
            toks.byteswap()
        if sum(meta["lengths"]) != len(toks):
            raise ValueError(f"{d / 'suffix_index.bin'} holds {len(toks)} tokens, the lengths say "
                             f"{sum(meta['lengths'])}")
        if meta.get("crc32") is not None and zlib.crc32(raw) != meta["crc32"]:
            raise ValueError(f"{d / 'suffix_index.bin'} does not match the CRC-32 in suffix_index.json")
        if len(meta["ids"]) != len(meta["lengths"]):
            raise ValueError(f"{d / 'suffix_index.json'} has {len(meta['ids'])} ids and "
                             f"{len(meta['lengths'])} lengths")
        out = cls(config or SuffixConfig(**meta["config"]))
        pos = 0
        for rid, n in zip(meta["ids"], meta["lengths"]):
            out.add_response(toks[pos:pos + n], rid)
            pos += n
        out.added += int(meta.get("added", 0)) - len(meta["ids"])
        out.evicted += int(meta.get("evicted", 0))
        return out

    @classmethod
    def rebuild_from_logs(cls, directory: str | Path, fingerprint: str, *, vocab_size: int, max_tokens: int,
                          config: SuffixConfig | None = None) -> tuple["SuffixIndex", dict]:
        """A fresh index over every usable response in the request logs of DIR (oldest file first), and the
        counts: records used and lines skipped per reason (`draftsmith.traffic.parse_record`'s reasons)."""
        out = cls(config)
        counts = {"used": 0, "skipped": {}}
        # requests-<unix seconds>-<seq>.jsonl: the name order is the writing order
        for path in sorted(Path(directory).glob(LOG_GLOB)):
            with open(path, "rb") as f:
                for line in f:
                    if not line.strip():
                        continue
                    try:
                        rec = parse_record(line, fingerprint, vocab_size=vocab_size, max_tokens=max_tokens)
                    except RecordError as e:
                        counts["skipped"][e.reason] = counts["skipped"].get(e.reason, 0) + 1
                        continue
                    out.add_response(rec.response_ids, rec.request_id)
                    counts["used"] += 1
        return out, counts
