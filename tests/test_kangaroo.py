"""Kangaroo on tiny random models: same-position alignment, the target's cache after a step,
exact losslessness, greedy equality, bad input, training end to end with a checkpoint round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import registry
from draftsmith.checkpoint import load_checkpoint, save_checkpoint, trainable_state_dict
from draftsmith.common.layers import LayerKV
from draftsmith.drafters.kangaroo.model import KangarooAdapter, KangarooObjective, expected_acceptance
from draftsmith.drafters.kangaroo.decode import KangarooDrafter, early_exit_drafter
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.engine.sampling import SamplingParams, TorchRandom
from draftsmith.engine.trees import DynamicTree, StaticTree
from draftsmith.recipe import RecipeError, parse_recipe
from draftsmith.target import TargetMismatchError
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.cache import build_cache
from draftsmith.train.training.trainer import StopTraining, build_drafter, train
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP, TOPKP
from tests.test_train import _cycle_sequences
from tests.tiny import make_tiny_target

PROMPT = [1, 3, 4, 5, 5]


def random_adapter(target, exit_layer=2, std=0.1, seed=1, mlp=False, **kw) -> KangarooAdapter:
    """An adapter whose output projection is random (a fresh one is the plain early exit)."""
    a = KangarooAdapter.for_target(target, exit_layer=exit_layer, adapter_mlp=mlp, **kw)
    torch.manual_seed(seed)
    with torch.no_grad():
        a.layer.o.weight.normal_(0, std)
        if mlp:
            a.layer.down.weight.normal_(0, std)
    return a.to(next(target.model.parameters()).dtype).eval()


def kangaroo(target, **kw) -> KangarooDrafter:
    a = random_adapter(target, **{k: kw.pop(k) for k in ("exit_layer", "std", "mlp") if k in kw})
    return KangarooDrafter(target, a.exit_layer, a, target_fingerprint=target.fingerprint, **kw)


@pytest.fixture(scope="module")
def tgt():
    return tiny(vocab=12, seed=2, std=0.5, layers=4)  # 40 greedy tokens without an EOS from PROMPT


# ---------------------------------------------------------------------- (a) same-position alignment
def _identity_tail(target, exit_layer):
    """Zero the output projections of layers l+1..L: the final state is norm(h^l) at the same position,
    so a fresh adapter (identity, final norm, LM head) reproduces the teacher exactly."""
    with torch.no_grad():
        for layer in target.model.get_decoder().layers[exit_layer:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    return target


class _ShiftedObjective(KangarooObjective):
    """A deliberately misaligned objective: the adapter reads the state of position t-1."""

    def window(self, i, lo, hi):
        b = super().window(i, lo, hi)
        if b is not None:
            h, lo_, keep = b.seqs[0]
            b.seqs = [(torch.cat([h[:1], h[:-1]]), lo_, keep)]
        return b


def _acceptance_on(obj: KangarooObjective, model) -> float:
    b = obj.prepare(list(range(len(obj.chunks))))
    with torch.no_grad():
        return float(expected_acceptance(model(b.seqs), b.teacher).mean())


def test_objective_reads_the_layer_l_state_of_the_same_position(tmp_path):
    t = _identity_tail(make_tiny_target(init_std=0.3, layers=3), 2)
    seqs = _cycle_sequences(n=4, length=40)
    build_cache(t, seqs, KangarooAdapter.cache_needs({"exit_layer": 2}), tmp_path / "c", dtype="float32")
    cache = HiddenCache(tmp_path / "c", t)
    obj = KangarooObjective(cache, t, 2, chunk_len=16)
    b = obj.window(0, 16, 32)
    ids = seqs[0]["ids"]
    with torch.no_grad():
        out = t.model(torch.tensor([ids]), output_hidden_states=True)
    h, lo, keep = b.seqs[0]
    torch.testing.assert_close(h, out.hidden_states[2][0, :32])  # layer-l states of positions 0..hi-1
    rows = torch.arange(16, 32)[keep]
    assert b.labels.tolist() == [ids[r + 1] for r in rows.tolist()]  # label of t is token t+1
    torch.testing.assert_close(b.teacher, out.logits[0, rows], atol=1e-4, rtol=1e-4)  # p at t, no shift
    fresh = KangarooAdapter.for_target(t, exit_layer=2)
    assert _acceptance_on(obj, fresh) > 1 - 1e-4  # the known answer: q == p at every position
    with pytest.raises(AssertionError):  # the same check fails a one-position shift (it has teeth)
        assert _acceptance_on(_ShiftedObjective(cache, t, 2, chunk_len=16), fresh) > 1 - 1e-4


def test_fresh_adapter_is_the_early_exit_and_no_weight_is_shared(tgt):
    a = KangarooAdapter.for_target(tgt, exit_layer=2, adapter_mlp=True)
    h = torch.randn(7, tgt.hidden_size)
    body = tgt.model.get_decoder()
    torch.testing.assert_close(a([(h, 0, torch.ones(7, dtype=torch.bool))]), tgt.lm_head(body.norm(h)))
    own = [(n, p) for n, p in a.named_parameters() if not n.startswith("lm_head")]
    assert len({p.data_ptr() for _, p in own}) == len(own) and all(p.requires_grad for _, p in own)
    assert not a.lm_head.weight.requires_grad
    assert not any(k.startswith("lm_head") for k in trainable_state_dict(a))  # shared, never saved


def test_adapter_incremental_equals_full_sequence(tgt):
    a = random_adapter(tgt, mlp=True)
    h = torch.randn(12, tgt.hidden_size)
    full = a.adapt(h, torch.arange(12))
    kv = LayerKV.empty(a.layer, 16)
    parts = [a.adapt(h[s:e], torch.arange(s, e), kv, s) for s, e in ((0, 5), (5, 6), (6, 12))]
    torch.testing.assert_close(torch.cat(parts), full, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------- (b) the target's cache after steps
@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(0.9)], ids=["greedy", "T0.9"])
@pytest.mark.parametrize("make", [lambda t: kangaroo(t), lambda t: kangaroo(t, full_verify=True),
                                  lambda t: early_exit_drafter(t, 1, FixedLength(3))],
                         ids=["kangaroo", "full-verify", "early-exit"])
def test_target_cache_matches_a_fresh_forward_after_each_step(tgt, make, sampling):
    dr = make(tgt)
    dec = SpeculativeDecoder(tgt, dr, sampling=sampling)
    state, rng = dec.start(PROMPT, 30), TorchRandom(0)
    steps = 0
    while not state.done:
        dec.step(state, rng)
        steps += 1
        n = state.cached
        with torch.no_grad():
            ref = tgt.model(torch.tensor([state.tokens[:n]]), use_cache=True).past_key_values
        for i, layer in enumerate(dec.cache.layers):
            torch.testing.assert_close(layer.keys[:, :, :n], ref.layers[i].keys, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(layer.values[:, :, :n], ref.layers[i].values, atol=1e-4, rtol=1e-4)
        ds = state.drafter_state
        if dr.heads is not None and ds.a_valid:  # the adapter's cache holds the committed prefix too
            with torch.no_grad():
                hl = tgt.model(torch.tensor([state.tokens[:ds.a_valid]]), output_hidden_states=True)
                lay = dr.heads.layer
                k = lay.k(lay.input_norm(hl.hidden_states[dr.exit_layer][0]))
            k = lay.rope(k.view(ds.a_valid, lay.nkv, lay.hd).transpose(0, 1), torch.arange(ds.a_valid))
            torch.testing.assert_close(ds.kv.keys[:, :ds.a_valid], k, atol=1e-4, rtol=1e-4)
    assert steps < 30 and sum(s.accepted for s in state.steps) > 0  # drafts were accepted and committed


# ---------------------------------------------------------------------- (c) losslessness
@pytest.mark.parametrize("make", [
    lambda t: kangaroo(t),  # double early exit: the confidence stop
    lambda t: kangaroo(t, policy=FixedLength(3), mlp=True),
    lambda t: kangaroo(t, exit_layer=1, threshold=0.3, max_draft_len=6),
    lambda t: kangaroo(t, full_verify=True),
    lambda t: early_exit_drafter(t, 3, FixedLength(4)),
], ids=["confidence", "fixed3-mlp", "l1-t0.3", "full-verify", "early-exit"])
def test_greedy_kangaroo_equals_plain(tgt, make):
    plain = SpeculativeDecoder(tgt).generate(PROMPT, 40).tokens
    assert len(plain) == 40
    res = SpeculativeDecoder(tgt, make(tgt)).generate(PROMPT, 40)
    assert res.tokens == plain
    assert res.tau > 1.05  # drafts were accepted, so accepted paths were committed


STAR = StaticTree([(0,), (1,), (2,)])  # top-3 candidates of one draft: a 4-row verification
BRANCHY = StaticTree([(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)])


@pytest.mark.parametrize("tree", [STAR, BRANCHY, DynamicTree(budget=6, max_depth=3, width=2, expand_batch=2)],
                         ids=["star", "branchy", "dynamic"])
@pytest.mark.parametrize("make", [lambda t: kangaroo(t, mlp=True), lambda t: kangaroo(t, full_verify=True),
                                  lambda t: early_exit_drafter(t, 1)], ids=["kangaroo", "full-verify", "early-exit"])
def test_greedy_kangaroo_trees_equal_plain(tgt, make, tree):
    plain = SpeculativeDecoder(tgt).generate(PROMPT, 40).tokens
    res = SpeculativeDecoder(tgt, make(tgt), tree=tree).generate(PROMPT, 40)
    assert res.tokens == plain
    assert res.tau > 1.05


@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(0.9)], ids=["greedy", "T0.9"])
def test_tree_step_leaves_both_caches_equal_to_a_fresh_forward(tgt, sampling):
    """After every tree step (accepted paths compacted), the target's cache and the adapter's keys hold
    exactly the committed prefix's entries."""
    dr = kangaroo(tgt, mlp=True)
    dec = SpeculativeDecoder(tgt, dr, tree=BRANCHY, sampling=sampling)
    paths, commit = [], dr.commit
    dr.commit = lambda d, st, tree, path: (paths.append(list(path)), commit(d, st, tree, path))[1]
    state, rng = dec.start(PROMPT, 30), TorchRandom(0)
    while not state.done:
        dec.step(state, rng)
        n = state.cached
        with torch.no_grad():
            out = tgt.model(torch.tensor([state.tokens[:n]]), use_cache=True, output_hidden_states=True)
        for i, layer in enumerate(dec.cache.layers):
            torch.testing.assert_close(layer.keys[:, :, :n], out.past_key_values.layers[i].keys, atol=1e-4, rtol=1e-4)
        ds = state.drafter_state
        torch.testing.assert_close(ds.shallow[:ds.s_valid], out.hidden_states[dr.exit_layer][0, :ds.s_valid],
                                   atol=5e-4, rtol=1e-4)  # states are O(1-10): fp32 summation order
        if ds.a_valid:
            with torch.no_grad():
                lay = dr.heads.layer
                k = lay.k(lay.input_norm(out.hidden_states[dr.exit_layer][0, :ds.a_valid]))
            k = lay.rope(k.view(ds.a_valid, lay.nkv, lay.hd).transpose(0, 1), torch.arange(ds.a_valid))
            torch.testing.assert_close(ds.kv.keys[:, :ds.a_valid], k, atol=1e-4, rtol=1e-4)
    assert any(p != list(range(len(p))) for p in paths)  # an accepted path off the first ranks: compacted


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_fused_prompt_gets_the_decoders_mask_for_the_attention_kernel(attn):
    """The first step's layers over the fused prompt get the decoder's own mask: none under sdpa (its causal
    kernel on the KV heads as they are; the explicit mask made HF copy keys/values to every query head and
    cost more than the skipped layer), the explicit one under eager, which does not mask by itself."""
    t = tiny(vocab=12, seed=2, std=0.5, layers=4)
    t.model.set_attn_implementation(attn)
    plain = SpeculativeDecoder(t).generate(PROMPT * 3, 40).tokens
    masks = []
    hook = t.model.get_decoder().layers[-1].register_forward_pre_hook(
        lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    try:
        res = SpeculativeDecoder(t, kangaroo(t)).generate(PROMPT * 3, 40)
    finally:
        hook.remove()
    assert res.tokens == plain and res.tau > 1.05
    assert (masks[0] is None) == (attn == "sdpa")  # the first verification: prompt + root + drafts from slot 0


def test_layers_get_the_cache_under_its_current_name(tgt):
    """No deprecated-argument shim (a rename and a warning) per layer call on the verification path."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        SpeculativeDecoder(tgt, kangaroo(tgt)).generate(PROMPT, 10)
    assert not [w for w in caught if "DecoderLayer" in str(w.message)]


@pytest.fixture(scope="module")
def enum_tgt():
    return tiny(vocab=6, seed=0, std=0.5, layers=3, dtype=torch.float64)


@pytest.fixture(scope="module")
def enum_refs(enum_tgt):
    return {s: target_distribution(enum_tgt, ENUM_PROMPT, N_NEW, s.temperature, s.top_k, s.top_p)
            for s in (TEMP, TOPKP)}


@pytest.mark.parametrize("make, sampling", [
    (lambda t: kangaroo(t, exit_layer=1, std=0.5, threshold=0.35, max_draft_len=2), TEMP),
    (lambda t: kangaroo(t, exit_layer=1, std=0.5, threshold=0.35, max_draft_len=2), TOPKP),
    (lambda t: kangaroo(t, exit_layer=2, std=0.5, policy=FixedLength(2)), TEMP),
    (lambda t: kangaroo(t, exit_layer=1, std=0.5, policy=FixedLength(2), full_verify=True), TOPKP),
    (lambda t: early_exit_drafter(t, 1, FixedLength(2)), TOPKP),
], ids=["confidence-T0.8", "confidence-topk-topp", "fixed-T0.8", "full-verify-topk-topp", "early-exit-topk-topp"])
def test_kangaroo_is_exact(enum_tgt, enum_refs, make, sampling):
    dec = SpeculativeDecoder(enum_tgt, make(enum_tgt), sampling=sampling)
    got = exact_distribution(dec, ENUM_PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, enum_refs[sampling]) < 1e-9


@pytest.mark.parametrize("make, tree, sampling", [
    (lambda t: kangaroo(t, exit_layer=1, std=0.5, mlp=True), StaticTree([(0,), (1,), (0, 0), (1, 0)]), TEMP),
    (lambda t: kangaroo(t, exit_layer=2, std=0.5), StaticTree([(0,), (1,), (2,)]), TOPKP),
    (lambda t: kangaroo(t, exit_layer=1, std=0.5), DynamicTree(budget=4, max_depth=2, width=2, expand_batch=2), TEMP),
    (lambda t: early_exit_drafter(t, 1), StaticTree([(0,), (1,), (0, 0)]), TOPKP),
], ids=["static-mlp-T0.8", "star-topk-topp", "dynamic-T0.8", "early-exit-topk-topp"])
def test_kangaroo_trees_are_exact(enum_tgt, enum_refs, make, tree, sampling):
    dec = SpeculativeDecoder(enum_tgt, make(enum_tgt), tree=tree, sampling=sampling)
    got = exact_distribution(dec, ENUM_PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, enum_refs[sampling]) < 1e-9


def test_tree_verification_from_misplaced_states_is_detected(enum_tgt, enum_refs):
    """Teeth for the tree path: tree nodes fed at chain positions (depth ignored) are caught by enumeration."""
    class ChainPositions(KangarooDrafter):
        @staticmethod
        def _tree_rows(tree, s, e, L, device):
            rows = KangarooDrafter._tree_rows(tree, s, e, L, device)
            return None if rows is None else (torch.arange(L + s, L + e, device=device), rows[1])

    a = random_adapter(enum_tgt, exit_layer=1, std=0.5)
    dec = SpeculativeDecoder(enum_tgt, ChainPositions(enum_tgt, 1, a), tree=StaticTree([(0,), (1,), (1, 0)]),
                             sampling=TEMP)
    assert total_variation(exact_distribution(dec, ENUM_PROMPT, N_NEW), enum_refs[TEMP]) > 1e-3


def test_monte_carlo_chi_square_passes_with_kangaroo(tgt):
    """The Monte Carlo harness (prefilled prompt, cloned states: the drafter recomputes the shallow prefix)."""
    from draftsmith.eval.mc_lossless import mc_lossless

    dec = SpeculativeDecoder(tgt, kangaroo(tgt, threshold=0.3), sampling=SamplingParams(0.9))
    r = mc_lossless(dec, PROMPT, n_new=3, n_samples=600, seed=0)
    assert r["cells"] > 10 and r["p_value"] > 1e-3, r


def test_verification_from_wrong_shallow_states_is_detected(enum_tgt, enum_refs):
    """The enumeration check has teeth here: verifying from stale layer-l states is caught."""
    class Stale(KangarooDrafter):
        def _shallow(self, dec, ds, ids, start):
            h = super()._shallow(dec, ds, ids, start)
            ds.shallow[start:start + h.shape[0]] += 0.5  # what verification would read if states were misfiled
            return h

    a = random_adapter(enum_tgt, exit_layer=1, std=0.5)
    dec = SpeculativeDecoder(enum_tgt, Stale(enum_tgt, 1, a, policy=FixedLength(2)), sampling=TEMP)
    assert total_variation(exact_distribution(dec, ENUM_PROMPT, N_NEW), enum_refs[TEMP]) > 1e-3


# ---------------------------------------------------------------------- (d) bad input
def test_bad_input_is_a_clear_error(tgt, tmp_path):
    for bad in (0, 4, 7):
        with pytest.raises(ValueError, match=r"1 <= l < L = 4"):
            KangarooAdapter.for_target(tgt, exit_layer=bad)
        with pytest.raises(ValueError, match=r"1 <= l < L = 4"):
            early_exit_drafter(tgt, bad)
    base = {"name": "k", "drafter": {"kind": "kangaroo"}}
    for key, val in (("threshold", 0.0), ("threshold", 1.0), ("threshold", 1.5), ("exit_layer", 0),
                     ("max_draft_len", 0), ("adapter_mlp", "maybe")):
        with pytest.raises(RecipeError, match=f"drafter.{key}"):
            parse_recipe({**base, "drafter": {"kind": "kangaroo", key: val}})
    with pytest.raises(RecipeError, match="drafter.exit_layr': unknown key"):
        parse_recipe({**base, "drafter": {"kind": "kangaroo", "exit_layr": 2}})
    r = parse_recipe({**base, "drafter": {"kind": "kangaroo", "exit_layer": 4}})  # L is known only with a target
    with pytest.raises(ValueError, match=r"L = 4 \(the target has 4 decoder layers\), got l = 4"):
        build_drafter(r, tgt)
    with pytest.raises(ValueError, match=r"threshold must be in \(0, 1\)"):
        kangaroo(tgt, threshold=1.0)
    with pytest.raises(ValueError, match="path"):  # a tree is checked like any other drafter's
        SpeculativeDecoder(tgt, kangaroo(tgt), tree=[(0,), (2,)])
    # a checkpoint of another target
    save_checkpoint(tmp_path / "ck", random_adapter(tgt), tgt)
    other = tiny(vocab=12, seed=3, std=0.5, layers=4)
    with pytest.raises(TargetMismatchError):
        drafter_from_checkpoint(tmp_path / "ck", other)


# ---------------------------------------------------------------------- (e) training end to end
def _recipe(tmp_path, **train_kw):
    t = {"max_steps": 12, "batch_size": 4, "chunk_len": 16, "lr": 1e-2, "warmup_steps": 2, "tracker": "none",
         "save_every": 4, "log_every": 4, "loss": "soft", "calibration_every": 0, **train_kw}
    return parse_recipe({"name": "kg", "output_dir": str(tmp_path / "run"), "seed": 3,
                         "drafter": {"kind": "kangaroo", "exit_layer": 1, "threshold": 0.5, "max_draft_len": 4},
                         "train": t})


def test_training_end_to_end_checkpoint_and_decoding(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    r = _recipe(tmp_path)
    needs = registry.get("kangaroo").cache_needs(r.drafter.model_dump())
    assert needs == ["layer:1", "final"]
    build_cache(t, _cycle_sequences(), needs, tmp_path / "cache", dtype="float32")
    cache = HiddenCache(tmp_path / "cache", t)
    obj = KangarooObjective(cache, t, 1, chunk_len=16)
    before = _acceptance_on(obj, build_drafter(r, t))
    ckpt, timing = train(r, t, tmp_path / "cache", r.out)
    assert timing["steps"] == 12
    assert sorted(p.name for p in ckpt.iterdir()) == ["config.json", "manifest.json", "model.safetensors",
                                                    "trainer_state.json", "trainer_state.safetensors"]
    man = json.loads((ckpt / "manifest.json").read_text())
    assert man["kind"] == "kangaroo" and man["target"]["fingerprint"] == t.fingerprint
    assert not any(k.startswith("lm_head") for k in load_file(str(ckpt / "model.safetensors")))
    model, _ = load_checkpoint(ckpt, t)
    after = _acceptance_on(obj, model)
    assert after > before + 0.05, (before, after)
    dr = drafter_from_checkpoint(ckpt, t)
    assert isinstance(dr, KangarooDrafter) and dr.default_policy == ConfidenceStop(0.5, 4)
    plain = SpeculativeDecoder(t).generate(PROMPT, 24).tokens
    assert SpeculativeDecoder(t, dr).generate(PROMPT, 24).tokens == plain
    # a stale cache without the layer the recipe needs is a clear error
    with pytest.raises(ValueError, match="needs \\['layer:2', 'final'\\]"):
        KangarooObjective(cache, t, 2)


def test_exact_resume(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    kw = dict(max_steps=4, save_every=2, batch_size=2)
    r = _recipe(tmp_path / "a", **kw)
    build_cache(t, _cycle_sequences(n=8), ["layer:1", "final"], tmp_path / "cache", dtype="float32")
    full, _ = train(r, t, tmp_path / "cache", r.out)
    part = _recipe(tmp_path / "b", **kw)
    with pytest.raises(StopTraining):
        train(part, t, tmp_path / "cache", part.out, stop_after=3)  # killed after step 3; last checkpoint at 2
    resumed, timing = train(part, t, tmp_path / "cache", part.out)
    assert timing["steps"] == 2
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_cli_runs_kangaroo_side_by_side(tmp_path):
    """`draftsmith eval` on a kangaroo checkpoint: double early exit, fixed lengths, full-depth verification,
    the early-exit peers (ours and HF's); a tree spec drafts a tree."""
    from draftsmith.cli import main
    from draftsmith.cli.eval import eval_main

    t = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, layers=3, save_to=tmp_path / "target")
    save_checkpoint(tmp_path / "ck", random_adapter(t, exit_layer=1), t)
    report = eval_main([str(tmp_path / "ck"), "--plain", "--prompts", "1", "--max-new-tokens", "8",
                        "--temperature", "0", "--fixed-len", "2", "3", "--full-verify", "--early-exit", "1",
                        "--hf-early-exit", "1", "--draft-len", "2", "--confidence", "0.5", "--out",
                        str(tmp_path / "r")])
    methods = report["runs"]["greedy"]["methods"]
    assert set(methods) == {"plain (ours)", "HF generate", "ours kangaroo chain", "ours kangaroo K=2",
                            "ours kangaroo K=3", "ours kangaroo full-verify", "ours early-exit-1 K=2",
                            "HF early-exit-1 K=2"}
    assert methods["HF generate"]["tau"] == 1.0
    args = ["eval", str(tmp_path / "ck"), "--prompts", "1", "--max-new-tokens", "3", "--tree", "[[0],[1]]"]
    assert main(args + ["--tree", "chain", "--full-verify", "--out", str(tmp_path / "r3")]) == 0  # trees draft too
    assert set(json.loads((tmp_path / "r3" / "report.json").read_text())["runs"]["greedy"]["methods"]) == {
        "plain (ours)", "ours kangaroo chain", "ours kangaroo [[0],[1]]", "ours kangaroo full-verify",
        "ours kangaroo [[0],[1]] full-verify"}


def test_heldout_metrics_of_the_known_answer(tmp_path):
    from draftsmith.drafters.kangaroo.model import heldout_metrics

    t = _identity_tail(make_tiny_target(init_std=0.3, layers=3), 1)
    build_cache(t, _cycle_sequences(n=3, length=30), ["layer:1", "final"], tmp_path / "c", dtype="float32")
    m = heldout_metrics(KangarooAdapter.for_target(t, exit_layer=1, max_draft_len=3), HiddenCache(tmp_path / "c", t), t)
    assert m["positions"] == 3 * 22  # positions 7..28 predict the assistant tokens 8..29
    assert m["expected_acceptance"] > 1 - 1e-4 and m["greedy_acceptance"] == 1.0
    assert m["predicted_chain_tau"] == 4.0


@pytest.mark.real
def test_real_target_skip_and_full_verification_equal_plain(real_target):
    """On the default target with kangaroo-large's adapter shape (l=1, MLP, 8192 kept ids, random outputs):
    verification from the layer-1 states (fused prompt without a mask under sdpa) and the full-depth forward
    give plain decoding's greedy tokens, for the chain and for a star and a branchy tree (paths compacted)."""
    from draftsmith.eval.mtbench import mtbench_prompts

    t = real_target
    a = KangarooAdapter.for_target(t, exit_layer=1, adapter_mlp=True, vocab_keep=8192)
    torch.manual_seed(0)
    with torch.no_grad():
        a.layer.o.weight.normal_(0, 0.002)
        a.layer.down.weight.normal_(0, 0.002)
    skip = a.to(next(t.model.parameters()).dtype).eval().decoder_drafter(t, t.fingerprint)
    decs = [SpeculativeDecoder(t), SpeculativeDecoder(t, skip), SpeculativeDecoder(t, skip.variant(full_verify=True)),
            SpeculativeDecoder(t, skip, tree=STAR), SpeculativeDecoder(t, skip, tree=BRANCHY)]
    drafted, accepted = 0, 0
    for p in mtbench_prompts(t.tokenizer, 2, spread=True):
        plain, *ours = [d.generate(p.ids, 24, seed=0) for d in decs]
        assert all(r.tokens == plain.tokens for r in ours)
        drafted += sum(s.drafted for s in ours[0].steps)
        accepted += sum(s.accepted for r in ours[2:] for s in r.steps)
    assert drafted > 0 and accepted > 0


def test_greedy_equality_script_checks_a_kangaroo_tree(tmp_path):
    """`python -m draftsmith.eval.greedy_equality --checkpoint C --tree SPEC` decodes with that tree."""
    from draftsmith.eval.greedy_equality import main

    t = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, layers=3, save_to=tmp_path / "target")
    save_checkpoint(tmp_path / "ck", random_adapter(t, exit_layer=1), t)
    rep = main(["--target", str(tmp_path / "target"), "--checkpoint", str(tmp_path / "ck"), "--tree", "[[0],[1],[2]]",
                "--methods", "heads-tree [[0],[1],[2]]", "--prompts", "2", "--max-new-tokens", "8",
                "--drafter-layers", "1"])
    m = rep["methods"]["heads-tree [[0],[1],[2]]"]
    assert rep["prompts"] == 2 and m["equal"] == 2 and m["unexplained"] == 0, m


def test_skip_vs_full_verification_bench_runs_both_on_the_same_drafts(tmp_path):
    from benchmarks.kangaroo_verify_bench import main

    t = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, layers=3, save_to=tmp_path / "target")
    save_checkpoint(tmp_path / "ck", random_adapter(t, exit_layer=1), t)
    rep = main([str(tmp_path / "ck"), "--target", str(tmp_path / "target"), "--tree", "chain", "--tree",
                "[[0],[1],[2]]", "--prompts", "2", "--max-new-tokens", "8"])
    for spec in ("chain", "[[0],[1],[2]]"):
        r = rep["trees"][spec]
        assert r["greedy_equal_plain"] == "2/2" and r["steps"] > 0
        assert r["skip_ms_median"] > 0 and r["full_ms_median"] > 0
    assert 4 in rep["trees"]["[[0],[1],[2]]"]["by_rows"]  # root + three candidates (fewer only at the very end)
