"""Kangaroo decoding: a self-drafter for `draftsmith.engine.decoder.SpeculativeDecoder` (docs/methods.md section 4).

Per step (chains, static trees and dynamic trees):
  * draft: each draft call runs the target's layers 1..l on the nodes whose
    children are asked for (the root first, together with any committed
    tokens not cached yet, e.g. the prompt on the first step), writing the
    target's OWN KV cache (the decoder's `KVCache`) for those layers, and
    keeps their layer-l states by slot; the adapter reads them with its own
    pre-allocated KV cache; its logits go through the target's LM head (or
    its kept rows). Slots follow the decoder's convention: committed
    position p at slot p, tree node i at slot L + i, at position L + depth;
    tree nodes attend to the committed prefix, their ancestors and
    themselves, in the shallow layers and in the adapter alike. The second
    early exit is a length policy for chains (`ConfidenceStop(threshold,
    gamma)`: stop when the next draft's top-1 probability is below the
    threshold, at most gamma drafts), the decoder's default for this
    drafter. The low-confidence candidate itself is not drafted: its
    layer-1..l pass already happened (it is the state of the previous draft,
    which verification needs anyway), so stopping there wastes no shallow
    work and adds no unlikely row to verification;
  * verify (`verify_forward`): only layers l+1..L run, over the rows from the
    first uncached position to the last node, starting from the stored
    layer-l states (the nodes that drafting never expanded, the leaves, get
    their shallow pass first), with the decoder's tree mask;
    ``full_verify=True`` uses the decoder's own full-depth forward instead,
    for comparison;
  * commit: both caches keep the accepted prefix. For chains the entries past
    it are simply overwritten next step (slot = position), so cutting a
    cache is setting its committed length; for trees the accepted path's
    layer-l states and adapter keys/values are compacted to consecutive
    slots, as the decoder compacts the target's cache. After a full
    acceptance the adapter has not seen the last draft and takes two states
    next step.

`early_exit_drafter(target, l)` is the untrained peer: the same machinery
with no adapter (first l layers, the target's final norm, the LM head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftsmith.engine import drafters as engine  # engine.project, looked up per call: step_breakdown's clock wraps it
from draftsmith.engine.cache_kw import cache_arg
from draftsmith.common.layers import LayerKV, layer_rope
from draftsmith.engine.kvcache import prefix_block_mask, sliding_windows
from draftsmith.engine.policies import ConfidenceStop, LengthPolicy
from draftsmith.engine.trees import DraftTree
from draftsmith.registry import register_untrained
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
    kv: LayerKV | None  # the adapter's keys/values [H_kv, capacity, D]; None: no adapter
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
        # it runs the target's layers one by one, with masks that carry no sliding window: a target whose layers
        # slide is drafted for only within its window, where they attend as full layers do (longer: refused)
        windows = sliding_windows(target.model.config)
        self.context_length = min(windows.values()) if windows else None
        self.heads = adapter.eval() if adapter is not None else None  # `heads`: what cpu_layout lays out
        self.name = name
        self.target_fingerprint = target_fingerprint
        self.max_depth = None
        self.supports_trees = True  # chains, static and dynamic trees (see the module doc)
        self.default_policy = policy or ConfidenceStop(threshold, max_draft_len)
        self.full_verify = full_verify
        if full_verify:
            self.verify_forward = None  # the decoder then runs its own full-depth forward
        self._buffers: tuple | None = None

    def variant(self, *, policy: LengthPolicy | None = None, full_verify: bool | None = None,
                name: str | None = None) -> "KangarooDrafter":
        """The same layers and adapter with another default policy or verification depth (benchmarks)."""
        return KangarooDrafter(self.target, self.exit_layer, self.heads, target_fingerprint=self.target_fingerprint,
                               name=name or self.name, policy=policy or self.default_policy,
                               full_verify=self.full_verify if full_verify is None else full_verify)

    def set_confidence(self, threshold: float) -> None:
        """Another second-early-exit threshold for the default policy (same maximum length)."""
        check_threshold(threshold)
        self.default_policy = ConfidenceStop(threshold, self.default_policy.max_len)

    # ------------------------------------------------------------------ target layers, run in place
    def _layers(self, dec, x: torch.Tensor, lo: int, hi: int, start: int,
                pos: torch.Tensor | None = None, block: tuple[int, torch.Tensor] | None = None) -> torch.Tensor:
        """Target decoder layers [lo, hi) on rows x [n, d] written at slots start.., writing their keys/values
        into the decoder's cache. Chains (``block`` None): positions = slots, row j sees slots [0, start + j].
        Trees: ``pos`` [n] the rows' positions, ``block = (prefix, allowed)``: every row sees slots
        [0, prefix) and the slots [prefix, start + n) that ``allowed`` [n, start + n - prefix] allows.

        The chain mask is the decoder's own (`SpeculativeDecoder.verify_forward`): none for one row, none for a
        block at slot 0 (the first step, prompt fused) under sdpa, which then runs its causal kernel on the
        KV heads as they are; an explicit [n, start + n] mask makes HF's sdpa path copy the keys and values
        to every query head and run the masked kernel (first-step verification of a 373-token prompt, l=1:
        1041 ms with the mask, 1028 ms without, the full forward 1065 ms). Eager attention does not mask by
        itself: it always gets the explicit mask."""
        n = x.shape[0]
        if pos is None:
            pos = torch.arange(start, start + n, device=x.device)
        pos = pos[None]
        if block is not None:
            mask = prefix_block_mask(block[0], block[1], x.dtype)
        else:
            # sdpa applies causality itself when it gets no mask (HF: is_causal for 2+ query rows); eager does not
            sdpa = getattr(dec.model.config, "_attn_implementation", None) == "sdpa"
            mask = None if n == 1 or (start == 0 and sdpa) else prefix_block_mask(
                start, torch.ones(n, n, dtype=torch.bool, device=x.device).tril(), x.dtype)
        ropes = layer_rope(dec.body, x[None], pos, lo, hi)
        dec.cache.set_write(start)
        h = x[None]
        kw = cache_arg(dec.body.layers[0], dec.cache)  # `cache` or `past_key_values` (engine.cache_kw)
        for layer, rope in zip(dec.body.layers[lo:hi], ropes):
            out = layer(h, attention_mask=mask, position_ids=pos, use_cache=True, position_embeddings=rope, **kw)
            h = out[0] if isinstance(out, tuple) else out
        return h[0]

    @staticmethod
    def _tree_rows(tree: DraftTree, s: int, e: int, L: int, device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Positions [e - s] of tree nodes [s, e) and which node slots [L, L + e) each sees (None: a chain
        segment, where every node sees all earlier nodes, so the chain path applies)."""
        if all(tree.parent[i] == i - 1 for i in range(1, e)):  # a chain so far: depth = index, all seen
            return None
        allowed = tree.ancestor_mask(device)[s:e, :e]
        return L + torch.tensor(tree.depth[s:e], device=device), allowed

    def _shallow_nodes(self, dec, ds: _KangarooState, tree: DraftTree, s: int, e: int, L: int,
                       rows: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Layers 1..l on tree nodes [s, e) (s >= 1), whose ancestors went through them already;
        ``rows`` = `_tree_rows` of those nodes."""
        x = dec.model.get_input_embeddings()(tree.tok[s:e])
        if rows is None:
            h = self._layers(dec, x, 0, self.exit_layer, L + s)
        else:
            h = self._layers(dec, x, 0, self.exit_layer, L + s, pos=rows[0], block=(L, rows[1]))
        ds.shallow[L + s:L + e] = h
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
                kv = LayerKV.empty(self.heads.layer, dec.capacity, dtype=dec.dtype, device=dec.device)
            self._buffers = (shallow, kv)
        return _KangarooState(*self._buffers)

    @torch.no_grad()
    def propose(self, dec, state, tree: DraftTree, start: int, end: int) -> torch.Tensor:
        ds: _KangarooState = state.drafter_state
        L, c = state.length, state.cached
        tree_rows = None
        if start == 0:  # a new step: committed tokens not cached yet, then the root
            if end != 1:
                raise ValueError("kangaroo: the root is proposed alone (node range [0, 1))")
            ds.tree, ds.fed, ds.a_fed = tree, 0, 0
            s0 = min(ds.s_valid, c)
            ids = tree.tok[:1] if s0 == L else torch.cat(
                [torch.tensor(state.tokens[s0:L], device=dec.device), tree.tok[:1]])
            self._shallow(dec, ds, ids, s0)
            a0 = min(ds.a_valid, L)  # the adapter catches up from the stored states (two after a full acceptance)
        else:
            if ds.tree is not tree or ds.fed != start or (self.heads is not None and ds.a_fed != start):
                raise RuntimeError(f"kangaroo drafter fed {ds.fed} nodes of this tree, asked for nodes "
                                   f"[{start}, {end})")
            if any(tree.parent[i] >= start for i in range(start, end)):
                raise ValueError(f"kangaroo: nodes [{start}, {end}) include a child of another node of the range")
            tree_rows = self._tree_rows(tree, start, end, L, dec.device)
            self._shallow_nodes(dec, ds, tree, start, end, L, tree_rows)
            a0 = L + start
        ds.fed = end
        p = L + end - 1  # the slot of the last node whose children are drafted
        if self.heads is None:
            out = dec.body.norm(ds.shallow[L + start:L + end])
        else:
            rows = ds.shallow[a0:p + 1]
            if tree_rows is None:  # chain rows: slot = position, causal
                out = self.heads.adapt(rows, torch.arange(a0, p + 1, device=rows.device), ds.kv, a0)
            else:  # tree nodes: depth positions, the committed prefix [0, L) + ancestors
                pos, allowed = tree_rows
                mask = torch.cat([torch.ones(end - start, L, dtype=torch.bool, device=rows.device), allowed], 1)
                out = self.heads.adapt(rows, pos, ds.kv, a0, mask=mask)
            out = out[-(end - start):]
            ds.a_fed = end
        ds.hidden = out[-1:]
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
            self._shallow(dec, ds, torch.cat([torch.tensor(state.tokens[s0:L], device=dec.device, dtype=torch.long),
                                              tree.tok[:1]]), s0)
            ds.fed = 1
        if ds.fed < m:  # the leaves: drafting never needed their own states
            self._shallow_nodes(dec, ds, tree, ds.fed, m, L, self._tree_rows(tree, ds.fed, m, L, dec.device))
        ds.fed = m
        x = ds.shallow[c:L + m]
        if tree.is_chain():
            h = self._layers(dec, x, self.exit_layer, self.num_layers, c)
        else:  # the decoder's tree rows: causal over the uncached prefix, which every node sees
            pos, block = tree.verify_rows(c, L, dec.device)
            h = self._layers(dec, x, self.exit_layer, self.num_layers, c, pos=pos, block=(c, block))
        h = dec.body.norm(h)[L - c:]
        return engine.project(dec.lm_head, h), h

    def commit(self, dec, state, tree: DraftTree, path: list[int]) -> None:
        ds: _KangarooState = state.drafter_state
        L, new = state.length, state.length + len(path)  # root + accepted drafts become committed
        if ds.tree is tree:
            moved = list(path[1:])
            if moved != list(range(1, len(path))):  # a tree's path: its entries to consecutive slots
                idx = torch.tensor([L + i for i in moved], dtype=torch.long, device=ds.shallow.device)
                ds.shallow[L + 1:L + 1 + len(moved)] = ds.shallow[idx]
                if ds.kv is not None:
                    for t in (ds.kv.keys, ds.kv.values):
                        t[:, L + 1:L + 1 + len(moved)] = t[:, idx]
            if ds.fed:
                ds.s_valid = min(L + 1 + sum(i < ds.fed for i in moved), new)
            if ds.a_fed:
                ds.a_valid = min(L + 1 + sum(i < ds.a_fed for i in moved), new)
        else:  # buffers past the cached prefix hold another tree's states
            ds.s_valid, ds.a_valid = min(ds.s_valid, state.cached), min(ds.a_valid, state.cached)
        ds.tree, ds.fed, ds.a_fed = None, 0, 0


@register_untrained("early-exit", "the target's first L layers drafting from its own cache, verified from the "
                    "shallow states (Kangaroo without an adapter, untrained)", arg="L")
def early_exit_drafter(target: Target, exit_layer: int, policy: LengthPolicy | None = None, *,
                       full_verify: bool = False) -> KangarooDrafter:
    """The untrained peer: the target's first ``exit_layer`` layers, its final norm and LM head, drafting
    from the target's own KV cache and verified from the shallow states, exactly like Kangaroo."""
    return KangarooDrafter(target, exit_layer, None, target_fingerprint=target.fingerprint,
                           name=f"early-exit-{exit_layer}", policy=policy, full_verify=full_verify)
