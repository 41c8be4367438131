"""Pruned draft vocabularies for head drafters: id maps, training, checkpoints, lossless decoding."""

import numpy as np
import pytest
import torch

from draftsmith.checkpoint import load_checkpoint, save_checkpoint
from draftsmith.engine.decoder import SpeculativeDecoder, plain_decoder
from draftsmith.heads.decode import HeadDrafter
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.engine.sampling import SamplingParams
from draftsmith.heads.hydra.model import HydraHeads
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.heads.objective import HeadBatch, HeadObjective
from draftsmith.common.vocab import PrunedHead, frequent_ids, kept_size
from tests.test_decoder import tiny


def test_kept_size_counts_ratios_and_rejects_bad_sizes():
    assert kept_size(10, 100) == 10 and kept_size(0.25, 100) == 25 and kept_size(1.0, 100) == 100
    for bad in (0, 101, 0.001):
        with pytest.raises(ValueError, match="between 1 and the vocabulary's 100"):
            kept_size(bad, 100)


def test_frequent_ids_count_assistant_tokens_only_and_break_ties_by_id():
    toks = [np.array([5, 5, 5, 7, 7, 9, 3, 3, 3, 3]), np.array([1, 7, 2])]
    mask = [np.array([1, 1, 1, 1, 1, 1, 0, 0, 0, 0]), np.array([0, 1, 1])]
    # assistant counts: 5 -> 3, 7 -> 3, 9 -> 1, 2 -> 1 (3 and 1 are prompt tokens)
    assert frequent_ids(toks, mask, 12, 2).tolist() == [5, 7]
    assert frequent_ids(toks, mask, 12, 3).tolist() == [2, 5, 7]  # 2 beats 9 on the id tie-break


def test_pruned_head_maps_ids_both_ways():
    full = torch.nn.Linear(4, 10, bias=False)
    ph = PrunedHead(full, torch.tensor([1, 4, 8]))
    assert torch.equal(ph.weight, full.weight[[1, 4, 8]])
    assert ph.t2d().tolist() == [-1, 0, -1, -1, 1, -1, -1, -1, 2, -1]
    out = ph.to_target(torch.tensor([[0.5, 1.5, 2.5]]))
    assert out[0, [1, 4, 8]].tolist() == [0.5, 1.5, 2.5]
    assert (out[0, [0, 2, 3, 5, 6, 7, 9]] == torch.finfo(out.dtype).min).all()
    loss_lab, hit_lab = ph.labels(torch.tensor([4, 3, -100, 8]))
    assert loss_lab.tolist() == [1, -100, -100, 2]  # a pruned label leaves the loss
    assert hit_lab.tolist() == [1, 3, -100, 2]  # ... and is a miss (id N = 3 is never a top-k index)
    with pytest.raises(ValueError, match="sorted, unique"):
        ph.set_kept(torch.tensor([4, 1, 8]), full)


def test_pruned_label_counts_as_a_miss_not_as_nothing():
    t = tiny(vocab=12, layers=1)
    heads = MedusaHeads.for_target(t, num_heads=1, vocab_keep=3)
    heads.set_draft_vocab(torch.tensor([0, 1, 2]))
    obj = HeadObjective.__new__(HeadObjective)
    obj.K, obj.loss_kind, obj.soft_weight, obj.head_decay = 1, "hard", 0.5, 1.0
    batch = HeadBatch(torch.randn(4, t.hidden_size), torch.tensor([[0, 1, 9, 9]]), None)
    loss, aux = obj.loss(heads, batch)
    assert torch.isfinite(loss)
    hits, count = obj.stats(aux, batch)["head1/top1"]
    assert count == 4 and hits <= 2  # the two pruned labels can never be hits


def test_checkpoint_round_trips_the_kept_ids(tmp_path):
    t = tiny(vocab=40, layers=1)
    heads = HydraHeads.for_target(t, num_heads=2, vocab_keep=7)
    ids = torch.tensor([0, 2, 3, 11, 19, 20, 39])
    heads.set_draft_vocab(ids)
    save_checkpoint(tmp_path / "ck", heads, t)
    back, _ = load_checkpoint(tmp_path / "ck", t)
    assert torch.equal(back.draft_head.kept_ids, ids)
    assert torch.equal(back.draft_head.weight, t.lm_head.weight[ids])


