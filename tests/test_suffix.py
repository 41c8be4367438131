"""Model-free drafting (drafters/suffix): the indexes, and losslessness of deterministic drafts.

Ladder: exact enumeration of the decoder's output distribution on a tiny float64 model (chains, trees with
sibling candidates, prompt lookup, the hybrid with a model drafter and with a path-reading head drafter),
a Monte Carlo chi-square at T=0.8, greedy equality with plain decoding (single and batched).
"""

import json
import math

import pytest
import torch

from draftsmith.drafters.suffix import (Draft, HybridDrafter, PromptLookupDrafter, SuffixConfig, SuffixDrafter,
                                        SuffixIndex, TokenIndex)
from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.heads.decode import HeadDrafter
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams, TorchRandom, verify_node_certain
from draftsmith.engine.trees import DraftTree, verify_tree
from draftsmith.eval.exact import enumerate_branches, exact_distribution, target_distribution, total_variation
from draftsmith.eval.mc_lossless import mc_lossless
from draftsmith.traffic import make_record
from tests.test_decoder import PathHeads, other_model_drafter, tiny
# the exact-enumeration setting and check shared with the decoder's own enumeration tests
from tests.test_decoder_enumeration import N_NEW, PROMPT, TEMP, TOPKP
from tests.test_decoder_enumeration import _check as _exact



# ---------------------------------------------------------------------------------------------- the index
def test_counts_give_probabilities_and_scores():
    ix = TokenIndex(SuffixConfig(tree=False, min_token_prob=0.0))
    ix.extend([1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5])
    d = ix.speculate([9, 2, 3, 4])
    # (2,3,4) occurs 3 times: continued by 5, 6, and the stream's end -> 5 has count 2 of 3
    assert d.tokens[0] == 5 and math.isclose(d.probs[0], 2 / 3) and d.match_len == 3
    # after (2,3,4,5): one continuation (1) of the two occurrences -> 2/3 * 1/2
    assert d.tokens[1] == 1 and math.isclose(d.probs[1], 1 / 3)
    assert math.isclose(d.score, sum(d.probs))
    # adaptive length: match 3 * factor 1.0 -> at most 3 tokens
    assert len(d) <= 3
    ix2 = TokenIndex(SuffixConfig(tree=False, min_token_prob=0.0, max_spec_factor=0.5))
    ix2.extend([1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3, 4, 5])
    assert len(ix2.speculate([9, 2, 3, 4])) == 1  # floor(3 * 0.5)


def test_min_token_prob_stops_and_tree_holds_siblings():
    seq = [7, 8, 1, 7, 8, 2, 7, 8, 1, 7, 8, 3]
    path = TokenIndex(SuffixConfig(tree=False, min_token_prob=0.4))
    path.extend(seq)
    d = path.speculate([7, 8])
    assert d.tokens == [1, 7] and d.probs == [0.5, 0.5]  # 1 has 2 of 4 occurrences, then 7 always; 2 = match 2 x 1
    strict = TokenIndex(SuffixConfig(tree=False, min_token_prob=0.6))
    strict.extend(seq)
    assert strict.speculate([7, 8]).tokens == []  # 0.5 < 0.6: nothing drafted
    tree = TokenIndex(SuffixConfig(tree=True, min_token_prob=0.2, max_spec_factor=4))
    tree.extend(seq)
    t = tree.speculate([7, 8])
    firsts = [tok for tok, p in zip(t.tokens, t.parents) if p == -1]
    assert set(firsts) == {1, 2, 3} and t.probs[0] == 0.5  # siblings under the root, best first
    assert all(p < i for i, p in enumerate(t.parents))
    assert t.score > d.score


def test_max_depth_bounds_match_and_draft():
    ix = TokenIndex(SuffixConfig(max_depth=4, max_spec_tokens=24, min_token_prob=0.0, tree=False))
    seq = list(range(1, 30))
    ix.extend(seq)
    d = ix.speculate(seq[:10])  # the context matches itself at any length, but match + draft <= 4
    assert d.match_len <= 4 and d.match_len + len(d) <= 4


def test_prompt_lookup_takes_newest_longest_match():
    ix = TokenIndex(SuffixConfig(max_depth=3))
    ix.extend([5, 6, 7, 1, 6, 7, 2, 3, 6, 7])
    assert ix.lookup([5, 6, 7, 1, 6, 7, 2, 3, 6, 7], 2) == [2, 3]  # (6, 7) newest earlier occurrence
    assert ix.lookup([5, 6, 7, 1, 6, 7, 2, 3, 6, 7], 2, max_ngram=3, min_ngram=3) == []  # (3, 6, 7) never occurred
    assert ix.lookup([9], 3) == []


