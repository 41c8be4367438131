"""The target's dtype: recipe field and `auto`, fingerprint independent of the dtype, losslessness in bf16.

Losslessness in a dtype (docs/methods.md): every emitted token is distributed as the target's processed
distribution at its position in the verification forward that emitted it, computed in that dtype. Checked
here on a tiny random bf16 model, in two ways:
  * exactly, against its own forwards: the decoder's exact output distribution (every draft and verification
    branch enumerated) equals the autoregressive distribution of the logits rows its verification forwards
    computed (1e-9, float64 maths), when every context's rows agree (they do here);
  * per generation, against the exact distribution of plain decoding in bf16, within the bound the forwards'
    disagreement allows: if every forward's logits are within eps of the cache-free forward's, each position's
    distribution (at temperature T) is within TV e^(2 eps / T) - 1 of the reference, so n positions are within
    n times that, for the decoder and for plain decoding alike. eps is measured over every forward both ran (0
    here for these short contexts; the greedy test shows longer ones on this CPU can round differently by an
    ulp, and another kernel may too: the bound then grows with it).
Medusa's typical acceptance (lossy) is caught by both.
"""

from __future__ import annotations

import math

import pytest
import torch

from draftsmith.checkpoint import DtypeMismatchWarning, drafter_from_checkpoint, read_manifest, save_checkpoint
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams, processed_probs
from draftsmith.eval.exact import exact_distribution, forwards_distribution, record_forwards, total_variation
from draftsmith.eval.greedy_equality import greedy_equality
from draftsmith.eval.mtbench import Prompt
from draftsmith.recipe import parse_recipe
from draftsmith.target import fingerprint, load_target, resolve_dtype
from tests.test_decoder import other_model_drafter, random_medusa, tiny

PROMPT = [1, 3, 4, 3]
N_NEW = 3
TEMP = SamplingParams(0.8)
STATIC = [(0,), (1,), (0, 0)]


@pytest.fixture(scope="module")
def bf16():
    return tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.bfloat16)


# ---------------------------------------------------------------- (a) exact enumeration in bf16
def _decoder(target, kind: str) -> SpeculativeDecoder:
    if kind == "plain":
        return SpeculativeDecoder(target, None, sampling=TEMP)
    if kind == "chain":
        return SpeculativeDecoder(target, other_model_drafter(target), sampling=TEMP, policy=FixedLength(2))
    return SpeculativeDecoder(target, random_medusa(target, num_heads=2, std=0.5), sampling=TEMP, tree=STATIC,
                              acceptance="typical" if kind == "typical" else "exact")


@torch.no_grad()
def _cache_free(target):
    return lambda seq: target.model(torch.tensor([list(seq)])).logits[0, -1]


def _eps(target, rows: dict) -> float:
    """Largest |logit| difference between any recorded forward row and a cache-free forward of its context."""
    f = _cache_free(target)
    return max(float((r - f(ctx).float()).abs().max()) for ctx, rs in rows.items() for r in rs)


@pytest.fixture(scope="module")
def enumerated(bf16):
    """kind -> (exact distribution, recorded forward rows), each decoder enumerated once."""
    out = {}
    for kind in ("plain", "chain", "static-tree", "typical"):
        dec = _decoder(bf16, kind)
        rows = record_forwards(dec)
        out[kind] = (exact_distribution(dec, PROMPT, N_NEW), rows)
    return out


@pytest.mark.parametrize("kind", ["plain", "chain", "static-tree"])
def test_bf16_exact_against_its_own_forwards(bf16, enumerated, kind):
    got, rows = enumerated[kind]
    ref, spread, missing = forwards_distribution(rows, PROMPT, N_NEW, TEMP, bf16.eos_token_ids, _cache_free(bf16))
    assert len(ref) > 100 and abs(sum(got.values()) - 1) < 1e-12
    assert missing == 0
    # spread 0 (this CPU, these short contexts): every context's row rounded alike in every forward, so the
    # reference is unambiguous and the check exact; a kernel that rounds by shape gets the rounding bound
    assert total_variation(got, ref) <= _bound(spread), spread


