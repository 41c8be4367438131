"""Kangaroo decoding: a self-drafter for `draftsmith.engine.decoder.SpeculativeDecoder` (methods.md section 4).

Per step (chains only; the decoder refuses a tree with this drafter):
  * draft: each draft step runs the target's layers 1..l on the last token
    (the root first, together with any committed tokens not cached yet, e.g.
    the prompt on the first step), writing the target's OWN KV cache (the
    decoder's `SlotCache`) for those layers, and keeps the layer-l state; the
    adapter reads it with its own pre-allocated KV cache; its logits go
    through the target's LM head. The second early exit is a length policy
    (`ConfidenceStop(threshold, gamma)`: stop when the next draft's top-1
    probability is below the threshold, at most gamma drafts), the decoder's
    default for this drafter. The low-confidence candidate itself is not
    drafted: its layer-1..l pass already happened (it is the state of the
    previous draft, which verification needs anyway), so stopping there
    wastes no shallow work and adds no unlikely row to verification;
  * verify (`verify_forward`): only layers l+1..L run, over the rows from the
    first uncached position to the last draft, starting from the stored
    layer-l states (the last draft's shallow state, which drafting never
    needed, is computed first); ``full_verify=True`` uses the decoder's own
    full-depth forward instead, for comparison;
  * commit: both caches keep the accepted prefix: entries past it are simply
    overwritten next step (slot = position for chains), so cutting a cache is
    setting its committed length. After a full acceptance the adapter has not
    seen the last draft and takes two states next step.

`early_exit_drafter(target, l)` is the untrained peer: the same machinery
with no adapter (first l layers, the target's final norm, the LM head).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from draftsmith.engine import drafters as engine  # engine.project, looked up per call: step_breakdown's clock wraps it
from draftsmith.engine.kvcache import prefix_block_mask
from draftsmith.engine.policies import ConfidenceStop, LengthPolicy
from draftsmith.engine.trees import DraftTree
from draftsmith.target import Target


def check_exit_layer(exit_layer: int, num_layers: int) -> None:
    """1 <= l < L: the draft path must exit strictly before the target's last layer."""
    if not 1 <= int(exit_layer) < int(num_layers):
        raise ValueError(f"kangaroo exit_layer must satisfy 1 <= l < L = {num_layers} (the target has {num_layers} "
                         f"decoder layers), got l = {exit_layer}")


def check_threshold(threshold: float) -> None:
    """The second early exit's confidence threshold must lie in (0, 1)."""
    if not 0.0 < float(threshold) < 1.0:
        raise ValueError(f"kangaroo threshold must be in (0, 1), got {threshold}")


@dataclass
class _KangarooState:
    shallow: torch.Tensor  # [capacity, d] layer-l states by position (buffer shared by clones)
    kv: tuple[torch.Tensor, torch.Tensor] | None  # the adapter's keys/values [H_kv, capacity, D]; None: no adapter
    s_valid: int = 0  # committed positions [0, s_valid) have their layer-l state in `shallow`
    a_valid: int = 0  # committed positions [0, a_valid) are in the adapter's KV cache
    tree: DraftTree | None = None  # the tree being drafted/verified this step
    fed: int = 0  # its nodes [0, fed) went through layers 1..l (states at positions L + i)
    a_fed: int = 0  # its nodes [0, a_fed) went through the adapter
    hidden: torch.Tensor | None = None  # the last drafting row (a feature for length policies)


