"""The target's intermediate states as a decoder's forwards leave them: forward hooks on chosen decoder layers.

Drafters that read several of the target's layers (EAGLE-3's three fused states, DFlash's context features) do
not change the decoder's forward: every target forward the decoder runs (a prefill, a verification, the fused
step, which calls the layers' hooks with its outputs) leaves the hooked layers' outputs behind, and the drafter
reads the rows it needs. The hooks hold the captured tensors' dict, not the drafter, so a drafter nobody holds
is collected and its ``close`` (or ``__del__``) takes the hooks off the target's layers.
"""

from __future__ import annotations

import torch

from draftsmith.common.hidden_cache import decoder_of


def _capture(store: dict, j: int):
    def hook(_module, _args, output):
        store[j] = output[0] if isinstance(output, tuple) else output
    return hook


class LayerTap:
    """Hooks on the target's decoder layers ``layers`` (Hugging Face ``hidden_states`` indices: N = the output of
    decoder layer N, 1-based); `features` concatenates the last forward's outputs in that order."""

    def __init__(self, target, layers: list[int], what: str):
        self.layers, self.what = [int(i) for i in layers], what
        body = decoder_of(target.model)
        n = len(body.layers)
        bad = [i for i in self.layers if not 1 <= i <= n]
        if bad:
            raise ValueError(f"{what} reads the outputs of layers {bad}, but the target has layers 1..{n}")
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [body.layers[i - 1].register_forward_hook(_capture(self._captured, j))
                       for j, i in enumerate(self.layers)]

    def close(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def features(self, row: int = 0) -> torch.Tensor:
        """[entries, len(layers) x H]: the last target forward's outputs of the hooked layers for batch row ``row``
        of that forward."""
        if len(self._captured) != len(self.layers):
            raise RuntimeError(f"no target states captured for {self.what}: the target's forward did not run "
                               "through its layers")
        return torch.cat([self._captured[j][row] for j in range(len(self.layers))], dim=-1)


class TappedDrafter:
    """What a single-sequence drafter that reads the target's layers through a `LayerTap` (``self.tap``) does the
    same way whatever it drafts with (EAGLE-3, DFlash): its state (``state.drafter_state``) holds ``feats``, the
    target's states not fed to it yet, and ``pending(feats)`` gives the state with those to feed next. After each
    verification the rows of the accepted path are appended (``commit``); a step another drafter drafted (the
    hybrid's SuffixDecoding, a plain step) is kept the same way (``observe_step``), as the next own step feeds
    every committed position."""

    tap: LayerTap

    def close(self) -> None:
        """Remove the hooks from the target's layers."""
        tap = self.__dict__.get("tap")  # absent when the constructor failed before it
        if tap is not None:
            tap.close()

    def __del__(self):
        self.close()

    def commit(self, dec, state, tree, path: list[int]) -> None:
        """Keep the target's states of the root and the accepted nodes (this step's verification rows)."""
        f = self.tap.features()
        self.keep(state, f[f.shape[0] - (tree.n + 1):], path)  # any uncached prefix comes first

    def observe_step(self, dec, state, tree, path: list[int]) -> None:
        self.commit(dec, state, tree, path)

    @staticmethod
    def keep(state, block: torch.Tensor, path: list[int]) -> None:
        """Append the target's states of the accepted path (``block``: the root's and the nodes' rows) to what
        the next step feeds."""
        ds = state.drafter_state
        new = block[torch.tensor(path, device=block.device)].to(ds.feats.dtype)
        state.drafter_state = ds.pending(torch.cat([ds.feats, new]))

    def batch_adapter(self) -> "TappedRows":
        """Batched decoding: this drafter's steps row by row (`TappedRows`)."""
        return TappedRows(self)


class TappedRows:
    """Batched decoding (`draftsmith.engine.batched.BatchedSpeculativeDecoder`) for a single-sequence drafter that
    reads the target's layers through a `LayerTap` (EAGLE-3's, DFlash's): each row keeps the drafter's own state in
    its `DecodeState`; the target's states come from the same hooks, after each row's prefill forward (one row per
    forward, ``prefilled``) and from the batched verification forward, whose batch row ``row`` holds that live
    row's block (``commit``). Drafting runs the drafter's ``propose`` row by row: rows differ in prefix length and
    tree, and the drafter is small next to the target's verification of every row.

    The drafter provides ``start(dec, state)``, ``propose(dec, state, tree, start, end)``, ``keep(state, rows,
    path)`` and ``tap`` (its `LayerTap`)."""

    def __init__(self, drafter):
        self.drafter = drafter

    def prefilled(self, row: int, state) -> None:
        state.drafter_state = self.drafter.start(None, state)

    def start(self, dec, states: list, capacity: int, rows: int) -> None:
        pass  # each row was started by `prefilled`, right after its prefill forward

    def join(self, dec, state) -> None:
        pass  # as `start`: `prefilled` started it

    def begin_step(self, states: list) -> None:
        pass

    @torch.no_grad()
    def propose(self, rows: list[int], states: list, trees: list, ranges: list[tuple[int, int]]) -> list:
        return [self.drafter.propose(None, s, t, a, b) for s, t, (a, b) in zip(states, trees, ranges)]

    def commit(self, row: int, dec, state, tree, path: list[int]) -> None:
        self.drafter.keep(state, self.drafter.tap.features(row)[: tree.n + 1], path)

    def history(self, state, old: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        return new

    def move_row(self, src: int, dst: int, src_state) -> None:
        pass  # per-row state lives in the row's DecodeState
