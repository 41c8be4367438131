"""Opt-out CPU weight layout for decoding: column-major linears, oneDNN-packed copies, a transposed head copy.

Decoding on CPU multiplies a handful of rows (1 for plain decoding and
drafting, K+1 for verification) by every weight matrix, and MKL's kernels
for that shape depend on how the weight is stored. Measured on this
project's 2-core AMD EPYC (torch 2.13 CPU, MKL, 1 thread, SmolLM2-135M):

  * ``F.linear(x, W)`` with ``W`` [out, in] row-major (PyTorch's default)
    takes 22 ms for 1 row through 60 [1536, 576] weights and 34 ms for 2
    rows; with ``W`` stored column-major (``W.t().contiguous().t()``, same
    values, same shape) 15 ms and 20 ms; 5 and 9 rows cost about the same
    either way;
  * the 49152 x 576 LM head: 11.5 ms per row as ``F.linear``, 7 ms as
    ``x @ W_t`` with a contiguous transposed copy (1 to 3 rows); from 4
    rows on, ``(W @ x.T).T`` on the row-major weight is fastest (see
    `draftsmith.engine.drafters.project`). A column-major LM head is
    catastrophic for 2+ rows, so the head keeps its row-major weight (it
    is tied to the input embeddings) and gets a transposed copy.

  * 2+ rows through the body's linears (verification of a chain or a
    tree, a drafter's catch-up forward): oneDNN's fp32 linear on a weight
    packed once (``torch.ops.mkldnn._linear_pointwise``) beats MKL's
    ``F.linear``: a full target forward over 5 rows 96 vs 119 ms, 9 rows
    130 vs 171 ms (1 thread, prefix 300; 1 and 2 rows unchanged). The
    packed copy is a plain attribute that checks the weight's identity and
    version before each use (a changed or copied weight falls back to
    ``F.linear``), and is never used when gradients are needed. One row
    keeps MKL's product on the column-major weight, which is faster there.
  * Exactly 2 rows are padded with 2 zero rows: inside a full forward (weights
    streamed from memory, not cache-resident as in a loop over one matrix)
    the 2-row product is slower than the 4-row one. Target body over a
    200-token prefix, 1 thread: 2 rows 57-70 ms unpadded (either kernel), 51-52
    ms padded to 4; 1 row 47-50 ms; 3 rows 49-54 ms. A 2-row verification is
    what a chain of one draft (Kangaroo's double early exit, K=1) pays.

The values are unchanged; only the order of floating-point accumulation
inside the matrix products differs, as it already does between a one-row
and a many-row forward. Every method of a benchmark runs on the same
module objects, so Hugging Face's `generate` and assisted generation get
the column-major linears too (they do not use the head copy, which only
`project` reads).

Not for training: parameters are replaced (an optimizer holding the old
ones would not see them).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

WEIGHT_T = "_draftsmith_weight_t"  # attribute holding the contiguous transposed head weight
PACKED = "_draftsmith_packed"  # attribute holding a `_Packed` oneDNN copy of the weight


class _Packed:
    """A oneDNN-packed weight and the identity/version of the weight it was packed from.

    Opaque oneDNN tensors cannot be deep-copied; a copied module simply loses
    its packed weight (and falls back to ``F.linear``) instead of failing.
    """

    __slots__ = ("wid", "version", "weight")

    def __init__(self, w: torch.Tensor, packed: torch.Tensor):
        self.wid, self.version, self.weight = id(w), w._version, packed

    def __deepcopy__(self, memo):
        return None


def onednn_available() -> bool:
    """Whether this torch build has oneDNN's packed fp32 linear (``torch.ops.mkldnn._linear_pointwise``)."""
    ops = torch.ops.mkldnn
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
                and hasattr(ops, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def packed_weight(m: torch.nn.Module) -> torch.Tensor | None:
    """``m``'s oneDNN-packed weight, or None when it has none or the weight changed since packing."""
    entry = m.__dict__.get(PACKED)
    w = getattr(m, "weight", None)
    if entry is None or w is None or entry.wid != id(w) or entry.version != w._version:
        return None
    return entry.weight


def pack_onednn(m: torch.nn.Module) -> bool:
    """Attach a oneDNN-packed copy of a float32 CPU ``nn.Linear``'s weight (a plain attribute). Idempotent."""
    w = getattr(m, "weight", None)
    if not isinstance(m, torch.nn.Linear) or w is None or w.dtype != torch.float32 or w.device.type != "cpu":
        return False
    if packed_weight(m) is None:
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), None)
        m.__dict__[PACKED] = _Packed(w, packed)
    return True


