"""EAGLE-3 on tiny random models: decoding computes what the training-time test trains, exact losslessness
(chain, static and dynamic trees), greedy equality, training end to end with a checkpoint round trip, bad input."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import registry
from draftsmith.checkpoint import drafter_from_checkpoint, load_checkpoint
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.drafters.eagle3.model import Eagle3Module
from draftsmith.drafters.eagle3.objective import Eagle3Objective, heldout_metrics
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.trees import DraftTree, DynamicTree, StaticTree
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.recipe import RecipeError, parse_recipe
from draftsmith.train.data.cache import build_cache
from draftsmith.train.training.trainer import build_drafter, train
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP, TOPKP
from tests.test_train import _cycle_sequences
from tests.tiny import make_tiny_target

PROMPT = [1, 3, 4, 5, 5]
AUX = [1, 2, 3]  # a 4-layer tiny target: outputs of its layers 1, 2, 3


def module(target, std=0.5, seed=1, vocab_keep=None, **kw) -> Eagle3Module:
    """A drafter with random (not tiny) weights, so every path through it matters."""
    m = Eagle3Module.for_target(target, aux_layers=AUX, vocab_keep=vocab_keep, **kw)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std / p.shape[1] ** 0.5 * 3)
    return m.to(next(target.model.parameters()).dtype).eval()


def feats_of(target, ids):
    hs = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in AUX], dim=-1)


def assert_decoding_is_the_training_time_test(t, m, K: int = 4) -> None:
    """The drafter's chain logits for a teacher-forced path equal the TTT steps at index L-1.

    Within 2^-16 of the logits' scale, not float64's rounding: the drafter's norms compute in float32 as
    Llama's do, even in a float64 model, so two float64 paths that differ in their last bits (the training-time
    test's products over the whole sequence, decoding's one position at a time: MKL sums them in orders that
    depend on the shape and the CPU) can round a norm to a neighbouring float32 number, 6e-8 of its value.
    Measured: up to 1.1e-6 on logits of magnitude ~4 on a 2-core Zen 1 EPYC (EAGLE 3.1's norms; 0 on a Xeon);
    a wrong position, step or state is off by the logits' own magnitude."""
    seq, L = PROMPT + [7, 9, 11, 13], len(PROMPT) - 1
    with torch.no_grad():
        steps = m.ttt(feats_of(t, seq)[None], torch.tensor([seq[1:] + [0] * (K + 1)]), steps=K)
    dr = m.decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr, policy=FixedLength(K))
    state = dec.start(PROMPT, 8)
    tree = DraftTree(PROMPT[-1], 8, "cpu")
    got = [dr.propose(dec, state, tree, 0, 1)[0]]
    for k in range(1, K):
        tree.add(k - 1, seq[L + k])
        got.append(dr.propose(dec, state, tree, k, k + 1)[0])
    for k in range(K):
        want = steps[k][0, L - 1]
        if m.draft_head is not None:
            want = m.draft_head.to_target(want)
        tol = 2.0 ** -16 * float(want.abs().max())
        assert torch.allclose(got[k], want, rtol=0, atol=tol), (k, float((got[k] - want).abs().max()))


@pytest.mark.parametrize("vocab_keep", [None, 24])
def test_decoding_computes_what_the_training_time_test_trains(vocab_keep):
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = module(t, vocab_keep=vocab_keep)
    if vocab_keep:
        m.set_draft_vocab(torch.arange(3, 3 + vocab_keep))
    assert_decoding_is_the_training_time_test(t, m)


def test_a_star_tree_node_equals_the_chain_node():
    """Sibling nodes do not see each other: node 2 of a star equals node 1 of a chain with its token."""
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = module(t)
    dr = m.decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr)
    state = dec.start(PROMPT, 8)
    star = DraftTree(PROMPT[-1], 8, "cpu")
    dr.propose(dec, state, star, 0, 1)
    star.add(0, 7)
    star.add(0, 9)
    both = dr.propose(dec, state, star, 1, 3)
    chain = DraftTree(PROMPT[-1], 8, "cpu")
    dr.propose(dec, state, chain, 0, 1)
    chain.add(0, 9)
    assert torch.allclose(both[1], dr.propose(dec, state, chain, 1, 2)[0], atol=1e-12)
    assert not torch.allclose(both[0], both[1])


