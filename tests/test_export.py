"""Exports: every format's names and fields (mirroring each consumer's loader), reload by transformers,
the reverse import, identical decoding from export and checkpoint, wrong kinds, corrupt exports."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import yaml
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from draftsmith.checkpoint import CheckpointError, load_checkpoint, read_manifest, save_checkpoint
from draftsmith.cli import main
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.drafters.standalone.decode import first_layers_drafter
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.export import ExportError, export, import_drafter, load_drafter
from draftsmith.heads.hydra.model import HydraHeads
from draftsmith.heads.medusa.export import write_medusa_dir
from draftsmith.heads.medusa.model import MedusaHeads
from draftsmith.target import TargetMismatchError, load_target
from tests.tiny import make_tiny_target

PROMPT = [1, 5, 6, 7, 8, 9]
DATA = {"data_dir": "/runs/x/data", "generation": {"conversations": 12, "response_tokens": 340},
        "sources": {"jsonl0": 12}, "rows": list(range(100))}


@pytest.fixture()
def target(tmp_path):
    """A tiny target saved as a local HF directory; small vocabulary (random heads do get accepted) and a seed
    whose greedy output runs 30 tokens without EOS."""
    make_tiny_target(vocab_size=16, seed=3, init_std=0.5, layers=3, save_to=tmp_path / "tiny")
    return load_target(tmp_path / "tiny")


def medusa_ckpt(target, path, share=True, layers=1, heads=3, seed=3):
    torch.manual_seed(seed)
    m = MedusaHeads.for_target(target, num_heads=heads, num_layers=layers,
                    share_lm_head=share)
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not name.startswith("lm_head"):
                p.add_(torch.randn_like(p) * 0.3)  # a trained-looking head: non-zero blocks, own projections
    save_checkpoint(path, m, target, recipe={"name": "unit-medusa", "train": {"lr": 1e-3}}, data=DATA)
    return m


def decode(target, drafter, n=30):
    """Greedy tokens and per-step (accepted, drafted): equal drafts give equal steps, not just equal tokens."""
    r = SpeculativeDecoder(target, drafter).generate(PROMPT, n)
    return r.tokens, [(s.accepted, s.drafted) for s in r.steps]


def vllm_config(raw: dict) -> dict:
    """vLLM's MedusaConfig.from_pretrained: every key holding 'num' and 'heads'/'layers' is renamed."""
    c = dict(raw)
    for k in list(c):
        if "num" in k:
            if "heads" in k:
                c["num_heads"] = c.pop(k)
            elif "layers" in k:
                c["num_hidden_layers"] = c.pop(k)
    return c


def vllm_load(out) -> tuple[dict, dict]:
    """vLLM's Medusa loader: its parameters from the config, filled from every *.safetensors, unknown names skipped."""
    raw = json.loads((out / "config.json").read_text())
    assert raw["model_type"] == "medusa"
    assert "hidden_size" in raw and "vocab_size" in raw  # vLLM's defaults (4096 / 32001) would be wrong
    c = vllm_config(raw)
    d, V = c["hidden_size"], c.get("truncated_vocab_size", c["vocab_size"])
    params = {}
    for i in range(c["num_heads"]):
        for j in range(c["num_hidden_layers"]):
            params[f"blocks.{i}.layers.{j}.weight"] = (d, d)
            if c.get("medusa_fc_bias", False):
                params[f"blocks.{i}.layers.{j}.bias"] = (d,)
        params[f"lm_heads.{i}.weight"] = (V, d)
    loaded = {}
    for f in sorted(out.glob("*.safetensors")):
        for name, t in load_file(str(f)).items():
            name = name.replace("medusa_heads.", "")
            if name in params:
                assert tuple(t.shape) == params[name], name
                loaded[name] = t
    assert set(loaded) == set(params)
    return c, loaded


