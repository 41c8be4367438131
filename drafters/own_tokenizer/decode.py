"""Decoding with a drafter that has its own tokenizer: TLI (lossless, any sampling) and SLEM (greedy).

Both are adapters in the engine's drafter interface (engine/drafters.py), chains only, so the
decoder and its verification are unchanged:

* TLI (2502.05202): ``propose`` returns the drafter's next-token logits mapped onto the target's
  vocabulary, -inf outside the intersection (`VocabBridge.to_target_logits`). The decoder samples
  the draft from exactly that q (restricted, renormalised, then temperature/top-k/top-p as for p)
  and verifies with exact rejection sampling in the target's vocabulary: lossless by construction.
  A drafted target token is in the intersection, so it is fed to the drafter as its one drafter id.
* SLEM (same paper, greedy only): the drafter writes ``draft_depth + extra`` tokens of its own
  greedily (extra = 0 by default: K of its own tokens, like HF universal assisted generation); their
  text is re-tokenised with the target's tokenizer (anchored on the last committed target tokens, so
  a draft that merges with them is seen), and ``propose`` returns one-hot logits
  for those target ids, one per chain position. Greedy verification accepts while they equal the
  target's argmax: exact match, the target's own greedy output.

The drafter's context (both): its own tokenisation of the committed text,
``drafter_ids(tokens[:length + 1])`` (decode the target ids, encode with the drafter's tokenizer).
Exact: the context is a pure function of the committed target ids, recomputed at every step. Cheap:
re-tokenising a few hundred tokens costs tens of microseconds; the drafter keeps its KV cache over
the ids it has fed (the committed context plus what it drafted), compares them with the fresh
tokenisation and re-feeds only from the first id that differs (usually the last word and the newly
accepted tokens). Cache slots are absolute positions: a rejected or re-tokenised tail is simply
overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.drafters import project
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.trees import DraftTree

if TYPE_CHECKING:  # the model module builds these drafters: importing it here would be a cycle
    from draftsmith.drafters.own_tokenizer.model import VocabBridge

SLACK = 64  # drafter cache slots beyond the target's capacity (its tokenisation may be a little longer)


@dataclass
class _OwnState:
    cache: KVCache
    fed: list[int] = field(default_factory=list)  # drafter ids whose KV sit at slots [0, len(fed))
    base: int = 0  # slot of this step's first drafted token (= length of the committed context)
    proposal: list[int] = field(default_factory=list)  # SLEM: this step's target ids


class _OwnTokenizerBase:
    """The drafter LM, its cache and the context synchronisation shared by TLI and SLEM."""

    supports_trees = False
    max_depth = None

    def __init__(self, model: torch.nn.Module, bridge: VocabBridge, target_fingerprint: str | None = None,
                 name: str = "own-tokenizer"):
        self.model = model.eval().requires_grad_(False)
        self.body = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.bridge = bridge
        self.name = name
        self.target_fingerprint = target_fingerprint
        self.positions = int(getattr(model.config, "max_position_embeddings", 2048))
        self._cache: KVCache | None = None

    def start(self, dec, state) -> _OwnState:
        need = min(2 * dec.capacity + SLACK, self.positions)
        if self._cache is None or self._cache.capacity < need:
            self._cache = KVCache.for_model(self.model, need)
        return _OwnState(self._cache)

    def _forward(self, ds: _OwnState, ids: list[int], start: int) -> torch.Tensor:
        """Feed ``ids`` at slots/positions [start, start + n) after ds.fed[:start]; the last row's logits [1, Vd]."""
        dev = ds.cache.layers[0].keys.device
        n = len(ids)
        mask = None if n == 1 or start == 0 else prefix_block_mask(
            start, torch.ones(n, n, dtype=torch.bool, device=dev).tril(), ds.cache.layers[0].keys.dtype)
        ds.cache.set_write(start)
        h = self.body(input_ids=torch.tensor([ids], device=dev), position_ids=torch.arange(start, start + n,
                      device=dev)[None], attention_mask=mask, **cache_arg(self.body, ds.cache), use_cache=True)
        del ds.fed[start:]
        ds.fed.extend(ids)
        return project(self.head, h.last_hidden_state[0, -1:])

    def _sync(self, state, ds: _OwnState, room: int) -> torch.Tensor | None:
        """Bring the cache to the drafter's tokenisation of the committed text (root included); logits [1, Vd].
        None when ``room`` more positions would not fit (the step falls back to plain decoding)."""
        ids = self.bridge.drafter_ids(state.tokens[:state.length + 1])
        if not ids or len(ids) + room > ds.cache.capacity:
            return None
        k, old = 0, ds.fed
        top = min(len(ids), len(old))
        while k < top and ids[k] == old[k]:
            k += 1
        k = min(k, len(ids) - 1)  # feed at least the last id: its logits are the next-token distribution
        logits = self._forward(ds, ids[k:], k)
        ds.base = len(ids)
        return logits

    def commit(self, dec, state, tree, path) -> None:
        pass  # ds.fed keeps what was fed (context + drafts); the next step's sync keeps its matching prefix