class KangarooDrafter:
    """Self-drafter on the target's first ``exit_layer`` layers, with an optional trained adapter.

    Args:
      target: the target; its layers, final norm and LM head are used in place (nothing copied).
      exit_layer: l, 1 <= l < L.
      adapter: a `KangarooAdapter` (None: the untrained early exit, final norm + LM head).
      threshold, max_draft_len: the second early exit, the decoder's default policy for this drafter
        (``policy`` overrides it, e.g. `FixedLength(k)` for the fixed-length sweep).
      full_verify: verify through all L layers (the decoder's own forward) instead of l+1..L.
    """

    def __init__(self, target: Target, exit_layer: int, adapter: torch.nn.Module | None = None, *,
                 target_fingerprint: str | None = None, name: str = "kangaroo", threshold: float = 0.6,
                 max_draft_len: int = 6, policy: LengthPolicy | None = None, full_verify: bool = False):
        body = target.model.get_decoder()
        self.target = target
        self.num_layers = len(body.layers)
        check_exit_layer(exit_layer, self.num_layers)
        check_threshold(threshold)
        self.exit_layer = int(exit_layer)
        self.heads = adapter.eval() if adapter is not None else None  # `heads`: what cpu_layout lays out
        self.name = name
        self.target_fingerprint = target_fingerprint
        self.max_depth = None
        self.supports_trees = False  # the decoder refuses a tree with this drafter
        self.default_policy = policy or ConfidenceStop(threshold, max_draft_len)
        self.full_verify = full_verify
        if full_verify:
            self.verify_forward = None  # the decoder then runs its own full-depth forward
        self._buffers: tuple | None = None
        # The layers' name for the cache argument: `cache` in transformers 5.x (`past_key_values` is a deprecated
        # alias there, renamed and warned about on every call), `past_key_values` before.
        params = inspect.signature(body.layers[0].forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"

    def variant(self, *, policy: LengthPolicy | None = None, full_verify: bool | None = None,
                name: str | None = None) -> "KangarooDrafter":
        """The same layers and adapter with another default policy or verification depth (benchmarks)."""
        return KangarooDrafter(self.target, self.exit_layer, self.heads, target_fingerprint=self.target_fingerprint,
                               name=name or self.name, policy=policy or self.default_policy,
                               full_verify=self.full_verify if full_verify is None else full_verify)

    # ------------------------------------------------------------------ target layers, run in place
    def _layers(self, dec, x: torch.Tensor, lo: int, hi: int, start: int) -> torch.Tensor:
        """Target decoder layers [lo, hi) on rows x [n, d] at positions start.. (slots = positions),
        writing their keys/values into the decoder's cache; row j sees slots [0, start + j].

        The mask is the decoder's own (`SpeculativeDecoder.verify_forward`): none for one row, none for a
        block at slot 0 (the first step, prompt fused) under sdpa, which then runs its causal kernel on the
        KV heads as they are; an explicit [n, start + n] mask makes HF's sdpa path copy the keys and values
        to every query head and run the masked kernel (first-step verification of a 373-token prompt, l=1:
        1041 ms with the mask, 1028 ms without, the full forward 1065 ms). Eager attention does not mask by
        itself: it always gets the explicit mask."""
        n = x.shape[0]
        pos = torch.arange(start, start + n, device=x.device)[None]
        # sdpa applies causality itself when it gets no mask (HF: is_causal for 2+ query rows); eager does not
        sdpa = getattr(dec.model.config, "_attn_implementation", None) == "sdpa"
        mask = None if n == 1 or (start == 0 and sdpa) else prefix_block_mask(
            start, torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), x.dtype)
        rope = dec.body.rotary_emb(x[None], pos)
        dec.cache.set_write(start)
        h = x[None]
        kw = {self._cache_kw: dec.cache}
        for layer in dec.body.layers[lo:hi]:
            out = layer(h, attention_mask=mask, position_ids=pos, use_cache=True, position_embeddings=rope, **kw)
            h = out[0] if isinstance(out, tuple) else out
        return h[0]

    def _shallow(self, dec, ds: _KangarooState, ids: torch.Tensor, start: int) -> torch.Tensor:
        """Layers 1..l on tokens ``ids`` at positions start..; their layer-l states are kept by position."""
        x = dec.model.get_input_embeddings()(ids)
        h = self._layers(dec, x, 0, self.exit_layer, start)
        ds.shallow[start:start + h.shape[0]] = h
        return h

    # ------------------------------------------------------------------ the decoder's drafter interface
    @torch.no_grad()
    def start(self, dec, state) -> _KangarooState:
        d = dec.model.config.hidden_size
        if self._buffers is None or self._buffers[0].shape[0] < dec.capacity:
            shallow = torch.zeros(dec.capacity, d, dtype=dec.dtype, device=dec.device)
            kv = None
            if self.heads is not None:
                a = self.heads
                shape = (a.nkv, dec.capacity, a.hd)
                kv = (torch.zeros(shape, dtype=dec.dtype, device=dec.device),
                      torch.zeros(shape, dtype=dec.dtype, device=dec.device))
            self._buffers = (shallow, kv)
        return _KangarooState(*self._buffers)

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor:
        if end != start + 1 or (start > 0 and tree.parent[start] != start - 1):
            raise ValueError("kangaroo drafts chains only (one node per call, each the child of the previous)")
        ds: _KangarooState = state.drafter_state
        L, c = state.length, state.cached
        if start == 0:  # a new step: committed tokens not cached yet, then the root
            ds.tree, ds.fed, ds.a_fed = tree, 0, 0
            s0 = min(ds.s_valid, c)
            ids = tree.tok[:1] if s0 == L else torch.cat(
                [torch.tensor(state.tokens[s0:L], device=dec.device), tree.tok[:1]])
            self._shallow(dec, ds, ids, s0)
            a0 = min(ds.a_valid, L)  # the adapter catches up from the stored states (two after a full acceptance)
        else:
            if ds.tree is not tree or ds.fed != start:
                raise RuntimeError(f"kangaroo drafter fed {ds.fed} nodes of this tree, asked for node {start}")
            self._shallow(dec, ds, tree.tok[start:start + 1], L + start)
            a0 = L + start
        ds.fed = start + 1
        p = L + start  # the position of the node whose child is drafted
        if self.heads is None:
            out = dec.body.norm(ds.shallow[p:p + 1])
        else:
            rows = ds.shallow[a0:p + 1]
            out = self.heads.adapt(rows, torch.arange(a0, p + 1, device=rows.device), ds.kv, a0)[-1:]
            ds.a_fed = start + 1
        ds.hidden = out
        dh = getattr(self.heads, "draft_head", None)
        if dh is not None:  # a pruned adapter: its kept rows only, q exactly 0 elsewhere (lossless)
            return dh.to_target(engine.project(dh, out))
        return engine.project(dec.lm_head, out)

    @torch.no_grad()
    def verify_forward(self, dec, state, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """Layers l+1..L over the uncached committed tokens, the root and the drafts, from their layer-l
        states; returns (logits [n+1, V], final hidden [n+1, d]) of the root and the drafts."""
        ds: _KangarooState = state.drafter_state
        L, c, m = state.length, state.cached, tree.n + 1
        if ds.tree is not tree:  # another tree was drafted since (exact enumeration re-drafts): feed this one
            ds.tree, ds.fed, ds.a_fed = tree, 0, 0
        if ds.fed == 0:
            s0 = min(ds.s_valid, c)
            self._shallow(dec, ds, torch.cat([torch.tensor(state.tokens[s0:L], device=dec.device,
                                                            dtype=torch.long), tree.tokens()]), s0)
        elif ds.fed < m:  # the last draft: drafting never needed its own state
            self._shallow(dec, ds, tree.tok[ds.fed:m], L + ds.fed)
        ds.fed = m
        h = self._layers(dec, ds.shallow[c:L + m], self.exit_layer, self.num_layers, c)
        h = dec.body.norm(h)[L - c:]
        return engine.project(dec.lm_head, h), h

    def commit(self, dec, state, tree: DraftTree, path: list[int]) -> None:
        ds: _KangarooState = state.drafter_state
        L, new = state.length, state.length + len(path)  # root + accepted drafts become committed
        if ds.tree is tree:
            if ds.fed:
                ds.s_valid = min(L + ds.fed, new)
            if ds.a_fed:
                ds.a_valid = min(L + ds.a_fed, new)
        else:  # buffers past the cached prefix hold another tree's states
            ds.s_valid, ds.a_valid = min(ds.s_valid, state.cached), min(ds.a_valid, state.cached)
        ds.tree, ds.fed, ds.a_fed = None, 0, 0


def early_exit_drafter(target: Target, exit_layer: int, policy: LengthPolicy | None = None, *,
                       full_verify: bool = False) -> KangarooDrafter:
    """The untrained peer: the target's first ``exit_layer`` layers, its final norm and LM head, drafting
    from the target's own KV cache and verified from the shallow states, exactly like Kangaroo."""
    return KangarooDrafter(target, exit_layer, None, target_fingerprint=target.fingerprint,
                           name=f"early-exit-{exit_layer}", policy=policy, full_verify=full_verify)
