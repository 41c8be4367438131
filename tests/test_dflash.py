"""The DFlash kind: decoding computes what training trains, the losslessness ladder (exact enumeration, Monte Carlo
chi-square, greedy equality), batched rows, training end to end, and clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file

from draftsmith import registry
from draftsmith.checkpoint import drafter_from_checkpoint, load_checkpoint
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.drafters.dflash.config import default_target_layers
from draftsmith.drafters.dflash.model import DFlashModule, resolve_mask_token_id
from draftsmith.drafters.dflash.objective import DFlashObjective, heldout_metrics, slot_weights
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
LAYERS = [1, 2, 3]  # a 4-layer tiny target: outputs of its layers 1, 2, 3


def module(target, std=0.5, seed=1, vocab_keep=None, block_size=5, mask=None, **kw) -> DFlashModule:
    """A drafter with random (not tiny) weights, so every path through it matters."""
    mask = target.vocab_size - 1 if mask is None else mask
    m = DFlashModule.for_target(target, target_layers=LAYERS, vocab_keep=vocab_keep, block_size=block_size,
                                mask_token_id=mask, **kw)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std / p.shape[1] ** 0.5 * 3)
    return m.to(next(target.model.parameters()).dtype).eval()


def feats_of(target, ids):
    hs = target.model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    return torch.cat([hs[i][0] for i in LAYERS], dim=-1)


@pytest.mark.parametrize("vocab_keep", [None, 24])
def test_decoding_computes_what_training_trains(vocab_keep):
    """The drafter's logits for every depth of a chain equal the training forward's slots of the block anchored at
    the root, with other blocks beside it in the same forward (which it must not see)."""
    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    m = module(t, vocab_keep=vocab_keep)
    if vocab_keep:
        m.set_draft_vocab(torch.arange(3, 3 + vocab_keep))
    S, L = m.block_size, len(PROMPT) - 1
    seq = PROMPT + [7, 9, 11, 13, 15, 17]
    mask_id = m.config.mask_token_id
    ids = torch.full((1, 3, S), mask_id)
    ids[0, :, 0] = torch.tensor([seq[2], seq[L], seq[L + 3]])
    with torch.no_grad():
        want = m.train_forward(feats_of(t, seq)[None], ids, torch.tensor([[2, L, L + 3]]))[0, 1]
    if m.draft_head is not None:
        want = m.draft_head.to_target(want)
    dr = m.decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr, policy=FixedLength(S - 1))
    state = dec.start(PROMPT, 8)
    tree = DraftTree(PROMPT[-1], 8, "cpu")
    got = [dr.propose(dec, state, tree, 0, 1)[0]]
    for k in range(1, S - 1):
        tree.add(k - 1, seq[L + k])
        got.append(dr.propose(dec, state, tree, k, k + 1)[0])
    keep = torch.arange(t.vocab_size) != mask_id  # decoding never drafts the mask token
    for k in range(S - 1):
        assert torch.allclose(got[k][keep], want[k + 1][keep], atol=1e-9), k
        assert got[k][mask_id] == torch.finfo(got[k].dtype).min
    assert not torch.allclose(got[0], got[1])
    # the block's own context ends before its anchor: another anchor's slots differ
    with torch.no_grad():
        other = m.train_forward(feats_of(t, seq)[None], ids, torch.tensor([[2, L + 1, L + 3]]))[0, 1]
    if m.draft_head is not None:
        other = m.draft_head.to_target(other)
    assert not torch.allclose(other[1:], want[1:])


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
def test_dflash_is_exact(enum_tgt, enum_refs, tree, sampling):
    dr = module(enum_tgt, vocab_keep=4, block_size=3, mask=1)
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


def test_monte_carlo_chi_square_passes_with_dflash():
    """The Monte Carlo harness (prefilled prompt, cloned decode states) with a sampled DFlash tree."""
    from draftsmith.engine.sampling import SamplingParams
    from draftsmith.eval.mc_lossless import mc_lossless

    t = tiny(vocab=12, seed=2, std=0.5, layers=4)
    dr = module(t, std=0.3).decoder_drafter(t)
    dec = SpeculativeDecoder(t, dr, tree=StaticTree([(0,), (1,), (0, 0)]), sampling=SamplingParams(0.9))
    r = mc_lossless(dec, PROMPT, n_new=3, n_samples=600, seed=0)
    assert r["cells"] > 10 and r["p_value"] > 1e-3, r


def test_hybrid_with_suffix_is_exact_and_greedy_equal(enum_tgt, enum_refs):
    """DFlash beside SuffixDecoding: its context takes the target's states of the suffix and plain steps too
    (`observe_step`), so the blocks it drafts after them are exact, and greedy output is plain decoding's."""
    from draftsmith.drafters.suffix import HybridDrafter
    from tests.test_suffix import _suffix

    dr = module(enum_tgt, vocab_keep=4, block_size=3, mask=1)
    dr.set_draft_vocab(torch.tensor([0, 2, 3, 5]))
    h = HybridDrafter(dr.decoder_drafter(enum_tgt), _suffix(), prior=1.0, inner_cost=1.0, explore_every=2)
    dec = SpeculativeDecoder(enum_tgt, h, tree=StaticTree([(0,), (1,), (0, 0)]), sampling=TEMP)
    assert total_variation(exact_distribution(dec, ENUM_PROMPT, N_NEW), enum_refs[TEMP]) < 1e-9
    greedy = SpeculativeDecoder(enum_tgt, h, tree=StaticTree([(0,), (1,), (0, 0)]))
    for _ in range(3):
        assert greedy.generate(ENUM_PROMPT, 12).tokens == SpeculativeDecoder(enum_tgt).generate(ENUM_PROMPT, 12).tokens
    assert h.steps["suffix"] > 0 and h.steps["inner"] > 0  # both members drafted


