import pytest
import torch

from draftsmith.common.hidden_cache import HiddenCache, teacher_logits

from draftsmith.train.data.cache import build_cache


def _seqs(target, n=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        L = int(torch.randint(5, 40, (1,), generator=g))
        ids = torch.randint(3, target.vocab_size, (L,), generator=g).tolist()
        mask = [0] * (L // 2) + [1] * (L - L // 2)
        out.append({"ids": ids, "mask": mask})
    return out


def _max_prob_diff(target, cache, seqs):
    worst = 0.0
    for i, s in enumerate(seqs):
        with torch.no_grad():
            ref = torch.softmax(target.model(torch.tensor([s["ids"]])).logits[0].float(), -1)
        got = torch.softmax(teacher_logits(target, cache.states(i, "final")), -1)
        worst = max(worst, float((ref - got).abs().max()))
    return worst


def test_cached_states_match_target_and_are_aligned(tiny_target, tmp_path):
    seqs = _seqs(tiny_target)
    idx = build_cache(tiny_target, seqs, ["final", "layer:1"], tmp_path / "c", dtype="float32",
                      batch_tokens=64, shard_tokens=50)
    assert len(idx["shards"]) > 1  # several shards, read back as one
    cache = HiddenCache(tmp_path / "c", tiny_target)
    assert len(cache) == len(seqs)
    for i, s in enumerate(seqs):
        assert cache.tokens(i).tolist() == s["ids"] and cache.mask(i).tolist() == s["mask"]
        with torch.no_grad():
            out = tiny_target.model(torch.tensor([s["ids"]]), output_hidden_states=True)
        torch.testing.assert_close(cache.states(i, "layer:1"), out.hidden_states[1][0], atol=1e-5, rtol=1e-5)
        # position t's state, through the frozen head, gives the target's logits at t (no shift)
        torch.testing.assert_close(teacher_logits(tiny_target, cache.states(i, "final")), out.logits[0],
                                   atol=1e-4, rtol=1e-4)
    assert _max_prob_diff(tiny_target, cache, seqs) < 1e-5
    assert idx["bytes_per_token"] > 2 * 4 * tiny_target.hidden_size  # two fp32 fields per token


def test_cache_is_resumable_and_checks_target(tiny_target, tmp_path):
    from tests.tiny import make_tiny_target
    seqs = _seqs(tiny_target, n=4)
    build_cache(tiny_target, seqs, ["final"], tmp_path / "c", dtype="bfloat16", shard_tokens=40)
    first = (tmp_path / "c" / "shard-00000" / "final.npy").stat().st_mtime_ns
    build_cache(tiny_target, seqs, ["final"], tmp_path / "c", dtype="bfloat16", shard_tokens=40)
    assert (tmp_path / "c" / "shard-00000" / "final.npy").stat().st_mtime_ns == first
    c = HiddenCache(tmp_path / "c")
    assert c.states(0, "final").dtype == torch.float32
    with pytest.raises(ValueError, match="fingerprint"):
        HiddenCache(tmp_path / "c", make_tiny_target(seed=1))


def test_empty_dataset_is_refused(tiny_target, tmp_path):
    with pytest.raises(ValueError, match="empty dataset"):
        build_cache(tiny_target, [], ["final"], tmp_path / "c")


@pytest.mark.real
def test_alignment_on_real_target(real_target, tmp_path):
    """Cached final state at t -> frozen head == target's own next-token distribution at t.

    fp32 caches meet 1e-4; fp16 storage rounds the state (measured ~2e-3), so it
    gets 1e-2, still far below what a one-position misalignment produces.
    """
    from draftsmith.common.chat import render_example
    from draftsmith.train.data.generate import prompt_ids
    tok = real_target.tokenizer
    msgs = [{"role": "user", "content": "Give me two tips for writing clear code."},
            {"role": "assistant", "content": "Use descriptive names, and keep functions short and focused."}]
    ids, mask = render_example(tok, msgs, [True])
    p = prompt_ids(tok, msgs[:1])
    seqs = [{"ids": ids, "mask": mask}, {"ids": p, "mask": [1] * len(p)}]
    build_cache(real_target, seqs, ["final"], tmp_path / "c32", dtype="float32")
    build_cache(real_target, seqs, ["final"], tmp_path / "c16", dtype="float16")
    assert _max_prob_diff(real_target, HiddenCache(tmp_path / "c32"), seqs) < 1e-4
    assert _max_prob_diff(real_target, HiddenCache(tmp_path / "c16"), seqs) < 1e-2
    # the check can fail: states shifted by one position are far off
    c = HiddenCache(tmp_path / "c32")
    with torch.no_grad():
        ref = torch.softmax(real_target.model(torch.tensor([ids])).logits[0], -1)
    shifted = torch.softmax(teacher_logits(real_target, c.states(0, "final"))[1:], -1)
    assert float((ref[:-1] - shifted).abs().max()) > 0.1


def test_a_finished_shard_holding_other_sequences_is_recomputed(tiny_target, tmp_path):
    """A resumed cache pass keeps only shards that hold the sequences it expects (the data stage may have
    written some from its generator); any other shard is computed again."""
    seqs = _seqs(tiny_target, n=4)
    build_cache(tiny_target, seqs, ["final"], tmp_path / "c", dtype="float32", shard_tokens=40)
    other = _seqs(tiny_target, n=4, seed=1)
    (tmp_path / "c" / "index.json").unlink()
    idx = build_cache(tiny_target, other, ["final"], tmp_path / "c", dtype="float32", shard_tokens=40)
    assert idx["provenance"]["states"]["forward"] == {"shard_mismatch": len(other)}
    assert _max_prob_diff(tiny_target, HiddenCache(tmp_path / "c"), other) < 1e-5
    again = build_cache(tiny_target, other, ["final", "layer:1"], tmp_path / "c", dtype="float32", shard_tokens=40)
    assert again["provenance"]["states"]["forward"] == {"shard_mismatch": len(other)}  # a field was missing


def test_merged_caches_read_as_one_in_order_and_refuse_mismatches(tiny_target, tmp_path):
    import json

    from draftsmith.pipeline.stages import merge_runs
    from draftsmith.train.data.cache import merge_caches

    a, b = _seqs(tiny_target, 4, seed=1), _seqs(tiny_target, 3, seed=2)
    for name, seqs in (("a", a), ("b", b)):
        run = tmp_path / name
        build_cache(tiny_target, seqs, ["final"], run / "cache" / "train", dtype="float32", shard_tokens=40)
        build_cache(tiny_target, a[:2], ["final"], run / "cache" / "heldout", dtype="float32")
        (run / "data").mkdir()
        (run / "data" / "meta.json").write_text(json.dumps({"generation": {"response_tokens": 10 * len(seqs)}}))
        (run / "data" / "heldout.jsonl").write_text("")
        (run / "data" / "train.jsonl").write_text("".join(
            json.dumps({"id": f"{name}{i}",
                        "messages": [{"role": "user", "content": "same" if i == 0 else f"{name}{i}"}]})
            + "\n" for i in range(len(seqs))))
    meta = merge_runs(tmp_path / "m", [tmp_path / "a", tmp_path / "b"])
    assert meta["sources"]["prompts_in_more_than_one_run"] == 1 and meta["generation"]["response_tokens"] == 70
    cache = HiddenCache(tmp_path / "m" / "cache" / "train", tiny_target)
    assert len(cache) == 7
    for i, s in enumerate(a + b):
        assert cache.tokens(i).tolist() == s["ids"] and cache.mask(i).tolist() == s["mask"]
    src = HiddenCache(tmp_path / "b" / "cache" / "train")
    torch.testing.assert_close(cache.states(5, "final"), src.states(1, "final"))
    assert len(HiddenCache(tmp_path / "m" / "cache" / "heldout")) == 2
    # another dtype (or target, or states) cannot be merged; an existing cache is never overwritten
    build_cache(tiny_target, b, ["final"], tmp_path / "c16", dtype="float16")
    with pytest.raises(ValueError, match="dtype"):
        merge_caches(tmp_path / "x", [tmp_path / "a" / "cache" / "train", tmp_path / "c16"])
    with pytest.raises(FileExistsError):
        merge_runs(tmp_path / "m", [tmp_path / "a"])
    with pytest.raises(FileNotFoundError, match="no index.json"):
        merge_caches(tmp_path / "y", [tmp_path / "nothing"])


def test_states_past_float16_are_refused_for_a_float16_cache_and_stored_in_bfloat16(tiny_target, tmp_path):
    """A target whose residual stream passes float16's range (Gemma-3-270M's middle layers reach 1e5) would leave
    infinities in a float16 cache and NaN losses in training: the cache names the state and the fix instead; a
    bfloat16 cache stores the same states finite."""
    import copy

    t = copy.deepcopy(tiny_target)
    with torch.no_grad():
        t.model.get_input_embeddings().weight.mul_(1e6)  # layer 1's input, so its state, past 65504
    seqs = _seqs(t, n=2)
    with pytest.raises(ValueError, match=r"'layer:1' state reaches .* past float16's 65504.*cache.dtype: bfloat16"):
        build_cache(t, seqs, ["layer:1", "final"], tmp_path / "f16", dtype="float16")
    build_cache(t, seqs, ["layer:1", "final"], tmp_path / "bf16", dtype="bfloat16")
    assert torch.isfinite(HiddenCache(tmp_path / "bf16", t).states(0, "layer:1")).all()