class TLIDrafter(_OwnTokenizerBase):
    """Token-level intersection: the drafter's distribution restricted to the shared token strings (lossless)."""

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor | None:
        ds: _OwnState = state.drafter_state
        if end != start + 1:
            raise ValueError(f"{self.name} drafts chains only (asked for nodes [{start}, {end}))")
        if start == 0:
            logits = self._sync(state, ds, (state.draft_depth or 1) + 1)
        else:  # node `start` was drafted from the intersection: one drafter id, at the next slot
            if len(ds.fed) != ds.base + start - 1:
                raise RuntimeError(f"{self.name}: chain node {start} asked out of order")
            t = int(tree.tok[start])
            logits = self._forward(ds, [self.bridge.t2d[t]], ds.base + start - 1)
        return None if logits is None else self.bridge.to_target_logits(logits)


class SLEMDrafter(_OwnTokenizerBase):
    """String-level exact match (greedy only): the drafter's text re-tokenised with the target's tokenizer."""

    def __init__(self, *args, extra: int = 0, anchor: int = 4, **kw):
        super().__init__(*args, **kw)
        self.extra, self.anchor = int(extra), int(anchor)
        specials = self.bridge.tokenizer.get_added_tokens_decoder()
        self._stop = {i for i, t in specials.items() if t.special}

    def start(self, dec, state) -> _OwnState:
        if not dec.sampling.greedy:
            raise ValueError(f"{self.name}: SLEM verifies by exact match, greedy decoding only "
                             f"(temperature 0); use TLI for sampling")
        return super().start(dec, state)

    @torch.no_grad()
    def _draft_text(self, state, ds: _OwnState, n: int) -> str | None:
        logits = self._sync(state, ds, n + 1)
        if logits is None:
            return None
        out: list[int] = []
        for i in range(n):
            d = int(logits[0].argmax())
            out.append(d)
            if d in self._stop or i == n - 1:
                break
            logits = self._forward(ds, [d], ds.base + i)
        text = self.bridge.tokenizer.decode(out, skip_special_tokens=False)
        return text.rstrip("\ufffd")  # an incomplete UTF-8 character at the end is drafted next step

    def _retokenise(self, state, text: str) -> list[int]:
        """Target ids of ``text`` after the committed tokens; anchored on the last few so a merge is caught."""
        L = state.length
        anchor = state.tokens[max(0, L + 1 - self.anchor):L + 1]
        ids = self.bridge.target_ids(self.bridge.text(anchor) + text)
        if ids[:len(anchor)] != anchor:  # the draft merges with a committed token: nothing to propose
            return []
        return ids[len(anchor):]

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor | None:
        ds: _OwnState = state.drafter_state
        if end != start + 1:
            raise ValueError(f"{self.name} drafts chains only (asked for nodes [{start}, {end}))")
        if start == 0:
            depth = state.draft_depth or 1
            text = self._draft_text(state, ds, depth + self.extra)
            ds.proposal = self._retokenise(state, text) if text else []
        if start >= len(ds.proposal):
            return None
        row = torch.full((1, self.bridge.target_vocab_size), float("-inf"), device=tree.tok.device,
                         dtype=torch.float32)
        row[0, ds.proposal[start]] = 0.0
        return row


def tli_drafter(module, target, fingerprint: str | None = None, name: str = "own-tokenizer") -> TLIDrafter:
    """A trained `OwnTokenizerDrafter` as a TLI decoder drafter."""
    return TLIDrafter(module.model, module.bridge(target), fingerprint or target.fingerprint, f"{name} TLI")


def slem_drafter(module, target, fingerprint: str | None = None, name: str = "own-tokenizer",
                 extra: int = 0) -> SLEMDrafter:
    """A trained `OwnTokenizerDrafter` as a SLEM decoder drafter (greedy only)."""
    return SLEMDrafter(module.model, module.bridge(target), fingerprint or target.fingerprint, f"{name} SLEM",
                       extra=extra)
