"""The online distillation job: tailer, ledger exactly-once under kills, quarantine, gate, publication."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from draftsmith.publish import PublishStore
from draftsmith.checkpoint import read_manifest
from draftsmith.traffic import SCHEMA, TrafficLog, TrafficRecord, make_record
from draftsmith.train.online.ledger import Ledger, Tailer
from draftsmith.train.online.job import OnlineJob
from tests.online_helpers import medusa_checkpoint, online_recipe
from tests.tiny import make_tiny_target

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def target():
    return make_tiny_target(init_std=0.3)


def _record(target, i: int, n: int = 24, steps=True, fingerprint=None) -> dict:
    """A synthetic served record: a cyclic response (learnable), with one rejection every 3 tokens."""
    prompt = [1, 5 + i % 7, 6, 7, 2, 1, 8]
    resp = [10 + (i + j) % 11 for j in range(n)]
    st = [[0, 1, 2, 1], [1, 2, 2, 2]] * (n // 3) if steps else None
    if st is not None:
        st += [[0, 1, 2, 1]] * (n - sum(s[3] for s in st))
    return make_record(request={"messages": [{"role": "user", "content": f"q{i}"}]}, prompt_ids=prompt,
                       response_ids=resp, response_text="", finish_reason="length", target_name=target.name,
                       fingerprint=fingerprint or target.fingerprint, drafter_version=None, drafter_kind=None,
                       steps=st, request_id=f"r{i}", started=0.0, finished=0.0)


def _served(target, i: int, n: int = 24) -> dict:
    """A record as the server logs it: the target's own greedy response (what the gate decodes)."""
    from draftsmith.engine.decoder import plain_decoder
    prompt = [1, 5 + i % 13, 6 + i % 5, 7, 2, 1, 8]
    resp = plain_decoder(target).generate(prompt, n).tokens
    rec = _record(target, i, n=len(resp))
    rec.update(prompt_ids=prompt, response_ids=resp)
    return rec


def _write(logdir: Path, lines: list, name="requests-1-000001.jsonl", mode="a"):
    logdir.mkdir(parents=True, exist_ok=True)
    with open(logdir / name, mode) as f:
        for x in lines:
            f.write((json.dumps(x) if isinstance(x, dict) else x) + "\n")


def test_rejected_positions_convention():
    # prompt of 3; steps: 1 accepted then rejected (emits 2), all 2 accepted (bonus, no rejection), plain step
    r = TrafficRecord([1, 2, 3], [10, 11, 12, 13, 14, 15], [[1, 2, 2, 2], [2, 2, 2, 3], [0, 0, 0, 1]], None, "x")
    # step 1 starts at response index 0: tokens 0 accepted, token 1 is the target's own -> position 3 + 1
    assert r.rejected_positions() == [4]
    r2 = TrafficRecord([1], [5, 6], [[0, 1, 1, 1], [0, 1, 1, 1]], None, "y")
    assert r2.rejected_positions() == [1, 2]


def test_tailer_rotation_and_torn_line(tmp_path):
    d = tmp_path / "logs"
    _write(d, ['{"a":1}', '{"a":2}'])
    with open(d / "requests-1-000001.jsonl", "a") as f:
        f.write('{"a":3')  # partly written last line
    t = Tailer(d, {})
    got = t.poll()
    assert [x[1] for x in got] == [b'{"a":1}', b'{"a":2}']
    with open(d / "requests-1-000001.jsonl", "a") as f:
        f.write('}\n')
    _write(d, ['{"b":1}'], name="requests-2-000002.jsonl")  # rotation: a new file
    got = t.poll()
    assert [x[1] for x in got] == [b'{"a":3}', b'{"b":1}']
    assert got[0][0] == "requests-1-000001.jsonl:16"
    assert t.poll() == []
    # a torn line in a file that is no longer the newest and stale is handed over as torn
    with open(d / "requests-1-000001.jsonl", "a") as f:
        f.write('{"never finished"')
    old = time.time() - 3600
    os.utime(d / "requests-1-000001.jsonl", (old, old))
    t.torn_grace_s = 60
    got = t.poll()
    assert got == [("requests-1-000001.jsonl:24", b'{"never finished"', True)]