@pytest.fixture(scope="module")
def enum_tgt():
    return tiny(vocab=6, seed=0, std=0.5, layers=4, dtype=torch.float64)


@pytest.fixture(scope="module")
def enum_refs(enum_tgt):
    return {s: target_distribution(enum_tgt, ENUM_PROMPT, N_NEW, s.temperature, s.top_k, s.top_p)
            for s in (TEMP, TOPKP)}


@pytest.mark.parametrize("tree, sampling", [
    (None, TEMP), (None, TOPKP),
    (StaticTree([(0,), (1,), (0, 0), (1, 0)]), TEMP),
    (DynamicTree(budget=4, max_depth=2, width=2, expand_batch=2), TOPKP),
], ids=["chain-T0.8", "chain-topk-topp", "static-T0.8", "dynamic-topk-topp"])
def test_eagle3_is_exact(enum_tgt, enum_refs, tree, sampling):
    dr = module(enum_tgt, vocab_keep=4)
    dr.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    dec = SpeculativeDecoder(enum_tgt, dr.decoder_drafter(enum_tgt), policy=FixedLength(2), tree=tree,
                             sampling=sampling)
    got = exact_distribution(dec, ENUM_PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, enum_refs[sampling]) < 1e-9


@pytest.mark.parametrize("tree", [None, StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]),
                                  DynamicTree(budget=6, max_depth=3, width=2, expand_batch=2)],
                         ids=["chain", "static", "dynamic"])
def test_greedy_equals_plain_decoding(tree):
    t = tiny(vocab=40, layers=4)
    plain = SpeculativeDecoder(t).generate(PROMPT, 24).tokens
    dec = SpeculativeDecoder(t, module(t).decoder_drafter(t), policy=FixedLength(3), tree=tree)
    assert dec.generate(PROMPT, 24).tokens == plain
    assert dec.generate(PROMPT, 24).tokens == plain  # a second generation on the same drafter


def _recipe(tmp_path, **train_kw):
    t = {"max_steps": 16, "batch_size": 4, "chunk_len": 64, "lr": 1e-2, "warmup_steps": 2, "tracker": "none",
         "save_every": 8, "log_every": 4, "loss": "soft", "calibration_every": 0, **train_kw}
    return parse_recipe({"name": "e3", "output_dir": str(tmp_path / "run"), "seed": 3,
                         "drafter": {"kind": "eagle3", "aux_layers": AUX, "vocab_keep": 30, "ttt_steps": 3,
                                     "draft_len": 3},
                         "train": t})


def test_training_end_to_end_checkpoint_and_decoding(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=4)
    r = _recipe(tmp_path)
    needs = registry.get("eagle3").cache_needs(r.drafter.model_dump())
    assert needs == ["layer:1", "layer:2", "layer:3", "final"]
    build_cache(t, _cycle_sequences(), needs, tmp_path / "cache", dtype="float32")
    cache = HiddenCache(tmp_path / "cache", t)
    before = heldout_metrics(build_drafter(r, t), cache, t)
    ckpt, timing = train(r, t, tmp_path / "cache", r.out)
    assert timing["steps"] == 16
    man = json.loads((ckpt / "manifest.json").read_text())
    assert man["kind"] == "eagle3" and man["target"]["fingerprint"] == t.fingerprint
    stored = load_file(str(ckpt / "model.safetensors"))
    assert "draft_head.kept_ids" in stored and not any(k.startswith(("lm_head", "embed")) for k in stored)
    model, _ = load_checkpoint(ckpt, t)
    after = heldout_metrics(model, cache, t)
    # training must lift every step's agreement with the target well above the random start
    assert all(a > b + 0.2 for a, b in zip(after["step_top1"], before["step_top1"])), (before, after)
    assert after["predicted_chain_tau"] > before["predicted_chain_tau"] + 0.3, (before, after)
    dr = drafter_from_checkpoint(ckpt, t)
    plain = SpeculativeDecoder(t).generate(PROMPT, 24).tokens
    res = SpeculativeDecoder(t, dr).generate(PROMPT, 24)
    assert res.tokens == plain
    # a stale cache without the states the drafter fuses is a clear error
    build_cache(t, _cycle_sequences(n=4), ["layer:1", "final"], tmp_path / "stale", dtype="float32")
    with pytest.raises(ValueError, match="needs \\['layer:2', 'layer:3'\\] too"):
        Eagle3Objective(HiddenCache(tmp_path / "stale", t), t, AUX)


