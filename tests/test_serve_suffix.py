"""``draftsmith serve --suffix``: SuffixDecoding inside the server. One global index per service learns from every
logged response as it finishes (one request at a time and batched), drafts the next requests (greedy outputs stay
plain decoding's), survives restarts (saved state, else rebuilt from the request logs with the counts), is kept
across drafter re-publishes (the hybrid), and reports its size and memory on ``GET /health``."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient

from draftsmith.cli.eval import build_parser as eval_parser
from draftsmith.cli.serve import build_parser as serve_parser
from draftsmith.cli.serve import publish_hint, suffix_summary
from draftsmith.cli.shared import suffix_config
from draftsmith.drafters.suffix import SuffixConfig, SuffixIndex
from draftsmith.publish import PublishStore
from draftsmith.serve.app import create_app
from tests.online_helpers import medusa_checkpoint
from tests import test_serve
from tests.test_serve import MSGS, _log_records, _plain, _queued_then_started

target, service = test_serve.target, test_serve.service  # the server tests' fixtures: tiny target, closed services

N = 40
CFG = SuffixConfig(min_score=2.0)  # serve --suffix's default gate


def _ask(client, msgs, n=N) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": msgs, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_second_identical_request_drafts_from_the_first_response(target, tmp_path, service):
    ids, text = _plain(target, MSGS[0], N)
    assert len(ids) >= 20  # a response long enough to draft from
    svc = service(target, log_dir=tmp_path / "logs", suffix=CFG)
    client = TestClient(create_app(svc))
    first, second = _ask(client, MSGS[0]), _ask(client, MSGS[0])
    for r in (first, second):  # greedy: exactly plain decoding
        assert r["choices"][0]["message"]["content"] == text and r["usage"]["completion_tokens"] == len(ids)
    assert second["draftsmith"]["accepted"] > first["draftsmith"]["accepted"]
    assert second["draftsmith"]["target_forwards"] < first["draftsmith"]["target_forwards"]
    assert len(svc.suffix.index) == 2
    assert [r.response_ids for r in _log_records(target, tmp_path / "logs")] == [ids, ids]
    assert all(json.loads(x)["drafter"]["kind"] == "suffix"
               for f in (tmp_path / "logs").glob("*.jsonl") for x in f.read_bytes().splitlines())
    # the control: without a global index the second request drafts no better than the first
    alone = service(target, suffix=SuffixConfig(min_score=2.0, max_cached_requests=0))
    c2 = TestClient(create_app(alone))
    a, b = _ask(c2, MSGS[0]), _ask(c2, MSGS[0])
    assert a["draftsmith"] == b["draftsmith"] and b["draftsmith"]["target_forwards"] == \
        first["draftsmith"]["target_forwards"]


def test_health_reports_the_index_and_it_grows(target, tmp_path, service):
    svc = service(target, log_dir=tmp_path / "logs", suffix=CFG)
    client = TestClient(create_app(svc))
    before = client.get("/health").json()["suffix"]
    assert before["responses"] == 0 and before["indexed_tokens"] == 0 and before["start"]["source"] == "logs"
    r = _ask(client, MSGS[1])
    after = client.get("/health").json()["suffix"]
    assert after["responses"] == 1 and after["indexed_tokens"] == r["usage"]["completion_tokens"] > 0
    assert after["bytes"] > before["bytes"] and after["max_cached_requests"] == CFG.max_cached_requests
    assert after["state_dir"] == str(tmp_path / "logs" / "suffix-index")
    plain = service(target)
    assert TestClient(create_app(plain)).get("/health").json()["suffix"] is None
    summary = suffix_summary(svc.suffix_report())
    assert "rebuilt from the request logs" in summary and "1 responses" in summary


def test_restart_loads_the_saved_index_else_rebuilds_from_the_logs(target, tmp_path, service, caplog):
    logs, state = tmp_path / "logs", tmp_path / "state"

    def start():
        return service(target, log_dir=logs, suffix=CFG, suffix_state=state, suffix_save_every=2)

    svc = start()
    client = TestClient(create_app(svc))
    assert SuffixIndex.load(state).added == 0  # the first start: rebuilt from no logs, saved at once
    _ask(client, MSGS[0], 24)
    assert SuffixIndex.load(state).added == 0
    _ask(client, MSGS[1], 24)
    assert SuffixIndex.load(state).added == 2 and svc.suffix_saves == 2  # saved every 2 responses
    _ask(client, MSGS[2], 24)
    svc.close()  # a clean shutdown saves the third
    size = svc.suffix.index.memory_report()
    ctx = svc.suffix.index.index.toks[-6:-2].tolist()

    again = start()
    assert again.suffix_start["source"] == "state" and again.suffix.index.memory_report() == size
    assert again.suffix.index.speculate(ctx) == svc.suffix.index.speculate(ctx)

    def rebuilt(expect_used=3, expect_skipped=0):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="draftsmith.serve"):
            s = start()
        st = s.suffix_start
        assert st["source"] == "logs" and st["used"] == expect_used and st["skipped"] == expect_skipped, st
        assert s.suffix.index.memory_report()["indexed_tokens"] == size["indexed_tokens"]
        assert f"{expect_used} records used, {expect_skipped} skipped" in caplog.text
        return s

    (state / "suffix_index.json").write_text('{"format": "draftsmith.suffix-ind')  # torn
    assert "unusable" in rebuilt().suffix_start["reason"]
    assert SuffixIndex.load(state, fingerprint=target.fingerprint).added == 3  # the rebuilt index is saved at once
    data = (state / "suffix_index.bin").read_bytes()
    (state / "suffix_index.bin").write_bytes(data[:4] + bytes([data[4] ^ 1]) + data[5:])  # a flipped bit
    assert "CRC-32" in rebuilt().suffix_start["reason"]
    svc.suffix.index.save(state, "another target")
    assert "saved for target" in rebuilt().suffix_start["reason"]
    for f in state.iterdir():
        f.unlink()
    assert rebuilt().suffix_start["reason"] == "no saved state"
    for f in state.iterdir():
        f.unlink()
    with open(sorted(logs.glob("*.jsonl"))[0], "a") as f:  # a corrupt line is counted, not fatal
        f.write("{not json\n")
    s = rebuilt(3, 1)
    assert s.suffix_start["skipped_by_reason"] == {"malformed": 1}
    assert "skipped {'malformed': 1}" in suffix_summary(s.suffix_report())
    # and the rebuilt index drafts as the one it replaces
    assert s.suffix.index.speculate(ctx) == svc.suffix.index.speculate(ctx)


def test_batched_requests_feed_the_index(target, tmp_path, service):
    svc = service(target, log_dir=tmp_path / "logs", suffix=CFG, max_batch=4, start=False)
    client = TestClient(create_app(svc))
    results = _queued_then_started(svc, client, [{"messages": m, "max_tokens": N, "temperature": 0} for m in MSGS])
    assert svc.batch_sizes == [3] and svc.unbatched == 0  # SuffixDecoding alone is batched
    for i, msgs in enumerate(MSGS):
        assert results[i][0] == 200 and results[i][1]["choices"][0]["message"]["content"] == _plain(target, msgs, N)[1]
    assert len(svc.suffix.index) == 3 and svc.suffix.index.added == 3
    first = results[0][1]["draftsmith"]
    again = _ask(client, MSGS[0])  # a batch of its own, drafted from the batched response
    assert again["choices"][0]["message"]["content"] == _plain(target, MSGS[0], N)[1]
    assert again["draftsmith"]["accepted"] > first["accepted"]
    assert again["draftsmith"]["target_forwards"] < first["target_forwards"]
    assert svc.batch_sizes == [3, 1] and len(svc.suffix.index) == 4


@pytest.mark.parametrize("max_batch", [1, 4])
def test_republish_keeps_the_index_hybrid(target, tmp_path, service, caplog, max_batch):
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    with caplog.at_level(logging.WARNING, logger="draftsmith.serve"):
        svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", suffix=CFG,
                      max_batch=max_batch)
    client = TestClient(create_app(svc))
    index = svc.suffix.index
    assert svc.version == "v000001" and svc.decoder.drafter.suffix is svc.suffix  # the hybrid
    if max_batch > 1:  # the hybrid is single-sequence: a lone request decodes with it, said at load
        assert svc.lone_single and svc.batched.drafter is svc.suffix
        assert "hybrid" in caplog.text and "batched with SuffixDecoding alone" in caplog.text
    ids, text = _plain(target, MSGS[0], N)
    first = _ask(client, MSGS[0])
    assert first["choices"][0]["message"]["content"] == text and len(index) == 1
    store.publish(medusa_checkpoint(target, tmp_path / "c2", seed=2))
    second = _ask(client, MSGS[0])
    assert second["draftsmith"]["drafter_version"] == "v000002" and svc.swaps == 2
    assert second["choices"][0]["message"]["content"] == text
    assert svc.suffix.index is index and len(index) == 2  # the re-publish kept the index
    assert svc.decoder.drafter.suffix is svc.suffix
    assert svc.decoder.drafter.steps["suffix"] > 0  # the new version's hybrid drafted from the earlier response
    kinds = [json.loads(x)["drafter"]["kind"] for f in (tmp_path / "logs").glob("*.jsonl")
             for x in f.read_bytes().splitlines()]
    assert kinds == ["medusa+suffix"] * 2
    assert svc.unbatched == (2 if max_batch > 1 else 0)


def test_cli_options_are_eval_suffix_options():
    a = serve_parser().parse_args(["--suffix", "--suffix-min-score", "1.5", "--suffix-depth", "16",
                                   "--suffix-max-requests", "7", "--suffix-state", "/x", "--suffix-save-every", "3"])
    cfg = suffix_config(a)
    assert (cfg.min_score, cfg.max_depth, cfg.max_spec_tokens, cfg.max_cached_requests) == (1.5, 16, 16, 7)
    assert a.suffix and a.suffix_state == "/x" and a.suffix_save_every == 3
    assert suffix_config(serve_parser().parse_args([])) == suffix_config(eval_parser().parse_args(["none",
                                                                                                 "--out", "o"]))
    assert suffix_config(serve_parser().parse_args([])).min_score == 2.0
    assert "SuffixDecoding alone" in publish_hint(None, "chain", suffix=True)


def test_a_drafter_that_cannot_be_a_hybrid_member_is_served_alone_and_the_index_learns(target, tmp_path, service,
                                                                                        caplog):
    store = PublishStore(tmp_path / "pub")
    store.publish(test_serve.kangaroo_checkpoint(target, tmp_path / "k1"))  # replaces the verification forward
    with caplog.at_level(logging.WARNING, logger="draftsmith.serve"):
        svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", suffix=CFG)
    assert "cannot draft beside SuffixDecoding" in caplog.text and svc.version == "v000001"
    r = _ask(TestClient(create_app(svc)), MSGS[0], 16)
    assert r["choices"][0]["message"]["content"] == _plain(target, MSGS[0], 16)[1]
    assert len(svc.suffix.index) == 1 and svc.kind == "kangaroo"


def test_with_the_hybrid_requests_that_come_together_are_batched_with_suffix_decoding(target, tmp_path, service):
    """A drafter published beside SuffixDecoding: requests queued together decode in one batched call with
    SuffixDecoding alone (logged as kind ``suffix``), not one at a time; each equals plain greedy decoding; a
    request alone afterwards decodes with the hybrid."""
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", suffix=CFG, max_batch=4,
                  start=False)
    client = TestClient(create_app(svc))
    results = _queued_then_started(svc, client, [{"messages": m, "max_tokens": N, "temperature": 0} for m in MSGS])
    for i, msgs in enumerate(MSGS):
        assert results[i][0] == 200 and results[i][1]["choices"][0]["message"]["content"] == _plain(target, msgs, N)[1]
    assert svc.batch_sizes == [len(MSGS)] and svc.unbatched == 0
    alone = _ask(client, MSGS[0])
    assert alone["choices"][0]["message"]["content"] == _plain(target, MSGS[0], N)[1] and svc.unbatched == 1
    kinds = [json.loads(x)["drafter"]["kind"] for f in sorted((tmp_path / "logs").glob("*.jsonl"))
             for x in f.read_bytes().splitlines()]
    assert sorted(kinds) == ["medusa+suffix"] + ["suffix"] * len(MSGS)
