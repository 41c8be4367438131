"""Drafters with their own tokenizer: the vocabulary bridge on a hand-made case, TLI exact
losslessness by enumeration, TLI and SLEM greedy equality with plain decoding (with a drafter trained end to
end on the tiny target's own text, so drafts are accepted), the HF export, and bad input."""

import json

import pytest
import torch
from tokenizers import Tokenizer, decoders, models

from draftsmith.checkpoint import CheckpointError, load_checkpoint
from draftsmith.drafters.own_tokenizer.model import (OwnTokenizerDrafter, VocabBridge, VocabularyError,
                                               train_bpe_tokenizer)
from draftsmith.drafters.own_tokenizer.decode import SLEMDrafter, TLIDrafter, slem_drafter, tli_drafter
from draftsmith.engine.decoder import SpeculativeDecoder, plain_decoder
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.sampling import SamplingParams
from draftsmith.eval.exact import exact_distribution, target_distribution, total_variation
from draftsmith.recipe import RecipeError, parse_recipe
from draftsmith.target import TargetMismatchError
from draftsmith.train.training.trainer import train_on_text
from tests.test_decoder import tiny
from tests.tiny import make_tiny_model

SPECIALS = ["<|im_start|>", "<|im_end|>"]


def hand_tokenizer() -> Tokenizer:
    """Drafter vocabulary {a, b, ab, d} + the chat markers: 'ab' and 'd' are the drafter's only,
    the target's 'c' (and <pad>) are the target's only."""
    tk = Tokenizer(models.BPE({"a": 0, "b": 1, "ab": 2, "d": 3}, [("a", "b")]))
    tk.add_special_tokens(SPECIALS)  # ids 4, 5
    tk.decoder = decoders.Fuse()
    return tk


def hand_drafter(tgt, seed=7, std=0.5) -> TLIDrafter:
    tk = hand_tokenizer()
    m = make_tiny_model(vocab_size=tk.get_vocab_size(), seed=seed, init_std=std, layers=1)
    m.to(next(tgt.model.parameters()).dtype)
    return TLIDrafter(m, VocabBridge(tgt.tokenizer, tk, tgt.vocab_size), tgt.fingerprint, "hand TLI")


# ---------------------------------------------------------------------- the bridge
def test_intersection_by_token_string_on_a_hand_made_case():
    tgt = tiny(vocab=6)  # <pad>, <|im_start|>, <|im_end|>, a, b, c
    b = VocabBridge(tgt.tokenizer, hand_tokenizer(), tgt.vocab_size)
    assert b.t2d == {1: 4, 2: 5, 3: 0, 4: 1}  # markers, a, b; not <pad> or c (target only), ab or d (drafter only)
    assert b.size == 4 and b.drafter_vocab_size == 6
    assert b.drafter_ids([1, 3, 4, 3, 5, 2]) == [4, 2, 0, 5]  # "<|im_start|>abac<|im_end|>": ab merges, c unknown
    dl = torch.tensor([[0.1, 0.2, 5.0, 3.0, -1.0, 0.7]], dtype=torch.float64)  # drafter ids 0..5
    tl = b.to_target_logits(dl)
    assert tl.shape == (1, 6) and torch.isinf(tl[0, [0, 5]]).all()  # <pad>, c: outside the intersection
    q = torch.softmax(tl, -1)[0]
    keep = torch.softmax(dl[0, [4, 5, 0, 1]], -1)  # the drafter's distribution over the shared strings, renormalised
    assert torch.allclose(q[[1, 2, 3, 4]], keep) and q[[0, 5]].sum() == 0


def test_tokenizer_sharing_nothing_is_refused():
    tgt = tiny(vocab=6)
    tk = Tokenizer(models.BPE({"x": 0, "y": 1}, []))
    with pytest.raises(VocabularyError, match="shares no token"):
        VocabBridge(tgt.tokenizer, tk, tgt.vocab_size)