def vllm_logits(c, w, h):
    out = []
    for i in range(c["num_heads"]):
        x = h
        for j in range(c["num_hidden_layers"]):
            x = x + F.silu(F.linear(x, w[f"blocks.{i}.layers.{j}.weight"], w.get(f"blocks.{i}.layers.{j}.bias")))
        out.append(F.linear(x, w[f"lm_heads.{i}.weight"]))
    return torch.stack(out)


@pytest.mark.parametrize("share,layers", [(True, 1), (False, 2)], ids=["shared-head", "own-heads-2-layers"])
def test_vllm_medusa_export_mirrors_vllm_loader(target, tmp_path, share, layers):
    m = medusa_ckpt(target, tmp_path / "ck", share=share, layers=layers)
    out = export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    c, w = vllm_load(out)
    assert (c["num_heads"], c["num_hidden_layers"], c["medusa_fc_bias"]) == (3, layers, True)
    h = torch.randn(4, target.hidden_size)
    torch.testing.assert_close(vllm_logits(c, w, h), m(h), rtol=1e-5, atol=1e-5)
    if share:  # explicit per-head copies of the target's LM head
        for i in range(3):
            assert torch.equal(w[f"lm_heads.{i}.weight"], target.lm_head.weight)


@pytest.mark.parametrize("layers", [1, 2])
def test_tgi_file_mirrors_tgi_loader(target, tmp_path, layers):
    m = medusa_ckpt(target, tmp_path / "ck", layers=layers)
    out = export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target, base_model="org/base")
    cfg = json.loads((out / "config.json").read_text())
    assert "architectures" not in cfg  # TGI would take the directory for another speculator
    assert (cfg["medusa_num_heads"], cfg["medusa_num_layers"],
            cfg["base_model_name_or_path"]) == (3, layers, "org/base")
    w = load_file(str(out / "medusa_lm_head.safetensors"))
    n, d = cfg["medusa_num_layers"], target.hidden_size
    h = torch.randn(4, d)
    v1 = []  # MedusaHeadV1: heads {i}, ResBlocks {i}.{j}.linear (bias required), output {i}.{n}
    for i in range(cfg["medusa_num_heads"]):
        x = h
        for j in range(n):
            assert w[f"{i}.{j}.linear.weight"].shape == (d, d) and w[f"{i}.{j}.linear.bias"].shape == (d,)
            x = x + F.silu(F.linear(x, w[f"{i}.{j}.linear.weight"], w[f"{i}.{j}.linear.bias"]))
        v1.append(F.linear(x, w[f"{i}.{n}.weight"]))
    assert len(w) == 3 * (2 * n + 1)
    torch.testing.assert_close(torch.stack(v1), m(h), rtol=1e-5, atol=1e-5)
    if n == 1:  # MedusaHeadV2: the heads' {i}.0.linear fused, projected by the base model's own LM head
        W = torch.cat([w[f"{i}.0.linear.weight"] for i in range(3)])
        b = torch.cat([w[f"{i}.0.linear.bias"] for i in range(3)])
        x = h.unsqueeze(-2) + F.silu(F.linear(h, W, b)).reshape(4, 3, d)
        torch.testing.assert_close(target.lm_head(x).transpose(0, 1), m(h), rtol=1e-5, atol=1e-5)


def test_provenance_in_config_and_model_card(target, tmp_path):
    medusa_ckpt(target, tmp_path / "ck")
    out = export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["draftsmith_target_fingerprint"] == target.fingerprint and cfg["draftsmith_kind"] == "medusa"
    assert cfg["draftsmith_recipe"]["name"] == "unit-medusa" and cfg["draftsmith_target"] == target.name
    assert cfg["draftsmith_data"]["generation"]["response_tokens"] == 340 and "rows" not in cfg["draftsmith_data"]
    assert vllm_config(cfg)["draftsmith_kind"] == "medusa"  # vLLM's renaming leaves our keys alone
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---")[1])
    assert front["base_model"] == str(target.path)
    assert front["draftsmith"]["target_fingerprint"] == target.fingerprint
    assert "unit-medusa" in card and "medusa_lm_head.safetensors" in card


