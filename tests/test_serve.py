"""`draftsmith serve`: responses equal plain greedy decoding, logs written and parseable, hot swap, bad requests."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from draftsmith.engine.decoder import plain_decoder
from draftsmith.publish import PublishStore
from draftsmith.serve.app import DecodingService, create_app
from draftsmith.traffic import chat_prompt_ids, parse_record
from tests.online_helpers import medusa_checkpoint
from tests.tiny import make_tiny_target

MSGS = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "write code"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]]


@pytest.fixture()
def target():
    return make_tiny_target(init_std=0.3)


def _plain(target, msgs, n):
    ids = chat_prompt_ids(target.tokenizer, msgs)
    out = plain_decoder(target).generate(ids, n).tokens
    return out, target.tokenizer.decode(out, skip_special_tokens=True)


def _stream_text(resp) -> tuple[str, list[dict]]:
    events = [x[6:] for x in resp.text.split("\n\n") if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks), chunks


def test_greedy_responses_equal_plain_decoding_and_are_logged(target, tmp_path):
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = DecodingService(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs")
    client = TestClient(create_app(svc))
    n = 24
    for msgs in MSGS:
        ids, text = _plain(target, msgs, n)
        body = {"model": target.name, "messages": msgs, "max_tokens": n, "temperature": 0}
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == text
        assert r.json()["usage"]["completion_tokens"] == len(ids)
        s = client.post("/v1/chat/completions", json={**body, "stream": True})
        got, chunks = _stream_text(s)
        assert got == text
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    lines = [x for f in sorted((tmp_path / "logs").glob("*.jsonl")) for x in f.read_bytes().splitlines()]
    assert len(lines) == 2 * len(MSGS)
    for line, msgs in zip(lines[::2], MSGS):
        rec = parse_record(line, target.fingerprint, vocab_size=target.vocab_size, max_tokens=10_000)
        ids, _ = _plain(target, msgs, n)
        assert rec.response_ids == ids and rec.drafter_version == "v000001"
        assert rec.prompt_ids == chat_prompt_ids(target.tokenizer, msgs)
        assert sum(s[3] for s in rec.steps) == len(ids)
        assert json.loads(line)["target"]["fingerprint"] == target.fingerprint
    assert client.get("/v1/models").json()["data"][0]["id"] == target.name


def test_hot_swap_between_requests(target, tmp_path):
    store = PublishStore(tmp_path / "pub")
    svc = DecodingService(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs")
    client = TestClient(create_app(svc))
    body = {"messages": MSGS[0], "max_tokens": 12, "temperature": 0}
    seen = []
    for i in range(3):
        r = client.post("/v1/chat/completions", json=body).json()
        seen.append(r["draftsmith"]["drafter_version"])
        store.publish(medusa_checkpoint(target, tmp_path / f"c{i}", seed=i))
    assert seen == [None, "v000001", "v000002"]
    # a broken version does not take the server down: the previous one keeps serving
    bad = store.versions_dir / "v000009"
    bad.mkdir()
    (bad / "manifest.json").write_text("{")
    store._switch("v000009", {"event": "test"})
    for _ in range(2):  # still v000002: v000003 was replaced by the broken one before any request came
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["draftsmith"]["drafter_version"] == "v000002"
    store.rollback("v000003")
    assert client.post("/v1/chat/completions", json=body).json()["draftsmith"]["drafter_version"] == "v000003"


def test_bad_requests_are_400(target, tmp_path):
    client = TestClient(create_app(DecodingService(target, log_dir=tmp_path / "logs")))
    assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": MSGS[0], "max_tokens": 0}).status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": MSGS[0], "n": 2}).status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": MSGS[0], "model": "x"}).status_code == 404
    r = client.post("/v1/chat/completions", json={"messages": MSGS[0], "max_tokens": 5000})
    assert r.status_code == 400 and "context" in r.json()["detail"]
    assert not list((tmp_path / "logs").glob("*.jsonl")) or all(
        f.stat().st_size == 0 for f in (tmp_path / "logs").glob("*.jsonl"))


def test_uvicorn_loopback_concurrent_clients_with_openai(target, tmp_path):
    """The real HTTP stack on 127.0.0.1 with the openai client, 4 concurrent clients, publications meanwhile."""
    openai = pytest.importorskip("openai")
    import uvicorn
    store = PublishStore(tmp_path / "pub")
    svc = DecodingService(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(svc), host="127.0.0.1", port=port, log_level="warning"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    while not server.started:
        time.sleep(0.05)
    try:
        cl = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")
        expected = {i: _plain(target, MSGS[i % 3], 16)[1] for i in range(3)}
        errors, done = [], []

        def worker(k):
            try:
                for j in range(3):
                    i = (k + j) % 3
                    if j % 2:
                        text = "".join(c.choices[0].delta.content or "" for c in cl.chat.completions.create(
                            model=target.name, messages=MSGS[i], max_tokens=16, temperature=0, stream=True))
                    else:
                        text = cl.chat.completions.create(model=target.name, messages=MSGS[i], max_tokens=16,
                                                          temperature=0).choices[0].message.content
                    done.append(text == expected[i])
            except Exception as e:  # noqa: BLE001 (reported below)
                errors.append(repr(e))

        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for i in range(2):
            store.publish(medusa_checkpoint(target, tmp_path / f"c{i}", seed=i))
            time.sleep(0.2)
        for t in ts:
            t.join(120)
        assert not errors, errors
        assert done == [True] * 12
        lines = [x for f in (tmp_path / "logs").glob("*.jsonl") for x in f.read_text().splitlines()]
        assert len(lines) == 12
    finally:
        server.should_exit = True
        th.join(10)
