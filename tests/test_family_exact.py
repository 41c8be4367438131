"""Exact enumeration of the decoder on every family's tiny target: each kind the family takes, as a chain and (the
head kinds and EAGLE-3) a static tree, sampling under top-k 3 at T=1, in float64, gives the target's own
distribution over 2 new tokens (TV < 1e-9 against cache-free forwards), from a prompt already past Gemma 3's
window."""

from __future__ import annotations

import pytest
import torch

from draftsmith import registry
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.kvcache import sliding_windows
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from tests.families import FAMILIES, family_target
from tests.test_families import KINDS, PROMPT, REFUSED, TREES

N_NEW = 2
TOPK = SamplingParams(1.0, top_k=3)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_kind_samples_the_targets_distribution_exactly(family):
    tgt = family_target(family)
    tgt.model.double()
    ref = target_distribution(tgt, PROMPT, N_NEW, TOPK.temperature, TOPK.top_k, TOPK.top_p)
    assert abs(sum(ref.values()) - 1) < 1e-9 and len(ref) > 4  # several outcomes, not one
    checked, drafters = 0, {}
    for name, (kind, fields) in KINDS.items():
        if (family, name) in REFUSED or (name == "kangaroo" and sliding_windows(tgt.model.config)):
            continue
        torch.manual_seed(1)
        m = registry.get(kind).for_target(tgt, **fields).double().eval()
        if name != "standalone":  # the standalone drafter keeps the target's first layer: drafts often accepted
            with torch.no_grad():  # random weights everywhere else, so that every path through them matters
                for p in m.parameters():
                    if p.requires_grad and p.dim() == 2:
                        p.normal_(0, 1.5 / p.shape[1] ** 0.5)
        d = drafters[name] = m.decoder_drafter(tgt, tgt.fingerprint)
        modes = {"chain": dict(policy=FixedLength(2))}
        if name in TREES:
            modes["tree"] = dict(tree=[(0,), (1,), (0, 0)])
        for mode, kw in modes.items():
            got = exact_distribution(SpeculativeDecoder(tgt, d, sampling=TOPK, **kw), PROMPT, N_NEW)
            assert total_variation(got, ref) < 1e-9, (family, name, mode)
            checked += 1
    assert checked >= 6
    # the enumeration goes through acceptances, not only rejections: each drafter's drafts are sometimes accepted
    # (checked on two families, the most different ones; the drafters are built alike on every family)
    for name, d in drafters.items() if family in ("llama", "gemma3") else ():
        if (family, name) == ("gemma3", "dflash"):
            # an untrained DFlash block on Gemma 3: the slots' residual is the mask token's embedding, scaled by
            # sqrt(H), and the head is the same embedding (tied), so q peaks on the tokens whose embeddings lie
            # nearest the mask's (the mask itself is never drafted), which the target's top 3 never hold (0
            # accepted in 100 steps); its exactness is checked above all the same
            continue
        dec = SpeculativeDecoder(tgt, d, sampling=TOPK, policy=FixedLength(2))
        runs = [dec.generate(PROMPT, 20, seed=s) for s in range(5)]
        assert sum(len(r.tokens) for r in runs) > sum(r.target_forwards for r in runs), (family, name)
