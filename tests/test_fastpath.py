"""Our static-shape decoding forward (engine/fastpath.py), eager and compiled, against the model's own.

The forward must give the model's hidden states and logits (up to the order of floating-point
accumulation), write the same keys and values into the slot cache, leave padded rows without effect, and
keep the decoder lossless: greedy outputs equal plain decoding through the model's own forward, and the
exact-enumeration tests run through it in tests/test_decoder_enumeration.py (the ``compiled`` target).
"""

import pytest
import torch

from draftsmith.engine.cache_kw import cache_arg
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.fastpath import FastBody, unsupported, use_fast_forward
from draftsmith.engine.kvcache import KVCache, prefix_block_mask
from draftsmith.engine.native import native_for
from draftsmith.engine.trees import DynamicTree
from tests.families import off_initial
from tests.test_decoder import random_medusa, tiny
from tests.tiny import make_tiny_target


def _hf_and_fast(tgt, fast, prompt_len=11, q=3, tree=False, capacity=64):
    """Prefill then one block of q rows through both forwards; returns (hf logits, fast logits, caches)."""
    m, body = tgt.model, tgt.model.get_decoder()
    dt = next(m.parameters()).dtype
    fast.reserve(q)  # compiled: the block runs in the bucket holding q rows (the prefill runs eagerly)
    c1, c2 = KVCache.for_model(m, capacity), KVCache.for_model(m, capacity)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, tgt.vocab_size, (1, prompt_len), generator=g)
    with torch.no_grad():
        c1.set_write(0), c2.set_write(0)
        body(input_ids=ids, use_cache=True, **cache_arg(body, c1))
        fast(input_ids=ids, cache=c2)
        blk = torch.ones(q, q, dtype=torch.bool).tril()
        if tree:  # rows 1 and 2 are siblings: row 2 must not see row 1
            blk[2, 1] = False
        mask = prefix_block_mask(prompt_len, blk, dt)
        pos = torch.arange(prompt_len, prompt_len + q)[None]
        if tree:
            pos[0, 2] = pos[0, 1]
        x = torch.randint(3, tgt.vocab_size, (1, q), generator=g)
        c1.set_write(prompt_len), c2.set_write(prompt_len)
        h1 = body(input_ids=x, position_ids=pos, attention_mask=mask, use_cache=True,
                  **cache_arg(body, c1)).last_hidden_state
        out = fast(input_ids=x, position_ids=pos, attention_mask=mask, cache=c2)
    return m.lm_head(h1), out.logits, c1, c2, prompt_len + q


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_fast_eager_forward_equals_the_models(tree):
    tgt = tiny(vocab=40, layers=2, dtype=torch.float64)
    a, b, c1, c2, n = _hf_and_fast(tgt, FastBody(tgt.model, compile=False), tree=tree)
    assert (a - b).abs().max() < 1e-10
    for l1, l2 in zip(c1.layers, c2.layers):
        assert (l1.keys[:, :, :n] - l2.keys[:, :, :n]).abs().max() < 1e-10
        assert (l1.values[:, :, :n] - l2.values[:, :, :n]).abs().max() < 1e-10


def test_fast_bf16_forward_stays_within_bf16_rounding_of_the_models():
    """bf16: where the CPU lacks bf16 instructions the step's linears run the native kernel (float32 sums, one
    rounding); either way the logits stay within bf16's rounding of the model's own bf16 forward."""
    from draftsmith.engine.native import rows_linear_dtypes  # a test-only probe of this CPU's kernel dtypes
    tgt = tiny(vocab=40, layers=2, dtype=torch.bfloat16)
    fast = FastBody(tgt.model, compile=False)
    assert fast.core.rows_native == (torch.bfloat16 in rows_linear_dtypes())
    a, b, c1, c2, n = _hf_and_fast(tgt, fast)
    assert b.dtype == torch.bfloat16
    scale = a.float().abs().max()
    assert (a.float() - b.float()).abs().max() <= 0.03 * scale  # a few bf16 units (2^-8) over two layers
    for l1, l2 in zip(c1.layers, c2.layers):
        v1, v2 = l1.values[:, :, :n].float(), l2.values[:, :, :n].float()
        assert (v1 - v2).abs().max() <= 0.03 * v1.abs().max()