def test_bad_configs_are_clear_errors():
    with pytest.raises(RecipeError, match="aux_layers"):
        parse_recipe({"name": "x", "drafter": {"kind": "eagle3", "aux_layers": [3, 2, 1]}})
    with pytest.raises(RecipeError, match="unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "eagle3", "ttt_step": 3}})
    t = make_tiny_target(layers=4)
    with pytest.raises(ValueError, match="do not fit a target with 4 layers"):
        Eagle3Module.for_target(t, aux_layers=[2, 15, 27])


def test_aux_layers_left_out_are_derived_from_the_targets_layer_count():
    """A recipe that leaves aux_layers out gets [2, L/2, L-3] for the target's L layers (the default target's
    [2, 15, 27]; Gemma-3-270M's 18 layers [2, 9, 15]; a 4-layer target [1, 2, 3]); its cache needs are refused
    until the section is filled for a target, rather than guessed."""
    from types import SimpleNamespace

    from draftsmith.drafters.eagle3.config import default_aux_layers
    r = parse_recipe({"name": "x", "drafter": {"kind": "eagle3"}})
    assert r.drafter.aux_layers is None
    with pytest.raises(ValueError, match="derived from the target's layer count"):
        registry.get("eagle3").cache_needs(r.drafter.model_dump())
    for layers, want in ((30, [2, 15, 27]), (18, [2, 9, 15]), (24, [2, 12, 21]), (4, [1, 2, 3])):
        fake = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(num_hidden_layers=layers)))
        assert r.drafter.with_target(fake).aux_layers == want == default_aux_layers(layers)
    with pytest.raises(ValueError, match="too few"):
        default_aux_layers(3)
    t = make_tiny_target(layers=4)
    assert Eagle3Module.for_target(t, vocab_keep=None).aux_layers == [1, 2, 3]


@pytest.mark.parametrize("fmt", ["vllm-eagle3", "eagle3"])
def test_export_reloads_and_imports_back(tmp_path, fmt):
    from draftsmith.checkpoint import save_checkpoint
    from draftsmith.export import export, import_drafter, load_drafter

    t = make_tiny_target(init_std=0.3, layers=4)
    m = module(t, vocab_keep=30)
    m.set_draft_vocab(torch.arange(30) * 3)
    save_checkpoint(tmp_path / "ck", m, t)
    out = export(tmp_path / "ck", fmt, tmp_path / "ex", t)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["norm_before_residual"] is False and cfg["draft_vocab_size"] == 30
    w = load_file(str(out / "model.safetensors"))
    assert torch.equal(w["d2t"] + torch.arange(30), torch.arange(30) * 3) and int(w["t2d"].sum()) == 30
    assert not any("embed" in k for k in w)
    plain = SpeculativeDecoder(t).generate(PROMPT, 16)
    ours = SpeculativeDecoder(t, drafter_from_checkpoint(tmp_path / "ck", t)).generate(PROMPT, 16)
    back = SpeculativeDecoder(t, load_drafter(out, t)).generate(PROMPT, 16)
    assert back.tokens == ours.tokens == plain.tokens
    assert [s.accepted for s in back.steps] == [s.accepted for s in ours.steps]
    import_drafter(out, tmp_path / "imported", t)
    again = SpeculativeDecoder(t, drafter_from_checkpoint(tmp_path / "imported", t)).generate(PROMPT, 16)
    assert [s.accepted for s in again.steps] == [s.accepted for s in ours.steps]