def test_traffic_log_rotates(tmp_path):
    log = TrafficLog(tmp_path, max_bytes=300)
    for i in range(5):
        log.write({"schema": SCHEMA, "i": i, "pad": "x" * 100})
    files = sorted(tmp_path.glob("*.jsonl"))
    assert len(files) >= 2
    lines = [json.loads(x) for f in files for x in f.read_text().splitlines()]
    assert [x["i"] for x in lines] == list(range(5))


def test_job_quarantine_counts_and_no_crash(target, tmp_path):
    r = online_recipe(tmp_path, every_records=100)
    logs = tmp_path / "logs"
    good = [_record(target, i) for i in range(10)]
    bad = ["not json at all", json.dumps({"schema": "other"}), json.dumps(_record(target, 99, fingerprint="sha256:x")),
           json.dumps(_record(target, 98, n=500)), json.dumps({**_record(target, 97), "prompt_ids": [1, "a"]}),
           json.dumps({**_record(target, 96), "steps": [[0, 1, 1, 7]]})]
    _write(logs, good[:5] + bad + good[5:])
    job = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    res = job.run(once=True)
    c = job.ledger.counts()
    assert c["quarantined"] == {"malformed": 3, "other_target": 1, "oversized": 1, "bad_steps": 1}
    assert c["applied"] + c["held_back"] == 10
    assert c["records_applied_in_model"] == c["applied"]
    q = [json.loads(x) for x in (tmp_path / "state" / "quarantine.jsonl").read_text().splitlines()]
    assert sorted(x["reason"] for x in q) == sorted(["malformed"] * 3 + ["other_target", "oversized", "bad_steps"])
    assert res[0]["train"]["emphasis_chunks"] > 0  # OSD emphasis from the logged rejections
    # a second pass over the same logs applies nothing again
    job2 = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    assert job2.run(once=True) == []
    assert job2.ledger.counts() == c


def test_gate_publishes_and_rollback(target, tmp_path):
    pub = tmp_path / "pub"
    store = PublishStore(pub)
    r = online_recipe(tmp_path, every_records=8, margin=0.0, lr=3e-2, max_steps=30, keep=2)
    logs = tmp_path / "logs"
    _write(logs, [_served(target, i) for i in range(16)])
    job = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=pub)
    res = job.run(once=True)
    gates = [x["gate"] for x in res if "gate" in x]
    assert gates and all(g["window"] > 0 for g in gates)
    first = gates[0]
    assert first["current_version"] is None and first["passed"] and first["published"]  # vs plain decoding
    assert store.current() == [g for g in gates if g["published"]][-1]["published"]
    # the gate refuses a candidate that is worse than current by more than the margin
    bad = medusa_checkpoint(target, tmp_path / "bad", seed=5)
    from draftsmith.train.online.job import evaluate
    w = job.ledger.holdout_window(4)
    cur = evaluate(target, store.current_path(), w, 8)
    worse = evaluate(target, bad, w, 8)
    assert worse["acceptance"] < cur["acceptance"]
    # rollback switches back to the previous kept version, and refuses when none is left
    vs = store.versions()
    if len(vs) >= 2:
        before = store.current()
        assert store.rollback() < before
    with pytest.raises(ValueError):
        PublishStore(tmp_path / "empty").rollback()


def test_publish_keep_and_reader_never_sees_partial(target, tmp_path):
    store = PublishStore(tmp_path / "pub")
    cks = [medusa_checkpoint(target, tmp_path / f"c{i}", seed=i) for i in range(4)]
    for c in cks:
        store.publish(c, keep=2)
    assert store.versions() == ["v000003", "v000004"]
    assert store.current() == "v000004"
    # a reader loop in another process loads `current` while versions are published and pruned
    script = (
        "import sys, json, time\n"
        "from draftsmith.publish import PublishStore, load_current\n"
        "from safetensors.torch import load_file\n"
        "s = PublishStore(sys.argv[1]); n = bad = 0; t0 = time.time()\n"
        "def load(p):\n"
        "    m = json.loads((p / 'manifest.json').read_text()); w = load_file(str(p / 'model.safetensors'))\n"
        "    json.loads((p / 'config.json').read_text()); return m['kind']\n"
        "while time.time() - t0 < 4:\n"
        "    try:\n"
        "        v, k = load_current(s, load); n += v is not None\n"
        "    except Exception as e:\n"
        "        bad += 1; print(repr(e))\n"
        "print(json.dumps({'loads': n, 'bad': bad}))\n")
    p = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "pub")], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    t0 = time.time()
    while time.time() - t0 < 3.5:
        store.publish(cks[int(time.time() * 10) % 4], keep=2)
    out = p.communicate(timeout=60)[0]
    res = json.loads(out.strip().splitlines()[-1])
    assert res["bad"] == 0 and res["loads"] > 0, out