def test_a_wrong_mask_is_detected():
    # The comparison has teeth: a tree mask given to one forward and a chain mask to the other differ.
    tgt = tiny(vocab=40, layers=2, dtype=torch.float64)
    a, _, _, _, _ = _hf_and_fast(tgt, FastBody(tgt.model, compile=False), tree=True)
    b, _, _, _, _ = _hf_and_fast(tgt, FastBody(tgt.model, compile=False), tree=False)
    assert (a[0, 2] - b[0, 2]).abs().max() > 1e-4


@pytest.fixture(scope="module")
def compiled_target():
    """Compiled without GEMM autotuning: the padding, masking and capacity checks below do not depend on which
    GEMM kernels inductor picks, and autotuning each of their graphs costs minutes on an AVX2 CPU."""
    tgt = tiny(vocab=40, layers=2)
    use_fast_forward(tgt, "compile", autotune=False)
    return tgt


@pytest.fixture(scope="module")
def autotuned_target():
    tgt = tiny(vocab=40, layers=2)
    use_fast_forward(tgt, "compile")  # autotuned: inductor's CPP GEMM kernels on this CPU, as decoding uses
    return tgt


def test_compiled_forward_pads_rows_without_effect(compiled_target):
    # 3 rows run in the 4-row graph where the native block kernel does not take this target's head size (8) (AVX-512:
    # the masked graph, padded); the real rows' logits and the cache's committed entries are the model's.
    a, b, c1, c2, n = _hf_and_fast(compiled_target, compiled_target.fast_body, q=3, tree=True)
    assert (a - b).abs().max() < 1e-4
    for l1, l2 in zip(c1.layers, c2.layers):
        assert (l1.keys[:, :, :n] - l2.keys[:, :, :n]).abs().max() < 1e-4
    assert compiled_target.fast_body.compile_s > 0


def test_compiled_forward_does_not_recompile_for_a_longer_context(compiled_target):
    from torch._dynamo.utils import counters
    _hf_and_fast(compiled_target, compiled_target.fast_body, q=3, capacity=64)
    graphs = counters["stats"]["unique_graphs"]
    for p in (20, 40, 55):  # other live lengths, same capacity and bucket: the same graph
        a, b, _, _, _ = _hf_and_fast(compiled_target, compiled_target.fast_body, prompt_len=p, q=2, capacity=64)
        assert (a - b).abs().max() < 1e-4
    assert counters["stats"]["unique_graphs"] == graphs


@pytest.fixture(scope="module")
def compiled_target16():
    """A tiny target whose head size (16) the native block kernel takes on AVX2 and AVX-512 alike."""
    tgt = make_tiny_target(vocab_size=40, init_std=0.3, layers=2, hidden_size=64, heads=4, kv_heads=2)
    use_fast_forward(tgt, "compile", autotune=False)
    return tgt


def test_blocks_run_at_their_own_rows_in_one_graph_with_the_models_logits(compiled_target16):
    """Chain and tree blocks of the 4-, 8- and 16-row buckets run one graph (their rows dynamic), each block at its
    own rows, not padded up to its bucket (the native products cost more with every row): a second and a third
    bucket and the odd sizes compile nothing, and every block's logits and cache entries are the model's."""
    from torch._dynamo.utils import counters
    fast = compiled_target16.fast_body
    if fast.core.attend_block is None:
        pytest.skip(f"the native block kernel does not take head size {fast.core.head_dim} on this CPU")
    _hf_and_fast(compiled_target16, fast, q=3, tree=True)
    graphs = counters["stats"]["unique_graphs"]
    for q in (7, 13, 4, 2):
        fast.reserve(q)
        # a 20-token prompt: its prefill runs eagerly (past the 16-row bucket), not in a masked graph
        a, b, c1, c2, n = _hf_and_fast(compiled_target16, fast, prompt_len=20, q=q, tree=q > 3)
        assert (a - b).abs().max() < 1e-4
        for l1, l2 in zip(c1.layers, c2.layers):
            assert (l1.values[:, :, :n] - l2.values[:, :, :n]).abs().max() < 1e-4
    assert {k[0] for k in fast._seen if k[-1] == "block"} == {3, 7, 13, 4, 2}  # padded, they would be 4, 8, 16
    assert counters["stats"]["unique_graphs"] == graphs