def test_trained_tokenizer_has_every_byte_and_the_specials():
    tk = train_bpe_tokenizer(["hello world " * 20, "the cat sat"], 300, SPECIALS)
    assert tk.get_vocab_size() <= 300 and all(tk.token_to_id(s) is not None for s in SPECIALS)
    text = "<|im_start|>héllo ✓<|im_end|>"
    assert tk.decode(tk.encode(text).ids, skip_special_tokens=False) == text
    with pytest.raises(ValueError, match="too small"):
        train_bpe_tokenizer(["x"], 100, SPECIALS)


# ---------------------------------------------------------------------- TLI exact losslessness
PROMPT = [1, 3, 4, 3]
N_NEW = 3


@pytest.fixture(scope="module")
def tgt64():
    return tiny(vocab=6, seed=0, std=0.5, layers=2, dtype=torch.float64)


@pytest.mark.parametrize("sampling", [SamplingParams(0.8), SamplingParams(1.0, top_k=3, top_p=0.9)],
                         ids=["T0.8", "topk-topp"])
def test_tli_is_exact_by_enumeration(tgt64, sampling):
    ref = target_distribution(tgt64, PROMPT, N_NEW, sampling.temperature, sampling.top_k, sampling.top_p)
    dec = SpeculativeDecoder(tgt64, hand_drafter(tgt64), sampling=sampling, policy=FixedLength(2))
    got = exact_distribution(dec, PROMPT, N_NEW)
    assert abs(sum(got.values()) - 1.0) < 1e-12
    assert total_variation(got, ref) < 1e-9
    # the check has teeth: the drafts were real (drafted and sometimes accepted, sometimes not)
    steps = [s for seed in range(20) for s in dec.generate(PROMPT, N_NEW, seed=seed).steps]
    assert sum(s.drafted for s in steps) > 0 and 0 < sum(s.accepted for s in steps) < sum(s.drafted for s in steps)


def test_tli_greedy_equals_plain_hand_made(tgt64):
    want = plain_decoder(tgt64).generate(PROMPT, 12).tokens
    for k in (1, 3):
        got = SpeculativeDecoder(tgt64, hand_drafter(tgt64), policy=FixedLength(k)).generate(PROMPT, 12)
        assert got.tokens == want


# ---------------------------------------------------------------------- a drafter trained end to end
def _prompt(tgt, q):
    text = tgt.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=False)
    return tgt.tokenizer.encode(text, add_special_tokens=False)


def _recipe(out):
    return parse_recipe({"name": "own-test", "output_dir": str(out), "drafter": {
        "kind": "own-tokenizer", "init": "scratch", "tokenizer_vocab_size": 320, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2},
        "train": {"max_steps": 150, "batch_size": 8, "chunk_len": 32, "lr": 3e-3, "warmup_steps": 5,
                  "log_every": 1000}})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny target's own greedy replies as data, a tokenizer and drafter trained on them (seconds)."""
    tgt = tiny(vocab=96, seed=3, std=0.3, layers=2)
    out = tmp_path_factory.mktemp("own")
    tok = tgt.tokenizer
    rows = []
    for i, q in enumerate(["hello there", "what is up", "tell me more", "abc"]):
        msgs = [{"role": "user", "content": q}]
        ids = _prompt(tgt, q)
        res = plain_decoder(tgt).generate(ids, 48)
        reply = tok.decode(res.tokens, skip_special_tokens=True)
        for j in range(6):
            rows.append({"id": f"c{i}-{j}", "source": "test", "system": None,
                         "messages": msgs + [{"role": "assistant", "content": reply}],
                         "finished": [res.stop_reason == "eos"]})
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recipe = _recipe(out)
    final, timing = train_on_text(recipe, tgt, out)
    return tgt, final, timing


@pytest.mark.parametrize("q", ["hello there", "what is up"])
def test_trained_tli_and_slem_greedy_equal_plain(trained, q):
    tgt, final, timing = trained
    assert timing["train_loss_last10"] < 1.0  # it learnt the replies
    module, manifest = load_checkpoint(final, tgt)
    prompt = _prompt(tgt, q)
    want = plain_decoder(tgt).generate(prompt, 40).tokens
    for dr in (tli_drafter(module, tgt), slem_drafter(module, tgt), drafter_from_checkpoint(final, tgt)):
        res = SpeculativeDecoder(tgt, dr, policy=FixedLength(4)).generate(prompt, 40)
        assert res.tokens == want, dr.name
        assert sum(s.accepted for s in res.steps) > 10, dr.name  # drafts are accepted, not just proposed


