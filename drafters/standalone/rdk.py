"""RDK: redistribute a pruned drafter's kept-set distribution onto pruned ids (docs/methods.md section 8, docs/rdk.md).

q_RDK = M^T q', with q' the drafter's distribution over the N kept ids and M
a row-stochastic [N, V] token-affinity matrix. Ours is sparse (NOT the
paper's construction, which is unconfirmed): every pruned id j is attached to
at most one kept id a(j) with weight w_j, and every kept id i keeps the rest
of its row on itself:

    M[a(j), j] = w_j,     M[i, i] = 1 - sum_{j: a(j) = i} w_j.

So M has at most V non-zeros and q_RDK costs O(V) per row, never O(N V).

Estimation (`build_rdk`), from the target's distributions p_t at training
positions and q'_t = p_t renormalised over the kept ids (what a perfectly
distilled pruned drafter outputs): the dense conditional-expectation matrix
M*[i, j] = C[i, j] / C_i with C[i, j] = sum_t q'_t(i) p_t(j) and
C_i = sum_t q'_t(i) is row-stochastic and reproduces the target's average
distribution exactly (sum_t M*^T q'_t = sum_t p_t). The sparse M keeps, for
each pruned column j, its largest entry (a(j) = argmax_i C[i, j]) and drops
the rest; pairs are accumulated over the top-k kept and top-k pruned ids of
each position only, so building costs O(T k^2) plus one LM-head product per
position. Every row of M stays stochastic (w sums to at most 1 per row, see
docs/rdk.md), so any fixed M is lossless when tokens are drawn from q_RDK and
verified with q_RDK.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from draftsmith.common.hidden_cache import HiddenCache, teacher_logits


class RDKMap(nn.Module):
    """The sparse affinity matrix as three buffers (saved in the checkpoint beside the id map).

    ``parent`` [V]: the kept target id a pruned id is attached to, -1 for kept ids and unattached ones;
    ``weight`` [V]: w_j (0 where ``parent`` is -1); ``kept_ids`` [N]: the kept target ids, sorted.
    """

    def __init__(self, kept_ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.register_buffer("kept_ids", kept_ids.long().clone())
        self.register_buffer("parent", torch.full((vocab_size,), -1, dtype=torch.long))
        self.register_buffer("weight", torch.zeros(vocab_size, dtype=torch.float32))
        self.vocab_size = int(vocab_size)

    @torch.no_grad()
    def set(self, kept_ids: torch.Tensor, parent: torch.Tensor, weight: torch.Tensor) -> None:
        """Install a map; checks that it is a valid row-stochastic sparse M."""
        kept_ids, parent, weight = kept_ids.long().cpu(), parent.long().cpu(), weight.float().cpu()
        V = self.vocab_size
        if parent.shape != (V,) or weight.shape != (V,) or kept_ids.numel() < 1:
            raise ValueError(f"RDK map needs parent and weight of shape [{V}] and at least one kept id")
        is_kept = torch.zeros(V, dtype=torch.bool)
        is_kept[kept_ids] = True
        att = parent >= 0
        if bool((att & is_kept).any()) or bool((att & ~is_kept[parent.clamp(min=0)]).any()):
            raise ValueError("RDK map: only pruned ids may be attached, and only to kept ids")
        if bool((weight < 0).any()) or bool((weight[~att] != 0).any()):
            raise ValueError("RDK map: weights must be >= 0 and 0 on unattached ids")
        if float(self.row_mass(kept_ids, parent, weight).max()) > 1.0 + 1e-6:
            raise ValueError("RDK map: an affinity row gives away more than its mass (rows must be stochastic)")
        self.kept_ids = kept_ids.to(self.kept_ids.device).clone()
        self.__dict__.pop("_frozen_plan", None)
        self.parent.copy_(parent)
        self.weight.copy_(weight)

    @staticmethod
    def row_mass(kept_ids: torch.Tensor, parent: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """[N] the mass each kept id's row gives to pruned ids (sum of its attached w)."""
        t2d = torch.full((parent.shape[0],), -1, dtype=torch.long, device=parent.device)
        t2d[kept_ids] = torch.arange(len(kept_ids), device=parent.device)
        att = parent >= 0
        out = torch.zeros(len(kept_ids), dtype=weight.dtype, device=weight.device)
        return out.index_add_(0, t2d[parent[att]], weight[att])

    def dense(self) -> torch.Tensor:
        """The [N, V] matrix M (tests and small vocabularies only)."""
        N, V = len(self.kept_ids), self.vocab_size
        m = torch.zeros(N, V, dtype=torch.float64, device=self.weight.device)
        m[torch.arange(N), self.kept_ids] = 1.0 - self.row_mass(self.kept_ids, self.parent, self.weight).double()
        att = (self.parent >= 0).nonzero().flatten()
        t2d = torch.full((V,), -1, dtype=torch.long, device=self.parent.device)
        t2d[self.kept_ids] = torch.arange(N, device=self.parent.device)
        m[t2d[self.parent[att]], att] = self.weight[att].double()
        return m

    def _plan(self, device, dtype) -> tuple:
        """(kept ids, attached pruned ids, their parents' draft ids, their weights, kept rows' own mass)."""
        N, V = len(self.kept_ids), self.vocab_size
        t2d = torch.full((V,), -1, dtype=torch.long, device=self.parent.device)
        t2d[self.kept_ids] = torch.arange(N, device=self.parent.device)
        att = (self.parent >= 0).nonzero().flatten()
        keep_self = 1.0 - self.row_mass(self.kept_ids, self.parent, self.weight)
        return tuple(x.to(device) for x in (self.kept_ids, att, t2d[self.parent[att]])) + \
            tuple(x.to(device, dtype) for x in (self.weight[att], keep_self))

    def redistribute(self, q_kept: torch.Tensor, frozen: bool = False) -> torch.Tensor:
        """q' [..., N] (probabilities over the kept ids, draft order) -> q_RDK [..., V] in target-id space, O(V).

        ``frozen``: the map no longer changes (decoding): its index plan is computed once and reused."""
        N, V = len(self.kept_ids), self.vocab_size
        if q_kept.shape[-1] != N:
            raise ValueError(f"q' has {q_kept.shape[-1]} entries, the RDK map keeps {N} ids")
        key = (q_kept.device, q_kept.dtype)
        plan = getattr(self, "_frozen_plan", {}).get(key) if frozen else None
        if plan is None:
            plan = self._plan(*key)
            if frozen:
                self.__dict__.setdefault("_frozen_plan", {})[key] = plan
        kept, att, att_parent, w_att, keep_self = plan
        out = q_kept.new_zeros((*q_kept.shape[:-1], V))
        out[..., kept] = q_kept * keep_self
        if att.numel():
            out[..., att] = q_kept[..., att_parent] * w_att
        return out

    def logits(self, kept_logits: torch.Tensor) -> torch.Tensor:
        """Kept logits [..., N] -> log q_RDK [..., V] (the dtype's minimum where q_RDK is 0): the decoder's
        softmax of these is q_RDK itself, so drafts are drawn from and verified with q_RDK (lossless).
        For decoding: the map must not change afterwards (`decoder_drafter` hands the decoder a copy)."""
        x = kept_logits if kept_logits.dtype == torch.float64 else kept_logits.float()
        r = self.redistribute(torch.softmax(x, dim=-1), frozen=True)
        out = torch.full_like(r, torch.finfo(r.dtype).min)
        pos = r > 0
        out[pos] = r[pos].log()
        return out