def test_a_block_that_fills_the_cache_exactly_still_decodes(compiled_target):
    # 12 + 4 rows = capacity 16 and 17: the block fills the cache (or all but one slot); both equal the model's.
    for cap in (16, 17):
        a, b, _, _, _ = _hf_and_fast(compiled_target, compiled_target.fast_body, prompt_len=12, q=4, capacity=cap)
        assert (a - b).abs().max() < 1e-4


def test_one_query_attends_by_the_native_kernel_and_a_masked_one_does_not(compiled_target):
    # Plain decoding's 1-row step (it sees every slot so far) runs its attention by the native decode kernel over
    # slots [0, s]; a 1-row step whose mask hides a slot keeps the masked attention. Both equal the model's.
    tgt, fast = compiled_target, compiled_target.fast_body
    m, body = tgt.model, tgt.model.get_decoder()
    if native_for(torch.float32, "cpu", fast.core.head_dim) is None:
        pytest.skip("the native decode kernel does not apply to this head size or machine")
    fast.reserve(1)
    for plen, hide in ((5, False), (23, False), (9, True)):
        c1, c2 = KVCache.for_model(m, 64), KVCache.for_model(m, 64)
        ids = torch.randint(3, tgt.vocab_size, (1, plen + 1), generator=torch.Generator().manual_seed(plen))
        mask = torch.zeros(1, 1, 1, plen + 1)
        if hide:
            mask[..., 2] = torch.finfo(torch.float32).min
        with torch.no_grad():
            c1.set_write(0), c2.set_write(0)
            body(input_ids=ids[:, :plen], use_cache=True, **cache_arg(body, c1))
            fast(input_ids=ids[:, :plen], cache=c2)
            c1.set_write(plen), c2.set_write(plen)
            h = body(input_ids=ids[:, plen:], position_ids=torch.tensor([[plen]]), attention_mask=mask,
                     use_cache=True, **cache_arg(body, c1)).last_hidden_state
            got = fast(input_ids=ids[:, plen:], attention_mask=mask, cache=c2).logits
        assert (m.lm_head(h) - got).abs().max() < 1e-4
    assert (1, 64, "cpu", (), "one") in fast._seen
    assert (1, 64, "cpu", (), 1) in fast._seen  # the masked step: the graph with one mask (no sliding layers)


def test_the_cpp_wrapper_changes_nothing_but_who_calls_the_kernels():
    """The 1-row graph with inductor's C++ wrapper (the default outside the tests, which leave it off to save its
    compile) gives the same bits as the Python wrapper, step after step of greedy decoding. Head size 16: a whole
    vector on AVX-512 and two on AVX2, so the native decode kernel (what the C++ wrapper calls) applies on both."""
    tgt = make_tiny_target(vocab_size=40, init_std=0.3, layers=2, hidden_size=64, heads=4)
    if native_for(torch.float32, "cpu", 16) is None:
        pytest.skip("the native decode kernel is not built on this machine")
    outs = []
    for wrapper in (False, True):
        fast = FastBody(tgt.model, compile=True, autotune=False, cpp_wrapper=wrapper)
        assert (fast.compiled_one is fast.compiled) == (not wrapper)
        fast.reserve(1)
        cache = KVCache.for_model(tgt.model, 64)
        ids, logits = [1, 5, 9, 4, 7], []
        with torch.no_grad():
            cache.set_write(0)
            out = fast(input_ids=torch.tensor([ids]), cache=cache)
            for _ in range(6):
                ids.append(int(out.logits[0, -1].argmax()))
                cache.set_write(len(ids) - 1)
                out = fast(input_ids=torch.tensor([ids[-1:]]), cache=cache)
                logits.append(out.logits[0, -1])
        assert (1, 64, "cpu", (), "one") in fast._seen
        outs.append((ids, torch.stack(logits)))
    assert outs[0][0] == outs[1][0]
    assert torch.equal(outs[0][1], outs[1][1])


