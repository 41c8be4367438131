"""The stack's one KV cache, written each way its users write it, against the model's own forward without a cache:
a single sequence fed in pieces (a span in row 0), rows of different lengths fed a block each at their own slots
(the batched decoder), prompts prefilled after a copied shared prefix and then decoded one token a row (the data
engine); moving and compacting entries; overflow named."""

import pytest
import torch

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.ragged import ragged_forward
from tests.tiny import make_tiny_model

ATOL = 1e-5  # float32, two layers of width 32: different kernels for the same sums


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return make_tiny_model().eval()


def _own(model, ids: list[int]) -> torch.Tensor:
    """The model's own final states for ``ids``, no cache."""
    with torch.no_grad():
        return model.get_decoder()(input_ids=torch.tensor([ids])).last_hidden_state[0]


def _seq(n: int, seed: int) -> list[int]:
    return torch.randint(3, 90, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_sequence_fed_in_pieces_equals_its_forward(model):
    ids = _seq(13, 1)
    cache = KVCache.for_model(model, 16)
    assert cache.n_rows == 1
    body = model.get_decoder()
    got = []
    with torch.no_grad():
        for s, e in [(0, 6), (6, 7), (7, 13)]:
            cache.set_write(s)
            mask = None if s == 0 else prefix_block_mask(s, torch.ones(e - s, e - s, dtype=torch.bool).tril(),
                                                         torch.float32)
            out = body(input_ids=torch.tensor([ids[s:e]]), position_ids=torch.arange(s, e)[None],
                       attention_mask=mask, **cache_arg(body, cache), use_cache=True).last_hidden_state[0]
            got.append(out)
    torch.testing.assert_close(torch.cat(got), _own(model, ids), atol=ATOL, rtol=ATOL)


def test_rows_of_different_lengths_at_their_own_slots_equal_their_forwards(model):
    seqs = [_seq(9, 2), _seq(4, 3), _seq(7, 4)]
    cache = KVCache.for_model(model, 16, rows=3)
    body = model.get_decoder()
    m = 3  # each row's last three tokens as one block, after its own prefix
    pre = torch.tensor([len(s) - m for s in seqs])
    with torch.no_grad():
        for i, s in enumerate(seqs):  # each row's prefix, one row at a time, in the same cache
            n = len(s) - m
            ragged_forward(body, cache, torch.tensor([s[:n]]), torch.tensor([0]), torch.arange(n)[None],
                           torch.tensor([0]), torch.ones(1, n, n, dtype=torch.bool).tril(), torch.tensor([0]),
                           rows=[i])
        ids = torch.tensor([s[-m:] for s in seqs])
        pos = pre[:, None] + torch.arange(m)[None]
        block = torch.ones(3, m, m, dtype=torch.bool).tril().clone()
        h = ragged_forward(body, cache, ids, pre, pos, pre, block, pre, rows=0)
    for i, s in enumerate(seqs):
        torch.testing.assert_close(h[i], _own(model, s)[-m:], atol=ATOL, rtol=ATOL)


def test_a_shared_prefix_copied_in_then_decoding_row_by_row_equals_the_forwards(model):
    prefix, tails = _seq(5, 5), [_seq(3, 6), _seq(2, 7)]
    body = model.get_decoder()
    lone = KVCache.for_model(model, 8)
    with torch.no_grad():
        lone.set_write(0)
        body(input_ids=torch.tensor([prefix]), **cache_arg(body, lone), use_cache=True)
        kv = [(layer.keys, layer.values) for layer in lone.layers]
        cache = KVCache.for_model(model, 16, rows=2)
        w = max(map(len, tails))
        cache.set_prefill(0, 2, kv, offset=len(prefix))
        ids = torch.tensor([t + [t[-1]] * (w - len(t)) for t in tails])  # right-padded; padding never read
        allowed = torch.zeros(2, 1, w, len(prefix) + w, dtype=torch.bool)
        allowed[..., :len(prefix)] = True
        allowed[..., len(prefix):] = torch.ones(w, w, dtype=torch.bool).tril()
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, torch.finfo(torch.float32).min)
        pos = torch.arange(len(prefix), len(prefix) + w)[None].expand(2, w)
        h = body(input_ids=ids, position_ids=pos, attention_mask=mask, **cache_arg(body, cache),
                 use_cache=True).last_hidden_state
        for i, t in enumerate(tails):
            torch.testing.assert_close(h[i, :len(t)], _own(model, prefix + t)[len(prefix):], atol=ATOL, rtol=ATOL)
        # one decode token a row, at each row's own slot
        lens = torch.tensor([len(prefix) + len(t) for t in tails])
        nxt = [7, 8]
        span = int(lens.max()) + 1
        allowed = torch.arange(span)[None, :] <= lens[:, None]
        mask = torch.zeros(2, 1, 1, span).masked_fill_(~allowed[:, None, None], torch.finfo(torch.float32).min)
        cache.set_decode(lens, span)
        h = body(input_ids=torch.tensor(nxt)[:, None], position_ids=lens[:, None], attention_mask=mask,
                 **cache_arg(body, cache), use_cache=True).last_hidden_state
    for i, t in enumerate(tails):
        torch.testing.assert_close(h[i, 0], _own(model, prefix + t + [nxt[i]])[-1], atol=ATOL, rtol=ATOL)


def test_moving_and_compacting_entries(model):
    cache = KVCache.for_model(model, 8, rows=2)
    for layer in cache.layers:
        layer.keys.copy_(torch.arange(layer.keys.numel(), dtype=torch.float32).view_as(layer.keys))
    k0 = cache.layers[0].keys.clone()
    cache.compact_row(1, [2, 5], 1)  # a tree's accepted path: slots 2 and 5 to slots 1 and 2
    assert torch.equal(cache.layers[0].keys[1, :, 1:3], k0[1, :, [2, 5]])
    assert torch.equal(cache.layers[0].keys[0], k0[0])  # the other row untouched
    cache.move_row(1, 0, 3)
    assert torch.equal(cache.layers[0].keys[0, :, :3], cache.layers[0].keys[1, :, :3])
    assert torch.equal(cache.layers[0].keys[0, :, 3:], k0[0, :, 3:])


def test_overflow_and_a_missing_row_are_named(model):
    cache = KVCache.for_model(model, 4)
    body = model.get_decoder()
    cache.set_write(2)
    with pytest.raises(RuntimeError, match="overflow: writing slots \\[2, 5\\) into capacity 4"), torch.no_grad():
        body(input_ids=torch.tensor([[5, 6, 7]]), position_ids=torch.arange(2, 5)[None],
             attention_mask=torch.zeros(1, 1, 3, 5), **cache_arg(body, cache), use_cache=True)
    with pytest.raises(ValueError, match="outside the cache capacity 4"):
        cache.set_write(5)
    with pytest.raises(RuntimeError, match="span 9 > capacity 4"):
        cache.set_block(torch.zeros(1, 1, dtype=torch.long), 9)
    with pytest.raises(RuntimeError, match="has 1 rows, a forward asked for rows up to 2"):
        cache.set_block(torch.zeros(2, 1, dtype=torch.long), 2)
    assert KVCache.bytes_needed(model.config, 3, 10, torch.float32) == 3 * sum(
        layer.keys.numel() * 4 * 2 for layer in cache.layers) * 10 // 4