KILL_SCRIPT = r"""
import sys, json
sys.path.insert(0, sys.argv[4])
from draftsmith.train.online.job import OnlineJob
from tests.online_helpers import online_recipe
from tests.tiny import make_tiny_target
from pathlib import Path
tmp = Path(sys.argv[1])
r = online_recipe(tmp, every_records=int(sys.argv[3]), max_steps=1, holdout_window=2, eval_max_new_tokens=4)
job = OnlineJob(r, make_tiny_target(init_std=0.3), sys.argv[2], state_dir=tmp / "state", publish_dir=tmp / "pub")
_crash = job._crash
def announce(point):  # tell the parent where the job is, so its kill lands inside an update
    print("AT", point, flush=True)
    _crash(point)
job._crash = announce
job.run(once=True)
print("DONE", json.dumps(job.ledger.counts()))
"""


def test_exactly_once_under_kill9(target, tmp_path):
    """Kill -9 the job at random moments, restart until it finishes: every record applied exactly once."""
    import random
    logs = tmp_path / "logs"
    n = 36
    _write(logs, [_record(target, i, n=12) for i in range(n // 2)], name="requests-1-000001.jsonl")
    _write(logs, [_record(target, i, n=12) for i in range(n // 2, n)] + ["garbage"], name="requests-2-000002.jsonl")
    rnd = random.Random(0)
    kills = 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    points = ["after_cache", "after_train", "before_commit", "after_commit"]  # reached by every update
    for attempt in range(12):
        errf = open(tmp_path / f"stderr{attempt}.txt", "w+")  # a file, not a pipe: stdout is read line by line
        p = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(tmp_path), str(logs), "6", str(REPO)],
                             stdout=subprocess.PIPE, stderr=errf, text=True, env=env)
        if attempt < 3:
            # kill -9 once the job reaches a randomly chosen point of an update, plus a random delay
            # (so the kill lands anywhere from that point on, not only at the named point itself)
            want = rnd.choice(points)
            for line in p.stdout:
                if line.startswith("AT " + want):
                    time.sleep(rnd.uniform(0.0, 0.3))
                    break
            if p.poll() is None:
                p.kill()
                kills += 1
            p.communicate()
            errf.close()
            continue
        out, _ = p.communicate(timeout=300)
        errf.seek(0)
        err = errf.read()
        errf.close()
        assert p.returncode == 0, err[-3000:]
        if "DONE" in out:
            break
    assert kills >= 1, kills
    led = Ledger(tmp_path / "state")
    c = led.counts()
    assert c["applied"] + c["held_back"] == n
    assert c["quarantined"] == {"malformed": 1}
    srcs = [r[0] for r in led.db.execute("SELECT src FROM records")]
    assert len(srcs) == len(set(srcs)) == n
    # the committed model says how many records it was trained on: exactly the ledger's count
    model = tmp_path / "state" / "models" / led.meta("model")
    assert read_manifest(model)["metrics"]["records_applied"] == c["applied"]
    assert sum(u["n_new"] for u in led.updates()) == c["applied"]


@pytest.mark.parametrize("point", ["after_cache", "after_train", "before_commit", "after_commit", "before_publish"])
def test_crash_points_then_resume_apply_each_record_once(target, tmp_path, point):
    """A crash at each named point of an update, then a fresh job: same counts as an uninterrupted run."""
    from draftsmith.train.online.job import Crash
    r = online_recipe(tmp_path, every_records=6, max_steps=1, holdout_window=2, eval_max_new_tokens=4, margin=1.0)
    PublishStore(tmp_path / "pub").publish(medusa_checkpoint(target, tmp_path / "init", seed=2))  # margin 1: passes
    logs = tmp_path / "logs"
    _write(logs, [_record(target, i, n=12) for i in range(14)] + ["{bad"])
    job = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub", crash_at=point)
    with pytest.raises(Crash):
        job.run(once=True)
    job.ledger.close()
    job2 = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    job2.run(once=True)
    c = job2.ledger.counts()
    assert c["applied"] + c["held_back"] == 14 and c["quarantined"] == {"malformed": 1}
    assert c["records_applied_in_model"] == c["applied"]
    assert [ln for ln in (tmp_path / "state" / "quarantine.jsonl").read_text().splitlines()].__len__() == 1
    if point in ("after_commit", "before_publish"):  # the committed update's gate ran after the restart
        gates = [json.loads(u["gate"]) for u in job2.ledger.updates() if u["n_new"]]
        assert gates and all(not g.get("publishing") for g in gates) and any(g["passed"] for g in gates)
        published = [u["version"] for u in job2.ledger.updates() if u["version"]]
        assert PublishStore(tmp_path / "pub").current() == published[-1]


def test_import_openai_logs(target, tmp_path):
    from draftsmith.traffic import import_openai_logs
    src = tmp_path / "openai.jsonl"
    good = {"request": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
            "response": {"id": "c1", "choices": [{"message": {"role": "assistant", "content": "hello you"},
                                                  "finish_reason": "stop"}]}}
    src.write_text("\n".join([json.dumps(good), "nope", json.dumps({"request": {}, "response": {}}),
                              json.dumps({**good, "response": {"choices": [{"message": {"content": "x" * 900}}]}})])
                   + "\n")
    counts = import_openai_logs(src, tmp_path / "logs", target, max_tokens=400)
    assert counts["imported"] == 1 and counts["skipped"] == {"malformed": 2, "oversized": 1}
    line = Path(counts["file"]).read_text().splitlines()[0]
    rec = json.loads(line)
    assert rec["steps"] is None and rec["response_ids"][-1] == target.tokenizer.eos_token_id
    assert target.tokenizer.decode(rec["response_ids"], skip_special_tokens=True) == "hello you"
    r = online_recipe(tmp_path, every_records=4, holdout_every=1000)
    job = OnlineJob(r, target, tmp_path / "logs", state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    res = job.run(once=True)
    assert job.ledger.counts()["applied"] == 1 and res[0]["train"]["emphasis_chunks"] == 0  # no acceptance data


def test_gate_never_reuses_a_published_name(target, tmp_path):
    """The init drafter published by hand as v000001 must not be mistaken for update 1's candidate."""
    pub = PublishStore(tmp_path / "pub")
    pub.publish(medusa_checkpoint(target, tmp_path / "init", seed=3))
    r = online_recipe(tmp_path, every_records=8, margin=1.0)  # margin 1: every candidate passes
    logs = tmp_path / "logs"
    _write(logs, [_record(target, i) for i in range(8)])
    res = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub").run(once=True)
    assert res[0]["gate"]["published"] == "v000002" and pub.current() == "v000002"
    assert read_manifest(pub.path("v000002"))["metrics"]["update_id"] == 1


def test_long_running_job_updates_after_t_seconds(target, tmp_path):
    r = online_recipe(tmp_path, every_records=1000, every_seconds=0.2, holdout_every=1000)
    logs = tmp_path / "logs"
    _write(logs, [_record(target, i) for i in range(3)])
    job = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    res = job.run(max_seconds=1.0)
    assert len(res) == 1 and res[0]["new"] == 3  # below every_records: applied because T passed


def test_cli_rollback_and_status(target, tmp_path, capsys):
    from draftsmith.cli import main
    store = PublishStore(tmp_path / "pub")
    for i in range(2):
        store.publish(medusa_checkpoint(target, tmp_path / f"c{i}", seed=i))
    assert main(["online", "rollback", "--publish", str(tmp_path / "pub")]) == 0
    assert store.current() == "v000001"
    assert main(["online", "rollback", "--publish", str(tmp_path / "pub")]) == 2  # nothing older: clear error
    assert "nothing to roll back to" in capsys.readouterr().err
    Ledger(tmp_path / "state")
    assert main(["online", "status", "--state", str(tmp_path / "state"), "--publish", str(tmp_path / "pub")]) == 0
    assert '"current": "v000001"' in capsys.readouterr().out


def test_emphasis_windows_are_capped_per_chunk():
    from draftsmith.train.online.update import cap_emphasis
    w = [(i % 3, i, i + 10) for i in range(100)]
    assert cap_emphasis(w, 200, 1.0, 0) == w and cap_emphasis(w, 5, None, 0) == w
    got = cap_emphasis(w, 20, 1.0, 0)
    assert len(got) == 20 and set(got) <= set(w) and got == sorted(got, key=w.index)
    assert cap_emphasis(w, 20, 1.0, 0) == got and cap_emphasis(w, 20, 1.0, 1) != got  # seeded
    assert len(cap_emphasis(w, 20, 0.5, 0)) == 10 and cap_emphasis(w, 20, 0.0, 0) == []


def test_anchor_conversations_join_every_update(target, tmp_path):
    conv = {"system": None, "messages": [{"role": "user", "content": "hi there"},
                                         {"role": "assistant", "content": "hello to you, friend"}], "finished": [True]}
    anchors = tmp_path / "anchors.jsonl"
    anchors.write_text("\n".join([json.dumps({**conv, "id": f"a{i}"}) for i in range(6)] + ["{broken"]) + "\n")
    r = online_recipe(tmp_path, every_records=100, anchor_data=str(anchors), anchor_ratio=1.0)
    logs = tmp_path / "logs"
    _write(logs, [_record(target, i) for i in range(8)])
    job = OnlineJob(r, target, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    got, skipped = job.anchor_sample(7, uid=3)  # every line: the corrupt one is counted, not trained on
    assert len(got) == 6 and skipped == {"corrupt_rows": 1}
    assert all(sum(s["mask"]) > 0 and len(s["ids"]) == len(s["mask"]) for s in got)
    assert job.anchor_sample(3, uid=3)[0] == job.anchor_sample(3, uid=3)[0]  # seeded per update
    res = job.run(once=True)
    t = res[0]["train"]
    assert 0 < t["anchors"] <= res[0]["new"]
    assert t["anchors"] + sum(t["anchor_rows_skipped"].values()) == min(res[0]["new"], 7)
    missing = online_recipe(tmp_path, anchor_data=str(tmp_path / "nope.jsonl"))
    with pytest.raises(FileNotFoundError, match="online.anchor_data .*nope.jsonl: no such file"):
        OnlineJob(missing, target, logs, state_dir=tmp_path / "state2", publish_dir=tmp_path / "pub2")


def test_the_online_job_updates_an_eagle3_drafter(tmp_path):
    """EAGLE-3 through the online job: the update caches the three layers' states, trains over the draft
    vocabulary it chose (the teacher restricted to it), and the gate decodes the candidate (greedy equality is
    the decoder's, checked in tests/test_eagle3.py)."""
    from draftsmith.recipe import parse_recipe

    t = make_tiny_target(init_std=0.3, layers=4)
    r = online_recipe(tmp_path, every_records=8, margin=0.0, lr=3e-2, max_steps=20)
    r = parse_recipe({**r.model_dump(mode="json"),
                      "drafter": {"kind": "eagle3", "aux_layers": [1, 2, 3], "vocab_keep": 40, "ttt_steps": 3}})
    logs = tmp_path / "logs"
    _write(logs, [_served(t, i) for i in range(16)])
    job = OnlineJob(r, t, logs, state_dir=tmp_path / "state", publish_dir=tmp_path / "pub")
    res = job.run(once=True)
    ups = [x for x in res if "train" in x]
    assert ups and all(u["train"]["steps"] > 0 for u in ups)
    assert ups[0]["train"]["loss_last"] < ups[0]["train"]["loss_first"]
    gates = [x["gate"] for x in res if "gate" in x]
    assert gates and all(g["window"] > 0 and "acceptance" in g["candidate"] for g in gates)
    if any(g["published"] for g in gates):
        assert read_manifest(PublishStore(tmp_path / "pub").current_path())["kind"] == "eagle3"
