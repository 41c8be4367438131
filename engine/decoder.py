"""The lossless speculative decoder: one loop for every drafter family, chains and trees.

One step = draft a tree (a chain is a tree) -> one target forward over the
root and every drafted node (tree attention through the model's public
forward: 4D additive mask, depth position ids, a pre-allocated `KVCache`)
-> walk the tree with the verification rule -> keep only the accepted path's
KV entries, compacted -> emit accepted tokens plus one final token (residual
or bonus). Without a drafter the same step is plain decoding (our baseline).

State convention: ``state.tokens[:state.length]`` are committed and
``state.tokens[state.length]`` (the root) is emitted but not yet cached;
``state.tokens[:state.cached]`` are in the target's cache. The prefill
covers the prompt minus its last token and is fused into the first step's
forward (plain decoding: one forward per token, as in HF ``generate``),
except for head drafters, which need the target's hidden state before their
first draft and get a separate prefill forward, not counted as a decoding
forward (see metrics.py).

Choices, documented here once:
  * empty prompt: ValueError (no position to predict from);
  * ``max_new_tokens == 0``: returns an empty result without any forward;
  * batch size: 1 only; a batch of more rows raises ValueError;
  * prompt + max_new_tokens + largest draft block > context length: ValueError;
  * an EOS token (drafted or final) ends the output; it is included, nothing after it;
  * host syncs: greedy chains and static trees with `FixedLength` sync once per
    step (tokens + target argmax in one transfer); sampling, dynamic trees and
    confidence policies sync per draw or round (their control flow depends on
    the values);
  * one decoder runs one generation at a time: its KV cache is allocated once
    and reused (grown only when a longer generation needs it).
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.capabilities import capabilities, check_drafter
from draftsmith.engine.drafters import project
from draftsmith.engine.drafting import GrowContext, grow_chain, grow_dynamic, grow_static
from draftsmith.engine.kvcache import KVCache, prefix_block_mask, sliding_windows, window_masks
from draftsmith.engine.metrics import DecodeResult, StepStats
from draftsmith.engine.policies import FixedLength, LengthPolicy
from draftsmith.engine.sampling import RandomSource, SamplingParams, TorchRandom
from draftsmith.engine.trees import DraftTree, DynamicTree, StaticTree, Verdict, verify_tree
from draftsmith.target import Target

ACCEPTANCE = ("exact", "typical")


@dataclass
class DecodeState:
    """Where one generation stands; `clone` gives an independent copy sharing the caches."""

    tokens: list[int]  # prompt + emitted
    prompt_len: int
    length: int  # tokens[:length] are committed (in the target's KV cache once `cached` catches up)
    hidden: torch.Tensor | None  # target's last hidden state (after the final norm) at length-1, [1, d]
    max_new_tokens: int
    # the target's hidden states of the positions committed by the last prefill or step, ending at length-1
    # (drafters that read the whole history, e.g. Hydra++'s prefix layer, consume them)
    fresh_hidden: torch.Tensor | None = None
    drafter_state: Any = None
    cached: int = 0  # tokens[:cached] are in the target's cache; the rest of the prefix rides with the next forward
    # the deepest level this step's draft can reach (set by `draft`); nodes at this depth get no children,
    # so a drafter may skip the work for them (Medusa: the heads past it are not projected)
    draft_depth: int | None = None
    done: bool = False
    stop_reason: str | None = None
    steps: list[StepStats] = field(default_factory=list)

    @property
    def emitted(self) -> int:
        return len(self.tokens) - self.prompt_len

    def clone(self) -> "DecodeState":
        c = copy.copy(self)
        c.tokens, c.steps = list(self.tokens), list(self.steps)
        c.drafter_state = copy.copy(self.drafter_state)
        return c


def as_prompt(prompt_ids: Sequence[int] | torch.Tensor) -> list[int]:
    """A single prompt as a list of ids; rejects batches of more than one row and empty prompts."""
    if isinstance(prompt_ids, torch.Tensor):
        if prompt_ids.dim() == 2:
            if prompt_ids.shape[0] != 1:
                raise ValueError(f"the decoder supports batch size 1 only; got a batch of {prompt_ids.shape[0]}")
            prompt_ids = prompt_ids[0]
        elif prompt_ids.dim() != 1:
            raise ValueError(f"prompt_ids must be [P] or [1, P], got shape {tuple(prompt_ids.shape)}")
        ids = [int(x) for x in prompt_ids.tolist()]
    else:
        ids = list(prompt_ids)
        if ids and isinstance(ids[0], (list, tuple)):
            if len(ids) != 1:
                raise ValueError(f"the decoder supports batch size 1 only; got a batch of {len(ids)}")
            ids = list(ids[0])
        ids = [int(x) for x in ids]
    if not ids:
        raise ValueError("empty prompt: the decoder needs at least one prompt token (e.g. a BOS or chat header)")
    return ids


class SpeculativeDecoder:
    """Lossless speculative decoding for one target and (optionally) one drafter.

    Args:
      target: the target model (`draftsmith.target.Target`).
      drafter: a `Drafter` (head, model or self drafter), or None for plain decoding.
      tree: None for chains (length from ``policy``), a `StaticTree` or a list of rank
        paths, or a `DynamicTree`.
      policy: drafting-length policy for chains (default: the drafter's ``default_policy`` if it has
        one, e.g. Kangaroo's confidence stop, else `FixedLength(4)`).
      sampling: temperature / top-k / top-p, applied identically to draft and target.
      acceptance: "exact" (lossless, default) or "typical" (Medusa's, LOSSY at T > 0).
      sync_timing: on CUDA, synchronise at phase boundaries so time shares are exact.
    """

    def __init__(self, target: Target, drafter: Any = None, *, tree: Any = None, policy: LengthPolicy | None = None,
                 sampling: SamplingParams | None = None, acceptance: str = "exact", sync_timing: bool = False):
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"acceptance must be one of {ACCEPTANCE}, got {acceptance!r}")
        self.target, self.drafter = target, drafter
        self.caps = capabilities(drafter)  # what the drafter can do, read and checked once
        self.sampling = sampling or SamplingParams()
        self.acceptance = acceptance
        self.policy = policy or self.caps.default_policy or FixedLength(4)
        if tree is not None and not isinstance(tree, (StaticTree, DynamicTree)):
            tree = StaticTree(tree)
        self.tree = tree
        self.model = target.model
        self.body = self.model.get_decoder()
        # the target's forward for prefill and verification: our static-shape one (engine/fastpath.py) when
        # `use_fast_forward` put it on the target, else the model's own body
        self.fast = getattr(target, "fast_body", None)
        self.lm_head = self.model.get_output_embeddings()
        p = next(self.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.windows = sliding_windows(target.model.config)  # layers that slide: their masks carry the window
        self.eos = frozenset(target.eos_token_ids)
        self.sync_timing = sync_timing and self.device.type == "cuda"
        self.cache: KVCache | None = None
        self.capacity = 0
        self._caches: dict[int, KVCache] = {}  # compiled forward: caches of other capacities, kept for reuse
        # per-request logits processing (penalties, logit bias, logprobs: engine/processors.py), or None;
        # applied to the target's logits at every tree node and to the draft's before q is formed
        self.processing: Any = None
        if drafter is not None:
            check_drafter(self.caps, target, self.tree)
        if self.fast is not None:
            self.fast.reserve(1)
            self.fast.reserve(self.max_block)

    @property
    def max_block(self) -> int:
        """Most entries one verification forward adds: the root plus the largest draft."""
        if self.drafter is None:
            return 1
        own = self.caps.max_nodes  # a drafter that builds its own trees (draft_tree)
        if self.tree is None:
            return 1 + max(own, self.policy.max_len)
        return 1 + max(own, self.tree.size)

    # ------------------------------------------------------------------ setup
    @torch.no_grad()
    def start(self, prompt_ids, max_new_tokens: int) -> DecodeState:
        """Validate, (re)use the pre-allocated cache; prefill now only for drafters that need the target's hidden
        state."""
        ids = as_prompt(prompt_ids)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        need = len(ids) + max_new_tokens + self.max_block
        limits = [("target", self.target.context_length)]
        if self.caps.context_length:
            limits.append(("drafter", self.caps.context_length))
        for who, ctx in limits:
            if need > ctx:
                raise ValueError(
                    f"prompt too long: {len(ids)} prompt tokens + {max_new_tokens} new tokens + a draft block of "
                    f"{self.max_block} = {need} positions exceed the {who}'s context length {ctx}")
        if max_new_tokens == 0:
            return DecodeState(tokens=ids, prompt_len=len(ids), length=len(ids) - 1, hidden=None,
                               max_new_tokens=0, done=True, stop_reason="max_new_tokens")
        if self.fast is not None and self.fast.compiled is not None:
            # a compiled forward attends over the whole cache (static shapes): few capacities, few graphs, and
            # each generation in the smallest that holds it (a long prompt earlier does not slow later steps)
            cap = 1 << max(need - 1, 511).bit_length()
            if self.cache is None or self.capacity != cap:
                if self.cache is not None:
                    self._caches[self.capacity] = self.cache
                self.capacity = cap
                self.cache = self._caches.pop(cap, None) or KVCache.for_model(self.model, cap)
        elif self.cache is None or self.capacity < need:
            self.capacity = max(need, 256)
            self.cache = KVCache.for_model(self.model, self.capacity)
        L = len(ids) - 1
        state = DecodeState(tokens=ids, prompt_len=len(ids), length=L, hidden=None, max_new_tokens=max_new_tokens)
        if self.caps.needs_target_hidden:
            self.prefill(state)  # head drafters read the target's hidden state at L-1 before their first draft
        if self.drafter is not None:
            state.drafter_state = self.drafter.start(self, state)
        reset = getattr(self.policy, "reset", None)  # optional policy hook (policies.py): online state per generation
        if reset is not None:
            reset()
        return state

    def _windowed(self, mask, q_pos: torch.Tensor, block_pos: torch.Tensor):
        """``mask`` (a block of new entries after ``c`` cached ones, or None: the model builds its own) with the
        target's sliding windows applied: the cached slots' positions are their indices, the block's entries
        have ``block_pos`` [1, kb]."""
        if mask is None or not self.windows:
            return mask
        c = mask.shape[-1] - block_pos.shape[-1]
        kv = torch.cat([torch.arange(c, device=self.device)[None], block_pos], dim=1)
        return window_masks(self.windows, mask, q_pos, kv)

    @torch.no_grad()
    def prefill(self, state: DecodeState) -> None:
        """Put the committed tokens not yet cached into the target's cache now (normally fused into the
        first step's forward); sets ``state.hidden``. Not counted as a decoding forward."""
        c, L = state.cached, state.length
        if c >= L:
            return
        self.cache.set_write(c)
        mask = None if c == 0 else prefix_block_mask(
            c, torch.ones(L - c, L - c, dtype=torch.bool, device=self.device).tril(), self.dtype)
        ids, pos = torch.tensor([state.tokens[c:L]], device=self.device), torch.arange(c, L, device=self.device)[None]
        mask = self._windowed(mask, pos, pos)
        if self.fast is not None:
            h = self.fast(input_ids=ids, position_ids=pos, attention_mask=mask, cache=self.cache,
                          want_logits=False).last_hidden_state
        else:
            h = self.body(input_ids=ids, position_ids=pos, attention_mask=mask,
                          **cache_arg(self.body, self.cache), use_cache=True).last_hidden_state
        state.hidden, state.cached = h[0, -1:], L
        state.fresh_hidden = h[0] if c == 0 or state.fresh_hidden is None else torch.cat([state.fresh_hidden, h[0]])

    # ------------------------------------------------------------------ one step, in phases
    @torch.no_grad()
    def draft(self, state: DecodeState, rng: RandomSource) -> DraftTree:
        """Grow this step's draft tree (root only when there is no drafter or no room)."""
        tree = DraftTree(state.tokens[state.length], self.max_block - 1, self.device)
        cap = state.max_new_tokens - state.emitted - 1  # the final token always takes one slot
        own = self.caps.draft_tree
        if own is not None and cap > 0 and own(self, state, tree, cap):
            return tree  # the drafter built this step's tree itself (model-free: deterministic candidates)
        md = self.caps.max_depth
        if md is not None:
            cap = min(cap, md)
        if self.drafter is None or cap <= 0:
            return tree
        if self.tree is None:
            state.draft_depth = min(cap, self.policy.max_len)
        elif isinstance(self.tree, StaticTree):
            state.draft_depth = min(cap, self.tree.depth)
        else:
            state.draft_depth = min(cap, self.tree.max_depth)
        ds = state.drafter_state
        propose = lambda t, s, e: self.drafter.propose(self, state, t, s, e)  # noqa: E731
        proc = self.processing
        if proc is not None and proc.active and proc.process_draft:
            def propose(t, s, e, raw=propose):
                lg = raw(t, s, e)
                return None if lg is None else proc.node_logits(state.tokens[:state.length + 1], state.prompt_len,
                                                                 t, s, e, lg)
        ctx = GrowContext(
            propose=propose,
            sampling=self.sampling, ranked=self.sampling.greedy or self.acceptance == "typical",
            rng=rng, eos=self.eos, depth_cap=cap, any_range=self.caps.any_range,
            features=(lambda: getattr(ds, "hidden", None)) if ds is not None else None)
        if self.tree is None:
            grow_chain(tree, ctx, self.policy)
        elif isinstance(self.tree, StaticTree):
            grow_static(tree, ctx, self.tree)
        else:
            grow_dynamic(tree, ctx, self.tree)
        return tree

    @torch.no_grad()
    def verify_forward(self, state: DecodeState, tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
        """One target forward over the root and every drafted node: (logits [n+1, V], hidden [n+1, d])."""
        hook = self.caps.verify_forward
        if hook is not None:
            return hook(self, state, tree)
        L, m, c = state.length, tree.n + 1, state.cached
        pre = L - c  # committed tokens not in the cache yet (the prompt, when the prefill is fused)
        ids = tree.tokens()
        if pre:
            ids = torch.cat([torch.tensor(state.tokens[c:L], device=self.device), ids])
        if tree.is_chain():
            pos = torch.arange(c, L + m, device=self.device)
            # With no cached prefix the block is plain causal (sdpa's is_causal); otherwise spell it out.
            mask = None if c == 0 or pre + m == 1 else prefix_block_mask(
                c, torch.ones(pre + m, pre + m, dtype=torch.bool, device=self.device).tril(), self.dtype)
        else:
            pos, block = tree.verify_rows(c, L, self.device)
            mask = prefix_block_mask(c, block, self.dtype)
        mask = self._windowed(mask, pos[None], pos[None])
        self.cache.set_write(c)
        if self.fast is not None:
            out = self.fast(input_ids=ids[None], position_ids=pos[None], attention_mask=mask, cache=self.cache,
                            logits_from=pre)
            return out.logits[0], out.last_hidden_state[0, pre:]
        h = self.body(input_ids=ids[None], position_ids=pos[None], attention_mask=mask,
                      **cache_arg(self.body, self.cache), use_cache=True).last_hidden_state[0, pre:]
        return project(self.lm_head, h), h

    def verify(self, state: DecodeState, tree: DraftTree, logits: torch.Tensor, rng: RandomSource) -> Verdict:
        proc = self.processing
        if proc is None:
            return verify_tree(tree, logits, self.sampling, rng, self.eos, self.acceptance)
        logits = proc.node_logits(state.tokens[:state.length + 1], state.prompt_len, tree, 0, tree.n + 1, logits)
        verdict = verify_tree(tree, logits, self.sampling, rng, self.eos, self.acceptance)
        proc.record(tree, logits, verdict)
        return verdict

    def commit(self, state: DecodeState, tree: DraftTree, verdict: Verdict, hidden: torch.Tensor) -> list[int]:
        """Keep the accepted path's KV (compacted), advance the state, return the emitted tokens."""
        L = state.length
        self.cache.compact([L + i for i in verdict.path[1:]], L + 1)
        if self.drafter is not None:
            self.drafter.commit(self, state, tree, verdict.path)
        state.hidden = hidden[verdict.path[-1]][None]
        state.fresh_hidden = hidden[verdict.path]
        out = list(verdict.tokens)
        room = state.max_new_tokens - state.emitted
        if len(out) > room:  # cannot happen (drafts are capped), kept as a guard
            raise RuntimeError(f"step emitted {len(out)} tokens with room for {room}")
        hit = next((i for i, t in enumerate(out) if t in self.eos), None)
        if hit is not None:
            out = out[: hit + 1]
            state.done, state.stop_reason = True, "eos"
        state.tokens.extend(out)
        state.length = state.cached = L + 1 + verdict.accepted
        if not state.done and state.emitted >= state.max_new_tokens:
            state.done, state.stop_reason = True, "max_new_tokens"
        return out

    def _now(self) -> float:
        if self.sync_timing:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @torch.no_grad()
    def step(self, state: DecodeState, rng: RandomSource) -> StepStats:
        """Draft, verify with one target forward, commit. Appends and returns the step's stats."""
        if state.done:
            raise RuntimeError("step() on a finished generation")
        t0 = self._now()
        tree = self.draft(state, rng)
        t1 = self._now()
        rows, context = state.length - state.cached + tree.n + 1, state.cached  # for step-cost simulation (sim/)
        logits, hidden = self.verify_forward(state, tree)
        verdict = self.verify(state, tree, logits, rng)
        observe = getattr(self.policy, "observe", None)  # optional policy hook (policies.py): traces, online refits
        if observe is not None and self.tree is None and self.drafter is not None:
            observe(state, tree, verdict, logits)
        t2 = self._now()
        out = self.commit(state, tree, verdict, hidden)
        t3 = self._now()
        st = StepStats(emitted=len(out), accepted=verdict.accepted, attempted=verdict.attempted, drafted=tree.n,
                       draft_s=t1 - t0, verify_s=t2 - t1, other_s=t3 - t2, rows=rows, context=context)
        state.steps.append(st)
        return st

    # ------------------------------------------------------------------ whole generation
    @torch.no_grad()
    def generate(self, prompt_ids, max_new_tokens: int = 128, *, rng: RandomSource | None = None,
                 seed: int | None = None) -> DecodeResult:
        """Generate up to ``max_new_tokens`` tokens for one prompt (batch size 1)."""
        rng = rng if rng is not None else TorchRandom(seed)
        t0 = self._now()
        state = self.start(prompt_ids, max_new_tokens)
        t1 = self._now()
        while not state.done:
            self.step(state, rng)
        finish = self.caps.finish  # optional: a drafter that learns from finished responses
        if finish is not None:
            finish(self, state)
        t2 = self._now()
        return DecodeResult(tokens=state.tokens[state.prompt_len:], prompt_len=state.prompt_len, steps=state.steps,
                            prefill_s=t1 - t0, wall_s=t2 - t0, stop_reason=state.stop_reason or "max_new_tokens")


def plain_decoder(target: Target, sampling: SamplingParams | None = None) -> SpeculativeDecoder:
    """Plain autoregressive decoding on the same pre-allocated cache (the baseline)."""
    return SpeculativeDecoder(target, None, sampling=sampling)
