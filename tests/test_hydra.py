"""Hydra / Hydra++ heads: teacher-forcing alignment, no shared weights, decoding equals plain, exactness."""

import numpy as np
import pytest
import torch

from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.heads.decode import HeadDrafter
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.trees import DynamicTree
from draftsmith.heads.hydra.model import HydraHeads
from draftsmith.heads.objective import HydraObjective
from tests.test_decoder import tiny


def random_hydra(target, num_heads=3, num_layers=2, prefix=True, std=0.3, seed=5) -> HydraHeads:
    torch.manual_seed(seed)
    m = HydraHeads.for_target(target, num_heads=num_heads, num_layers=num_layers, prefix_layer=prefix)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, std / max(1, p.shape[1]) ** 0.5 * 4)
    return m.to(next(target.model.parameters()).dtype).eval()


def test_zero_init_heads_start_as_the_lm_head(tiny_target):
    m = HydraHeads.for_target(tiny_target, num_heads=3, num_layers=2, prefix_layer=True)
    h = torch.randn(7, tiny_target.hidden_size)
    nxt = torch.randint(0, tiny_target.vocab_size, (7, 3))
    out = m(None, nxt, [(h, 0, torch.ones(7, dtype=torch.bool))])
    for k in range(3):  # zero-initialised input layers and prefix output projections: the identity
        torch.testing.assert_close(out[k], tiny_target.lm_head(h))


def test_no_weight_sharing_between_stacked_layers(tiny_target):
    m = HydraHeads.for_target(tiny_target, num_heads=4, num_layers=4, dropout=0.2, prefix_layer=True)
    own = [(n, p) for n, p in m.named_parameters() if not n.startswith(("lm_head", "embed"))]
    assert len({p.data_ptr() for _, p in own}) == len(own)
    mods = [mod for n, mod in m.named_modules() if n.startswith(("heads", "prefix")) and not list(mod.children())]
    assert len({id(x) for x in mods}) == len(mods)
    assert len(m.heads) == 4 and all(len(h.blocks) == 3 for h in m.heads)  # 4 layers per head: input + 3
    assert not m.lm_head.weight.requires_grad and not m.embed.weight.requires_grad
    assert all(p.requires_grad for _, p in own)


class _ProbeHeads(HydraHeads):
    """Records the token ids each head reads."""

    def head_states(self, base, next_tokens):
        self.seen = next_tokens[:, : self.num_heads].clone()
        return super().head_states(base, next_tokens)


def test_teacher_forced_embeddings_are_aligned(tiny_target, tmp_path):
    """Head i at t reads exactly tokens t+1..t+i, and its label is token t+i+1."""
    from draftsmith.common.hidden_cache import HiddenCache
    from draftsmith.train.data.cache import build_cache

    seqs = [{"ids": list(range(3, 23)), "mask": [0] * 5 + [1] * 15}]
    build_cache(tiny_target, seqs, ["final"], tmp_path / "c")
    cache = HiddenCache(tmp_path / "c", tiny_target)
    obj = HydraObjective(cache, tiny_target, 3, chunk_len=8, prefix_layer=False)
    b = obj.window(0, 0, 8)
    ids = np.arange(3, 23)
    # positions where some head has a label (an assistant token t+k+1, k = 1..3)
    t = torch.tensor([x for x in range(8) if any(5 <= x + k + 1 < 20 for k in (1, 2, 3))])
    assert b.next_tokens.shape == (len(t), 3)
    for row, tt in zip(b.next_tokens.tolist(), t.tolist()):
        assert row == [int(ids[min(tt + i, 19)]) for i in (1, 2, 3)]
    for k in range(3):  # label of head k+1 is token t+k+2
        lab = b.labels[k][b.labels[k] != -100]
        tt = t[b.labels[k] != -100]
        assert lab.tolist() == [int(ids[x + k + 2]) for x in tt.tolist()]
    m = _ProbeHeads.for_target(tiny_target, num_heads=3)
    obj.logits(m, b)
    assert torch.equal(m.seen, b.next_tokens)


def test_prefix_layer_sees_whole_sequence_and_is_causal(tiny_target):
    m = random_hydra(tiny_target)
    h = torch.randn(12, tiny_target.hidden_size)
    full = m.base_states(h)
    # incremental (decoding) equals the full pass; a later row does not change earlier outputs
    a, past = m.base_step(h[:5], 0, None)
    b, past = m.base_step(h[5:9], 5, past)
    c, _ = m.base_step(h[9:], 9, past)
    torch.testing.assert_close(torch.cat([a, b, c]), full, atol=1e-5, rtol=1e-5)
    h2 = h.clone()
    h2[8] += 1.0
    torch.testing.assert_close(m.base_states(h2)[:8], full[:8])
    assert not torch.allclose(m.base_states(h2)[8:], full[8:])


@pytest.mark.parametrize("prefix", [False, True], ids=["hydra", "hydra++"])
@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0)], DynamicTree(8, 3, 3)],
                         ids=["chain", "static", "dynamic"])
def test_greedy_hydra_equals_plain(prefix, tree):
    t = tiny(vocab=10, seed=9, std=0.5)
    prompt = [1, 3, 4, 2, 5]
    plain = SpeculativeDecoder(t).generate(prompt, 40).tokens
    dr = HeadDrafter(random_hydra(t, prefix=prefix), t.fingerprint, name="hydra")
    res = SpeculativeDecoder(t, dr, tree=tree).generate(prompt, 40)
    assert res.tokens == plain
    assert res.tau > 1.1  # small vocabulary: drafts do get accepted, so accepted paths are committed


def test_draft_states_match_teacher_forcing(tiny_target):
    """Decoding-time head i on a path equals the teacher-forced head i on the same tokens."""
    m = random_hydra(tiny_target, prefix=False)
    h = torch.randn(1, tiny_target.hidden_size)
    toks = torch.tensor([[4, 7, 2]])
    tf = m.head_states(h, toks)  # [K, 1, d]
    for i in (1, 2, 3):
        torch.testing.assert_close(m.draft_states(h, toks[:, :i]), tf[i - 1])


SAMP = SamplingParams(0.8)


@pytest.mark.parametrize("tree", [[(0,), (1,), (0, 0)], DynamicTree(budget=3, max_depth=2, width=2, expand_batch=1)],
                         ids=["static", "dynamic"])
def test_hydra_pp_trees_are_exact(tree):
    tgt = tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)
    prompt = [1, 3, 4, 3]
    ref = target_distribution(tgt, prompt, 3, SAMP.temperature, SAMP.top_k, SAMP.top_p)
    dr = HeadDrafter(random_hydra(tgt, num_heads=2, prefix=True).double(), tgt.fingerprint, name="hydra")
    got = exact_distribution(SpeculativeDecoder(tgt, dr, sampling=SAMP, tree=tree), prompt, 3)
    assert total_variation(got, ref) < 1e-9