BATCH_PROMPTS = [[1, 5, 6, 7, 8], [1, 9], [1] + list(range(3, 38)) + [4, 5, 6] * 8, [1], [1, 20, 21, 22, 23]]
BATCH_NEW = [24, 30, 9, 30, 17]


@pytest.mark.parametrize("forward", ["eager", "fast"])
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]],
                         ids=["chain", "static"])
def test_batched_rows_equal_batch_one_and_draft_the_same(tree, forward):
    """Greedy: each batched row equals plain decoding and accepts what the single-sequence decoder with the same
    drafter accepts (the rows' states come from the batched forwards' hooks), with prompts of very different
    lengths, a one-token prompt and rows that leave early; with the model's own forward and with ours."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.fastpath import use_fast_forward

    t = tiny(vocab=40, layers=4, dtype=torch.float64)
    use_fast_forward(t, forward)
    dr = module(t, std=0.3).decoder_drafter(t)
    ref = [SpeculativeDecoder(t).generate(p, n).tokens for p, n in zip(BATCH_PROMPTS, BATCH_NEW)]
    one = SpeculativeDecoder(t, dr, policy=None if tree else FixedLength(3), tree=StaticTree(tree) if tree else None)
    singles = [one.generate(p, n) for p, n in zip(BATCH_PROMPTS, BATCH_NEW)]
    assert [s.tokens for s in singles] == ref
    res = BatchedSpeculativeDecoder(t, dr, tree=tree, k=3).generate(BATCH_PROMPTS, BATCH_NEW)
    assert [r.tokens for r in res.rows] == ref
    assert [[s.accepted for s in r.steps] for r in res.rows] == [[s.accepted for s in r.steps] for r in singles]


def _recipe(tmp_path, **train_kw):
    t = {"max_steps": 24, "batch_size": 4, "chunk_len": 64, "lr": 1e-2, "warmup_steps": 2, "tracker": "none",
         "save_every": 12, "log_every": 4, "loss": "soft", "calibration_every": 0, **train_kw}
    return parse_recipe({"name": "df", "output_dir": str(tmp_path / "run"), "seed": 3,
                         "drafter": {"kind": "dflash", "target_layers": LAYERS, "vocab_keep": 30, "block_size": 4,
                                     "mask_token_id": 1},
                         "train": t})


@pytest.mark.parametrize("loss", ["soft", "hard"])
def test_training_end_to_end_checkpoint_and_decoding(tmp_path, loss):
    t = make_tiny_target(init_std=0.3, layers=4)
    r = _recipe(tmp_path, loss=loss)
    needs = registry.get("dflash").cache_needs(r.drafter.model_dump())
    assert needs == ["layer:1", "layer:2", "layer:3", "final"]
    build_cache(t, _cycle_sequences(), needs, tmp_path / "cache", dtype="float32")
    cache = HiddenCache(tmp_path / "cache", t)
    before = heldout_metrics(build_drafter(r, t), cache, t)
    ckpt, timing = train(r, t, tmp_path / "cache", r.out)
    assert timing["steps"] == 24
    man = json.loads((ckpt / "manifest.json").read_text())
    assert man["kind"] == "dflash" and man["target"]["fingerprint"] == t.fingerprint
    stored = load_file(str(ckpt / "model.safetensors"))
    assert "draft_head.kept_ids" in stored and not any(k.startswith(("lm_head", "embed")) for k in stored)
    model, _ = load_checkpoint(ckpt, t)
    after = heldout_metrics(model, cache, t)
    if loss == "soft":
        # training must lift every slot's agreement with the target well above the random start
        assert all(a > b + 0.2 for a, b in zip(after["step_top1"], before["step_top1"])), (before, after)
        assert after["predicted_chain_tau"] > before["predicted_chain_tau"] + 0.3, (before, after)
    else:  # the data's tokens (a cycle the tiny random target did not write) are what hard labels teach
        got, start = _label_agreement(model, cache, t), _label_agreement(build_drafter(r, t), cache, t)
        assert got > start + 0.3, (start, got)
    # the trees stage's acceptance by rank: its rank 0 is the held-out report's conditional top-1, slot by slot
    ranks = model.rank_acceptance(cache, t)
    assert ranks["top1"] == pytest.approx(after["step_top1_conditional"], abs=1e-6)  # float32 ratios
    assert all(sum(r) <= 1 + 1e-9 for r in ranks["rank_acc"])
    dr = drafter_from_checkpoint(ckpt, t)
    plain = SpeculativeDecoder(t).generate(PROMPT, 24).tokens
    assert SpeculativeDecoder(t, dr).generate(PROMPT, 24).tokens == plain
    # a stale cache without the states the drafter fuses is a clear error
    build_cache(t, _cycle_sequences(n=4), ["layer:1", "final"], tmp_path / "stale", dtype="float32")
    with pytest.raises(ValueError, match="needs \\['layer:2', 'layer:3'\\] too"):
        DFlashObjective(HiddenCache(tmp_path / "stale", t), t, LAYERS, mask_token_id=1)


def _label_agreement(model, cache, target) -> float:
    """Top-1 agreement of every counted slot with the data's token."""
    obj = DFlashObjective(cache, target, LAYERS, model.block_size, max_anchors=None, loss="hard", chunk_len=1 << 20,
                          mask_token_id=model.config.mask_token_id)
    obj.use_pruned_teacher(model.draft_head)
    b = obj.prepare(list(range(len(obj.chunks))), every=True)
    with torch.no_grad():
        got = model(b.feats, b.ids, b.anchors, b.valid).argmax(-1)
    return float((got == b.labels[b.valid]).float().mean())