@pytest.mark.parametrize("share", [True, False])
def test_import_round_trip_decodes_identically(target, tmp_path, share):
    medusa_ckpt(target, tmp_path / "ck", share=share)
    export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    import_drafter(tmp_path / "ex", tmp_path / "back", target)
    man = read_manifest(tmp_path / "back")
    assert man["target"]["fingerprint"] == target.fingerprint and man["imported_from"]["format"] == "vllm-medusa"
    assert man["recipe"]["name"] == "unit-medusa"  # provenance survives the round trip
    keys = load_file(str(tmp_path / "back" / "model.safetensors")).keys()
    assert any(k.startswith("proj") for k in keys) is (not share)  # copies of the shared head are folded back
    ref = decode(target, drafter_from_checkpoint(tmp_path / "ck", target))
    assert sum(a for a, _ in ref[1]) > 0  # drafts do get accepted, so the step lists can tell drafters apart
    assert decode(target, drafter_from_checkpoint(tmp_path / "back", target)) == ref
    assert decode(target, load_drafter(tmp_path / "ex", target)) == ref


def test_import_original_medusa_and_vllm_only_directories(target, tmp_path):
    m = medusa_ckpt(target, tmp_path / "ck")
    export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    h = torch.randn(2, target.hidden_size)
    # original Medusa / TGI: config + medusa_lm_head.safetensors only, no model_type
    orig = tmp_path / "orig"
    orig.mkdir()
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    (orig / "config.json").write_text(json.dumps({k: cfg[k] for k in ("medusa_num_heads", "medusa_num_layers",
                                                                      "base_model_name_or_path")}))
    (orig / "medusa_lm_head.safetensors").write_bytes((tmp_path / "ex" / "medusa_lm_head.safetensors").read_bytes())
    import_drafter(orig, tmp_path / "ck-orig", target)
    assert read_manifest(tmp_path / "ck-orig")["imported_from"]["format"] == "medusa"
    torch.testing.assert_close(load_checkpoint(tmp_path / "ck-orig", target)[0](h), m(h))
    # vLLM written without biases (medusa_fc_bias false): a zero bias
    vl = tmp_path / "vl"
    vl.mkdir()
    w = load_file(str(tmp_path / "ex" / "model.safetensors"))
    save_file({k: v for k, v in w.items() if not k.endswith(".bias")}, str(vl / "model.safetensors"))
    (vl / "config.json").write_text(json.dumps({"model_type": "medusa", "num_heads": 3, "num_hidden_layers": 1,
                                                "hidden_size": target.hidden_size, "vocab_size": target.vocab_size}))
    heads, _ = load_drafter(vl, target).heads, None
    assert all(torch.count_nonzero(b[0].linear.bias) == 0 for b in heads.blocks)
    assert torch.equal(heads.blocks[1][0].linear.weight, m.blocks[1][0].linear.weight)


def test_import_checks_the_target(target, tmp_path):
    medusa_ckpt(target, tmp_path / "ck")
    export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    other = make_tiny_target(vocab_size=16, seed=1, init_std=0.5, layers=3)
    with pytest.raises(TargetMismatchError, match="trained for target fingerprint"):
        import_drafter(tmp_path / "ex", tmp_path / "back", other)
    wider = make_tiny_target(vocab_size=20, seed=0)
    cfg = json.loads((tmp_path / "ex" / "config.json").read_text())
    del cfg["draftsmith_target_fingerprint"]
    (tmp_path / "ex" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="vocab_size is 16, the target"):
        import_drafter(tmp_path / "ex", tmp_path / "back", wider)