@torch.no_grad()
def build_rdk(cache: HiddenCache, target, kept_ids: torch.Tensor, exclude: set[int] | None = None,
              max_positions: int = 20000, topk: int = 16, batch_rows: int = 512,
              weights: str = "conditional", max_row_mass: float = 1.0) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Sparse affinity (parent [V], weight [V]) from the target's distributions at the cache's training
    positions (whose next token is an assistant token), at most ``max_positions`` of them; see the module doc.

    ``weights``: ``conditional`` (w_j = M*[a(j), j], the dense matrix's entry: each pruned id keeps only the
    share of its mass that co-occurs with its parent, so the map moves far less mass than the target has
    off the kept set) or ``column`` (w_j = sum_t p_t(j) / C_a(j): a pruned id's whole average mass is moved
    through its one parent, so the map moves the target's average off-set mass). A kept id's row gives away
    at most ``max_row_mass`` (rows above it are scaled down to it)."""
    if topk < 1:
        raise ValueError(f"rdk topk must be >= 1, got {topk}")
    if not 0.0 < max_row_mass <= 1.0:
        raise ValueError(f"rdk max_row_mass must be in (0, 1], got {max_row_mass}")
    if weights not in ("conditional", "column"):
        raise ValueError(f"rdk weights must be 'conditional' or 'column', got {weights!r}")
    V = target.vocab_size
    kept = kept_ids.long().cpu()
    N = len(kept)
    is_kept = torch.zeros(V, dtype=torch.bool)
    is_kept[kept] = True
    pruned_ids = (~is_kept).nonzero().flatten()
    if pruned_ids.numel() == 0:  # nothing pruned: M is the identity
        return torch.full((V,), -1, dtype=torch.long), torch.zeros(V), {"positions": 0, "attached": 0}
    c_i = torch.zeros(N, dtype=torch.float64)
    col = torch.zeros(len(pruned_ids), dtype=torch.float64)  # sum_t p_t(j) over the pruned ids, exact
    keys, vals = [], []
    used = 0
    kp, kq = min(topk, len(pruned_ids)), min(topk, N)

    def flush():
        if not keys:
            return
        k = np.concatenate(keys)
        v = np.concatenate(vals)
        u, inv = np.unique(k, return_inverse=True)
        keys[:] = [u]
        vals[:] = [np.bincount(inv, weights=v, minlength=len(u))]

    for i in range(len(cache)):
        if (exclude and i in exclude) or used >= max_positions:
            continue
        m = cache.mask(i)
        rows = np.nonzero(m[1:] > 0)[0]  # positions t whose token t+1 is an assistant token
        rows = rows[: max_positions - used]
        for s in range(0, len(rows), batch_rows):
            r = rows[s:s + batch_rows]
            h = cache.states(i, "final", int(r[0]), int(r[-1]) + 1)[torch.from_numpy(r - r[0])]
            p = torch.softmax(teacher_logits(target, h).cpu().double(), dim=-1)  # [B, V]
            q = p[:, kept]
            q = q / q.sum(-1, keepdim=True).clamp_min(1e-300)
            c_i += q.sum(0)
            col += p[:, pruned_ids].sum(0)
            qv, qi = q.topk(kq, dim=-1)  # draft ids
            pv, pj = p[:, pruned_ids].topk(kp, dim=-1)  # indices into pruned_ids
            pair = (qi[:, :, None] * len(pruned_ids) + pj[:, None, :]).reshape(-1).numpy()
            keys.append(pair)
            vals.append((qv[:, :, None] * pv[:, None, :]).reshape(-1).numpy())
            if sum(len(k) for k in keys) > 4_000_000:
                flush()
        used += len(rows)
    flush()
    parent = torch.full((V,), -1, dtype=torch.long)
    weight = torch.zeros(V, dtype=torch.float32)
    if keys:
        k, v = keys[0], vals[0]
        qi, pj = k // len(pruned_ids), k % len(pruned_ids)
        best = np.full(len(pruned_ids), -1.0)
        arg = np.full(len(pruned_ids), -1, dtype=np.int64)
        order = np.argsort(v, kind="stable")  # ascending: the last write per column is its largest entry
        best[pj[order]] = v[order]
        arg[pj[order]] = qi[order]
        has = arg >= 0
        cols = pruned_ids[torch.from_numpy(np.nonzero(has)[0])]
        par_d = torch.from_numpy(arg[has])
        num = torch.from_numpy(best[has]) if weights == "conditional" else col[torch.from_numpy(np.nonzero(has)[0])]
        w = num / c_i[par_d].clamp_min(1e-300)
        parent[cols] = kept[par_d]
        weight[cols] = w.float()
        # Conditional rows stay stochastic in exact arithmetic (docs/rdk.md; float rounding is clipped here);
        # column rows can exceed 1. Rows above max_row_mass are scaled down to it.
        mass = RDKMap.row_mass(kept, parent, weight)
        over = mass > max_row_mass
        if bool(over.any()):
            scale = torch.ones(N)
            scale[over] = max_row_mass / mass[over]
            t2d = torch.full((V,), -1, dtype=torch.long)
            t2d[kept] = torch.arange(N)
            att = parent >= 0
            weight[att] *= scale[t2d[parent[att]]]
    info = {"positions": used, "attached": int((parent >= 0).sum()), "pruned": int(len(pruned_ids)),
            "mean_row_mass_moved": float(RDKMap.row_mass(kept, parent, weight).mean())}
    return parent, weight, info


def dense_affinity_reference(p_rows: torch.Tensor, kept_ids: torch.Tensor) -> torch.Tensor:
    """The dense conditional-expectation M* [N, V] (C[i, j] / C_i over all pairs) for tests on tiny vocabularies."""
    q = p_rows[:, kept_ids]
    q = q / q.sum(-1, keepdim=True)
    c = q.T @ p_rows  # [N, V]
    return c / q.sum(0)[:, None]
