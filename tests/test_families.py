"""Every drafter kind on every model family's tiny random target: lossless (greedy tokens equal to the model's own
forward, chains and a tree), or refused with a message naming what the family lacks. Gemma 3's sliding windows
reach the single and batched decoders' masks; the data engine, whose masks do not carry them, refuses rows past the
window."""

from __future__ import annotations

import pytest
import torch

from draftsmith import registry
from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.kvcache import sliding_windows
from draftsmith.train.data.batchgen import BatchGenerator, Job
from tests.families import FAMILIES, WINDOW, family_target
from tests.tiny import greedy_reference

PROMPT = [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]  # 13 tokens: past Gemma 3's window of 8 already
NEW = 30
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]
KINDS = {
    "medusa": ("medusa", {"num_heads": 2}),
    "hydra": ("hydra", {"num_heads": 2, "num_layers": 2, "prefix_layer": False}),
    "hydra++": ("hydra", {"num_heads": 2, "num_layers": 2, "prefix_layer": True}),
    "eagle3": ("eagle3", {"aux_layers": [1, 2, 3], "vocab_keep": None}),
    "dflash": ("dflash", {"target_layers": [1, 2, 3], "vocab_keep": None, "block_size": 4, "mask_token_id": 4}),
    "kangaroo": ("kangaroo", {"exit_layer": 1, "adapter_mlp": True}),
    "standalone": ("standalone", {"init": "target", "num_layers": 1}),
}
# kinds that build a layer like the target's (Hydra++'s prefix layer, Kangaroo's adapter) know the Llama-shaped
# families and Gemma 3's layer; Phi-3's (fused projections) is refused by name
REFUSED = {("phi3", "hydra++"), ("phi3", "kangaroo")}
TREES = {"medusa", "hydra", "hydra++", "eagle3", "dflash"}  # kinds drafting from a static tree here


@pytest.fixture(scope="module", params=FAMILIES)
def fam(request):
    tgt = family_target(request.param)
    ref, _ = greedy_reference(tgt.model, PROMPT, NEW, set(tgt.eos_token_ids))
    return request.param, tgt, ref


def test_plain_decoding_is_the_models_own_forward(fam):
    family, tgt, ref = fam
    assert SpeculativeDecoder(tgt).generate(PROMPT, NEW).tokens == ref


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_is_lossless_or_refused_by_name(fam, name):
    family, tgt, ref = fam
    kind, fields = KINDS[name]
    if (family, name) in REFUSED:
        with pytest.raises(ValueError, match=tgt.model.config.model_type):
            registry.get(kind).for_target(tgt, **fields)
        return
    if name == "kangaroo" and sliding_windows(tgt.model.config):
        drafter = registry.get(kind).for_target(tgt, **fields).eval().decoder_drafter(tgt, tgt.fingerprint)
        with pytest.raises(ValueError, match="drafter's context length"):  # its layers run without the window
            SpeculativeDecoder(tgt, drafter).generate(PROMPT, NEW)
        return
    torch.manual_seed(1)
    m = registry.get(kind).for_target(tgt, **fields).eval()
    drafter = m.decoder_drafter(tgt, tgt.fingerprint)
    assert SpeculativeDecoder(tgt, drafter).generate(PROMPT, NEW).tokens == ref
    if name in TREES:
        assert SpeculativeDecoder(tgt, drafter, tree=TREE).generate(PROMPT, NEW).tokens == ref


def test_gemma3_verification_needs_its_windows():
    """The test can fail: without the windows in the verification's masks, Gemma 3's sliding layers see past them
    and the tokens differ from the model's own."""
    tgt = family_target("gemma3")
    assert sliding_windows(tgt.model.config) == {"sliding_attention": WINDOW}
    ref, _ = greedy_reference(tgt.model, PROMPT, NEW, set(tgt.eos_token_ids))
    torch.manual_seed(1)
    drafter = registry.get("medusa").for_target(tgt, num_heads=2).eval().decoder_drafter(tgt, tgt.fingerprint)
    dec = SpeculativeDecoder(tgt, drafter)
    dec.windows = {}
    assert dec.generate(PROMPT, NEW).tokens != ref


def test_windows_read_from_each_config():
    import transformers
    assert sliding_windows(transformers.LlamaConfig()) == {}
    assert sliding_windows(transformers.Qwen2Config()) == {}  # use_sliding_window off: every layer full
    qwen_window = transformers.Qwen2Config(use_sliding_window=True, max_window_layers=1, num_hidden_layers=2,
                                           sliding_window=64)
    assert sliding_windows(qwen_window) == {"sliding_attention": 64}
    assert sliding_windows(transformers.MistralConfig(sliding_window=32)) == {"all": 32}


