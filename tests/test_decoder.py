"""The decoder on tiny random models: greedy equality with plain decoding, KV compaction, EOS, limits, bad inputs."""

import pytest
import torch

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter, ModelDrafter
from draftsmith.heads.decode import HeadDrafter
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.kvcache import KVCache
from draftsmith.engine.policies import ConfidenceStop, FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.trees import DynamicTree
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.target import TargetMismatchError
from draftsmith.engine.cache_kw import cache_arg
from tests.tiny import make_tiny_model, make_tiny_target

PROMPT = [1, 5, 6, 7, 8]
TREE = [(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0)]


def tiny(vocab=40, seed=0, std=0.3, layers=3, dtype=torch.float32):
    t = make_tiny_target(vocab_size=vocab, seed=seed, init_std=std, layers=layers)
    t.model.to(dtype)
    return t


def random_medusa(target, num_heads=3, std=0.3, seed=3) -> HeadDrafter:
    """Medusa heads with random (non-identity) ResBlocks sharing the target's LM head."""
    torch.manual_seed(seed)
    heads = MedusaHeads.for_target(target, num_heads=num_heads, num_layers=1)
    for blk in heads.blocks:
        torch.nn.init.normal_(blk[0].linear.weight, std=std)
    heads.to(next(target.model.parameters()).dtype).eval()
    return HeadDrafter(heads, target.fingerprint)


def other_model_drafter(target, seed=5, std=0.5) -> ModelDrafter:
    """A different tiny random model over the same vocabulary."""
    m = make_tiny_model(vocab_size=target.vocab_size, seed=seed, init_std=std)
    return ModelDrafter(m.to(next(target.model.parameters()).dtype), target.fingerprint, name="other")


