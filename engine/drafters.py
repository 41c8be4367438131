"""The drafter interface; each kind's drafters live in the kind's folder.

A drafter proposes the next-token logits for the children of tree nodes.
The decoder calls, per generation and per step:
  * ``start(dec, state) -> drafter state`` once per generation (prefill the
    drafter's own cache over ``state.tokens[:state.length]``). The target's
    prefill is fused into the first verification forward unless the drafter
    sets ``needs_target_hidden = True`` (then ``state.hidden``, the target's
    last hidden state at ``length - 1``, is ready before the first draft);
  * ``propose(dec, state, tree, start, end) -> logits [end - start, V] | None``
    for the contiguous node range [start, end) of this step's draft tree
    (node 0 is the root, the last emitted token; ``tree.parent``,
    ``tree.depth`` and ``tree.tok`` give every path); None means "cannot
    draft now" and the step falls back to plain decoding;
  * ``commit(dec, state, tree, path)`` after verification, before the
    decoder advances ``state.length``; ``path`` lists the accepted nodes.
Drafter state lives in ``state.drafter_state`` and is copied with
``copy.copy`` when a decode state is cloned.

Families:
  * heads on the target's last hidden state (Medusa, Hydra, Hydra++):
    ``draftsmith.heads.decode.HeadDrafter``;
  * any causal LM over the target's vocabulary, with its own pre-allocated
    KV cache and tree attention: ``draftsmith.drafters.standalone.decode.
    ModelDrafter`` (``first_layers_drafter`` there builds an untrained
    baseline from the target's first layers);
  * EAGLE-3 in drafters/eagle3;
  * Self-drafters (Kangaroo) share the target's first layers: they get the
    decoder (its ``cache``, ``body``) in ``propose``, and may define
    ``verify_forward(dec, state, tree) -> (logits, hidden)`` to replace the
    decoder's full target forward (e.g. to reuse the shallow states).
Model-free drafters (suffix trees, prompt lookup) build the whole tree
themselves: ``draft_tree(dec, state, tree, cap) -> bool`` is called first
at every step with the room left (``cap`` drafted tokens at most); it adds
nodes with ``tree.add`` and puts every node whose children it proposed with
certainty in ``tree.certain`` (verified by `sampling.verify_node_certain`,
no q), and returns False to let the decoder grow the tree from ``propose``
as usual (a hybrid deferring to its trained drafter). ``max_nodes`` is the
largest tree it builds; ``finish(dec, state)`` is called after a
generation ends (a global index learning from finished responses).
Optional drafter attributes (``default_policy``, ``supports_trees``,
``max_depth``, ...) and the batched adapter (``batch_adapter()``) are read
in one place, `draftsmith.engine.capabilities`. A checkpoint's module that
has ``decoder_drafter(target, fingerprint, name)`` builds its own drafter.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from draftsmith.engine.cpu_layout import WEIGHT_T, linear_rows, packed_weight
from draftsmith.engine.native import decode_linear, rows_linear_applies, rows_linear_on
from draftsmith.engine.trees import DraftTree


def project(head: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``head(x)`` for [n, d] rows, with the fastest CPU kernel for few rows (same math).

    float32 on CPU (bf16 on a CPU without bf16 instructions), up to `ROWS_LINEAR_MAX` rows:
    `draftsmith.engine.native.decode_linear` (on a 2-core AVX2 EPYC, 2 threads,
    49152 x 576: 4.0 ms for 1 row and 5.2 ms for 4, against 8.8 and 21.6 ms for F.linear). Otherwise,
    measured on this project's CPU (MKL, 1 thread, 49152 x 576 head): F.linear
    takes ~2x longer for 2-8 rows than the transposed product (19 vs 10 ms
    for 4 rows). With `draftsmith.engine.cpu_layout` the head also carries a
    contiguous transposed weight, and 1-3 rows use ``x @ W_t`` (7 vs 11.5 ms
    for one row).
    """
    w = getattr(head, "weight", None)
    if isinstance(head, torch.nn.Linear) and x.dim() == 2 and rows_linear_on() and rows_linear_applies(x, w):
        return decode_linear(x, w, head.bias)  # the native kernel, at about the memory's bandwidth
    if x.device.type == "cpu" and isinstance(head, torch.nn.Linear) and head.bias is None and x.dim() == 2:
        wt = getattr(head, WEIGHT_T, None)
        if wt is not None and x.shape[0] == 1 and wt.dtype == x.dtype:
            return x @ wt
        if x.shape[0] > 1 and packed_weight(head) is not None:
            return linear_rows(head, x)
        if wt is not None and x.shape[0] <= 3 and wt.dtype == x.dtype:
            return x @ wt
        if 1 < x.shape[0] <= 16:
            return (w @ x.T).T
    return head(x)


class Drafter(Protocol):
    """What the decoder needs from a drafter (see the module docstring)."""

    name: str
    max_depth: int | None  # deepest draft it can make (Medusa: its number of heads); None = any
    target_fingerprint: str | None  # the target it was made for; checked by the decoder

    def start(self, dec: Any, state: Any) -> Any: ...

    def propose(self, dec: Any, state: Any, tree: DraftTree, start: int, end: int) -> torch.Tensor | None: ...

    def commit(self, dec: Any, state: Any, tree: DraftTree, path: list[int]) -> None: ...


@runtime_checkable
class SelfDrafter(Protocol):
    """A drafter that drafts from the target's own shallow layers (Kangaroo, early exit): it can verify at full
    depth instead of reusing its shallow states, and stops its chain on a confidence threshold."""

    name: str
    default_policy: Any

    def variant(self, *, policy: Any = None, full_verify: bool | None = None, name: str | None = None) -> Any: ...

    def set_confidence(self, threshold: float) -> None: ...


