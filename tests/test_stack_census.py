"""benchmarks/stack_census.py: the counts on in-memory sources and on a tiny git repository."""

import json
import subprocess

import pytest

from benchmarks import stack_census as sc

SETUP = 'FOLDERS = {"pkg": "core", "pkg.engine": "engine", "pkg.heads": "heads", "pkg.tests": "tests"}\n'

ENGINE = '''import torch


class SlotCache:
    pass


class PrefixKV:
    class InnerCache:
        pass


class CacheLike:  # not a cache: the name does not end in Cache or KV
    pass


class SpeculativeDecoder:
    def sample_once(self):
        def sample_nested():  # nested in a function: not counted
            pass

    def categorical(self, probs):
        return getattr(probs, "shape")


def inverse_cdf(p, u):
    if hasattr(p, "shape") and hasattr(p, "dtype"):
        return getattr(p, name)
    return 0


def generate_batch(rows):
    step = torch.compile(rows)
    other.compile(rows)
    return step


def step():

    return torch.compile(
        step)
'''


def test_source_counts():
    fc = sc.census_source(ENGINE)
    assert sorted(fc.caches) == ["InnerCache", "PrefixKV", "SlotCache"]
    assert fc.samplers == ["SpeculativeDecoder.sample_once", "SpeculativeDecoder.categorical", "inverse_cdf"]
    assert sorted(fc.loops) == ["SpeculativeDecoder", "generate_batch"]
    assert fc.compiles == [33, 40]
    assert fc.probes == {"getattr": 2, "hasattr": 2}
    assert fc.probe_names == {"shape": 2, "dtype": 1}
    assert fc.non_literal == 1


def test_two_getattr_one_compile():
    fc = sc.census_source("import torch\nx = getattr(a, 'b')\ny = getattr(a, 'c', None)\nz = torch.compile(f)\n")
    assert sum(fc.probes.values()) == 2 and len(fc.probe_names) == 2
    assert fc.compiles == [4]
    assert not fc.caches and not fc.samplers and not fc.loops


def test_hand_built_config_dicts_in_kinds_only():
    src = ("class A:\n    def __init__(self, c):\n        self.config = {'a': 1}\n"
           "class B:\n    def __init__(self, c):\n        self.config = dict(c)\n"
           "class C:\n    def __init__(self, c):\n        self.config = c\n        other.config = {}\n")
    assert sc.census_source(src).config_dicts == [3, 6]
    r = sc.census({"setup.py": SETUP, "heads/h.py": src, "engine/e.py": src})
    assert r["config_dicts"] == ["heads/h.py:3", "heads/h.py:6"]


def test_attention_layers_written_out_anywhere():
    src = ("import torch\nfrom torch import nn\n"
           "class A(nn.Module):\n    def __init__(self):\n        self.q = nn.Linear(4, 4)\n"
           "class B:\n    def __init__(self):\n        self.q_proj = torch.nn.Linear(4, 4, bias=False)\n"
           "class C:\n    def __init__(self, q):\n        self.q = q\n        self.k = nn.Linear(4, 4)\n"
           "        other.q = nn.Linear(4, 4)\n")
    assert sc.census_source(src).attention == [5, 8]
    r = sc.census({"setup.py": SETUP, "heads/h.py": src, "engine/e.py": src})
    assert r["attention_layers"] == ["engine/e.py:5", "engine/e.py:8", "heads/h.py:5", "heads/h.py:8"]


def test_syntax_error_raises():
    with pytest.raises(SyntaxError):
        sc.census_source("def broken(:\n")


def test_nonblank_lines():
    assert sc.nonblank_lines("a = 1\n\n   \n\tb = 2\n") == 2


def test_package_folders_excludes_tests():
    assert sc.package_folders(SETUP) == ["core", "engine", "heads"]
    with pytest.raises(ValueError):
        sc.package_folders("X = 1\n")


def test_census_folders_kinds_and_skipped():
    files = {
        "setup.py": SETUP,
        "core/__init__.py": "x = getattr(a, 'z')\n\n",
        "engine/__init__.py": "",
        "engine/dec.py": ENGINE,
        "engine/bad.py": "def broken(:\n    pass\n",
        "heads/h.py": "y = getattr(a, 'only_in_a_kind')\nclass HeadCache: pass\n",
        "tests/test_x.py": "class TestCache: pass\nz = getattr(a, 'q')\n",
        "other/o.py": "class OtherCache: pass\n",
        "engine/notes.txt": "getattr(a, 'txt')\n",
    }
    r = sc.census(files)
    assert list(r["folders"]) == ["core", "engine", "heads"]
    assert r["folders"]["core"] == {"lines": 1, "modules": 1}
    assert r["folders"]["engine"]["modules"] == 3  # the unparsable file is still a module
    assert r["folders"]["engine"]["lines"] == sc.nonblank_lines(ENGINE) + 2
    assert r["totals"] == {"modules": 5, "lines": 1 + sc.nonblank_lines(ENGINE) + 2 + 2}
    assert sorted(c["name"] for c in r["kv_caches"]) == ["HeadCache", "InnerCache", "PrefixKV", "SlotCache"]
    assert r["compiled_steps"] == ["engine/dec.py:33", "engine/dec.py:40"]
    assert [s["name"] for s in r["samplers"]] == ["SpeculativeDecoder.sample_once", "SpeculativeDecoder.categorical",
                                                   "inverse_cdf"]
    # probes: heads/ (a kind) and tests/ (not a package folder) are left out
    assert r["probes"]["total"] == 5
    assert r["probes"]["per_folder"] == {"core": 1, "engine": 4}
    assert r["probes"]["distinct_names"] == 3 and r["probes"]["non_literal"] == 1
    assert [s["file"] for s in r["skipped"]] == ["engine/bad.py"]
    assert r["skipped"][0]["error"].startswith("SyntaxError")


def _git(repo, *args):
    subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True)


def test_revisions_and_worktree(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "engine").mkdir(parents=True)
    (repo / "setup.py").write_text(SETUP)
    (repo / "engine" / "a.py").write_text("class ACache: pass\nclass BKV: pass\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    (repo / "engine" / "a.py").write_text("class ACache: pass\n")  # after: one cache
    (repo / "engine" / "new.py").write_text("import torch\nf = torch.compile(g)\n")  # untracked, not ignored
    (repo / ".gitignore").write_text("build/\n")
    (repo / "engine" / "build").mkdir()
    (repo / "engine" / "build" / "ignored.py").write_text("class IgnoredCache: pass\n")
    out = tmp_path / "census.json"
    results = sc.main(["--repo", str(repo), "--rev", "HEAD", "--rev", sc.WORKTREE, "--out", str(out)])
    before, after = results
    assert [c["name"] for c in before["kv_caches"]] == ["ACache", "BKV"]
    assert before["compiled_steps"] == [] and before["totals"]["modules"] == 1
    assert [c["name"] for c in after["kv_caches"]] == ["ACache"]
    assert after["compiled_steps"] == ["engine/new.py:2"] and after["totals"]["modules"] == 2
    assert before["sha"] and after["sha"] is None
    printed = capsys.readouterr().out
    assert "| **KV caches** | 2 | 1 |" in printed
    assert "| **torch.compile calls** | 0 | 1 |" in printed
    doc = json.loads(out.read_text())
    assert [r["rev"] for r in doc["revisions"]] == ["HEAD", sc.WORKTREE]
    assert "torch.compile" in doc["definitions"]
