"""``draftsmith publish``: a checkpoint is checked against the target before it becomes current; list, rollback;
a checkpoint of another target or a tree it cannot draft is refused and nothing is published."""

from __future__ import annotations

import json

from draftsmith.cli import main
from draftsmith.cli.serve import publish_hint
from draftsmith.publish import PublishStore
from tests.online_helpers import medusa_checkpoint
from tests.tiny import make_tiny_target


def test_publish_checks_then_switches_list_and_rollback(tmp_path, capsys):
    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    c1 = medusa_checkpoint(target, tmp_path / "c1", seed=1)
    c2 = medusa_checkpoint(target, tmp_path / "c2", seed=2)
    pub = tmp_path / "pub"
    assert main(["publish", str(c1), "--to", str(pub), "--tokens", "8"]) == 0
    assert main(["publish", str(c2), "--to", str(pub), "--tree", "[[0],[1],[0,0]]", "--tokens", "8"]) == 0
    out = capsys.readouterr().out
    assert "greedy equal on 2/2 prompts" in out and "published" in out and "v000002" in out
    store = PublishStore(pub)
    assert store.versions() == ["v000001", "v000002"] and store.current() == "v000002"
    hist = store.history()
    assert [h["event"] for h in hist] == ["publish", "publish"]
    assert hist[1]["check"]["equal"] == 2 and hist[1]["tree"] == "[[0],[1],[0,0]]"
    assert (store.path("v000002") / "manifest.json").read_bytes() == (c2 / "manifest.json").read_bytes()
    assert main(["publish", "list", "--to", str(pub)]) == 0
    listing = capsys.readouterr().out
    assert "current v000002" in listing and "* v000002" in listing and "  v000001" in listing
    assert main(["publish", "rollback", "--to", str(pub)]) == 0 and store.current() == "v000001"
    assert main(["publish", "rollback", "v000002", "--to", str(pub)]) == 0 and store.current() == "v000002"
    assert main(["publish", "rollback", "v000009", "--to", str(pub)]) == 2
    assert "not kept" in capsys.readouterr().err


def test_publish_refuses_what_does_not_fit_the_target(tmp_path, capsys):
    target = make_tiny_target(vocab_size=96, seed=0, init_std=0.3, save_to=tmp_path / "target")
    other = make_tiny_target(vocab_size=96, seed=7, init_std=0.3, save_to=tmp_path / "other")
    pub = tmp_path / "pub"
    foreign = medusa_checkpoint(other, tmp_path / "foreign", seed=1)
    # the checkpoint was made for `other`: checked against `target`, its fingerprint does not match
    assert main(["publish", str(foreign), "--to", str(pub), "--target", str(tmp_path / "target")]) == 2
    assert "fingerprint" in capsys.readouterr().err.lower()
    mine = medusa_checkpoint(target, tmp_path / "mine", seed=1)  # 2 heads: a depth-3 tree cannot be drafted
    assert main(["publish", str(mine), "--to", str(pub), "--tree", "[[0],[0,0],[0,0,0]]"]) == 2
    assert "depth" in capsys.readouterr().err
    assert main(["publish", str(tmp_path / "nothing"), "--to", str(pub)]) == 2
    assert "not a drafter checkpoint" in capsys.readouterr().err
    assert PublishStore(pub).current() is None and PublishStore(pub).versions() == []
    manifest = json.loads((mine / "manifest.json").read_text())
    assert manifest["target"]["fingerprint"] == target.fingerprint


def test_serve_says_how_to_publish_when_none_is_current():
    hint = publish_hint("/srv/pub", "built:4")
    assert "draftsmith publish CHECKPOINT --to /srv/pub --tree built:4" in hint
    assert "--publish DIR" in publish_hint(None, "chain")
