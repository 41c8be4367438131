"""Exact losslessness: the decoder's output distribution, enumerated exactly, equals the target's.

Tiny random float64 models with a 6-token vocabulary (EOS included, so
early stops are covered), 3 new tokens. `exact_distribution` enumerates
every draft draw and every acceptance branch of the real decoder phases
(draft, target forward, verification walk, commit); `target_distribution`
multiplies the target's own next-token probabilities from cache-free full
forwards. Lossless means total variation below 1e-9; a deliberately lossy
rule (Medusa's typical acceptance) shows the check has teeth.

Every test runs twice: through the model's own forward and through our compiled static-shape forward
(engine/fastpath.py; inductor without GEMM autotuning, which these float64 models would not use anyway).
"""

import pytest
import torch

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.trees import DynamicTree
from draftsmith.heads.decode import HeadDrafter
from draftsmith.engine.fastpath import use_fast_forward
from tests.test_decoder import PathHeads, other_model_drafter, random_medusa, tiny

PROMPT = [1, 3, 4, 3]
N_NEW = 3
TEMP = SamplingParams(0.8)
TOPKP = SamplingParams(1.0, top_k=4, top_p=0.95)


@pytest.fixture(scope="module", params=["model-forward", "compiled"])
def tgt(request):
    t = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)
    if request.param == "compiled":
        use_fast_forward(t, "compile", autotune=False)
    return t


@pytest.fixture(scope="module")
def references(tgt):
    return {s: target_distribution(tgt, PROMPT, N_NEW, s.temperature, s.top_k, s.top_p) for s in (TEMP, TOPKP)}


# Losslessness bound on the total variation. Through the model's own forward the decoder's arithmetic is the
# reference's: 1e-9. The compiled forward rounds differently inside the norms (the model's RMSNorm computes
# in float32 even in a float64 model, and inductor's vectorised rsqrt differs from eager's by up to an fp32
# ulp, 6e-8 relative; the mean's vectorised sum order depends on the SIMD width): measured up to 7e-9 on an
# AVX2-only EPYC and 1.5e-7 on an AVX-512 Xeon, bounded at 1e-6 -- three orders of magnitude under what a
# lossy rule gives (test_typical_acceptance_is_lossy_and_detected: > 1e-3).
_TOL = {False: 1e-9, True: 1e-6}


def _check(tgt, references, drafter, sampling, **kw):
    dec = SpeculativeDecoder(tgt, drafter, sampling=sampling, **kw)
    assert dec.fast is tgt.fast_body  # the compiled run really decodes through the compiled forward
    got = exact_distribution(dec, PROMPT, N_NEW)
    ref = references[sampling]
    assert abs(sum(got.values()) - 1.0) < 1e-12
    tv = total_variation(got, ref)
    assert tv < _TOL[tgt.fast_body is not None], tv
    return got


def test_references_are_not_degenerate(references):
    # Several outcomes with real mass, some of them shorter than 3 tokens (EOS), and top-k/top-p bite.
    full = references[TEMP]
    assert len(full) > 100 and max(full.values()) < 0.3
    assert any(len(k) < N_NEW for k in full)
    assert 20 < len(references[TOPKP]) < len(full)


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_chain_standalone_drafter_is_exact(tgt, references, sampling):
    _check(tgt, references, other_model_drafter(tgt), sampling, policy=FixedLength(2))


def test_chain_with_confidence_policy_is_exact(tgt, references):
    _check(tgt, references, other_model_drafter(tgt), TEMP, policy=ConfidenceStop(0.35, 2))


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_static_tree_medusa_is_exact(tgt, references, sampling):
    _check(tgt, references, random_medusa(tgt, num_heads=2, std=0.5), sampling, tree=[(0,), (1,), (0, 0)])


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_dynamic_tree_medusa_is_exact(tgt, references, sampling):
    _check(tgt, references, random_medusa(tgt, num_heads=2, std=0.5), sampling,
           tree=DynamicTree(budget=3, max_depth=2, width=2, expand_batch=1))


def test_static_tree_path_reading_heads_is_exact(tgt, references):
    heads = PathHeads(tgt, num_heads=2).double()
    _check(tgt, references, HeadDrafter(heads, tgt.fingerprint), TEMP, tree=[(0,), (1,), (0, 0)])


def test_static_tree_standalone_drafter_is_exact(tgt, references):
    _check(tgt, references, other_model_drafter(tgt), TEMP, tree=[(0,), (1,), (0, 0)])


def test_typical_acceptance_is_lossy_and_detected(tgt, references):
    dec = SpeculativeDecoder(tgt, random_medusa(tgt, num_heads=2, std=0.5), sampling=TEMP,
                             tree=[(0,), (1,), (0, 0)], acceptance="typical")
    assert total_variation(exact_distribution(dec, PROMPT, N_NEW), references[TEMP]) > 1e-3