class PathHeads(torch.nn.Module):
    """A toy Hydra-style head drafter: reads the target's hidden state and the drafted path's embeddings."""

    def __init__(self, target, num_heads=3, seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.num_heads = num_heads
        self.emb = target.model.get_input_embeddings()
        self.lm_head = target.lm_head
        self.mix = torch.nn.Linear(2 * target.hidden_size, target.hidden_size)
        self.paths_seen = []

    def draft_states(self, hidden, paths):  # hidden [1, d], paths [n, k+1]: root then drafted tokens
        self.paths_seen.append(paths.tolist())
        e = self.emb(paths[:, -1])
        return hidden.expand(len(paths), -1) + self.mix(torch.cat([hidden.expand(len(paths), -1), e], -1))


@pytest.fixture(scope="module")
def tgt():
    return tiny()


@pytest.fixture(scope="module")
def plain_tokens(tgt):
    return SpeculativeDecoder(tgt).generate(PROMPT, 48).tokens


def test_plain_matches_hf_generate(tgt, plain_tokens):
    res = SpeculativeDecoder(tgt).generate(PROMPT, 48)
    hf = tgt.model.generate(torch.tensor([PROMPT]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                            pad_token_id=0)
    assert res.tokens == hf[0, len(PROMPT):].tolist() == plain_tokens
    assert res.tau == 1.0 and res.target_forwards == 48 and len(res.steps) == 48


@pytest.mark.parametrize("kind, tree, policy", [
    ("layers", None, FixedLength(3)),
    ("layers", None, ConfidenceStop(0.3, 5)),
    ("layers", TREE, None),
    ("layers", DynamicTree(budget=8, max_depth=4, width=3, expand_batch=3), None),
    ("other", None, FixedLength(4)),
    ("medusa", None, FixedLength(3)),
    ("medusa", TREE, None),
    ("medusa", DynamicTree(budget=10, max_depth=3, width=3, expand_batch=1), None),
])
def test_greedy_equals_plain(tgt, plain_tokens, kind, tree, policy):
    drafter = {"layers": lambda: first_layers_drafter(tgt, 2), "other": lambda: other_model_drafter(tgt),
               "medusa": lambda: random_medusa(tgt)}[kind]()
    res = SpeculativeDecoder(tgt, drafter, tree=tree, policy=policy).generate(PROMPT, 48)
    assert res.tokens == plain_tokens
    assert sum(s.emitted for s in res.steps) == 48
    if kind == "layers":  # a 2-of-3-layer drafter agrees often: the test exercises acceptance and compaction
        assert res.tau > 1.2


@pytest.mark.parametrize("tree", [None, TREE])
def test_path_reading_heads(tgt, plain_tokens, tree):
    """Head drafters that read the drafted path (Hydra) get root-first paths of the right depth."""
    heads = PathHeads(tgt)
    res = SpeculativeDecoder(tgt, HeadDrafter(heads, tgt.fingerprint), tree=tree).generate(PROMPT, 20)
    assert res.tokens == plain_tokens[:20]
    seen = [p for call in heads.paths_seen for p in call]
    assert seen and all(1 <= len(p) <= 3 for p in seen)
    assert heads.paths_seen[0] == [[PROMPT[-1]]]  # the first draft reads the root: the last prompt token


def test_greedy_equals_plain_medusa_small_vocab():
    """Small vocabulary: random heads get accepted often, so tree paths with rank > 0 are committed."""
    t = tiny(vocab=10, seed=9, std=0.5)
    plain = SpeculativeDecoder(t).generate([1, 3, 4], 40).tokens
    res = SpeculativeDecoder(t, random_medusa(t, std=0.5), tree=TREE).generate([1, 3, 4], 40)
    assert res.tokens == plain and res.tau > 1.2


@pytest.mark.parametrize("tree,policy,rows", [([(0,), (1,), (0, 0)], None, 2), (None, FixedLength(1), 1),
                                               (DynamicTree(budget=6, max_depth=2, width=2), None, 2),
                                               ([(0,), (0, 0), (0, 0, 0)], None, 3)])
def test_medusa_projects_only_the_heads_the_draft_reads(tgt, plain_tokens, monkeypatch, tree, policy, rows):
    """A draft of depth D reads heads 1..D: the LM-head product gets D rows, not K, and output is unchanged."""
    import draftsmith.engine.drafters as drafters

    seen = []
    real = drafters.project
    monkeypatch.setattr(drafters, "project", lambda head, x: seen.append(x.shape[0]) or real(head, x))
    res = SpeculativeDecoder(tgt, random_medusa(tgt, num_heads=3), tree=tree, policy=policy).generate(PROMPT, 20)
    assert res.tokens == plain_tokens[:20]
    assert seen and max(seen) == rows and set(seen) <= set(range(1, rows + 1))


def _fresh_prefill(model, tokens):
    cache = KVCache.for_model(model, len(tokens) + 1)
    body = model.get_decoder()
    body(input_ids=torch.tensor([tokens]), position_ids=torch.arange(len(tokens))[None],
         **cache_arg(body, cache.set_write(0)), use_cache=True)
    return cache


@pytest.mark.parametrize("tree", [TREE, DynamicTree(budget=8, max_depth=3, width=3)])
def test_kv_compaction_equals_fresh_prefill(tgt, tree):
    """After tree steps, the target's and the drafter's caches hold exactly the accepted tokens' KV, in order."""
    drafter = first_layers_drafter(tgt, 2)
    dec = SpeculativeDecoder(tgt, drafter, tree=tree)
    state = dec.start(PROMPT, 30)
    paths = []
    verify = dec.verify

    def spy(*a):
        v = verify(*a)
        paths.append(v.path)
        return v

    dec.verify = spy
    rng = None
    while not state.done:
        dec.step(state, rng)
    assert any(p != list(range(len(p))) for p in paths), "no off-chain path was accepted: compaction untested"
    L = state.length
    with torch.no_grad():
        ref = _fresh_prefill(tgt.model, state.tokens[:L])
        dref = _fresh_prefill(drafter.model, state.tokens[:state.drafter_state.valid])
    for a, b in zip(dec.cache.layers, ref.layers):
        assert torch.allclose(a.keys[:, :, :L], b.keys[:, :, :L], atol=1e-5)
        assert torch.allclose(a.values[:, :, :L], b.values[:, :, :L], atol=1e-5)
    v = state.drafter_state.valid
    assert v >= L - 2
    for a, b in zip(state.drafter_state.cache.layers, dref.layers):
        assert torch.allclose(a.keys[:, :, :v], b.keys[:, :, :v], atol=1e-5)
    # the hidden state handed to head drafters is the target's at position L-1
    with torch.no_grad():
        h = tgt.model.get_decoder()(input_ids=torch.tensor([state.tokens[:L]])).last_hidden_state[0, -1]
    assert torch.allclose(state.hidden[0], h, atol=1e-5)


def test_nothing_after_eos_drafted_mid_chain(tgt, plain_tokens):
    t = tiny()
    eos = plain_tokens[2]
    assert eos not in plain_tokens[:2]
    t.model.generation_config.eos_token_id = eos
    t.tokenizer.eos_token = t.tokenizer.convert_ids_to_tokens(eos)
    assert eos in t.eos_token_ids
    oracle = ModelDrafter(make_tiny_model(vocab_size=40, seed=0, init_std=0.3, layers=3), t.fingerprint)
    for samp in (SamplingParams(), SamplingParams(0.7)):
        res = SpeculativeDecoder(t, oracle, policy=FixedLength(6), sampling=samp).generate(PROMPT, 20, seed=0)
        if samp.greedy:  # the oracle drafts [a, b, eos, ...] in one chain; all but what follows eos is emitted
            assert res.tokens == plain_tokens[:3] and len(res.steps) == 1 and res.steps[0].accepted == 3
        assert res.stop_reason == "eos" and res.tokens[-1] == eos and eos not in res.tokens[:-1]
    assert SpeculativeDecoder(t).generate(PROMPT, 20).tokens == plain_tokens[:3]


@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 9])
def test_max_new_tokens_is_exact(tgt, plain_tokens, n):
    oracle = ModelDrafter(tgt.model, tgt.fingerprint)  # the target as its own drafter: everything is accepted
    res = SpeculativeDecoder(tgt, oracle, policy=FixedLength(4)).generate(PROMPT, n)
    assert res.tokens == plain_tokens[:n] and res.stop_reason == "max_new_tokens"
    assert res.target_forwards == -(-n // 5)  # 4 drafts + bonus per forward
    res = SpeculativeDecoder(tgt, oracle, tree=TREE, sampling=SamplingParams(0.9)).generate(PROMPT, n, seed=1)
    assert len(res.tokens) == n


def test_one_token_prompt_with_heads(tgt):
    plain = SpeculativeDecoder(tgt).generate([1], 12).tokens
    res = SpeculativeDecoder(tgt, random_medusa(tgt), tree=TREE).generate([1], 12)
    assert res.tokens == plain and res.steps[0].drafted == 0  # no hidden state yet at the first step


def test_sampling_is_reproducible_with_seed(tgt):
    dec = SpeculativeDecoder(tgt, first_layers_drafter(tgt, 2), tree=TREE, sampling=SamplingParams(0.8, 20, 0.95))
    a, b = dec.generate(PROMPT, 24, seed=7).tokens, dec.generate(PROMPT, 24, seed=7).tokens
    assert a == b and len(a) == 24


def test_empty_prompt_and_zero_tokens(tgt):
    dec = SpeculativeDecoder(tgt, first_layers_drafter(tgt, 2))
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate([], 5)
    with pytest.raises(ValueError, match="empty prompt"):
        dec.generate(torch.zeros(1, 0, dtype=torch.long), 5)
    res = dec.generate(PROMPT, 0)
    assert res.tokens == [] and res.target_forwards == 0 and res.tau == 0.0
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(PROMPT, -1)


def test_batch_larger_than_one_is_refused(tgt):
    with pytest.raises(ValueError, match="batch size 1"):
        SpeculativeDecoder(tgt).generate(torch.tensor([PROMPT, PROMPT]), 4)
    with pytest.raises(ValueError, match="batch size 1"):
        SpeculativeDecoder(tgt).generate([PROMPT, PROMPT], 4)
    assert SpeculativeDecoder(tgt).generate(torch.tensor([PROMPT]), 3).tokens == \
        SpeculativeDecoder(tgt).generate(PROMPT, 3).tokens


def test_prompt_too_long_for_context(tgt):
    ctx = tgt.context_length  # 512 for tiny models
    dec = SpeculativeDecoder(tgt, first_layers_drafter(tgt, 2), tree=TREE)
    with pytest.raises(ValueError, match="context length 512"):
        dec.generate([1] * (ctx - 10), 10)  # + tree of 7 + root > 512
    assert len(dec.generate([1] * (ctx - 20), 10).tokens) == 10


def test_drafter_of_another_target_is_refused(tgt, tmp_path):
    other = tiny(seed=9)
    with pytest.raises(TargetMismatchError):
        SpeculativeDecoder(tgt, first_layers_drafter(other, 2))
    with pytest.raises(TargetMismatchError):
        SpeculativeDecoder(tgt, random_medusa(other))
    from draftsmith.checkpoint import save_checkpoint
    heads = MedusaHeads.for_target(other, num_heads=2)
    save_checkpoint(tmp_path / "ck", heads, other)
    with pytest.raises(TargetMismatchError):
        drafter_from_checkpoint(tmp_path / "ck", tgt)
    assert drafter_from_checkpoint(tmp_path / "ck", other).max_depth == 2
    small_vocab = ModelDrafter(make_tiny_model(vocab_size=30), None)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(tgt, small_vocab)


def test_bad_tree_and_options(tgt):
    with pytest.raises(ValueError, match=r"\(0, 0, 0, 0\).*at most 3"):
        SpeculativeDecoder(tgt, random_medusa(tgt, num_heads=3), tree=[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)])
    with pytest.raises(ValueError, match=r"\(2, 0\)"):
        SpeculativeDecoder(tgt, random_medusa(tgt), tree=[(0,), (1,), (2, 0)])
    with pytest.raises(ValueError, match="acceptance"):
        SpeculativeDecoder(tgt, acceptance="fast")
    assert SpeculativeDecoder(tgt).acceptance == "exact"