def test_compiled_decoder_greedy_equals_plain_through_the_models_forward(autotuned_target):
    tgt = autotuned_target
    prompts = [[1, 5, 9, 4, 7], [1, 30, 2 + 10, 11, 12, 13, 14, 15, 16], [1, 3]]
    fast = tgt.fast_body
    tgt.fast_body = None
    ref = [SpeculativeDecoder(tgt).generate(p, 24).tokens for p in prompts]
    tgt.fast_body = fast
    medusa = random_medusa(tgt, num_heads=3, std=0.3)
    decs = {"plain": SpeculativeDecoder(tgt),
            "chain": SpeculativeDecoder(tgt, medusa),
            "static tree": SpeculativeDecoder(tgt, medusa, tree=[(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]),
            "dynamic tree": SpeculativeDecoder(tgt, medusa, tree=DynamicTree(6, 3, 2))}
    for name, dec in decs.items():
        assert dec.fast is fast
        got = [dec.generate(p, 24).tokens for p in prompts]
        assert got == ref, name


def test_a_long_prompt_does_not_leave_later_generations_on_a_larger_cache():
    # The compiled forward attends over the whole cache, so a generation runs in the smallest power-of-two
    # capacity (>= 512) that holds it, and a short prompt after a long one goes back to the 512-slot cache (and
    # its graph) rather than paying for 1024 slots at every later step.
    from tests.tiny import make_tiny_target
    from torch._dynamo.utils import counters
    tgt = make_tiny_target(vocab_size=40, layers=2, max_positions=1024)
    use_fast_forward(tgt, "compile", autotune=False)
    dec = SpeculativeDecoder(tgt)
    short, long = [1, 5, 9, 4], [1] + [5 + i % 30 for i in range(600)]
    ref = dec.generate(short, 8).tokens
    first = dec.cache
    assert dec.capacity == 512
    got_long = dec.generate(long, 8).tokens
    assert dec.capacity == 1024
    graphs = counters["stats"]["unique_graphs"]
    assert dec.generate(short, 8).tokens == ref
    assert dec.capacity == 512 and dec.cache is first
    assert dec.generate(long, 8).tokens == got_long
    assert counters["stats"]["unique_graphs"] == graphs  # both capacities' graphs reused, nothing recompiled


def test_compiled_weights_are_frozen_into_the_graph():
    # Freezing really applies (passed in torch.compile's options it silently does not): the compiled graph holds
    # the weights as constants, so changing a parameter after compiling leaves its output unchanged, while the
    # same forward run eagerly over the same parameters sees the change (the check can fail).
    tgt = tiny(vocab=40, layers=2)
    use_fast_forward(tgt, "compile", autotune=False)
    fast = tgt.fast_body
    fast.core.rows_native = False  # the BLAS products, whose weights freezing packs (the native kernel reads them)
    fast.reserve(3)
    x = torch.tensor([[5, 7, 9]])

    def run():
        c = KVCache.for_model(tgt.model, 64)
        c.set_write(0)
        with torch.no_grad():
            return fast(input_ids=x, cache=c).logits

    before = run()
    with torch.no_grad():
        fast.core.gate_up[0].mul_(0.5)
    assert torch.equal(run(), before)
    fast.compiled = None  # the same function, eagerly, over the changed parameters
    assert (run() - before).abs().max() > 1e-3


def test_unsupported_models_keep_their_own_forward():
    tgt = tiny(vocab=40, layers=2)
    tgt.model.config.model_type = "gpt2"
    assert "gpt2" in unsupported(tgt.model)
    assert use_fast_forward(tgt, "compile")["forward"] == "eager"
    assert SpeculativeDecoder(tgt).fast is None
    with pytest.raises(ValueError, match="decoding forward must be one of"):
        use_fast_forward(tgt, "fastest")


def test_layer_hooks_see_the_layer_outputs():
    """Forward hooks on the model's layers (plain and with kwargs) are called with the outputs the model's own
    forward gives them, though our forward runs its fused copy of the weights."""
    tgt = tiny(vocab=40, layers=4, dtype=torch.float64)  # hidden_states[4], the last, is after the final norm
    layers = tgt.model.get_decoder().layers
    got: dict = {}
    h1 = layers[0].register_forward_hook(lambda mod, args, out: got.__setitem__(0, out[0]))
    h2 = layers[2].register_forward_hook(lambda mod, args, kw, out: got.__setitem__(2, out[0]), with_kwargs=True)
    ids = torch.tensor([[1, 5, 7, 9, 11, 3]])
    hs = tgt.model(ids, output_hidden_states=True).hidden_states  # also fills `got` through the model's forward
    got.clear()
    fast = FastBody(tgt.model, compile=False)
    c = KVCache.for_model(tgt.model, 16)
    c.set_write(0)
    with torch.no_grad():
        fast(input_ids=ids, cache=c)
    assert sorted(got) == [0, 2]
    assert (got[0] - hs[1]).abs().max() < 1e-10 and (got[2] - hs[3]).abs().max() < 1e-10
    h1.remove(), h2.remove()


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fast_forward_equals_the_models_for_other_families(family):
    """Qwen2 (q/k/v biases) and Qwen3 (per-head q/k norms, a head size of its own) through our forward, a chain and a
    tree block, in float64: the model's logits and cache."""
    import transformers

    from draftsmith.target import Target
    from tests.tiny import make_tokenizer
    common = dict(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.3)
    cfg = transformers.Qwen2Config(**common) if family == "qwen2" else transformers.Qwen3Config(head_dim=16, **common)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).to(torch.float64).eval().requires_grad_(False)
    off_initial(model)  # biases and norms away from their initial values, so that copying them matters
    assert unsupported(model) is None
    tgt = Target(model=model, tokenizer=make_tokenizer(40), name=family, path=None, fingerprint=family)
    for tree in (False, True):
        a, b, c1, c2, n = _hf_and_fast(tgt, FastBody(model, compile=False), tree=tree)
        assert (a - b).abs().max() < 1e-10
        for l1, l2 in zip(c1.layers, c2.layers):
            assert (l1.keys[:, :, :n] - l2.keys[:, :, :n]).abs().max() < 1e-10


