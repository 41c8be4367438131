"""Self-distillation through an OpenAI-compatible server on loopback: same rows, identity checked."""

import json

import pytest

from draftsmith.train.data import generate
from draftsmith.train.data.remote import ServerError, regenerate_remote
from draftsmith.train.data.sources import Conversation
from tests.openai_stub import serve
from tests.tiny import make_tiny_target


@pytest.fixture(scope="module")
def tgt():
    return make_tiny_target(init_std=0.5, seed=3)


def _convs(n):
    return [Conversation(id=f"c{i}", source="t", user_turns=[f"question number {i} please", "and then?"])
            for i in range(n)]


KW = dict(max_new_tokens=10, max_turns=2, max_seq_len=256)


def test_server_rows_equal_local_rows(tgt, tmp_path):
    url, stop, seen = serve(tgt)
    try:
        st = regenerate_remote(tgt, _convs(6), tmp_path / "r.jsonl", url=url, model="tiny", concurrency=4, **KW)
    finally:
        stop()
    generate.regenerate(tgt, _convs(6), tmp_path / "l.jsonl", batch_size=3, engine="batched", **KW)
    rows = lambda p: {json.loads(x)["id"]: json.loads(x) for x in p.read_text().splitlines()}  # noqa: E731
    assert rows(tmp_path / "r.jsonl") == rows(tmp_path / "l.jsonl")
    assert st["conversations"] == 6 and st["identity_check_probe"] == 1
    assert seen["chat"] >= 6 + 3  # every turn plus the identity probes went over HTTP


def test_server_of_another_target_is_refused_before_any_row(tgt, tmp_path):
    url, stop, _ = serve(make_tiny_target(init_std=0.5, seed=8))
    try:
        with pytest.raises(ServerError, match="is not the target"):
            regenerate_remote(tgt, _convs(2), tmp_path / "x.jsonl", url=url, model="tiny", **KW)
        with pytest.raises(ServerError, match="does not serve model 'other'"):
            regenerate_remote(tgt, _convs(2), tmp_path / "x.jsonl", url=url, model="other", check="models", **KW)
    finally:
        stop()
    assert not (tmp_path / "x.jsonl").exists() or (tmp_path / "x.jsonl").read_text() == ""


def test_unreachable_server_and_missing_key_are_clear_errors(tgt, tmp_path):
    with pytest.raises(ServerError, match="127.0.0.1:9"):
        regenerate_remote(tgt, _convs(1), tmp_path / "x.jsonl", url="http://127.0.0.1:9", model="tiny",
                          timeout_s=2, **KW)
    with pytest.raises(ServerError, match="DRAFTSMITH_NO_SUCH_KEY"):
        regenerate_remote(tgt, _convs(1), tmp_path / "x.jsonl", url="http://127.0.0.1:9", model="tiny",
                          api_key_env="DRAFTSMITH_NO_SUCH_KEY", **KW)


def test_data_stage_through_a_server_from_the_recipe(tmp_path, capsys):
    import yaml

    from draftsmith.cli import main

    make_tiny_target(save_to=tmp_path / "tiny")
    url, stop, seen = serve(make_tiny_target(), model_name="smol")  # the same weights as tmp_path/tiny
    src = tmp_path / "p.jsonl"
    src.write_text("".join(json.dumps({"prompt": f"topic {i}"}) + "\n" for i in range(5)))
    r = {"name": "srv", "target": str(tmp_path / "tiny"), "output_dir": str(tmp_path / "run"),
         "data": {"sources": [{"type": "jsonl", "path": str(src)}], "max_new_tokens": 6, "heldout_mtbench": False,
                  "server": {"url": url, "model": "smol", "concurrency": 2}},
         "drafter": {"kind": "medusa", "num_heads": 2}, "train": {"tracker": "none"}}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(r))
    try:
        assert main(["data", str(tmp_path / "r.yaml")]) == 0
    finally:
        stop()
    assert len((tmp_path / "run" / "data" / "train.jsonl").read_text().splitlines()) == 5
    assert seen["chat"] >= 5
