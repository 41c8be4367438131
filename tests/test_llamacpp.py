"""llama.cpp: bad builds and mismatched files are refused with messages that name the problem (always run); and,
where a llama.cpp build exists (scripts/llamacpp_env.sh), a tiny random target with the default target's
tokenizer exported to GGUF, served by llama-server, decodes greedily what our decoder decodes, and EAGLE-3 and
standalone drafters exported to GGUF load in llama.cpp, draft, and leave its greedy tokens unchanged."""

import json

import pytest
import torch

from draftsmith.export import llamacpp as lc
from draftsmith.export import llamacpp_server as srv
from draftsmith.export.llamacpp import LlamaCppError, check_pair

WHY = lc.have_llamacpp() or lc.converter_problem()  # every test that needs the build converts a tiny target
needs_build = pytest.mark.skipif(WHY is not None, reason=f"no usable llama.cpp build: {(WHY or '-').splitlines()[0]}")


def test_the_converter_without_sentencepiece_is_refused_by_name(monkeypatch, tmp_path):
    """A build whose Python lacks sentencepiece (the converter imports it): a clear error that says how to get it,
    before llama.cpp's own traceback."""
    real = lc.importlib.util.find_spec
    monkeypatch.setattr(lc.importlib.util, "find_spec", lambda name, *a: None if name == "sentencepiece"
                        else real(name, *a))
    assert "sentencepiece" in lc.converter_problem()
    with pytest.raises(LlamaCppError, match="needs sentencepiece in this Python"):
        lc.convert_hf(None, tmp_path, tmp_path / "x.gguf", "f32")


def info(arch="llama", tokens="a" * 64, n_tokens=100, kv=None, path="x.gguf"):
    return {"path": path, "architecture": arch, "kv": kv or {}, "n_tokens": n_tokens, "tokens_sha256": tokens}


def test_a_missing_build_says_how_to_build_it(tmp_path):
    with pytest.raises(LlamaCppError, match="scripts/llamacpp_env.sh"):
        lc.find_llamacpp(tmp_path / "nowhere")


def test_a_build_for_another_cpu_is_refused(tmp_path):
    here = lc.cpu_stamp()
    (tmp_path / "BUILD.json").write_text(json.dumps({"sdist": "x", "cpu_model": "Other CPU",
                                                     "cpu_isa": here["cpu_isa"] + ["avx512_fake"]}))
    with pytest.raises(LlamaCppError, match="another CPU.*avx512_fake.*LLAMACPP_FORCE=1"):
        lc.find_llamacpp(tmp_path)


NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def test_a_stale_build_missing_a_program_is_refused(tmp_path):
    (tmp_path / "BUILD.json").write_text(json.dumps({"sdist": "x", "cflags": NO_AMX, **lc.cpu_stamp()}))
    with pytest.raises(LlamaCppError, match="llama-server: not built"):
        lc.find_llamacpp(tmp_path)


def test_a_build_with_amx_kernels_is_refused_on_an_amx_cpu(tmp_path, monkeypatch):
    """llama.cpp's AMX kernels die with SIGILL in batched forwards (scripts/llamacpp_env.sh): a build that has
    them is stale on a CPU with AMX, and says how to rebuild; on a CPU without AMX the same stamp is fine."""
    amx = {"cpu_model": "Xeon", "cpu_isa": ["amx_tile", "avx2", "avx512f"]}
    monkeypatch.setattr(lc, "cpu_stamp", lambda: amx)
    (tmp_path / "BUILD.json").write_text(json.dumps({"sdist": "x", "cflags": "", **amx}))
    with pytest.raises(LlamaCppError, match="AMX kernels.*LLAMACPP_FORCE=1"):
        lc.find_llamacpp(tmp_path)
    (tmp_path / "BUILD.json").write_text(json.dumps({"sdist": "x", "cflags": NO_AMX, **amx}))
    with pytest.raises(LlamaCppError, match="llama-server: not built"):  # past the AMX check
        lc.find_llamacpp(tmp_path)
    plain = {"cpu_model": "EPYC", "cpu_isa": ["avx2"]}
    monkeypatch.setattr(lc, "cpu_stamp", lambda: plain)
    (tmp_path / "BUILD.json").write_text(json.dumps({"sdist": "x", "cflags": "", **plain}))
    with pytest.raises(LlamaCppError, match="llama-server: not built"):
        lc.find_llamacpp(tmp_path)