def test_bf16_own_forwards_check_detects_typical_acceptance(bf16, enumerated):
    got, rows = enumerated["typical"]
    ref, _, _ = forwards_distribution(rows, PROMPT, N_NEW, TEMP, bf16.eos_token_ids, _cache_free(bf16))
    assert total_variation(got, ref) > 1e-2


def _bound(eps: float) -> float:
    """TV allowed between two decoders whose logits are each within eps of the cache-free forward's."""
    return 1e-9 + 2 * N_NEW * (math.exp(2 * eps / TEMP.temperature) - 1)


@pytest.mark.parametrize("kind", ["chain", "static-tree", "typical"])
def test_bf16_generation_matches_plain_bf16_decoding(bf16, enumerated, kind):
    plain, plain_rows = enumerated["plain"]
    got, rows = enumerated[kind]
    bound = _bound(max(_eps(bf16, rows), _eps(bf16, plain_rows)))
    tv = total_variation(got, plain)
    if kind == "typical":  # lossy: well above what rounding allows
        assert tv > 10 * bound, (tv, bound)
    else:
        assert tv <= bound, (tv, bound)


def test_probabilities_are_fp32_from_bf16_logits():
    lg = torch.randn(3, 50).to(torch.bfloat16)
    for s in (SamplingParams(0.7), SamplingParams(1.0, top_k=5, top_p=0.9)):
        p = s.probs(lg)
        assert p.dtype == torch.float32
        assert torch.allclose(p, processed_probs(lg.float(), s.temperature, s.top_k, s.top_p))


# ---------------------------------------------------------------- (b) greedy equality in bf16
def test_tie_threshold_scales_with_the_dtype():
    from draftsmith.eval.greedy_equality import tie_threshold

    assert tie_threshold(6.0, torch.float32) == 1e-3
    assert tie_threshold(6.0, torch.bfloat16) == 4 * 4 * 2 ** -7  # 4 ulps of a logit in [4, 8)
    assert tie_threshold(6.0, torch.float16) == 4 * 4 * 2 ** -10


def test_bf16_greedy_equals_plain_chain_and_static_tree():
    tgt = tiny(vocab=40, seed=1, std=0.3, layers=3, dtype=torch.bfloat16)
    layers = first_layers_drafter(tgt, 1)
    methods = {"chain": SpeculativeDecoder(tgt, layers, policy=FixedLength(3)),
               "static-tree": SpeculativeDecoder(tgt, layers, tree=[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0)]),
               "medusa-static-tree": SpeculativeDecoder(tgt, random_medusa(tgt, num_heads=3),
                                                        tree=[(0,), (1,), (0, 0), (0, 0, 0)])}
    prompts = [Prompt(i, "tiny", "", [1] + [(7 * i + 3 * j) % 37 + 3 for j in range(5 + i)]) for i in range(6)]
    report = greedy_equality(tgt, methods, prompts, max_new_tokens=40)
    assert report["dtype"] == "bfloat16"
    divergences = 0
    for name, m in report["methods"].items():
        # every divergence sits at a bf16 near-tie: a top-2 gap of a few ulps of the top logit. On this CPU the
        # chain and the 6-node tree diverge on 2 of 6 prompts at gaps of 1 and 2 ulps (0.016, 0.031): the
        # verification forward and the 1-row forward rounded those two logits differently
        assert m["unexplained"] == 0, (name, m)
        assert all(d["top2_gap"] < d["tie_threshold"] for d in m["divergences"])
        divergences += len(m["divergences"])
        assert m["equal"] + len(m["divergences"]) == len(prompts)
    assert report["pass"] and divergences <= len(prompts)  # rare: most prompts are equal token for token