def test_global_index_is_fifo_bounded_and_compacts():
    g = SuffixIndex(SuffixConfig(max_cached_requests=3))
    for i in range(2000):
        g.add_response([i % 50, 10 + i % 7, 99, i % 50 + 1], request_id=f"r{i}")
    assert len(g) == 3 and g.evicted == 1997 and g.added == 2000
    assert len(g.index) < 2000  # compacted: the dead prefix never outgrows the live part by much
    # evicted responses never match: (0, 10) ended only evicted responses (i = 0, 350, ...: 10 + i % 7 = 10)
    assert g.speculate([0, 10]).tokens == []
    live = {r for r, _, _ in g.responses}
    assert live == {"r1997", "r1998", "r1999"}
    d = g.speculate([1999 % 50, 10 + 1999 % 7])
    assert d.tokens[:1] == [99]
    rep = g.memory_report()
    assert rep["responses"] == 3 and rep["indexed_tokens"] == 12 and rep["bytes"] > 0


def test_no_global_index_when_disabled():
    g = SuffixIndex(SuffixConfig(max_cached_requests=0))
    g.add_response([1, 2, 3])
    assert len(g) == 0 and g.speculate([1, 2]).tokens == []


def test_save_load_round_trip(tmp_path):
    g = SuffixIndex(SuffixConfig(max_cached_requests=5))
    resp = [[1, 2, 3, 4, 5], [2, 3, 4, 6], [9, 9, 9], [3, 4, 5, 6, 7]]
    for i, r in enumerate(resp):
        g.add_response(r, request_id=f"q{i}")
    g.save(tmp_path)
    h = SuffixIndex.load(tmp_path)
    assert [r for r, _, _ in h.responses] == [r for r, _, _ in g.responses] and h.added == 4
    for ctx in ([2, 3, 4], [3, 4], [9, 9]):
        assert h.speculate(ctx) == g.speculate(ctx)
    small = SuffixIndex.load(tmp_path, SuffixConfig(max_cached_requests=2))
    assert len(small) == 2
    (tmp_path / "suffix_index.bin").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match="holds 2 tokens"):
        SuffixIndex.load(tmp_path)


def test_rebuild_from_logs_counts_skipped(tmp_path):
    def rec(i, resp, fp="fp"):
        return make_record(request={}, prompt_ids=[1, 2], response_ids=resp, response_text="", finish_reason="stop",
                           target_name="t", fingerprint=fp, drafter_version=None, drafter_kind=None, steps=None,
                           request_id=f"id{i}", started=0.0, finished=1.0)
    lines = [json.dumps(rec(0, [5, 6, 7])), "not json", json.dumps(rec(1, [5, 6, 8], fp="other")),
             json.dumps(rec(2, [])), json.dumps(rec(3, [5, 6, 9]))]
    (tmp_path / "requests-1700000000-000001.jsonl").write_text("\n".join(lines[:3]) + "\n")
    (tmp_path / "requests-1700000001-000002.jsonl").write_text("\n".join(lines[3:]) + "\n")
    g, counts = SuffixIndex.rebuild_from_logs(tmp_path, "fp", vocab_size=100, max_tokens=64)
    assert counts == {"used": 2, "skipped": {"malformed": 1, "other_target": 1, "empty_response": 1}}
    assert [r for r, _, _ in g.responses] == ["id0", "id3"]
    d = g.speculate([5, 6])
    assert sorted(d.tokens) == [7, 9]


def test_pathological_inputs_stay_bounded():
    cfg = SuffixConfig(max_candidates=64)
    ix = TokenIndex(cfg)
    ix.extend([7] * 50000)  # a long run of one token
    cands = ix._candidates([7] * 10)
    assert len(cands) == 64  # never more than max_candidates occurrences examined
    d = ix.speculate([7] * 30)
    assert len(d) <= cfg.max_spec_tokens and set(d.tokens) == {7}
    with pytest.raises(ValueError, match="outside"):
        ix.extend([-5])


