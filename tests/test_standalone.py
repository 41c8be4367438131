"""Standalone distilled drafters on tiny random models: divergences, initialisation,
LoRA merge, tokenizer checks, pruned-vocabulary training and exact losslessness, checkpoints, export to HF."""

import math

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.checkpoint import load_checkpoint, save_checkpoint
from draftsmith.common.divergences import divergence
from draftsmith.drafters.standalone.model import StandaloneDrafter, StandaloneObjective, TokenizerMismatchError
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.policies import FixedLength
from draftsmith.eval.exact import exact_distribution, total_variation
from draftsmith.export import export, load_drafter
from draftsmith.recipe import RecipeError, parse_recipe
from draftsmith.target import TargetMismatchError
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.cache import build_cache
from draftsmith.train.training.trainer import build_drafter, train
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP, TOPKP
from tests.test_train import _cycle_sequences
from tests.tiny import make_tiny_target, make_tokenizer

P = torch.tensor([[0.5, 0.5]])
Q = torch.tensor([[0.25, 0.75]])


# ---------------------------------------------------------------------- divergences
def test_divergences_on_a_hand_computed_case():
    lp, lq = P.log(), Q.log()
    fkl = 0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75)
    rkl = 0.25 * math.log(0.25 / 0.5) + 0.75 * math.log(0.75 / 0.5)
    m = [0.5 * 0.5 + 0.5 * 0.25, 0.5 * 0.5 + 0.5 * 0.75]
    jsd = 0.5 * sum(p * math.log(p / mm) for p, mm in zip([0.5, 0.5], m)) + \
        0.5 * sum(q * math.log(q / mm) for q, mm in zip([0.25, 0.75], m))
    b = 0.9  # DistillSpec's JSD[beta] with an asymmetric beta
    mb = [b * 0.5 + (1 - b) * 0.25, b * 0.5 + (1 - b) * 0.75]
    jsd9 = b * sum(p * math.log(p / mm) for p, mm in zip([0.5, 0.5], mb)) + \
        (1 - b) * sum(q * math.log(q / mm) for q, mm in zip([0.25, 0.75], mb))
    assert divergence(lq, lp, "fkl").item() == pytest.approx(fkl, abs=1e-6)
    assert divergence(lq, lp, "rkl").item() == pytest.approx(rkl, abs=1e-6)
    assert divergence(lq, lp, "tvd").item() == pytest.approx(0.25, abs=1e-6)
    assert divergence(lq, lp, "jsd", 0.5).item() == pytest.approx(jsd, abs=1e-6)
    assert divergence(lq, lp, "jsd", b).item() == pytest.approx(jsd9, abs=1e-6)
    for k in ("fkl", "rkl", "tvd", "jsd"):
        assert divergence(lp, lp, k).item() == pytest.approx(0.0, abs=1e-7)
    with pytest.raises(ValueError, match="unknown divergence 'kl'"):
        divergence(lq, lp, "kl")


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd", "jsd"])
def test_divergence_gradient_moves_q_toward_p(kind):
    # q puts too little on token 0 (0.25 < 0.5): every divergence must push its logit up (negative gradient),
    # and a small step along the gradient lowers the divergence
    z = Q.log().clone().requires_grad_(True)
    d = divergence(z, P.log(), kind)
    d.backward()
    assert z.grad[0, 0] < 0 < z.grad[0, 1]
    assert divergence(z.detach() - 0.1 * z.grad, P.log(), kind) < d.detach()


# ---------------------------------------------------------------------- initialisation, LoRA, tokenizers
def test_init_from_target_equals_the_targets_first_layers():
    t = make_tiny_target(init_std=0.3, layers=3)
    d = StandaloneDrafter.for_target(t, init="target", num_layers=2)
    ref = first_layers_drafter(t, 2).model
    ids = torch.randint(0, t.vocab_size, (2, 9))
    with torch.no_grad():
        h = d(ids, torch.ones_like(ids), torch.ones(2, 9, dtype=torch.bool))
        torch.testing.assert_close(h, ref(ids).logits.reshape(18, -1))
        full = t.model(ids, output_hidden_states=True)
    # and the copied layers are the target's: layer 1's output, and the final norm of layer 2's
    out = d.model.model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(out[1], full.hidden_states[1])
    torch.testing.assert_close(out[2], t.model.model.norm(full.hidden_states[2]))
    assert not d.model.get_input_embeddings().weight.requires_grad  # frozen by default (init: target)
    assert all(p.requires_grad for n, p in d.named_parameters() if ".layers." in n)
    with pytest.raises(ValueError, match="leave \\['hidden_size'\\] unset"):
        StandaloneDrafter.for_target(t, init="target", hidden_size=64)