def _pruned_medusa(t, keep_ids, seed=3, std=0.5):
    torch.manual_seed(seed)
    heads = MedusaHeads.for_target(t, num_heads=2, num_layers=1,
                        vocab_keep=len(keep_ids))
    for blk in heads.blocks:
        torch.nn.init.normal_(blk[0].linear.weight, std=std)
    heads.to(next(t.model.parameters()).dtype).set_draft_vocab(torch.tensor(keep_ids))
    return HeadDrafter(heads.eval(), t.fingerprint)


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0)]], ids=["chain", "tree"])
def test_pruned_drafting_is_exact(tree):
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)
    prompt, n_new, s = [1, 3, 4, 3], 3, SamplingParams(0.8)
    ref = target_distribution(tgt, prompt, n_new, s.temperature, s.top_k, s.top_p)
    dec = SpeculativeDecoder(tgt, _pruned_medusa(tgt, [2, 3, 5]), sampling=s, tree=tree)
    got = exact_distribution(dec, prompt, n_new)
    assert total_variation(got, ref) < 1e-9


def test_pruned_drafts_only_kept_ids_and_greedy_equals_plain():
    t = tiny(vocab=40, seed=1, std=0.5, layers=2)
    keep = list(range(0, 40, 2))
    drafter = _pruned_medusa(t, keep)
    dec = SpeculativeDecoder(t, drafter, tree=[(0,), (1,), (0, 0), (0, 1)])
    state = dec.start([1, 5, 7, 9], 6)
    tree = dec.draft(state, __import__("draftsmith.engine.sampling", fromlist=["TorchRandom"]).TorchRandom(0))
    assert all(int(x) in keep for x in tree.tok[1:tree.n + 1].tolist())
    for p in ([1, 5, 7, 9], [1, 2, 3], [1, 30, 31, 32, 33]):
        a = plain_decoder(t).generate(p, 20).tokens
        b = SpeculativeDecoder(t, drafter, tree=[(0,), (1,), (0, 0)]).generate(p, 20).tokens
        assert a == b


def test_training_with_a_pruned_vocabulary_learns_and_keeps_the_frequent_ids(tmp_path):
    from draftsmith.eval.head_accuracy import head_accuracy
    from draftsmith.recipe import parse_recipe
    from draftsmith.common.hidden_cache import HiddenCache
    from draftsmith.train.data.cache import build_cache
    from draftsmith.train.training.trainer import build_drafter, train
    from tests.test_train import _cycle_sequences
    from tests.tiny import make_tiny_target

    t = make_tiny_target(init_std=0.3)
    seqs = _cycle_sequences()
    build_cache(t, seqs, ["final"], tmp_path / "cache", dtype="float32")
    cycle = sorted({x for s in seqs for x, m in zip(s["ids"], s["mask"]) if m})
    r = parse_recipe({"name": "v", "output_dir": str(tmp_path / "run"), "seed": 3,
                      "drafter": {"kind": "hydra", "num_heads": 2, "num_layers": 1, "vocab_keep": len(cycle)},
                      "train": {"epochs": 10, "batch_size": 4, "chunk_len": 16, "lr": 2e-2, "warmup_steps": 2,
                                "tracker": "none", "save_every": 1000, "log_every": 5, "calibration_every": 0}})
    cache = HiddenCache(tmp_path / "cache", t)
    before = head_accuracy(build_drafter(r, t), cache, 2)
    ckpt, _ = train(r, t, tmp_path / "cache", r.out)
    model, _ = load_checkpoint(ckpt, t)
    assert model.draft_head.kept_ids.tolist() == cycle  # exactly the assistant tokens' ids
    after = head_accuracy(model, cache, 2)
    assert after["top1"][0] > before["top1"][0] + 0.3, (before["top1"], after["top1"])