def test_unknown_gguf_type_is_refused():
    with pytest.raises(LlamaCppError, match="unknown GGUF type 'q3_fancy'.*q4_1"):
        lc._check_type("q3_fancy")


@pytest.mark.parametrize("draft,target,match", [
    (info(tokens="b" * 64), info(), "vocabulary: 100 tokens"),
    (info("eagle3", kv={"eagle3.target_hidden_size": 64}), info(kv={"llama.embedding_length": 96}),
     "hidden size: the drafter reads 64-wide target states, the target's are 96"),
    (info("eagle3", kv={"eagle3.extract_layers": [1, 2, 5]}), info(kv={"llama.block_count": 4}),
     r"layer count: the drafter reads target layers \[1, 2, 5\], the target has 4"),
    (info(kv={"draftsmith.target_fingerprint": "sha256:aaa"}), info(kv={"draftsmith.target_fingerprint": "sha256:bbb"}),
     "fingerprint: the drafter was trained for sha256:aaa"),
    (info(kv={"tokenizer.ggml.model": "gpt2"}), info(kv={"tokenizer.ggml.model": "llama"}),
     "vocabulary type: the drafter's file holds a 'gpt2' vocabulary, the target's a 'llama' one"),
])
def test_a_drafter_for_another_target_is_refused_naming_the_mismatch(draft, target, match):
    with pytest.raises(LlamaCppError, match=match):
        check_pair(draft, target)


def test_the_same_ids_spelled_with_the_space_marker_are_one_vocabulary():
    """A drafter file llama.cpp's converter wrote from our converted directory spells SentencePiece's whitespace
    tokens with its space marker; the file the target ships as has spaces. Same ids, same count: it drafts for it.
    Spelled otherwise too, or another count, it does not."""
    d = {**info(tokens="b" * 64), "tokens_spelled_sha256": "s" * 64}
    check_pair(d, {**info(), "tokens_spelled_sha256": "s" * 64})
    with pytest.raises(LlamaCppError, match="vocabulary"):
        check_pair(d, {**info(), "tokens_spelled_sha256": "t" * 64})
    with pytest.raises(LlamaCppError, match="vocabulary"):
        check_pair(d, {**info(n_tokens=99), "tokens_spelled_sha256": "s" * 64})


def test_a_matching_pair_passes_and_the_expected_fingerprint_counts():
    d = info("eagle3", kv={"eagle3.target_hidden_size": 96, "eagle3.extract_layers": [1, 2, 3],
                           "draftsmith.target_fingerprint": "sha256:aaa"})
    t = info(kv={"llama.embedding_length": 96, "llama.block_count": 4})
    check_pair(d, t)
    check_pair(d, t, expected_fingerprint="sha256:aaa")
    with pytest.raises(LlamaCppError, match="fingerprint"):
        check_pair(d, t, expected_fingerprint="sha256:ccc")


def test_export_cli_refuses_the_target_in_a_drafter_format(tmp_path, capsys):
    from draftsmith.cli import main
    with pytest.raises(SystemExit, match="only --to gguf"):
        main(["export", "target", "--to", "hf", "--out", str(tmp_path / "x")])


# ---------------------------------------------------------------- with a build
@pytest.fixture(scope="module")
def tiny_gguf_target(tmp_path_factory):
    """A 4-layer random Llama (hidden 64) with the default target's tokenizer (llama.cpp's converter knows its
    pre-tokenizer), saved as a Hugging Face directory and loaded as a target."""
    from transformers import AutoTokenizer
    from draftsmith.target import default_target_dir, load_target
    from tests.tiny import make_tiny_model
    d = tmp_path_factory.mktemp("tiny-gguf-target")
    tok = AutoTokenizer.from_pretrained(default_target_dir())
    model = make_tiny_model(vocab_size=len(tok), hidden_size=64, layers=4, heads=4, kv_heads=2, init_std=0.4,
                            max_positions=1024)
    model.config.bos_token_id, model.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return load_target(d)


PROMPTS = ["Write a poem about the sea.", "What is 12 times 7?", "List three colors."]


def _prompts(target):
    from draftsmith.eval.mtbench import chat_ids
    return [chat_ids(target.tokenizer, p) for p in PROMPTS]