def test_lora_merge_equals_unmerged_forward():
    t = make_tiny_target(init_std=0.3, layers=3)
    d = StandaloneDrafter.for_target(t, num_layers=2, lora={"rank": 4, "alpha": 8})
    trainable = [n for n, p in d.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    with torch.no_grad():
        for n, p in d.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)  # a fresh B is 0: make the adapters matter
    ids = torch.randint(0, t.vocab_size, (1, 12))
    with torch.no_grad():
        unmerged = d(ids, torch.ones_like(ids), torch.ones(1, 12, dtype=torch.bool))
        merged = d.plain_model()(ids).logits[0]
        base = first_layers_drafter(t, 2).model(ids).logits[0]
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)
    assert (merged - base).abs().max() > 1e-2
    sd = d.state_dict()
    assert not any("lora" in k or "base_layer" in k for k in sd)  # merged on save, plain names
    plain = StandaloneDrafter.from_config(d.config, t)
    plain.load_state_dict({k: v for k, v in sd.items() if k != "model.lm_head.weight"}, strict=False)
    with torch.no_grad():
        torch.testing.assert_close(plain(ids, torch.ones_like(ids), torch.ones(1, 12, dtype=torch.bool)), unmerged,
                                   atol=1e-5, rtol=1e-5)


def test_user_model_directory_with_another_tokenizer_is_refused(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    good = tmp_path / "good"
    first_layers_drafter(t, 1).model.save_pretrained(good)
    t.tokenizer.save_pretrained(good)
    d = StandaloneDrafter.for_target(t, init=str(good))
    assert d.config.model["num_hidden_layers"] == 1
    bad = tmp_path / "bad"
    first_layers_drafter(t, 1).model.save_pretrained(bad)
    tok = make_tokenizer(96)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(bad)
    with pytest.raises(TokenizerMismatchError, match="its tokenizer is not the target's"):
        StandaloneDrafter.for_target(t, init=str(bad))
    with pytest.raises(ValueError, match="not 'target', 'scratch' or a local"):
        StandaloneDrafter.for_target(t, init=str(tmp_path / "nowhere"))


# ---------------------------------------------------------------------- pruned vocabulary: bad input, id maps
def _base(tmp_path, drafter, **train):
    t = {"epochs": 3, "batch_size": 4, "chunk_len": 16, "lr": 5e-3, "warmup_steps": 2, "tracker": "none",
         "save_every": 100, "log_every": 5, "calibration_every": 0, **train}
    return parse_recipe({"name": "sa", "output_dir": str(tmp_path / "run"), "seed": 3,
                         "drafter": {"kind": "standalone", **drafter}, "train": t})


def test_bad_vocab_keep_is_refused(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    with pytest.raises(RecipeError, match="vocab_keep"):
        _base(tmp_path, {"vocab_keep": 0})
    with pytest.raises(ValueError, match="must keep between 1 and the vocabulary's 96 ids"):
        build_drafter(_base(tmp_path, {"vocab_keep": 97}), t)
    with pytest.raises(ValueError, match="rdk: true needs vocab_keep"):
        build_drafter(_base(tmp_path, {"rdk": True}), t)
    with pytest.raises(RecipeError, match="divergence"):
        _base(tmp_path, {"divergence": "kl"})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A pruned RDK drafter trained end to end on the tiny target (one run shared by the tests below)."""
    tmp = tmp_path_factory.mktemp("sa")
    t = make_tiny_target(init_std=0.3, layers=3)
    r = _base(tmp, {"num_layers": 1, "vocab_keep": 8, "rdk": True, "rdk_topk": 8, "divergence": "fkl"})
    build_cache(t, _cycle_sequences(n=8, length=40), ["final"], tmp / "cache", dtype="float32")
    ckpt, timing = train(r, t, tmp / "cache", r.out)
    return t, r, ckpt, tmp


def test_training_checkpoint_round_trips_the_id_maps(trained):
    t, r, ckpt, tmp = trained
    sd = load_file(str(ckpt / "model.safetensors"))
    kept = sd["draft_head.kept_ids"]
    cache = HiddenCache(tmp / "cache", t)
    seen = sorted({int(x) for i in range(len(cache)) for x in cache.tokens(i)[cache.mask(i) > 0]})
    assert kept.tolist() == sorted(seen)[:8] or set(kept.tolist()) <= set(seen)  # kept ids come from the data
    assert len(kept) == 8 and torch.equal(sd["rdk.kept_ids"], kept)
    m, manifest = load_checkpoint(ckpt, t)
    assert torch.equal(m.draft_head.kept_ids, kept) and torch.equal(m.rdk.parent, sd["rdk.parent"])
    t2d = m.draft_head.t2d()
    assert torch.equal(t2d[kept], torch.arange(8)) and int((t2d >= 0).sum()) == 8  # t2d and d2t invert
    assert "model.lm_head.weight" not in sd  # tied to the embedding, saved once
    assert manifest["kind"] == "standalone"
    other = make_tiny_target(init_std=0.3, layers=3, seed=7)
    with pytest.raises(TargetMismatchError):
        load_checkpoint(ckpt, other)


def test_training_improves_acceptance_and_greedy_decoding_is_the_targets(trained):
    t, r, ckpt, tmp = trained
    cache = HiddenCache(tmp / "cache", t)
    fresh = build_drafter(r, t)
    fresh.set_draft_vocab(load_checkpoint(ckpt, t)[0].draft_head.kept_ids)
    m, _ = load_checkpoint(ckpt, t)
    obj = StandaloneObjective(cache, t, chunk_len=16)
    b = obj.prepare(list(range(len(obj.chunks))))
    with torch.no_grad():  # the divergence to the target renormalised over the kept ids falls
        assert float(obj.loss(m, b)[0]) < 0.5 * float(obj.loss(fresh, b)[0])
    before, after = fresh.heldout_metrics(cache, t), m.heldout_metrics(cache, t)
    assert after["expected_acceptance"] > before["expected_acceptance"]
    assert 0 <= after["expected_acceptance_rdk"] <= 1
    # q_RDK moves mass from kept ids to pruned ones, so it gains at most the target's mass off the kept set
    assert 0 < after["target_mass_off_kept"] < 1 and 0 <= after["rdk_mass_off_kept"] < 1
    assert after["expected_acceptance_rdk"] <= after["expected_acceptance"] + after["target_mass_off_kept"] + 1e-6
    assert after["oracle_acceptance"] == pytest.approx(1 - after["target_mass_off_kept"], abs=1e-5)
    assert 0 < after["oracle_acceptance_rdk"] <= 1
    plain = SpeculativeDecoder(t, None).generate([1, 3, 4, 5], 24).tokens
    for use_rdk in (False, True):
        d = m.decoder_drafter(t, t.fingerprint, use_rdk=use_rdk)
        got = SpeculativeDecoder(t, d, policy=FixedLength(3)).generate([1, 3, 4, 5], 24).tokens
        assert got == plain
    d = drafter_from_checkpoint(ckpt, t)
    assert d.vocab_size == t.vocab_size and d.head.rdk is not None


# ---------------------------------------------------------------------- exact losslessness (pruned, RDK)
@pytest.fixture(scope="module")
def etgt():
    return tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)


def _random_pruned(t, keep, rdk=False, seed=5):
    torch.manual_seed(seed)
    d = StandaloneDrafter.for_target(t, init="scratch", num_layers=1, vocab_keep=len(keep), rdk=rdk, seed=seed)
    with torch.no_grad():
        for p in d.model.parameters():
            p.normal_(0, 0.5)
    d.set_draft_vocab(torch.tensor(keep))
    if rdk:  # a fixed, non-trivial affinity: pruned ids 0 and 5 attached to kept ids
        parent = torch.full((t.vocab_size,), -1, dtype=torch.long)
        weight = torch.zeros(t.vocab_size)
        parent[0], weight[0] = keep[0], 0.3
        parent[5], weight[5] = keep[0], 0.2
        d.rdk.set(torch.tensor(keep), parent, weight)
    return d.double()


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
@pytest.mark.parametrize("rdk", [False, True], ids=["pruned", "rdk"])
def test_pruned_and_rdk_drafting_is_exact(etgt, sampling, rdk):
    from draftsmith.eval.exact import target_distribution
    d = _random_pruned(etgt, [1, 2, 3, 4], rdk=rdk).decoder_drafter(etgt, etgt.fingerprint)
    ref = target_distribution(etgt, ENUM_PROMPT, N_NEW, sampling.temperature, sampling.top_k, sampling.top_p)
    dec = SpeculativeDecoder(etgt, d, sampling=sampling, policy=FixedLength(2))
    got = exact_distribution(dec, ENUM_PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, ref) < 1e-9


def test_rdk_drafts_pruned_ids_and_q_rdk_sums_to_one(etgt):
    """q_RDK really proposes pruned ids (which the pruned head never does), so the exact test above covers
    drafted out-of-vocabulary tokens verified with the probability they were drawn with."""
    m = _random_pruned(etgt, [1, 2, 3, 4], rdk=True)
    h = torch.randn(3, etgt.hidden_size, dtype=torch.float64)
    q = torch.softmax(m.decoder_drafter(etgt, etgt.fingerprint).head(h), -1)
    assert (q[:, 0] > 0).all() and (q[:, 5] > 0).all()
    torch.testing.assert_close(q.sum(-1), torch.ones(3, dtype=torch.float64))
    plain = torch.softmax(m.decoder_drafter(etgt, etgt.fingerprint, use_rdk=False).head(h), -1)
    assert (plain[:, 0] == 0).all() and (plain[:, 5] == 0).all()  # pruned: q is exactly 0 off the kept ids


# ---------------------------------------------------------------------- export to Hugging Face
def test_export_hf_reloads_and_hf_assisted_generation_gives_the_targets_greedy_output(trained, tmp_path):
    t, r, ckpt, _ = trained
    out = export(ckpt, "hf", tmp_path / "hf", t)
    from transformers import AutoModelForCausalLM
    m = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert m.get_output_embeddings().weight.shape[0] == t.vocab_size  # the full-size head, pruned or not
    assert m.config.draftsmith_vocab_keep == 8
    prompt = torch.tensor([[1, 3, 4, 5]])
    ref = t.model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0)
    got = t.model.generate(prompt, max_new_tokens=20, do_sample=False, pad_token_id=0, assistant_model=m)
    assert got.tolist() == ref.tolist()
    d = load_drafter(out, t)
    assert SpeculativeDecoder(t, d).generate([1, 3, 4, 5], 20).tokens == \
        SpeculativeDecoder(t, None).generate([1, 3, 4, 5], 20).tokens
    card = (out / "README.md").read_text()
    assert "standalone" in card and "full-size output head" in card


def test_save_and_load_a_full_vocabulary_drafter(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    d = StandaloneDrafter.for_target(t, num_layers=1, divergence="jsd", jsd_beta=0.9)
    save_checkpoint(tmp_path / "c", d, t)
    m, _ = load_checkpoint(tmp_path / "c", t)
    ids = torch.randint(0, t.vocab_size, (1, 7))
    one = (ids, torch.ones_like(ids), torch.ones(1, 7, dtype=torch.bool))
    with torch.no_grad():
        torch.testing.assert_close(m(*one), d(*one))
    assert m.config.divergence == "jsd" and m.draft_head is None


def test_objective_aligns_the_drafter_with_the_teacher_at_the_same_position(tmp_path):
    """The target itself as the drafter (all its layers) reproduces the teacher at every kept row: q == p."""
    t = make_tiny_target(init_std=0.3, layers=2)
    seqs = _cycle_sequences(n=3, length=30)
    build_cache(t, seqs, ["final"], tmp_path / "c", dtype="float32")
    obj = StandaloneObjective(HiddenCache(tmp_path / "c", t), t, chunk_len=16)
    d = StandaloneDrafter.for_target(t, num_layers=2)
    b = obj.prepare(list(range(len(obj.chunks))))
    with torch.no_grad():
        loss, _ = obj.loss(d, b)
    assert float(loss) < 1e-6
    b.ids = torch.roll(b.ids, 1, dims=1)  # a one-position shift is caught
    with torch.no_grad():
        assert float(obj.loss(d, b)[0]) > 1e-3


@pytest.mark.real
def test_real_target_pruned_rdk_drafter_decodes_the_targets_greedy_tokens(real_target):
    """On SmolLM2: a first-2-layers drafter over 1024 kept ids with a (hand-made) RDK map, greedy equality."""
    t = real_target
    d = StandaloneDrafter.for_target(t, num_layers=2, vocab_keep=1024, rdk=True)
    keep = torch.arange(0, 2048, 2)
    d.set_draft_vocab(keep)
    parent = torch.full((t.vocab_size,), -1, dtype=torch.long)
    weight = torch.zeros(t.vocab_size)
    parent[1:2048:2], weight[1:2048:2] = keep, 0.2  # each odd id attached to the even id before it
    d.rdk.set(keep, parent, weight)
    from draftsmith.eval.mtbench import mtbench_prompts
    ids = mtbench_prompts(t.tokenizer, 1)[0].ids
    plain = SpeculativeDecoder(t, None).generate(ids, 16).tokens
    for use_rdk in (False, True):
        dr = d.decoder_drafter(t, t.fingerprint, use_rdk=use_rdk)
        assert SpeculativeDecoder(t, dr, policy=FixedLength(3)).generate(ids, 16).tokens == plain


def test_monte_carlo_chi_square_passes_with_a_fitted_rdk_map(trained):
    """The RDK map built from data (96 ids, 8 kept, pruned ids attached) drafting at T = 0.9: sampled outputs
    follow the target's distribution (chi-square over the outcome cells, a real p-value threshold)."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.eval.mc_lossless import mc_lossless
    t, r, ckpt, _ = trained
    m, _ = load_checkpoint(ckpt, t)
    assert int((m.rdk.parent >= 0).sum()) > 0
    dec = SpeculativeDecoder(t, m.decoder_drafter(t, t.fingerprint), sampling=SamplingParams(0.9),
                             policy=FixedLength(2))
    res = mc_lossless(dec, [1, 3, 4, 5, 5], n_new=2, n_samples=600, seed=0)
    assert res["cells"] > 5 and res["p_value"] > 1e-3, res


def test_lora_training_saves_a_merged_plain_checkpoint(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    r = _base(tmp_path, {"num_layers": 2, "lora": {"rank": 4, "alpha": 8}}, epochs=1, lr=2e-2)
    build_cache(t, _cycle_sequences(n=8, length=40), ["final"], tmp_path / "cache", dtype="float32")
    ckpt, _ = train(r, t, tmp_path / "cache", r.out)
    sd = load_file(str(ckpt / "model.safetensors"))
    assert not any("lora" in k or "base_layer" in k for k in sd)
    base = first_layers_drafter(t, 2).model.state_dict()
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(sd["model." + q], base[q])  # the adapters were trained and merged in
    assert torch.equal(sd["model.model.layers.0.mlp.up_proj.weight"], base["model.layers.0.mlp.up_proj.weight"])
    m, manifest = load_checkpoint(ckpt, t)
    assert m.lora_config is None and manifest["recipe"]["drafter"]["lora"]["rank"] == 4
    plain = SpeculativeDecoder(t, None).generate([1, 3, 4, 5], 16).tokens
    assert SpeculativeDecoder(t, drafter_from_checkpoint(ckpt, t)).generate([1, 3, 4, 5], 16).tokens == plain
    with pytest.raises(ValueError, match="exact resume of a LoRA run is not supported"):
        build_drafter(r, t).load_state_dict(sd, strict=False)