def linear_rows(m: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``m(x)``: oneDNN's packed kernel for 2+ rows at inference, ``F.linear`` otherwise (same math)."""
    pk = packed_weight(m)
    if (pk is not None and x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() >= 2
            and x.numel() >= 2 * x.shape[-1]
            and not (torch.is_grad_enabled() and (x.requires_grad or m.weight.requires_grad))):
        if x.numel() == 2 * x.shape[-1]:  # 2 rows: padded to 4 (module doc); the real rows' values are kept
            flat = x.reshape(2, x.shape[-1])
            out = torch.ops.mkldnn._linear_pointwise(torch.cat([flat, flat.new_zeros(2, flat.shape[1])]), pk,
                                                     m.bias, "none", [], "")[:2]
            return out.reshape(*x.shape[:-1], out.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(x, pk, m.bias, "none", [], "")
    return F.linear(x, m.weight, m.bias)


def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
    return linear_rows(self, x)


def pack_linears(module: torch.nn.Module, *, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Give every float32 ``nn.Linear`` in ``module`` except ``skip`` a oneDNN-packed weight, and make
    its forward use it for 2+ rows. Returns how many linears are packed; 0 where oneDNN is missing."""
    if not onednn_available():
        return 0
    n = 0
    for m in module.modules():
        if type(m) is not torch.nn.Linear or any(m is s for s in skip):
            continue
        if pack_onednn(m):
            m.forward = _packed_forward.__get__(m)  # this instance only; nn.Linear itself is untouched
            n += 1
    return n


def column_major_linears(module: torch.nn.Module, *, skip: tuple[torch.nn.Module, ...] = ()) -> int:
    """Store every ``nn.Linear`` weight in ``module`` column-major, except ``skip``, tied weights and
    vocabulary projections (more than 8x as many outputs as inputs).

    Returns the number of weights changed. Idempotent.
    """
    shared: dict[int, int] = {}
    for m in module.modules():
        for p in m.parameters(recurse=False):
            shared[id(p)] = shared.get(id(p), 0) + 1
    n = 0
    for m in module.modules():
        if not isinstance(m, torch.nn.Linear) or any(m is s for s in skip):
            continue
        w = m.weight
        if shared.get(id(w), 0) > 1 or w.dim() != 2 or not w.is_contiguous() or w.shape[0] == 1:
            continue  # tied (e.g. to embeddings), or already column-major
        if w.shape[0] > 8 * w.shape[1]:
            continue  # a vocabulary projection: column-major is slow for 2+ rows (see above)
        m.weight = torch.nn.Parameter(w.detach().t().contiguous().t(), requires_grad=w.requires_grad)
        n += 1
    return n


def attach_transposed_head(head: torch.nn.Module) -> bool:
    """Give a bias-free ``nn.Linear`` output head a contiguous transposed copy of its weight (for `project`)."""
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    w = head.weight.detach()
    wt = getattr(head, WEIGHT_T, None)
    if wt is None or wt.shape != (w.shape[1], w.shape[0]) or wt.device != w.device or wt.dtype != w.dtype:
        object.__setattr__(head, WEIGHT_T, w.t().contiguous())  # a plain attribute: not a parameter or buffer
    return True


def cpu_decode_layout(*models: torch.nn.Module) -> dict:
    """Apply the decoding layout to CPU models (the target, drafter models, head modules).

    For each model: its output head (``get_output_embeddings()`` or an
    ``lm_head`` attribute) gets a transposed copy, every other linear goes
    column-major. CUDA models are left alone. Returns what was done.
    """
    done = {"linears": 0, "packed": 0, "heads": 0}
    for model in models:
        if model is None:
            continue
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cpu":
            continue
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else getattr(model, "lm_head", None)
        heads = (head,) if isinstance(head, torch.nn.Module) else ()
        dh = getattr(model, "draft_head", None)  # a pruned output head (heads/vocab.py) is laid out as a head
        heads += (dh,) if isinstance(dh, torch.nn.Module) else ()
        done["linears"] += column_major_linears(model, skip=heads)
        done["packed"] += pack_linears(model, skip=heads)
        done["heads"] += sum(attach_transposed_head(h) for h in heads)
        if onednn_available():
            for h in heads:
                pack_onednn(h)  # read by `project` only; the head's own forward is not changed
    return done


def apply_cpu_layout(target, *drafters) -> dict:
    """`cpu_decode_layout` on a target's model and on each drafter's modules (model drafters' models,
    head drafters' heads); a no-op on CUDA. Returns counts, for the report."""
    mods = [target.model]
    for d in drafters:
        mods.append(getattr(d, "model", None) if getattr(d, "model", None) is not None else getattr(d, "heads", None))
    done = cpu_decode_layout(*mods)
    done["applied"] = next(target.model.parameters()).device.type == "cpu"
    return done