def test_hf_export_loads_in_transformers_and_assists(target, tmp_path):
    out = export("first-layers:1", "hf", tmp_path / "hf", target)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "README.md"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pkl")) for n in names)
    drafter = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert drafter.config.num_hidden_layers == 1 and drafter.config.vocab_size == target.vocab_size
    assert drafter.config.draftsmith_target_fingerprint == target.fingerprint
    assert drafter.generation_config.num_assistant_tokens == 4
    assert AutoTokenizer.from_pretrained(out).get_vocab() == target.tokenizer.get_vocab()
    ids = torch.tensor([PROMPT])
    kw = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    plain = target.model.generate(ids, **kw)
    assert torch.equal(target.model.generate(ids, assistant_model=drafter, **kw), plain)
    ref = decode(target, first_layers_drafter(target, 1))
    assert sum(a for a, _ in ref[1]) > 0
    assert decode(target, load_drafter(out, target)) == ref
    assert ref[0][:20] == plain[0, len(PROMPT):].tolist()  # HF and our decoder agree on the target's output


def hydra_ckpt(target, path):
    torch.manual_seed(4)
    m = HydraHeads.for_target(target, num_heads=2, num_layers=2, prefix_layer=True)
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad and p.dim() == 2:
                p.normal_(0, 1.2 / p.shape[1] ** 0.5)
    save_checkpoint(path, m, target, recipe={"name": "unit-hydra"}, data=DATA)
    (path / "trees.json").write_text(json.dumps({"trees": {"3": {"paths": [[0], [1], [0, 0]]}}}))
    return m


def test_kind_a_format_cannot_hold_is_a_clear_error(target, tmp_path):
    hydra_ckpt(target, tmp_path / "hy")
    with pytest.raises(ExportError, match="'hydra' drafter cannot be exported to 'vllm-medusa'.*: draftsmith$"):
        export(tmp_path / "hy", "vllm-medusa", tmp_path / "ex", target)
    with pytest.raises(ExportError, match="formats that can hold 'hydra': draftsmith"):
        export(tmp_path / "hy", "hf", tmp_path / "ex", target)
    with pytest.raises(ExportError, match=r"N must be in \[1, 3\]"):
        export("first-layers:4", "hf", tmp_path / "ex", target)
    with pytest.raises(ExportError, match="formats that can hold 'first-layers': hf"):
        export("first-layers:1", "vllm-medusa", tmp_path / "ex", target)
    medusa_ckpt(target, tmp_path / "ck")
    with pytest.raises(ExportError, match="formats that can hold 'medusa': vllm-medusa, draftsmith"):
        export(tmp_path / "ck", "hf", tmp_path / "ex", target)
    assert not (tmp_path / "ex").exists()


def test_draftsmith_export_of_hydra_pp_decodes_identically(target, tmp_path):
    hydra_ckpt(target, tmp_path / "hy")
    out = export(tmp_path / "hy", "draftsmith", tmp_path / "ex", target)
    assert {p.name for p in out.iterdir()} == {"model.safetensors", "config.json", "manifest.json", "trees.json",
                                               "README.md"}
    man = read_manifest(out)
    assert man["export"]["format"] == "draftsmith" and man["recipe"]["name"] == "unit-hydra"
    assert yaml.safe_load((out / "README.md").read_text().split("---")[1])["base_model"] == str(target.path)
    ref = decode(target, drafter_from_checkpoint(tmp_path / "hy", target))
    assert sum(a for a, _ in ref[1]) > 0
    assert decode(target, load_drafter(out, target)) == ref