def test_bad_exports_are_clear_errors(tmp_path):
    from safetensors.torch import save_file

    from draftsmith.checkpoint import CheckpointError, save_checkpoint
    from draftsmith.export import export, import_drafter
    from draftsmith.target import TargetMismatchError

    t = make_tiny_target(init_std=0.3, layers=4)
    m = module(t, vocab_keep=30)
    m.set_draft_vocab(torch.arange(30) * 3)
    save_checkpoint(tmp_path / "ck", m, t)
    out = export(tmp_path / "ck", "vllm-eagle3", tmp_path / "ex", t)
    w = load_file(str(out / "model.safetensors"))
    cfg = json.loads((out / "config.json").read_text())

    def variant(name, tensors=None, config=None):
        d = tmp_path / name
        d.mkdir()
        save_file(tensors if tensors is not None else w, str(d / "model.safetensors"))
        (d / "config.json").write_text(json.dumps(config if config is not None else cfg))
        return d

    with pytest.raises(CheckpointError, match="d2t has shape"):
        import_drafter(variant("short", {**w, "d2t": w["d2t"][:20]}), tmp_path / "o1", t)
    with pytest.raises(CheckpointError, match="no d2t"):
        import_drafter(variant("nod2t", {k: v for k, v in w.items() if k != "d2t"}), tmp_path / "o2", t)
    with pytest.raises(CheckpointError, match="eagle_aux_hidden_state_layer_ids"):
        import_drafter(variant("layers", config={**cfg, "eagle_aux_hidden_state_layer_ids": [2, 15, 27]}),
                       tmp_path / "o3", t)
    with pytest.raises(CheckpointError, match="norm_before_residual"):
        import_drafter(variant("nbr", config={k: v for k, v in cfg.items() if k != "norm_before_residual"}),
                       tmp_path / "o4", t)
    with pytest.raises(TargetMismatchError):
        import_drafter(out, tmp_path / "o5", make_tiny_target(init_std=0.3, layers=4, seed=5))
    with pytest.raises(ValueError, match="cannot be exported to 'vllm-medusa'"):
        export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex2", t)


def test_monte_carlo_chi_square_passes_with_eagle3():
    """The Monte Carlo harness (prefilled prompt, cloned decode states) with a sampled EAGLE-3 tree."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.eval.mc_lossless import mc_lossless

    t = tiny(vocab=12, seed=2, std=0.5, layers=4)
    dr = module(t, std=0.3).decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr, tree=StaticTree([(0,), (1,), (0, 0)]), sampling=SamplingParams(0.9))
    r = mc_lossless(dec, PROMPT, n_new=3, n_samples=600, seed=0)
    assert r["cells"] > 10 and r["p_value"] > 1e-3, r


def test_a_dropped_drafter_takes_its_hooks_off_the_target():
    import gc

    t = tiny(vocab=40, layers=4)
    layer = t.model.model.layers[0]
    before = len(layer._forward_hooks)
    dr = module(t).decoder_drafter(t)
    assert len(layer._forward_hooks) == before + 1
    del dr
    gc.collect()
    assert len(layer._forward_hooks) == before


# ---------------------------------------------------------------------------------------------- batched decoding
BATCH_PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1] + list(range(3, 38)) + [4, 5, 6] * 8, [1], [1, 20, 21, 22, 23]]
BATCH_NEW = [24, 30, 9, 30, 17]


@pytest.mark.parametrize("forward", ["eager", "fast"])
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]],
                         ids=["chain", "static"])
def test_batched_rows_equal_batch_one_and_draft_the_same(tree, forward):
    """Greedy: each batched row equals plain decoding, and drafts and accepts exactly what the single-sequence
    decoder with the same drafter does (the same trees: the rows' states come from the batched forwards'
    hooks), with prompts of very different lengths, a one-token prompt and rows that leave early; with the
    model's own forward and with ours (the fused batched step calls the layers' hooks with its outputs)."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.fastpath import use_fast_forward

    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    use_fast_forward(t, forward)
    dr = module(t, std=0.3).decoder_drafter(t)
    plain = SpeculativeDecoder(t)
    ref = [plain.generate(p, n).tokens for p, n in zip(BATCH_PROMPTS, BATCH_NEW)]
    one = SpeculativeDecoder(t, dr, policy=None if tree else FixedLength(3), tree=StaticTree(tree) if tree else None)
    singles = [one.generate(p, n) for p, n in zip(BATCH_PROMPTS, BATCH_NEW)]
    assert [s.tokens for s in singles] == ref
    res = BatchedSpeculativeDecoder(t, dr, tree=tree, k=3).generate(BATCH_PROMPTS, BATCH_NEW)
    assert [r.tokens for r in res.rows] == ref
    assert [[s.accepted for s in r.steps] for r in res.rows] == [[s.accepted for s in r.steps] for r in singles]
    assert sum(s.accepted for s in res.steps) > 0  # the drafter is right sometimes: the comparison has teeth