def test_pruned_medusa_is_not_widened_silently_on_export(tmp_path):
    from draftsmith.export import ExportError, export

    t = tiny(vocab=40, layers=1)
    heads = MedusaHeads.for_target(t, num_heads=2, vocab_keep=8)
    heads.set_draft_vocab(torch.arange(0, 40, 5))
    save_checkpoint(tmp_path / "ck", heads, t)
    with pytest.raises(ExportError, match="draftsmith"):
        export(tmp_path / "ck", "vllm-medusa", tmp_path / "out", t)


@pytest.mark.parametrize("prefix", [False, True])
def test_pruned_teacher_gives_the_full_teachers_loss(tmp_path, prefix):
    """The soft teacher computed through the kept rows only equals the full teacher renormalised over them."""
    from draftsmith.heads.objective import HydraObjective
    from draftsmith.common.hidden_cache import HiddenCache
    from draftsmith.train.data.cache import build_cache
    from tests.test_train import _cycle_sequences
    from tests.tiny import make_tiny_target

    t = make_tiny_target(init_std=0.3)
    build_cache(t, _cycle_sequences(), ["final"], tmp_path / "cache", dtype="float32")
    cache = HiddenCache(tmp_path / "cache", t)
    heads = HydraHeads.for_target(t, num_heads=2, num_layers=1, prefix_layer=prefix, vocab_keep=20)
    torch.manual_seed(0)
    for p in heads.heads.parameters():
        torch.nn.init.normal_(p, std=0.1)
    heads.set_draft_vocab(torch.arange(0, 40, 2))
    full = HydraObjective(cache, t, 2, loss="soft", chunk_len=16, prefix_layer=prefix)
    pruned = HydraObjective(cache, t, 2, loss="soft", chunk_len=16, prefix_layer=prefix)
    pruned.use_pruned_teacher(heads.draft_head)
    bf, bp = full.prepare([0, 1, 2]), pruned.prepare([0, 1, 2])
    assert bf.teacher.shape[-1] == t.vocab_size and bp.teacher.shape[-1] == 20
    torch.testing.assert_close(bp.teacher.log_softmax(-1), bf.teacher[..., heads.draft_head.kept_ids].log_softmax(-1),
                               rtol=1e-5, atol=1e-5)
    lf, lp = full.loss(heads, bf)[0], pruned.loss(heads, bp)[0]
    assert float(lf.detach()) > 0
    torch.testing.assert_close(lp, lf, rtol=1e-5, atol=1e-6)


def test_every_pruning_kind_shares_one_pruned_vocabulary_and_names_the_misuse():
    """Medusa, Hydra, EAGLE-3, Kangaroo and the standalone drafter prune through `PrunedVocab`: kept ids set later
    or given at construction, and a full-vocabulary drafter asked for kept ids refuses, naming its kind."""
    from draftsmith import registry
    from draftsmith.common.vocab import PrunedVocab
    for kind in ("medusa", "hydra", "eagle3", "kangaroo", "standalone"):
        assert issubclass(registry.get(kind), PrunedVocab), kind
    t = tiny()
    full = HydraHeads.for_target(t, num_heads=2, vocab_keep=None)
    with pytest.raises(ValueError, match="this hydra drafter drafts over the full vocabulary"):
        full.set_draft_vocab(torch.tensor([1, 2, 3]))
    pruned = MedusaHeads.for_target(t, num_heads=2, vocab_keep=3)
    pruned.set_draft_vocab(torch.tensor([4, 9, 11]))
    assert pruned.draft_head.kept_ids.tolist() == [4, 9, 11]
    assert torch.equal(pruned.draft_head.weight, pruned.lm_head.weight[[4, 9, 11]])
    with pytest.raises(ValueError, match="2 kept ids for vocab_keep 3"):
        pruned.init_pruned_vocab(pruned.lm_head, 3, torch.tensor([1, 2]))
    pruned.init_pruned_vocab(pruned.lm_head, 3, torch.tensor([0, 5, 6]))  # given at construction
    assert pruned.draft_head.kept_ids.tolist() == [0, 5, 6]