def _gemma_steps(tgt, fast, prompt_len: int, tree: bool) -> float:
    """Gemma 3's tiny target (window 8): a prefill, four 1-token steps, then a 3-row chain or tree block with the
    decoder's per-layer-type masks, through the model's forward and ``fast``; the largest logit difference."""
    from draftsmith.engine.kvcache import sliding_windows, window_masks
    m, body = tgt.model, tgt.model.get_decoder()
    c1, c2 = KVCache.for_model(m, 64), KVCache.for_model(m, 64)
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    with torch.no_grad():
        s = 0
        for x in [torch.randint(3, 48, (1, prompt_len), generator=g)] + [torch.randint(3, 48, (1, 1), generator=g)
                                                                        for _ in range(4)]:
            pos = torch.arange(s, s + x.shape[1])[None]
            c1.set_write(s), c2.set_write(s)
            h = body(input_ids=x, position_ids=pos, use_cache=True, **cache_arg(body, c1)).last_hidden_state
            worst = max(worst, (m.lm_head(h) - fast(input_ids=x, position_ids=pos, cache=c2).logits).abs().max())
            s += x.shape[1]
        blk = torch.ones(3, 3, dtype=torch.bool).tril()
        pos = torch.arange(s, s + 3)[None]
        if tree:  # rows 1 and 2 are siblings
            blk[2, 1] = False
            pos[0, 2] = pos[0, 1]
        mask = window_masks(sliding_windows(m.config), prefix_block_mask(s, blk, torch.float64), pos,
                            torch.cat([torch.arange(s)[None], pos], 1))
        x = torch.randint(3, 48, (1, 3), generator=g)
        c1.set_write(s), c2.set_write(s)
        h = body(input_ids=x, position_ids=pos, attention_mask=mask, use_cache=True,
                 **cache_arg(body, c1)).last_hidden_state
        out = fast(input_ids=x, position_ids=pos, attention_mask=mask, cache=c2)
    return float(max(worst, (m.lm_head(h) - out.logits).abs().max()))


@pytest.mark.parametrize("prompt_len", [4, 13], ids=["crosses-window", "past-window"])
def test_gemma3_forward_equals_the_models_within_and_past_its_window(prompt_len):
    """Gemma 3 through our forward, float64: norms that scale by 1 + weight, the sandwich norms, the tanh GELU, its
    score scale, a RoPE per layer type and the sliding layers' window (8 here: a prefill of 4 then 1-token steps
    crosses it, one of 13 starts past it), chains and trees. Without the window, or with Llama's norms, the logits
    differ: the test can fail."""
    from tests.families import family_target
    tgt = family_target("gemma3")
    tgt.model.to(torch.float64)
    assert unsupported(tgt.model) is None
    for tree in (False, True):
        assert _gemma_steps(tgt, FastBody(tgt.model, compile=False), prompt_len, tree) < 1e-10
    # no window; Llama's norms; one RoPE (the first type's) for every layer; SiLU
    for attr, value in (("window", None), ("norm_offset", False), ("rope_of", [0] * 4),
                        ("act", torch.nn.functional.silu)):
        fast = FastBody(tgt.model, compile=False)
        setattr(fast.core, attr, value)
        assert _gemma_steps(tgt, fast, prompt_len, True) > 1e-3, attr


