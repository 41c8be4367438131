"""Opt-in CPU weight layout for decoding: column-major linear weights, a transposed LM head copy.

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
    `draftsmith.eval.drafters.project`). A column-major LM head is
    catastrophic for 2+ rows, so the head keeps its row-major weight (it
    is tied to the input embeddings) and gets a transposed copy.

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

WEIGHT_T = "_draftsmith_weight_t"  # attribute holding the contiguous transposed head weight


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
    done = {"linears": 0, "heads": 0}
    for model in models:
        if model is None:
            continue
        p = next(model.parameters(), None)
        if p is None or p.device.type != "cpu":
            continue
        get = getattr(model, "get_output_embeddings", None)
        head = get() if callable(get) else getattr(model, "lm_head", None)
        heads = (head,) if isinstance(head, torch.nn.Module) else ()
        done["linears"] += column_major_linears(model, skip=heads)
        done["heads"] += sum(attach_transposed_head(h) for h in heads)
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
