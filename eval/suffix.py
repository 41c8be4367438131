"""Model-free methods for ``draftsmith eval --suffix`` and the suffix benchmark: ours SuffixDecoding alone,
ours prompt lookup, Hugging Face prompt lookup, and the hybrid of each checkpoint's drafter with SuffixDecoding.

The global suffix index of each method learns from that method's own finished responses, in the order the
prompts are served. The benchmark's warm-up runs are not traffic: each method's index is emptied (or reloaded)
once they are done (`fresh_after_warmup`), so no prompt is helped by a response of the warm-up.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from draftsmith.drafters.suffix import (Calibration, HybridDrafter, PromptLookupDrafter, SuffixConfig, SuffixDrafter,
                                       SuffixIndex)
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.eval.bench import Method, hf_run


def fresh_after_warmup(method: Method, drafter: SuffixDrafter, index_dir: str | Path | None = None,
                       hybrid: HybridDrafter | None = None) -> Method:
    """``method`` with an ``after_warmup`` that empties (or reloads) ``drafter``'s global index once the
    benchmark's warm-up runs are done (they decode benchmark prompts: the longest one's answer would otherwise
    be in the index when that prompt is timed); a hybrid's step counts and running estimate start over too."""

    def forget():
        drafter.index = SuffixIndex.load(index_dir, drafter.config) if index_dir else SuffixIndex(drafter.config)
        drafter.lookup_s, drafter.lookups = 0.0, 0
        drafter.calibration = Calibration()  # what the counts are worth is learnt again (the costs are kept)
        if hybrid is not None:
            hybrid.steps = {"suffix": 0, "inner": 0}
            hybrid.estimate = hybrid.prior

    return dataclasses.replace(method, after_warmup=forget)


def suffix_methods(target, sampling, drafters: list, *, config: SuffixConfig | None = None, lookup_k: int = 10,
                   hf_lookup: bool = True, ours_lookup: bool = True, index_dir: str | Path | None = None,
                   prior: float = 1.0, also: list[tuple[str, SuffixConfig]] = ()
                   ) -> tuple[list[Method], dict]:
    """The model-free methods and the hybrids of ``drafters`` ([(drafter, [(tree label, tree)])]); ``also``:
    more SuffixDecoding-alone methods, ``ours suffix (LABEL)`` with their own settings (side-by-side variants).

    Returns (methods, members): members maps a method name to its `SuffixDrafter` (or `HybridDrafter`) for
    the figures `suffix_stats` reports."""
    cfg = config or SuffixConfig()
    methods: list[Method] = []
    members: dict = {}

    def suffix(c: SuffixConfig = cfg) -> SuffixDrafter:
        return SuffixDrafter(c, SuffixIndex.load(index_dir, c) if index_dir else None)

    for name, c in [("ours suffix", cfg)] + [(f"ours suffix ({label})", c) for label, c in also]:
        sd = suffix(c)
        methods.append(fresh_after_warmup(Method(name, _gen(SpeculativeDecoder(target, sd, sampling=sampling))),
                                          sd, index_dir))
        members[name] = sd
    if ours_lookup:
        pl = PromptLookupDrafter(k=lookup_k)
        methods.append(Method(f"ours {pl.name}", _gen(SpeculativeDecoder(target, pl, sampling=sampling))))
    if hf_lookup:
        methods.append(Method(f"HF prompt-lookup K={lookup_k}",
                              hf_run(target, sampling, {"prompt_lookup_num_tokens": lookup_k}), "hf"))
    for d, trees in drafters:
        for label, tree in trees:
            s = suffix()
            h = HybridDrafter(d, s, prior=prior)
            name = f"ours {h.name} {label}"
            methods.append(fresh_after_warmup(Method(name, _gen(SpeculativeDecoder(target, h, tree=tree,
                                                                                    sampling=sampling))), s,
                                              index_dir, h))
            members[name] = h
    return methods, members


def _gen(dec):
    return lambda ids, n, seed: dec.generate(ids, n, seed=seed)


def suffix_stats(members: dict) -> dict:
    """Per method: lookup time per step (both indexes), the global index's memory report, and for hybrids
    how many steps each member drafted (each drafter's ``stats()``)."""
    return {name: m.stats() for name, m in members.items()}