def test_batched_row_is_exact_with_injected_randomness(enum_tgt, enum_refs):
    """Exact enumeration of one row's draws (sampled EAGLE-3 static tree) while another row, with its own
    seeded source, shares every forward and ends first: total variation to the target < 1e-9."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.sampling import TorchRandom
    from draftsmith.eval.exact import enumerate_branches

    dr = module(enum_tgt, vocab_keep=4)
    dr.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    dec = BatchedSpeculativeDecoder(enum_tgt, dr.decoder_drafter(enum_tgt), tree=[(0,), (1,), (0, 0)],
                                    sampling=TEMP)
    prompts, news = [[1, 3, 4, 3, 5, 4], ENUM_PROMPT], [1, N_NEW]
    got: dict = {}
    for out, w, _ in enumerate_branches(lambda src: tuple(dec.generate(prompts, news,
                                                                       rngs=[TorchRandom(7), src]).rows[1].tokens)):
        got[out] = got.get(out, 0.0) + w
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, enum_refs[TEMP]) < 1e-9


@pytest.mark.parametrize("mode", ["fast", "compile"])
def test_eagle3_decodes_through_our_forward(mode):
    """Our static-shape forward (engine/fastpath.py) calls the forward hooks of the layers EAGLE-3 reads with
    their outputs: the drafts and acceptances are the model forward's, and greedy output equals plain decoding
    (float64, so that the fused forward's accumulation order cannot flip a token)."""
    from draftsmith.engine.fastpath import use_fast_forward

    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    dr = module(t, std=0.3).decoder_drafter(t)
    tree = StaticTree([(0,), (1,), (0, 0), (1, 0), (0, 0, 0)])
    prompts = [p for p in BATCH_PROMPTS if len(p) > 1]
    ref = [SpeculativeDecoder(t, dr, tree=tree).generate(p, 40) for p in prompts]
    plain = [SpeculativeDecoder(t).generate(p, 40).tokens for p in prompts]
    use_fast_forward(t, mode, autotune=False)
    dec = SpeculativeDecoder(t, dr, tree=tree)
    assert dec.fast is t.fast_body
    got = [dec.generate(p, 40) for p in prompts]
    assert [g.tokens for g in got] == [r.tokens for r in ref] == plain
    assert [[s.accepted for s in g.steps] for g in got] == [[s.accepted for s in r.steps] for r in ref]
    assert sum(s.accepted for g in got for s in g.steps) > 0


@pytest.mark.parametrize("prior", [0.0, 1.0], ids=["suffix-first", "mixed"])
def test_hybrid_with_suffix_is_exact_and_greedy_equal(enum_tgt, enum_refs, prior):
    """EAGLE-3 beside SuffixDecoding: its state carries the target's states of the suffix and plain steps too
    (`observe_step`), so the steps it drafts after them are exact, and greedy output is plain decoding's."""
    from draftsmith.drafters.suffix import HybridDrafter
    from tests.test_suffix import _suffix

    dr = module(enum_tgt, vocab_keep=4)
    dr.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    h = HybridDrafter(dr.decoder_drafter(enum_tgt), _suffix(), prior=prior, inner_cost=1.0, explore_every=2)
    dec = SpeculativeDecoder(enum_tgt, h, tree=StaticTree([(0,), (1,), (0, 0)]), sampling=TEMP)
    got = exact_distribution(dec, ENUM_PROMPT, N_NEW)
    assert total_variation(got, enum_refs[TEMP]) < 1e-9
    greedy = SpeculativeDecoder(enum_tgt, h, tree=StaticTree([(0,), (1,), (0, 0)]))
    for _ in range(3):
        assert greedy.generate(ENUM_PROMPT, 12).tokens == SpeculativeDecoder(enum_tgt).generate(ENUM_PROMPT, 12).tokens
    assert h.steps["suffix"] > 0 and h.steps["inner"] > 0  # both members drafted
