"""EAGLE-3 on the real default target (SmolLM2-135M-Instruct): the fused states are the ones the cache and the
reference code use (Hugging Face hidden_states 2, 15, 27), decoding equals plain greedy, and the training
objective reads the same states from a cache."""

import pytest
import torch

from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.drafters.eagle3.model import Eagle3Module
from draftsmith.drafters.eagle3.objective import Eagle3Objective
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.trees import StaticTree
from draftsmith.train.data.cache import build_cache

pytestmark = pytest.mark.real


def _chat(target, text):
    return target.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                tokenize=True, return_dict=False)


def test_hooked_states_are_the_cached_and_reference_states(real_target, tmp_path):
    prompt = _chat(real_target, "Name three primary colours.")
    m = Eagle3Module.for_target(real_target)  # the default aux layers [2, 15, 27] fit the 30-layer target
    assert m.aux_layers == [2, 15, 27]
    dr = m.decoder_drafter(real_target)
    dec = SpeculativeDecoder(real_target, dr)
    state = dec.start(prompt, 4)  # the prefill: the hooks hold the prompt's states
    with torch.no_grad():
        hs = real_target.model(torch.tensor([prompt[:-1]]), output_hidden_states=True).hidden_states
    want = torch.cat([hs[i][0] for i in (2, 15, 27)], dim=-1)
    assert torch.allclose(state.drafter_state.feats, want, atol=1e-4)
    # the cache stage stores the same states ("layer:N" = hidden_states[N]) for the training objective
    build_cache(real_target, [{"ids": prompt, "mask": [0] * (len(prompt) - 4) + [1] * 4}],
                Eagle3Module.cache_needs(m.config.model_dump()), tmp_path / "c", dtype="float32")
    obj = Eagle3Objective(HiddenCache(tmp_path / "c", real_target), real_target, [2, 15, 27], steps=2, chunk_len=512)
    feats = obj.example(0, 0, len(prompt) - 1)[0]
    assert torch.allclose(feats, want, atol=1e-4)


@pytest.mark.parametrize("options", [{}, {"fc_norm": True, "norm_output": True}], ids=["eagle3", "eagle3.1"])
@pytest.mark.parametrize("tree", [None, StaticTree([(0,), (1,), (2,), (0, 0)])], ids=["chain", "tree"])
def test_greedy_equals_plain_on_the_real_target(real_target, tree, options):
    prompt = _chat(real_target, "Write a haiku about the sea.")
    plain = SpeculativeDecoder(real_target).generate(prompt, 24).tokens
    dr = Eagle3Module.for_target(real_target, vocab_keep=4096, **options)
    dr.set_draft_vocab(torch.arange(4096) * 12)
    got = SpeculativeDecoder(real_target, dr.decoder_drafter(real_target), tree=tree).generate(prompt, 24).tokens
    assert got == plain