def test_anchors_and_slots_follow_the_definition(tmp_path):
    """Anchors are assistant tokens followed by one, at most max_anchors per sequence; slot 0 never counts; slot k
    of the block at a is labelled with t_{a+k}; slot weights decay from slot 1."""
    t = make_tiny_target(init_std=0.3, layers=4)
    build_cache(t, _cycle_sequences(n=4), ["layer:1", "layer:2", "layer:3", "final"], tmp_path / "c", dtype="float32")
    cache = HiddenCache(tmp_path / "c", t)
    obj = DFlashObjective(cache, t, LAYERS, block_size=4, max_anchors=3, mask_token_id=1, loss="hard",
                          chunk_len=1 << 20)
    tok, m = cache.tokens(0), cache.mask(0)
    feats, ids, anchors, labels, teacher, valid = obj.example(*obj.chunks[0])
    assert len(anchors) == 3 and all(m[a] > 0 and m[a + 1] > 0 for a in anchors.tolist())
    assert (ids[:, 1:] == 1).all() and ids[:, 0].tolist() == tok[anchors.numpy()].tolist()
    assert not valid[:, 0].any() and valid[:, 1].all()
    for j, a in enumerate(anchors.tolist()):
        for k in range(1, 4):
            if valid[j, k]:
                assert labels[j, k] == int(tok[a + k])
    assert teacher.shape[0] == int(valid.sum())
    w = slot_weights(4, 2.0)
    assert w[0] == 0 and w[1] == 1 and abs(float(w[2]) - 0.6065306597) < 1e-6
    every = obj.example(*obj.chunks[0], every=True)[2]
    assert len(every) == int(((m[1:-1] > 0) & (m[2:] > 0)).sum())


def test_default_layers_and_mask_token():
    assert default_target_layers(30) == [2, 9, 15, 21, 28]  # z-lab's [1, 8, 14, 20, 27], + 1
    assert default_target_layers(24) == [2, 7, 12, 17, 22]  # SpecForge's Qwen2.5-0.5B recipe's [1, 6, 11, 16, 21]

    class Tok:
        mask_token_id, pad_token_id, eos_token_id, unk_token_id = None, None, 2, 0

        def __len__(self):
            return 40

    assert resolve_mask_token_id(Tok(), 48) == (40, "the first embedding row past the tokenizer's tokens")
    assert resolve_mask_token_id(Tok(), 40) == (2, "the tokenizer's eos token")
    t = make_tiny_target(layers=4)
    m = DFlashModule.for_target(t, target_layers=LAYERS, vocab_keep=None)
    assert 0 <= m.config.mask_token_id < t.vocab_size