def test_trained_tli_sampling_runs_and_slem_refuses_sampling(trained):
    tgt, final, _ = trained
    module, _ = load_checkpoint(final, tgt)
    prompt = _prompt(tgt, "abc")
    res = SpeculativeDecoder(tgt, tli_drafter(module, tgt), sampling=SamplingParams(0.7)).generate(prompt, 20, seed=1)
    assert len(res.tokens) > 0
    with pytest.raises(ValueError, match="greedy"):
        SpeculativeDecoder(tgt, slem_drafter(module, tgt), sampling=SamplingParams(0.7)).generate(prompt, 5)


def test_checkpoint_holds_the_tokenizer_and_the_target(trained, tmp_path):
    tgt, final, _ = trained
    assert (final / "tokenizer.json").is_file() and (final / "model.safetensors").is_file()
    manifest = json.loads((final / "manifest.json").read_text())
    assert manifest["kind"] == "own-tokenizer" and manifest["target"]["fingerprint"] == tgt.fingerprint
    assert manifest["metrics"]["intersection"] > 0


def _copy(final, tmp_path):
    import shutil
    d = tmp_path / "ck"
    shutil.copytree(final, d)
    return d


def test_bad_checkpoints(trained, tmp_path):
    tgt, final, _ = trained
    d = _copy(final, tmp_path)
    (d / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="tokenizer.json: missing"):
        load_checkpoint(d, tgt)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not a valid tokenizers JSON"):
        load_checkpoint(d, tgt)
    (d / "tokenizer.json").write_text(train_bpe_tokenizer(["other text entirely"], 300, SPECIALS).to_str())
    with pytest.raises(CheckpointError, match="not the tokenizer this drafter was trained with"):
        load_checkpoint(d, tgt)
    with pytest.raises(TargetMismatchError):
        load_checkpoint(final, tiny(vocab=96, seed=9, std=0.3, layers=2))


def test_pipeline_skips_the_cache_and_reports_in_own_tokens(trained):
    from draftsmith.pipeline import stages as pipeline
    tgt, final, _ = trained
    recipe = _recipe(final.parent)
    assert pipeline.stage_cache(recipe, tgt) == {}  # no target states for a kind that trains on text
    rows = (recipe.out / "data" / "train.jsonl").read_text().splitlines()
    (recipe.out / "data" / "heldout.jsonl").write_text("\n".join(rows[::6]) + "\n{corrupt\n")
    rep = pipeline.stage_report(recipe, tgt, final)
    assert rep["heldout_conversations"] == 4 and rep["heldout_top1"] > 0.5
    assert 0.5 < rep["target_answer_tokens_shared"] <= 1.0  # single characters: mostly shared (not ' ', '\n')
    assert "heldout_top1" in (recipe.out / "report.md").read_text()


@pytest.mark.parametrize("sampling", [SamplingParams(0.0), SamplingParams(0.9)], ids=["greedy", "T0.9"])
def test_init_from_target_with_the_same_vocabulary_accepts_every_draft(sampling):
    """A drafter tokenizer with exactly the target's strings and every layer copied from the target IS the
    target: TLI must then accept every draft (any misaligned context or position would show)."""
    from draftsmith.drafters.own_tokenizer.model import init_from_target
    tgt = tiny(vocab=40, seed=4, std=0.3, layers=2)
    tok = Tokenizer.from_str(tgt.tokenizer.backend_tokenizer.to_str())
    d = OwnTokenizerDrafter({"init": "target", "num_hidden_layers": 2}, tok, tgt)
    info = init_from_target(d, tgt)
    assert info["embedding_rows_shared"] == 40 and info["layers_from_target"] == 2
    dr = tli_drafter(d.eval(), tgt)
    res = SpeculativeDecoder(tgt, dr, policy=FixedLength(3), sampling=sampling).generate([1, 5, 6, 7], 30, seed=0)
    assert sum(s.drafted for s in res.steps) > 20
    assert all(s.accepted == s.drafted for s in res.steps)
    with pytest.raises(ValueError, match="layers"):
        init_from_target(OwnTokenizerDrafter({"init": "target", "num_hidden_layers": 3}, tok, tgt), tgt)