def test_cli_export_import_and_errors(target, tmp_path, capsys):
    medusa_ckpt(target, tmp_path / "ck")
    assert main(["export", str(tmp_path / "ck"), "--to", "vllm-medusa", "--out", str(tmp_path / "ex")]) == 0
    assert "loaded back and checked" in capsys.readouterr().out
    assert main(["import", str(tmp_path / "ex"), "--out", str(tmp_path / "back"), "--target", str(target.path)]) == 0
    assert read_manifest(tmp_path / "back")["kind"] == "medusa"
    assert main(["export", str(tmp_path / "ck"), "--to", "draftsmith", "--out", str(tmp_path / "ex")]) == 2
    assert "not an empty directory" in capsys.readouterr().err
    hydra_ckpt(target, tmp_path / "hy")
    assert main(["export", str(tmp_path / "hy"), "--to", "vllm-medusa", "--out", str(tmp_path / "e2")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("draftsmith")]
    assert len(err) == 1 and err[0].endswith("formats that can hold 'hydra': draftsmith")


def test_corrupt_or_partial_medusa_exports_name_the_file(target, tmp_path):
    medusa_ckpt(target, tmp_path / "ck")
    ex = export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    tgi, vl = ex / "medusa_lm_head.safetensors", ex / "model.safetensors"
    vl.unlink()  # partial: only the TGI file left, and it is truncated
    tgi.write_bytes(tgi.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=r"medusa_lm_head.safetensors: truncated: the header describes \d+ bytes"):
        import_drafter(ex, tmp_path / "b1", target)
    tgi.write_bytes(b"")
    with pytest.raises(CheckpointError, match="medusa_lm_head.safetensors: truncated or empty"):
        import_drafter(ex, tmp_path / "b1", target)
    tgi.unlink()
    with pytest.raises(CheckpointError, match="neither model.safetensors .* nor medusa_lm_head.safetensors"):
        import_drafter(ex, tmp_path / "b1", target)
    w = load_file(str(tmp_path / "ck" / "model.safetensors"))
    save_file({"0.0.linear.weight": w["blocks.0.0.linear.weight"]}, str(tgi))
    with pytest.raises(CheckpointError, match="medusa_lm_head.safetensors: no tensor '0.1.weight'"):
        import_drafter(ex, tmp_path / "b1", target)
    save_file({"0.1.weight": torch.zeros(3, 3)}, str(tgi))
    with pytest.raises(CheckpointError, match=r"'0.1.weight' has shape \[3, 3\], expected \[16, 32\]"):
        import_drafter(ex, tmp_path / "b1", target)
    cfg = json.loads((ex / "config.json").read_text())
    (ex / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if "num" not in k}))
    with pytest.raises(CheckpointError, match="config.json: none of"):
        import_drafter(ex, tmp_path / "b1", target)
    (ex / "config.json").write_text("{\"medusa_num_heads\": 3,")
    with pytest.raises(CheckpointError, match="config.json: malformed JSON"):
        import_drafter(ex, tmp_path / "b1", target)
    (ex / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json: missing"):
        load_drafter(ex, target)
    assert not (tmp_path / "b1").exists()


def test_truncated_hf_export_names_the_file(target, tmp_path):
    out = export("first-layers:1", "hf", tmp_path / "hf", target)
    w = out / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: truncated"):
        load_drafter(out, target)


def test_reload_check_catches_a_wrong_export_and_leaves_nothing(target, tmp_path, monkeypatch):
    import draftsmith.export as ex

    def swapped_heads(heads, out, base_model, prov):  # a writer bug: heads 0 and 1 trade their blocks
        files = write_medusa_dir(heads, out, base_model, prov)
        w = load_file(str(out / "model.safetensors"))
        for suffix in ("weight", "bias"):
            a, b = f"blocks.0.layers.0.{suffix}", f"blocks.1.layers.0.{suffix}"
            w[a], w[b] = w[b], w[a]
        save_file(w, str(out / "model.safetensors"))
        return files

    medusa_ckpt(target, tmp_path / "ck")
    monkeypatch.setitem(ex.FORMATS, "vllm-medusa", dataclasses.replace(
        ex.FORMATS["vllm-medusa"], write=lambda src, out, t, base, prov: swapped_heads(src.module, out, base, prov)))
    with pytest.raises(ExportError, match="loads back but computes other logits"):
        export(tmp_path / "ck", "vllm-medusa", tmp_path / "ex", target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "tiny"]  # no export, no half-written .tmp