# ---------------------------------------------------------------------------------------------- verification
def test_certain_node_rule_is_the_target_distribution():
    p = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64)
    for kids in ([2], [3, 0], [1, 2, 3, 0]):
        out = {}
        for v, w, _ in enumerate_branches(lambda rng: verify_node_certain(p, kids, rng)):
            tok = kids[v.child] if v.child is not None else v.token
            out[tok] = out.get(tok, 0.0) + w
            if v.child is None:
                assert v.token not in kids
        assert all(abs(out.get(i, 0.0) - float(p[i])) < 1e-12 for i in range(4))
    acc = sum(w for v, w, _ in enumerate_branches(lambda rng: verify_node_certain(p, [3, 0], rng))
              if v.child is not None)
    assert abs(acc - 0.5) < 1e-12  # p(3) + p(0): the most any rule accepts


def test_greedy_tree_walk_follows_argmax_among_certain_siblings():
    tree = DraftTree(5, 4, "cpu")
    tree.add(0, 1)
    b = tree.add(0, 2)
    tree.certain.add(0)
    logits = torch.full((3, 6), -5.0)
    logits[0, 2] = 5  # root -> 2
    logits[b, 4] = 5
    v = verify_tree(tree, logits, SamplingParams(), TorchRandom(0))
    assert v.path == [0, b] and v.tokens == [2, 4]


# ---------------------------------------------------------------------------------------------- exact enumeration
@pytest.fixture(scope="module")
def tgt():
    return tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)


@pytest.fixture(scope="module")
def references(tgt):
    return {s: target_distribution(tgt, PROMPT, N_NEW, s.temperature, s.top_k, s.top_p) for s in (TEMP, TOPKP)}


def _suffix(tree=True, **kw):
    cfg = SuffixConfig(max_spec_factor=3, min_token_prob=0.05, tree=tree, **kw)
    g = SuffixIndex(cfg)
    for r in ([3, 2, 5, 1], [4, 3, 2, 2], [4, 3, 1, 0], [3, 5, 4, 3], [2, 3, 2, 2]):  # siblings after (4, 3)
        g.add_response(r)
    return SuffixDrafter(cfg, g)


def test_suffix_drafts_trees_with_certain_siblings(tgt):
    dec = SpeculativeDecoder(tgt, _suffix(), sampling=TEMP)
    st = dec.start([0, 4, 3], N_NEW)  # (4, 3) is continued by 2 and by 1 in the global index, never locally
    tree = dec.draft(st, TorchRandom(0))
    assert tree.n == 2 and 0 in tree.certain and len(tree.children[0]) == 2  # siblings at the root (cap: 2 nodes)
    assert not tree.q  # no vocabulary-sized q


def test_min_score_gate_drafts_only_promising_drafts(tgt):
    """The gate turns a draft whose expected accepted tokens are under min_score into a plain step."""
    ctx = [0, 4, 3]  # (4, 3) is continued in the global index: a draft of score < 3 (path probabilities <= 1)
    for min_score, drafts in ((0.0, True), (0.05, True), (3.0, False), (1e3, False)):
        dec = SpeculativeDecoder(tgt, _suffix(min_score=min_score), sampling=TEMP)
        assert (dec.draft(dec.start(ctx, N_NEW), TorchRandom(0)).n > 0) == drafts, min_score


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_gated_suffix_is_exact(tgt, references, sampling):
    _exact(tgt, references, _suffix(min_score=0.9), sampling)


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "path"])
def test_suffix_is_exact(tgt, references, sampling, tree):
    _exact(tgt, references, _suffix(tree), sampling)


@pytest.mark.parametrize("sampling", [TEMP, TOPKP], ids=["T0.8", "topk-topp"])
def test_prompt_lookup_is_exact(tgt, references, sampling):
    _exact(tgt, references, PromptLookupDrafter(k=3), sampling)


@pytest.mark.parametrize("prior", [0.0, 1.0, 50.0], ids=["suffix-first", "mixed", "inner-only"])
def test_hybrid_with_model_drafter_is_exact(tgt, references, prior):
    h = HybridDrafter(other_model_drafter(tgt), _suffix(), prior=prior, inner_cost=1.0, explore_every=2)
    _exact(tgt, references, h, TEMP, policy=FixedLength(2))


def test_hybrid_with_path_heads_is_exact(tgt, references):
    # a path-reading head drafter needs the target's hidden states, including those of suffix steps
    heads = HeadDrafter(PathHeads(tgt).double(), tgt.fingerprint, name="paths")
    h = HybridDrafter(heads, _suffix(), prior=1.0, inner_cost=1.0)
    _exact(tgt, references, h, TEMP, tree=[(0,), (1,), (0, 0)])