def test_recipe_validation():
    with pytest.raises(RecipeError, match="come from the target"):
        parse_recipe({"name": "x", "drafter": {"kind": "own-tokenizer", "hidden_size": 64}})
    with pytest.raises(RecipeError, match="tokenizer_vocab_size"):
        parse_recipe({"name": "x", "drafter": {"kind": "own-tokenizer", "tokenizer_vocab_size": 10}})
    with pytest.raises(RecipeError, match="unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "own-tokenizer", "vocab_keep": 10}})
    with pytest.raises(ValueError, match="needs its tokenizer"):
        OwnTokenizerDrafter.from_config({}, tiny(vocab=6))


def test_hf_export_with_universal_assisted_generation(trained, tmp_path):
    """The exported directory is a plain HF model + tokenizer; HF's universal assisted generation with it gives
    the target's own greedy output."""
    from draftsmith.drafters.own_tokenizer.model import hf_assistant
    tgt, final, _ = trained
    from draftsmith.export import export
    export(final, "hf", tmp_path / "hf", tgt)  # draftsmith export CKPT --to hf: reloaded and checked before returning
    assert (tmp_path / "hf" / "tokenizer.json").is_file()
    model, tok = hf_assistant(tmp_path / "hf")
    assert tok.get_vocab() != tgt.tokenizer.get_vocab() and model.config.vocab_size == len(tok.get_vocab())
    prompt = _prompt(tgt, "hello there")
    want = plain_decoder(tgt).generate(prompt, 24).tokens
    out = tgt.model.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, assistant_model=model,
                             tokenizer=tgt.tokenizer, assistant_tokenizer=tok, pad_token_id=0,
                             eos_token_id=list(tgt.eos_token_ids))
    got = out[0, len(prompt):].tolist()
    assert got[:len(want)] == want


# ---------------------------------------------------------------------- the real target's tokenizer
@pytest.mark.real
def test_real_target_bridge_slem_retokenisation_and_tli_greedy(real_target):
    """A byte-level BPE trained on a little text shares strings with SmolLM2's vocabulary (chat markers
    included); SLEM's re-tokenisation proposes nothing when the draft would merge into a committed token;
    an untrained TLI drafter leaves greedy decoding unchanged."""
    from types import SimpleNamespace
    tgt = real_target
    text = "The capital of France is Paris. Hello world, how are you today? " * 30
    tok = train_bpe_tokenizer([text], 400, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    b = VocabBridge(tgt.tokenizer, tok, tgt.vocab_size)
    for s in ("<|im_end|>", "Ġthe", "a"):
        if tok.token_to_id(s) is not None:
            assert b.t2d[tgt.tokenizer.convert_tokens_to_ids(s)] == tok.token_to_id(s)
    m = make_tiny_model(vocab_size=tok.get_vocab_size(), seed=1, init_std=0.5, layers=1, max_positions=2048)
    slem = SLEMDrafter(m, b, tgt.fingerprint)
    ids = tgt.tokenizer.encode("Hello wor", add_special_tokens=False)
    st = SimpleNamespace(tokens=ids, length=len(ids) - 1)
    assert slem._retokenise(st, "ld is") == []  # " wor" + "ld" is the single target token " world"
    ids = tgt.tokenizer.encode("Hello world", add_special_tokens=False)
    st = SimpleNamespace(tokens=ids, length=len(ids) - 1)
    assert slem._retokenise(st, ", how are") == tgt.tokenizer.encode(", how are", add_special_tokens=False)
    prompt = tgt.tokenizer.encode(tgt.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False)
    want = plain_decoder(tgt).generate(prompt, 16).tokens
    for dr in (TLIDrafter(m, b, tgt.fingerprint), slem):
        assert SpeculativeDecoder(tgt, dr, policy=FixedLength(3)).generate(prompt, 16).tokens == want