def test_bad_configs_are_clear_errors():
    with pytest.raises(RecipeError, match="target_layers"):
        parse_recipe({"name": "x", "drafter": {"kind": "dflash", "target_layers": [3, 2]}})
    with pytest.raises(RecipeError, match="unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "dflash", "blocksize": 4}})
    with pytest.raises(RecipeError, match="block_size"):
        parse_recipe({"name": "x", "drafter": {"kind": "dflash", "block_size": 1}})
    t = make_tiny_target(layers=4)
    with pytest.raises(ValueError, match="do not fit a target with 4 layers"):
        DFlashModule.for_target(t, target_layers=[1, 4], mask_token_id=1)
    with pytest.raises(ValueError, match="mask_token_id 999 is not a row"):
        DFlashModule.for_target(t, target_layers=LAYERS, mask_token_id=999)
    with pytest.raises(ValueError, match="draft_len 9 is more than a block of 4"):
        DFlashModule.for_target(t, target_layers=LAYERS, mask_token_id=1, block_size=4, draft_len=9)


@pytest.mark.parametrize("pruned", [False, True], ids=["full-vocab", "pruned"])
def test_export_reloads_and_imports_back(tmp_path, pruned):
    from draftsmith.checkpoint import save_checkpoint
    from draftsmith.export import export, import_drafter, load_drafter

    t = make_tiny_target(init_std=0.3, layers=4)
    m = module(t, vocab_keep=30 if pruned else None, block_size=4, draft_layers=2)
    if pruned:
        m.set_draft_vocab(torch.arange(30) * 3)
    save_checkpoint(tmp_path / "ck", m, t)
    out = export(tmp_path / "ck", "vllm-dflash", tmp_path / "ex", t)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["num_hidden_layers"] == 2
    assert cfg["dflash_config"]["target_layer_ids"] == [0, 1, 2]  # z-lab's ids: ours minus one
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYERS
    assert cfg["dflash_config"]["mask_token_id"] == t.vocab_size - 1
    w = load_file(str(out / "model.safetensors"))
    assert not any("embed" in k for k in w) and "layers.1.self_attn.k_norm.weight" in w
    if pruned:
        assert cfg["draft_vocab_size"] == 30 and torch.equal(w["d2t"] + torch.arange(30), torch.arange(30) * 3)
    else:
        assert "lm_head.weight" not in w and "d2t" not in w
    plain = SpeculativeDecoder(t).generate(PROMPT, 16)
    ours = SpeculativeDecoder(t, drafter_from_checkpoint(tmp_path / "ck", t)).generate(PROMPT, 16)
    back = SpeculativeDecoder(t, load_drafter(out, t)).generate(PROMPT, 16)
    assert back.tokens == ours.tokens == plain.tokens
    assert [s.accepted for s in back.steps] == [s.accepted for s in ours.steps]
    import_drafter(out, tmp_path / "imported", t)
    again = SpeculativeDecoder(t, drafter_from_checkpoint(tmp_path / "imported", t)).generate(PROMPT, 16)
    assert [s.accepted for s in again.steps] == [s.accepted for s in ours.steps]
    assert (m.engine_gap("llama.cpp") is not None) == pruned and m.engine_gap("vllm") is None


def test_bad_exports_are_clear_errors(tmp_path):
    from safetensors.torch import save_file

    from draftsmith.checkpoint import CheckpointError, save_checkpoint
    from draftsmith.export import export, import_drafter
    from draftsmith.target import TargetMismatchError

    t = make_tiny_target(init_std=0.3, layers=4)
    m = module(t, vocab_keep=30)
    m.set_draft_vocab(torch.arange(30) * 3)
    save_checkpoint(tmp_path / "ck", m, t)
    out = export(tmp_path / "ck", "vllm-dflash", tmp_path / "ex", t)
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
    with pytest.raises(CheckpointError, match="target layer ids"):
        import_drafter(variant("layers", config={**cfg, "eagle_aux_hidden_state_layer_ids": [2, 15, 27]}),
                       tmp_path / "o3", t)
    no_mask = {**cfg, "dflash_config": {k: v for k, v in cfg["dflash_config"].items() if k != "mask_token_id"}}
    with pytest.raises(CheckpointError, match="mask_token_id"):
        import_drafter(variant("mask", config=no_mask), tmp_path / "o4", t)
    with pytest.raises(CheckpointError, match="causal"):
        import_drafter(variant("causal", config={**cfg, "dflash_config": {**cfg["dflash_config"], "causal": True}}),
                       tmp_path / "o6", t)
    with pytest.raises(CheckpointError, match="layers.0.mlp.up_proj.weight"):
        import_drafter(variant("missing", {k: v for k, v in w.items() if "up_proj" not in k}), tmp_path / "o7", t)
    with pytest.raises(TargetMismatchError):
        import_drafter(out, tmp_path / "o5", make_tiny_target(init_std=0.3, layers=4, seed=5))
    with pytest.raises(ValueError, match="cannot be exported to 'vllm-eagle3'"):
        export(tmp_path / "ck", "vllm-eagle3", tmp_path / "ex2", t)