def _plain_ours(target, prompts, n):
    from draftsmith.engine.decoder import SpeculativeDecoder
    dec = SpeculativeDecoder(target)
    return [list(dec.generate(p, n).tokens) for p in prompts]


def _near_tie_free_equal(target, prompts, a, b, gap=1e-3):
    """Equal, except where they first differ at a top-2 logit gap below ``gap`` (float noise)."""
    from draftsmith.eval.greedy_equality import first_divergence, top2_gap
    for p, x, y in zip(prompts, a, b):
        i = first_divergence(x, y)
        if i is not None:
            g = top2_gap(target, p + x[:i])
            assert g < gap, f"llama.cpp and ours differ at position {i} with a top-2 gap of {g} (not a near-tie)"


@needs_build
def test_target_f32_gguf_decodes_what_we_decode(tiny_gguf_target, tmp_path):
    t = tiny_gguf_target
    rep = lc.export_gguf("target", tmp_path / "t", t, "f32")
    f = tmp_path / "t" / rep["file"]
    meta = lc.gguf_info(f)
    assert meta["kv"]["draftsmith.target_fingerprint"] == t.fingerprint
    assert meta["n_tokens"] == len(t.tokenizer)
    prompts = _prompts(t)
    with srv.LlamaServer(f, threads=2, ctx=512) as s:
        theirs = srv.run_prompts(s, prompts, 24)
    assert theirs["generated"] > 0
    _near_tie_free_equal(t, prompts, theirs["tokens"], _plain_ours(t, prompts, 24))


@needs_build
@pytest.mark.parametrize("kind", ["eagle3", "dflash", "standalone"])
def test_drafter_gguf_loads_drafts_and_keeps_llamacpp_greedy_tokens(tiny_gguf_target, tmp_path, kind):
    from draftsmith.checkpoint import save_checkpoint
    t = tiny_gguf_target
    if kind == "eagle3":
        from tests.test_eagle3 import module
        import tests.test_eagle3 as te
        m = module(t, vocab_keep=4096)
        m.set_draft_vocab(torch.arange(4096) * 12)
        assert te.AUX == [1, 2, 3]
        ck = tmp_path / "ck"
        save_checkpoint(ck, m, t)
        spec = str(ck)
    elif kind == "dflash":  # over the full vocabulary: llama.cpp's DFlash reads no d2t
        from tests.test_dflash import module as dflash_module
        save_checkpoint(tmp_path / "ck", dflash_module(t, block_size=4, mask=16), t)
        spec = str(tmp_path / "ck")
    else:
        spec = "first-layers:2"  # the target's first two layers as a standalone draft model
    rep = lc.export_gguf(spec, tmp_path / "d", t, "q8_0" if kind == "eagle3" else "f32",
                         target_file=lc.target_gguf(t, "f32"))
    assert rep["reload"]["n_drafted"] > 0
    draft = tmp_path / "d" / rep["file"]
    assert lc.gguf_info(draft)["kv"]["draftsmith.target_fingerprint"] == t.fingerprint
    prompts = _prompts(t)
    tf = lc.target_gguf(t, "f32")
    with srv.LlamaServer(tf, threads=2, ctx=512) as s:
        plain = srv.run_prompts(s, prompts, 24)
    with srv.LlamaServer(tf, threads=2, ctx=512, draft=draft, spec_type=rep["spec_type"]) as s:
        spec_run = srv.run_prompts(s, prompts, 24)
    assert spec_run["drafted"] > 0
    assert spec_run["tokens"] == plain["tokens"]


@needs_build
def test_a_drafter_is_refused_against_another_targets_gguf(tiny_gguf_target, tmp_path):
    from draftsmith.target import load_target
    t = tiny_gguf_target
    other = load_target("smollm2-135m-instruct")
    with pytest.raises(LlamaCppError, match="does not draft for"):
        lc.export_gguf("first-layers:1", tmp_path / "d", t, "f32", target_file=lc.target_gguf(other, "q4_1"))
    assert not (tmp_path / "d").exists() and not (tmp_path / "d.tmp").exists()