def test_hybrid_chooses_both_members(tgt):
    h = HybridDrafter(other_model_drafter(tgt), _suffix(), prior=1.0, inner_cost=1.0)
    dec = SpeculativeDecoder(tgt, h, sampling=TEMP, policy=FixedLength(2))
    for s in range(6):
        dec.generate(PROMPT, 8, seed=s)
    assert h.steps["suffix"] > 0 and h.steps["inner"] > 0


def test_mc_chi_square_at_t08(tgt):
    dec = SpeculativeDecoder(tgt, _suffix(), sampling=TEMP)
    r = mc_lossless(dec, PROMPT, 3, 3000, seed=1)
    assert r["drafted"] > 0 and r["accepted"] > 0
    assert r["p_value"] > 1e-3, r


# ---------------------------------------------------------------------------------------------- greedy equality
def test_greedy_equals_plain_and_learns_from_responses():
    t = tiny(vocab=40, seed=1, std=0.3)
    plain = SpeculativeDecoder(t)
    sd = SuffixDrafter(SuffixConfig())
    dec = SpeculativeDecoder(t, sd)
    prompts = [[1, 5, 9, 5, 9], [2, 5, 9, 5, 9, 3], [1, 5, 9, 5, 9]]
    forwards = []
    for p in prompts:
        ref = plain.generate(p, 30).tokens
        got = dec.generate(p, 30)
        assert got.tokens == ref
        forwards.append(got.target_forwards)
    assert len(sd.index) == 3  # each finished response indexed
    assert forwards[2] < forwards[0]  # the repeated prompt is drafted from the earlier response
    pl = SpeculativeDecoder(t, PromptLookupDrafter(k=4))
    assert pl.generate(prompts[1], 30).tokens == plain.generate(prompts[1], 30).tokens


def test_batched_greedy_equals_plain():
    t = tiny(vocab=40, seed=1, std=0.3)
    prompts = [[1, 5, 9, 5, 9], [2, 5, 9, 5, 9, 3], [4, 4, 4]]
    plain = SpeculativeDecoder(t)
    sd = SuffixDrafter(SuffixConfig())
    sd.index.add_response(plain.generate(prompts[0], 20).tokens)
    b = BatchedSpeculativeDecoder(t, sd)
    res = b.generate(prompts, 20)
    for p, r in zip(prompts, res.rows):
        assert r.tokens == plain.generate(p, 20).tokens
    assert sum(s.accepted for s in res.steps) > 0
    assert len(sd.index) == 4
    with pytest.raises(ValueError, match="builds its own trees"):
        BatchedSpeculativeDecoder(t, HybridDrafter(other_model_drafter(t), sd))


def test_empty_draft_is_plain_step(tgt):
    dec = SpeculativeDecoder(tgt, SuffixDrafter(SuffixConfig(max_cached_requests=0)))
    st = dec.start([0, 1, 2], 4)  # nothing to match anywhere
    assert dec.draft(st, TorchRandom(0)).n == 0
    assert Draft().score == 0.0


def test_suffix_tree_with_siblings_is_exact(tgt):
    prompt = [0, 4, 3]  # the first step drafts two certain siblings (see the test above)
    ref = target_distribution(tgt, prompt, N_NEW, TEMP.temperature)
    dec = SpeculativeDecoder(tgt, _suffix(), sampling=TEMP)
    got = exact_distribution(dec, prompt, N_NEW)
    assert total_variation(got, ref) < 1e-9


def test_hybrid_cost_ratio_and_exploration(tgt):
    # a trained drafter costing 10x a model-free step is worth it only if it accepts 10x more: here never,
    # except the exploration step every 3 steps
    h = HybridDrafter(other_model_drafter(tgt), SuffixDrafter(SuffixConfig(max_cached_requests=0)), prior=1.0,
                      inner_cost=10.0, explore_every=3)
    dec = SpeculativeDecoder(tgt, h, sampling=TEMP, policy=FixedLength(2))
    r = dec.generate([0, 1, 2], 12, seed=0)
    n = len(r.steps)
    assert h.steps["inner"] == n // 4 and h.steps.get("plain", 0) + h.steps["suffix"] == n - n // 4
    m = HybridDrafter(other_model_drafter(tgt), SuffixDrafter(), prior=1.0)  # measured costs
    SpeculativeDecoder(tgt, m, sampling=TEMP, policy=FixedLength(2)).generate([0, 1, 2], 12, seed=0)
    assert m.cost_ratio() > 0
