"""EAGLE 3.1's options of the eagle3 kind (``norm_before_fc``, ``fc_norm``, ``norm_output``): decoding computes what
the training-time test trains, eagerly and compiled; the losslessness ladder (exact enumeration, greedy equality,
and on the real target in tests/test_eagle3_real.py); exports vLLM reads, reloaded exactly; llama.cpp refused by
name where its loader would ignore an option."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.trees import StaticTree
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP
from tests.test_eagle3 import PROMPT, assert_decoding_is_the_training_time_test, feats_of, module
from tests.test_eagle3_fast import _drafting, same_greedy_proposals
from tests.tiny import make_tiny_target

OPTIONS = [{"fc_norm": True, "norm_output": True}, {"norm_before_fc": True}, {"norm_output": True},
           {"norm_before_fc": True, "fc_norm": True, "norm_output": True}]
IDS = ["eagle3.1", "norm-before-fc", "norm-output", "all"]


def eagle31(target, options, **kw):
    """`module` with the options on and every norm's weight random too (a norm of ones would hide a swap)."""
    m = module(target, **options, **kw)
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() == 1 and "norm" in name:
                p.uniform_(0.5, 1.5)
    return m


def test_each_option_changes_the_function():
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    seq = PROMPT + [7, 9]
    with torch.no_grad():
        f, nxt = feats_of(t, seq)[None], torch.tensor([seq[1:] + [0] * 4])
        base = torch.stack(module(t).ttt(f, nxt, steps=3))
        for opts in OPTIONS:
            got = torch.stack(eagle31(t, opts).ttt(f, nxt, steps=3))
            assert not torch.allclose(got, base, atol=1e-3), opts


@pytest.mark.parametrize("options", OPTIONS, ids=IDS)
def test_decoding_computes_what_the_training_time_test_trains(options):
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    assert_decoding_is_the_training_time_test(t, eagle31(t, options))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager-fn", "compiled"])
def test_compiled_drafting_proposes_what_the_eager_drafter_does(compiled):
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = eagle31(t, OPTIONS[-1], std=0.3, vocab_keep=24)
    m.set_draft_vocab(torch.arange(2, 26))
    tree = StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    _, got, _ = same_greedy_proposals(t, m.decoder_drafter(t), lambda: _drafting(m, compiled).decoder_drafter(t), tree,
                                   24, 1e-5)
    assert any(s.accepted for s in got.steps)  # the comparison reaches nodes below accepted ones


@pytest.mark.parametrize("tree", [None, StaticTree([(0,), (1,), (0, 0), (1, 0)])], ids=["chain", "static"])
def test_eagle31_is_exact(tree):
    t = tiny(vocab=6, seed=0, std=0.5, layers=4, dtype=torch.float64)
    ref = target_distribution(t, ENUM_PROMPT, N_NEW, TEMP.temperature, TEMP.top_k, TEMP.top_p)
    dr = eagle31(t, OPTIONS[0], vocab_keep=4)
    dr.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    dec = SpeculativeDecoder(t, dr.decoder_drafter(t), policy=FixedLength(2), tree=tree, sampling=TEMP)
    got = exact_distribution(dec, ENUM_PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12 and total_variation(got, ref) < 1e-9


def test_greedy_equals_plain_decoding():
    t = tiny(vocab=40, layers=4)
    plain = SpeculativeDecoder(t).generate(PROMPT, 24).tokens
    tree = StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    dec = SpeculativeDecoder(t, eagle31(t, OPTIONS[0]).decoder_drafter(t), policy=FixedLength(3), tree=tree)
    assert dec.generate(PROMPT, 24).tokens == plain


@pytest.mark.parametrize("fmt", ["vllm-eagle3", "eagle3"])
def test_exports_carry_the_options_and_reload_exactly(tmp_path, fmt):
    from draftsmith.checkpoint import drafter_from_checkpoint, save_checkpoint
    from draftsmith.export import export, import_drafter

    t = make_tiny_target(init_std=0.3, layers=4)
    m = eagle31(t, OPTIONS[-1], vocab_keep=30)
    m.set_draft_vocab(torch.arange(30) * 3)
    save_checkpoint(tmp_path / "ck", m, t)
    out = export(tmp_path / "ck", fmt, tmp_path / "ex", t)  # the export's reload check compares logits
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["norm_before_fc"], cfg["fc_norm"], cfg["norm_output"]) == (True, True, True)
    w = load_file(str(out / "model.safetensors"))
    assert {"input_norm.weight", "fc_norm.0.weight", "fc_norm.1.weight", "fc_norm.2.weight"} <= set(w)
    ours = SpeculativeDecoder(t, drafter_from_checkpoint(tmp_path / "ck", t)).generate(PROMPT, 16)
    import_drafter(out, tmp_path / "imported", t)
    again = SpeculativeDecoder(t, drafter_from_checkpoint(tmp_path / "imported", t)).generate(PROMPT, 16)
    assert again.tokens == ours.tokens and [s.accepted for s in again.steps] == [s.accepted for s in ours.steps]


def test_llamacpp_refuses_what_its_loader_ignores(tmp_path):
    from draftsmith.checkpoint import save_checkpoint
    from draftsmith.export import load_source
    from draftsmith.export.llamacpp import LlamaCppError, converter_input

    t = make_tiny_target(init_std=0.3, layers=4, save_to=tmp_path / "target")
    for opts, refused in ((OPTIONS[0], "fc_norm and norm_output"), ({"norm_before_fc": True}, None)):
        ck = tmp_path / f"ck{len(opts)}"
        save_checkpoint(ck, eagle31(t, opts), t)
        src = load_source(ck, t)
        if refused:
            with pytest.raises(LlamaCppError, match=f"EAGLE 3.1's {refused}"):
                converter_input(src, tmp_path / f"tmp{len(opts)}", t)
        else:  # llama.cpp reads norm_before_fc: written for its converter
            d, _, spec = converter_input(src, tmp_path / f"tmp{len(opts)}", t)
            assert json.loads((d / "config.json").read_text())["norm_before_fc"] is True
            assert spec == "draft-eagle3"