@pytest.mark.parametrize("drafter", ["plain", "chain"])
def test_batched_gemma3_runs_the_fused_step_within_its_window_and_the_models_forward_past_it(drafter):
    """The batched decoder (the server's) on a windowed target: a call whose cache fits the window (64 here) runs the
    fused step (its kernels attend over every live slot, which is the window's attention there), a longer one the
    model's own forward; both give the model's greedy tokens. The fused step past the window would not: the test
    can fail."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.fast_batch import batch_body
    from tests.families import family_target
    from tests.tiny import greedy_reference
    tgt = family_target("gemma3", window=64)
    eos = set(tgt.eos_token_ids)
    prompts = [[1, 5, 6, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    assert use_fast_forward(tgt, "fast", autotune=False) == {"forward": "fast"}
    body = batch_body(tgt.model, "fast", within_window=True)
    fused = []
    for name in ("prefill", "step", "verify"):
        def counted(*a, _f=getattr(body, name), _n=name, **kw):
            fused.append(_n)
            return _f(*a, **kw)
        setattr(body, name, counted)
    dec = BatchedSpeculativeDecoder(tgt, random_medusa(tgt, num_heads=2, std=0.3) if drafter == "chain" else None,
                                    k=2)
    for new, within in ((20, True), (60, False)):
        refs = [greedy_reference(tgt.model, p, new, eos)[0] for p in prompts]
        cap = dec.call_capacity(max(dec.positions(len(p), new) for p in prompts), 2048)
        assert cap == (64 if within else 2048)
        fused.clear()
        res = dec.generate(prompts, [new, new], capacity=cap)
        assert [r.tokens for r in res.rows] == refs, (new, within)
        assert (dec._fast() is not None) is within and dec.cache.capacity == cap
        assert ("prefill" in fused and ("step" in fused or "verify" in fused)) if within else not fused
    # what the capacity guards (random tiny models repeat a token, so their greedy tokens would not show it): the
    # fused prefill of a prompt inside the window gives the model's logits, past it not (its last token sees slots
    # the sliding layers must not)
    for n, same in ((40, True), (80, False)):
        ids = [1 + (7 * i) % 40 for i in range(n)]
        kv = [t for layer in KVCache.for_model(tgt.model, 128).layers for t in (layer.keys, layer.values)]
        lg = body.prefill([ids], [0], 0, kv)[1][0]
        ref = tgt.model(torch.tensor([ids])).logits[0, -1]
        assert (float((lg - ref).abs().max()) < 1e-4) is same, n


def test_compiled_gemma3_decoding_keeps_the_models_tokens():
    """The compiled forward on Gemma 3's tiny target: native kernels while the live slots fit the window, then the
    masked graphs with the sliding layers' own mask; plain decoding, a chain and a tree give the model's own
    greedy tokens across and past the window. The batched decoder keeps the model's forward (its kernels attend
    over every live slot) and gives them too."""
    from draftsmith.engine.batched import BatchedSpeculativeDecoder
    from draftsmith.engine.fast_batch import batch_body
    from tests.families import family_target
    from tests.tiny import greedy_reference
    tgt = family_target("gemma3")
    prompts = [[1, 5, 6, 7], [1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    refs = [greedy_reference(tgt.model, p, 20, set(tgt.eos_token_ids))[0] for p in prompts]
    assert use_fast_forward(tgt, "compile", autotune=False) == {"forward": "compile"}
    medusa = random_medusa(tgt, num_heads=2, std=0.3)
    for name, dec in {"plain": SpeculativeDecoder(tgt), "chain": SpeculativeDecoder(tgt, medusa),
                      "tree": SpeculativeDecoder(tgt, medusa, tree=[(0,), (1,), (0, 0)])}.items():
        assert dec.fast is tgt.fast_body
        assert [dec.generate(p, 20).tokens for p in prompts] == refs, name
    assert batch_body(tgt.model, "compile") is None
    assert [r.tokens for r in BatchedSpeculativeDecoder(tgt, None).generate(prompts, [20, 20]).rows] == refs