def test_batched_decoder_applies_the_windows_and_the_data_engine_refuses_past_them():
    """The batched decoder (and so the server) builds its ragged masks per layer type: past Gemma 3's window it
    gives the model's own tokens, plain and drafting. The data engine's masks carry no window: it refuses a job
    that would pass it, naming the window, and within it runs."""
    tgt = family_target("gemma3")
    ref, _ = greedy_reference(tgt.model, PROMPT, NEW, set(tgt.eos_token_ids))
    assert BatchedSpeculativeDecoder(tgt, None).generate([PROMPT], [NEW]).rows[0].tokens == ref
    torch.manual_seed(1)
    drafter = registry.get("medusa").for_target(tgt, num_heads=2).eval().decoder_drafter(tgt, tgt.fingerprint)
    other = PROMPT[:5]
    ref2, _ = greedy_reference(tgt.model, other, NEW, set(tgt.eos_token_ids))
    out = BatchedSpeculativeDecoder(tgt, drafter, k=2).generate([PROMPT, other], [NEW, NEW])
    assert [r.tokens for r in out.rows] == [ref, ref2]
    gen = BatchGenerator(tgt.model, set(tgt.eos_token_ids), max_rows=2, capacity=64)
    with pytest.raises(ValueError, match=f"sliding attention window of {WINDOW}"):
        gen.run([Job(0, PROMPT, NEW)], lambda *a, **k: None)


def test_the_data_engine_runs_gemma3_on_the_fused_step_within_its_window():
    """Rows never pass the window in the data engine (it refuses them), so its fused batched step (whose kernels
    attend over every live slot) is exact there: greedy rows equal the model's own tokens. The batched decoder,
    whose rows may pass the window, keeps the model's forward."""
    from draftsmith.engine.fast_batch import batch_body
    tgt = family_target("gemma3")
    eos = set(tgt.eos_token_ids)
    prompts = [[1, 5, 6], [1, 9], [1, 7, 8, 9]]  # each with its 4 new tokens within the window of 8
    got = {}
    gen = BatchGenerator(tgt.model, eos, max_rows=2, capacity=64, forward="fast")
    assert gen.forward == "fast" and gen.fast is not None
    gen.run([Job(i, p, 4) for i, p in enumerate(prompts)], lambda j, toks, fin: got.__setitem__(j.key, toks))
    assert [got[i] for i in range(3)] == [greedy_reference(tgt.model, p, 4, eos)[0] for p in prompts]
    assert batch_body(tgt.model, "fast") is None


def test_eagle3_takes_and_exports_the_targets_full_attention_rope():
    """The drafter layer's RoPE is the target's full layers' (Gemma 3: the global base, not the sliding layers'
    local one; Llama 3: its scaled frequencies), and the exported config says so: an engine that read another base
    would draft with positions rotated otherwise, and accept less with no error."""
    import transformers

    from draftsmith.common.layers import rope_frequencies
    from draftsmith.drafters.eagle3.export import _llama_config
    from draftsmith.target import Target
    from tests.tiny import make_tokenizer
    tgt = family_target("gemma3")
    m = registry.get("eagle3").for_target(tgt, aux_layers=[1, 2, 3], vocab_keep=None)
    full = tgt.model.config.rope_parameters["full_attention"]["rope_theta"]
    assert full != tgt.model.config.rope_parameters["sliding_attention"]["rope_theta"]
    torch.testing.assert_close(m.layer.inv_freq, rope_frequencies(8, full))
    cfg = _llama_config(m, tgt)
    assert cfg["rope_theta"] == full and "rope_scaling" not in cfg
    scaled = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0, rope_scaling=scaled)).eval()
    llama3 = Target(model=model, tokenizer=make_tokenizer(48), name="llama3", path=None, fingerprint="llama3")
    m = registry.get("eagle3").for_target(llama3, aux_layers=[1, 2, 3], vocab_keep=None)
    torch.testing.assert_close(m.layer.inv_freq, model.model.rotary_emb.inv_freq)
    assert not torch.allclose(m.layer.inv_freq, rope_frequencies(8, 500000.0))  # the scaling matters here
    cfg = _llama_config(m, llama3)
    assert cfg["rope_theta"] == 500000.0 and cfg["rope_scaling"]["rope_type"] == "llama3"
    assert cfg["rope_scaling"]["factor"] == 8.0