# ---------------------------------------------------------------- (c) fingerprint independent of the dtype
def _old_fingerprint(model, tokenizer) -> str:
    """The fingerprint as it was computed before the dtype choice (the checkpoints on disk carry these)."""
    import hashlib
    import json

    from draftsmith.target import _ARCH_FIELDS

    d = model.config.to_dict()
    h = hashlib.sha256()
    h.update(json.dumps({k: d.get(k) for k in _ARCH_FIELDS if k in d}, sort_keys=True, default=str).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])).encode())
    h.update(model.get_output_embeddings().weight.detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return "sha256:" + h.hexdigest()[:32]


def test_fp32_fingerprint_is_unchanged(tmp_path):
    from tests.tiny import make_tiny_target

    t = make_tiny_target(save_to=tmp_path / "tiny")
    fp32 = load_target(tmp_path / "tiny")
    assert fp32.fingerprint == t.fingerprint == _old_fingerprint(fp32.model, fp32.tokenizer)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_low_precision_load_shares_the_fingerprint(tmp_path, dtype):
    from tests.tiny import make_tiny_target

    make_tiny_target(save_to=tmp_path / "tiny")
    fp32, low = load_target(tmp_path / "tiny"), load_target(tmp_path / "tiny", dtype=dtype)
    assert low.dtype == getattr(torch, dtype) and fp32.dtype == torch.float32
    assert low.fingerprint == fp32.fingerprint
    # hashing the rounded head would not have been: the dtype is not part of the identity
    assert fingerprint(low.model, low.tokenizer) != fp32.fingerprint


def test_fingerprint_falls_back_when_the_head_is_not_in_safetensors(tmp_path, monkeypatch):
    from draftsmith import target as target_mod
    from tests.tiny import make_tiny_target

    make_tiny_target(save_to=tmp_path / "tiny")
    monkeypatch.setattr(target_mod, "stored_output_weight", lambda path, model: None)
    assert load_target(tmp_path / "tiny", dtype="bfloat16").fingerprint == load_target(tmp_path / "tiny").fingerprint


def test_checkpoint_records_dtype_and_warns_on_another(tmp_path):
    from tests.tiny import make_tiny_target

    make_tiny_target(save_to=tmp_path / "tiny")
    fp32, low = load_target(tmp_path / "tiny"), load_target(tmp_path / "tiny", dtype="bfloat16")
    from draftsmith.heads.medusa.model import MedusaHeads

    heads = MedusaHeads.for_target(fp32, num_heads=2)
    save_checkpoint(tmp_path / "ck", heads, fp32)
    assert read_manifest(tmp_path / "ck")["target"]["dtype"] == "float32"
    with pytest.warns(DtypeMismatchWarning, match="trained on features of the target in float32"):
        d = drafter_from_checkpoint(tmp_path / "ck", low)  # same fingerprint: loads, cast to bf16
    assert next(d.heads.parameters()).dtype == torch.bfloat16
    out = SpeculativeDecoder(low, d, tree=[(0,), (0, 0)]).generate([1, 5, 6], 8).tokens
    assert out == SpeculativeDecoder(low).generate([1, 5, 6], 8).tokens
    save_checkpoint(tmp_path / "ck16", heads, fp32, target_dtype="bfloat16")  # features cached in bf16
    assert read_manifest(tmp_path / "ck16")["target"]["dtype"] == "bfloat16"
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error", DtypeMismatchWarning)
        drafter_from_checkpoint(tmp_path / "ck16", low)


# ---------------------------------------------------------------- (d) recipe field and auto
def test_recipe_dtype_field_and_override():
    r = parse_recipe({"name": "x", "drafter": {"kind": "medusa"}})
    assert r.dtype == "float32"
    assert parse_recipe({"name": "x", "drafter": {"kind": "medusa"}}, ["dtype=bfloat16"]).dtype == "bfloat16"
    assert parse_recipe({"name": "x", "dtype": "auto", "drafter": {"kind": "medusa"}}).dtype == "auto"
    with pytest.raises(ValueError, match="recipe key 'dtype'"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa"}}, ["dtype=float64"])


def test_resolve_dtype_names_and_auto_on_cpu():
    assert resolve_dtype("bfloat16").dtype == torch.bfloat16
    assert resolve_dtype(None).dtype == torch.float32
    assert resolve_dtype(torch.float16).name == "float16"
    with pytest.raises(ValueError, match="float64"):
        resolve_dtype("float64")
    native = resolve_dtype("auto", "cpu", cpu_flags=lambda: {"avx2", "avx512_bf16"})
    assert native.dtype == torch.bfloat16 and "avx512_bf16" in native.reason
    assert resolve_dtype("auto", "cpu", cpu_flags=lambda: {"amx_bf16"}).dtype == torch.bfloat16
    plain = resolve_dtype("auto", "cpu", cpu_flags=lambda: {"avx2", "fma"})
    assert plain.dtype == torch.float32 and "no native bf16" in plain.reason


def test_auto_reads_proc_cpuinfo(monkeypatch):
    from draftsmith import target as target_mod

    monkeypatch.setattr(target_mod, "cpuinfo_flags", lambda: {"sse", "amx_bf16"})
    assert resolve_dtype("auto", "cpu").dtype == torch.bfloat16
    monkeypatch.setattr(target_mod, "cpuinfo_flags", lambda: set())
    assert resolve_dtype("auto", "cpu").dtype == torch.float32


def test_decoding_auto_is_float32_for_a_target_shipped_as_low_bit_gguf(monkeypatch, tmp_path):
    """`decode_dtype`: auto on a CPU with native bf16 decodes a target that ships as a low-bit GGUF file in float32
    (its packed blocks), and keeps bf16 for one shipped full width, for any other directory, for the model's own
    forward, without the packed path, or when bf16 is asked for by name."""
    from draftsmith import target as target_mod
    from draftsmith.engine import fastpath

    monkeypatch.setattr(target_mod, "cpuinfo_flags", lambda: {"avx2", "avx512_bf16"})
    monkeypatch.setattr(fastpath, "rows_linear_dtypes", lambda: frozenset({torch.float32}))
    shipped = {"smollm2-135m-instruct": (tmp_path / "t.gguf", "q4_1"), "wide": (tmp_path / "w.gguf", "bf16")}
    monkeypatch.setattr(fastpath, "shipped_gguf", lambda name, path=None: shipped.get(name))
    got = fastpath.decode_dtype("auto", "smollm2-135m-instruct")
    assert got.dtype == torch.float32 and "Q4_1" in got.reason and "bfloat16" in got.reason
    assert fastpath.decode_dtype("auto", "wide").dtype == torch.bfloat16
    assert fastpath.decode_dtype("auto", str(tmp_path)).dtype == torch.bfloat16  # a local directory: no shipped file
    assert fastpath.decode_dtype("auto", "smollm2-135m-instruct", forward="eager").dtype == torch.bfloat16
    assert fastpath.decode_dtype("bfloat16", "smollm2-135m-instruct").dtype == torch.bfloat16
    assert fastpath.decode_dtype("auto", "smollm2-135m-instruct", device="cuda").dtype != torch.float32 or \
        not torch.cuda.is_available()
    monkeypatch.setenv("DRAFTSMITH_PACKED", "0")
    assert fastpath.decode_dtype("auto", "smollm2-135m-instruct").dtype == torch.bfloat16
    monkeypatch.delenv("DRAFTSMITH_PACKED")
    monkeypatch.setattr(fastpath, "rows_linear_dtypes", lambda: frozenset())  # no native kernels: nothing packed
    assert fastpath.decode_dtype("auto", "smollm2-135m-instruct").dtype == torch.bfloat16
    monkeypatch.setattr(target_mod, "cpuinfo_flags", lambda: {"avx2"})  # no native bf16: float32 anyway
    assert fastpath.decode_dtype("auto", "wide").dtype == torch.float32


def test_auto_on_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    assert resolve_dtype("auto", "cuda").dtype == torch.bfloat16
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: False)
    assert resolve_dtype("auto", "cuda").dtype == torch.float16


def test_cli_dtype_beats_the_recipe(tmp_path):
    import argparse

    from draftsmith.cli.shared import recipe_from

    (tmp_path / "r.yaml").write_text("name: x\ndtype: bfloat16\ndrafter: {kind: medusa}\n")
    args = argparse.Namespace(recipe=str(tmp_path / "r.yaml"), overrides=[], dtype=None)
    assert recipe_from(args).dtype == "bfloat16"
    args.dtype = "float16"
    assert recipe_from(args).dtype == "float16"


# ---------------------------------------------------------------- the real target
@pytest.mark.real
def test_real_target_in_bf16(real_target):
    low = load_target(dtype="bfloat16")
    assert low.dtype == torch.bfloat16 and low.fingerprint == real_target.fingerprint
    ids = low.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colours."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    out = SpeculativeDecoder(low).generate(ids, 16)
    assert len(out.tokens) == 16 or out.stop_reason == "eos"
    assert all(0 <= t < low.vocab_size for t in out.tokens)