def test_the_recommendation_is_plain_decoding_unless_a_drafter_beats_it():
    from draftsmith.export.llamacpp_check import recommend

    def run(t, x, equal=80):
        return {"target_file": t, "x_llamacpp_plain": x, "ms_per_step": 30.0, "mean_acceptance_length": 1.2,
                "ms_per_plain_token": 13.0, "equal_to_llamacpp_plain": {"equal": equal, "of": 80}}
    rec = recommend({"runs": {"a on q4": run("q4", 0.6), "b on q4": run("q4", 0.9), "a on f32": run("f32", 1.1),
                              "b on f32": run("f32", 1.4), "c on f32": run("f32", 1.6, equal=40)}})
    assert rec["q4"]["choice"] == "no drafter (plain decoding)" and "b on q4" in rec["q4"]["why"]
    assert rec["f32"]["choice"] == "b on f32" and rec["f32"]["x_llamacpp_plain"] == 1.4
    assert "c on f32 (50%)" in rec["f32"]["why"]


@needs_build
def test_llamacpp_plain_joins_a_bench_report_and_its_plots(tiny_gguf_target, tmp_path):
    import contextlib
    from draftsmith.eval.bench import mark_fastest_plain, ours, run_bench, table
    from draftsmith.export.llamacpp_server import llamacpp_plain_methods
    from draftsmith.eval.mtbench import Prompt
    from draftsmith.eval.report import write_report
    from draftsmith.engine.decoder import SpeculativeDecoder
    from draftsmith.engine.sampling import SamplingParams
    t = tiny_gguf_target
    prompts = [Prompt(i, "writing" if i else "coding", x, ids) for i, (x, ids) in enumerate(zip(PROMPTS, _prompts(t)))]
    why: dict = {}
    with contextlib.ExitStack() as servers:  # interleaved with ours, prompt by prompt
        ll = llamacpp_plain_methods(servers, why, t, ["f32"])
        assert [m.name for m in ll] == ["llama.cpp plain (f32)"] and not why
        figs = run_bench([ours("plain (ours)", SpeculativeDecoder(t)), *ll], prompts, 12)
        server = ll[0].run.__defaults__[0]
        assert server.proc.poll() is None
    assert server.proc.poll() is not None, "the run's servers outlived it"
    mark_fastest_plain(figs)
    assert figs["methods"]["llama.cpp plain (f32)"]["tau"] == 1.0
    assert all(0 < p["llama.cpp plain (f32)"]["tokens"] <= 12 for p in figs["per_prompt"])
    sampled: dict = {}
    assert llamacpp_plain_methods(contextlib.ExitStack(), sampled, t, ["f32"], sampling=SamplingParams(1.0)) == []
    assert "greedy only" in sampled["llamacpp"]
    assert figs["fastest_plain"] in figs["methods"]
    assert any(x["baseline"] == "llama.cpp plain (f32)" for x in figs["methods"]["plain (ours)"]["speedup"])
    assert "llama.cpp plain (f32)" in table(figs)
    write_report(tmp_path, {"greedy": figs}, {"prompts": 3, "max_new_tokens": 12}, "cmd", {})
    assert (tmp_path / "report.json").exists()


def test_a_state_reading_drafter_for_an_architecture_whose_graph_keeps_no_layer_inputs_is_refused(tmp_path):
    """llama.cpp aborts (GGML_ASSERT "layer input tensor is null") when an EAGLE-3 or DFlash drafter drafts for a
    target whose graph does not record its layers' inputs (llama-cpp-python 0.3.36: gemma3, qwen2): refused first,
    naming the architecture; a draft model that reads no states, or an architecture whose source is not there,
    is let through."""
    models = tmp_path / "src" / "src" / "models"
    models.mkdir(parents=True)
    (models / "llama.cpp").write_text("res->t_layer_inp[il] = inpL;")
    (models / "gemma3.cpp").write_text("cur = build_norm(cur);")
    ll = lc.LlamaCpp(home=tmp_path, stamp={"sdist": "test"})
    assert lc.state_reading_archs(ll) == {"llama"}
    lc.check_state_reading(ll, info(), "draft-eagle3")
    with pytest.raises(LlamaCppError, match="cannot run draft-dflash for a gemma3 target.*those that do here: llama"):
        lc.check_state_reading(ll, info("gemma3"), "draft-dflash")
    lc.check_state_reading(ll, info("gemma3"), "draft-simple")
    lc.check_state_reading(ll, info("mamba"), "draft-eagle3")
