"""Kangaroo over a pruned vocabulary: exact losslessness, the id map in the checkpoint,
training against the target renormalised over the kept ids, bad sizes refused."""

import pytest
import torch
from safetensors.torch import load_file

from draftsmith.checkpoint import load_checkpoint
from draftsmith.drafters.kangaroo.model import KangarooAdapter, KangarooObjective, heldout_metrics
from draftsmith.drafters.kangaroo.decode import KangarooDrafter
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.policies import FixedLength
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.recipe import parse_recipe
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.cache import build_cache
from draftsmith.train.training.trainer import build_drafter, train
from tests.test_decoder import tiny
from tests.test_decoder_enumeration import N_NEW, PROMPT as ENUM_PROMPT, TEMP, TOPKP
from tests.test_train import _cycle_sequences
from tests.tiny import make_tiny_target


def pruned_adapter(t, keep, seed=1, std=0.5):
    a = KangarooAdapter.for_target(t, exit_layer=1, vocab_keep=len(keep))
    torch.manual_seed(seed)
    with torch.no_grad():
        a.layer.o.weight.normal_(0, std)
    a.set_draft_vocab(torch.tensor(keep))
    return a.to(next(t.model.parameters()).dtype).eval()


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_pruned_kangaroo_is_exact(sampling):
    t = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)
    a = pruned_adapter(t, [1, 3, 4])
    d = KangarooDrafter(t, 1, a, target_fingerprint=t.fingerprint, policy=FixedLength(2))
    h = torch.randn(2, t.hidden_size, dtype=torch.float64)
    q = torch.softmax(a.draft_head.to_target(a.project(h)), -1)
    assert (q[:, [0, 2, 5]] == 0).all()  # never drafts a pruned id
    ref = target_distribution(t, ENUM_PROMPT, N_NEW, sampling.temperature, sampling.top_k, sampling.top_p)
    got = exact_distribution(SpeculativeDecoder(t, d, sampling=sampling), ENUM_PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12 and total_variation(got, ref) < 1e-9


def test_pruned_kangaroo_trains_saves_its_id_map_and_decodes_the_targets_tokens(tmp_path):
    t = make_tiny_target(init_std=0.3, layers=3)
    tr = {"max_steps": 12, "batch_size": 4, "chunk_len": 16, "lr": 1e-2, "warmup_steps": 2, "tracker": "none",
          "save_every": 12, "log_every": 4, "loss": "soft", "calibration_every": 0}
    r = parse_recipe({"name": "kp", "output_dir": str(tmp_path / "run"), "seed": 3, "train": tr,
                      "drafter": {"kind": "kangaroo", "exit_layer": 1, "max_draft_len": 3, "vocab_keep": 12}})
    build_cache(t, _cycle_sequences(n=8), ["layer:1", "final"], tmp_path / "cache", dtype="float32")
    cache = HiddenCache(tmp_path / "cache", t)
    ckpt, _ = train(r, t, tmp_path / "cache", r.out)
    sd = load_file(str(ckpt / "model.safetensors"))
    kept = sd["draft_head.kept_ids"]
    seen = {int(x) for i in range(len(cache)) for x in cache.tokens(i)[cache.mask(i) > 0]}
    assert len(kept) == 12 and set(kept.tolist()) >= seen  # the cycle's 11 ids are all kept (plus one filler)
    m, _ = load_checkpoint(ckpt, t)
    assert torch.equal(m.draft_head.kept_ids, kept) and m.config.vocab_keep == 12
    fresh = build_drafter(r, t)
    fresh.set_draft_vocab(kept)
    assert heldout_metrics(m, cache, t)["expected_acceptance"] > heldout_metrics(fresh, cache, t)["expected_acceptance"]
    obj = KangarooObjective(cache, t, 1, loss="soft", chunk_len=16)
    b = obj.prepare(list(range(4)))
    loss, aux = obj.loss(m, b)
    assert aux["logits"].shape[-1] == 12  # trained over the kept ids only
    d = drafter_from_checkpoint(ckpt, t)
    plain = SpeculativeDecoder(t, None).generate([1, 3, 4, 5], 20).tokens
    assert SpeculativeDecoder(t, d).generate([1, 3, 4, 5], 20).tokens == plain


def test_bad_vocab_keep_is_refused():
    t = make_tiny_target(init_std=0.3, layers=3)
    with pytest.raises(ValueError, match="must keep between 1 and the vocabulary's 96 ids"):
        KangarooAdapter.for_target(t, exit_layer=1, vocab_keep=97)
    r = parse_recipe({"name": "kp", "drafter": {"kind": "kangaroo", "exit_layer": 1, "vocab_keep": 200}})
    with pytest.raises(ValueError, match="vocab_keep 200 gives 200 kept ids"):
        build_drafter(r, t)
