"""The decoder on the real default target (SmolLM2-135M-Instruct): few, short checks.

The full versions are scripts: ``python -m draftsmith.eval.mc_lossless``
(>= 2000 samples per method) and ``python -m draftsmith.eval.greedy_equality``
(all 80 MT-Bench first turns, 128 new tokens).
"""

import pytest
import torch

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.eval.greedy_equality import first_divergence
from draftsmith.eval.mc_lossless import mc_lossless
from draftsmith.engine.sampling import SamplingParams

pytestmark = pytest.mark.real


def _chat(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)


def test_greedy_plain_chain_and_hf_agree(real_target):
    prompt = _chat(real_target, "Name three primary colours.")
    plain = SpeculativeDecoder(real_target).generate(prompt, 16)
    hf = real_target.model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    assert plain.tokens == hf[0, len(prompt):].tolist()[: len(plain.tokens)]
    spec = SpeculativeDecoder(real_target, first_layers_drafter(real_target, 20), tree=[(0,), (1,), (0, 0)])
    res = spec.generate(prompt, 16)
    div = first_divergence(plain.tokens, res.tokens)
    assert div is None, f"speculative output diverged from plain decoding at token {div}"
    assert res.tau > 1.0


def _perturbed_copy(target, std=0.3, seed=0):
    """A full copy of the target with a randomly rescaled final norm: q close to p but not equal (alpha ~0.75)."""
    d = first_layers_drafter(target, target.config.num_hidden_layers)
    w = d.model.model.norm.weight
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w.mul_(1 + std * torch.randn(w.shape, generator=g).to(w))
    return d


def test_monte_carlo_tree_sampling_matches_target(real_target):
    """200 samples of the first 2 tokens at temperature 1: 3 root candidates drawn without replacement
    from a standalone drafter, multi-candidate rejection, bonus tokens; chi-square p > 0.001."""
    dec = SpeculativeDecoder(real_target, _perturbed_copy(real_target), tree=[(0,), (1,), (2,)],
                             sampling=SamplingParams(1.0))
    steps = []
    step = dec.step
    dec.step = lambda st, rng: steps.append(step(st, rng)) or steps[-1]
    r = mc_lossless(dec, _chat(real_target, "Write a story."), n_new=2, n_samples=200, seed=0)
    assert r["cells"] >= 8 and r["min_expected"] >= 5 and r["unassigned"] == 0
    assert r["p_value"] > 1e-3, r
    # both branches were exercised: accepted candidates (bonus tokens) and full rejections (residual draws)
    first = [s for s in steps if s.drafted > 0]
    assert 0.3 < sum(s.accepted for s in first) / len(first) < 0.99


def test_cpu_layout_keeps_greedy_output(real_target):
    """The CPU decoding layout (column-major linears, transposed head copy) on a copy of the real target:
    plain and speculative greedy output equal plain decoding with PyTorch's default layout."""
    import copy
    import dataclasses

    from draftsmith.engine.cpu_layout import apply_cpu_layout

    prompt = _chat(real_target, "Explain what a prime number is.")
    ref = SpeculativeDecoder(real_target).generate(prompt, 24).tokens
    laid = dataclasses.replace(real_target, model=copy.deepcopy(real_target.model))
    dr = first_layers_drafter(laid, 8)
    done = apply_cpu_layout(laid, dr)
    assert done["applied"] and done["linears"] == 7 * (30 + 8) and done["heads"] == 2
    assert SpeculativeDecoder(laid).generate(prompt, 24).tokens == ref
    res = SpeculativeDecoder(laid, dr, tree=[(0,), (1,), (0, 0), (0, 0, 0)]).generate(prompt, 24)
    assert first_divergence(ref, res.tokens) is None
