"""`draftsmith serve` as a user exposes it: API key, bounded queue (429 + Retry-After), body and request limits,
clients that go away (queued or decoding, streaming or not), logs without bodies, and continuous batching
(requests that arrive while a batch runs join it and still equal plain greedy decoding)."""

from __future__ import annotations

import threading
import time

import pytest
from fastapi.testclient import TestClient

from draftsmith.serve.app import create_app
from draftsmith.serve.scheduler import Cancelled, Job, QueueFull, retry_after_s
from draftsmith.traffic import chat_prompt_ids
from tests import test_serve
from tests.test_serve import MSGS, _log_records, _plain, _post_in_thread, _wait_queued

target, service = test_serve.target, test_serve.service  # the same fixtures

BODY = {"messages": MSGS[0], "max_tokens": 8, "temperature": 0}


def test_api_key_is_required_on_every_route_but_health(target, service):
    svc = service(target, max_batch=1)
    client = TestClient(create_app(svc, api_key="s3cret"))
    assert client.get("/health").status_code == 200
    for method, path, kw in [("get", "/v1/models", {}), ("post", "/v1/chat/completions", {"json": BODY}),
                             ("post", "/v1/completions", {"json": {"prompt": "hi", "max_tokens": 2}})]:
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = getattr(client, method)(path, headers=headers, **kw)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers)
    ok = {"Authorization": "Bearer s3cret"}
    assert client.get("/v1/models", headers=ok).status_code == 200
    r = client.post("/v1/chat/completions", json=BODY, headers=ok)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == _plain(target, MSGS[0], 8)[1]


def test_a_body_over_the_limit_is_413_before_it_is_parsed(target, service):
    svc = service(target, max_batch=1)
    client = TestClient(create_app(svc, max_body_bytes=2000))
    big = {"messages": [{"role": "user", "content": "x" * 5000}], "max_tokens": 2}
    r = client.post("/v1/chat/completions", json=big)
    assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
    # no Content-Length (chunked): still cut at the limit
    r = client.post("/v1/chat/completions", content=iter([b'{"messages": [', b" " * 3000, b"]}"]),
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 413
    assert svc.served == 0
    assert client.post("/v1/chat/completions", json=BODY).status_code == 200


def test_prompt_and_max_tokens_limits_are_400_naming_the_field(target, service):
    n = len(chat_prompt_ids(target.tokenizer, MSGS[0]))
    svc = service(target, max_batch=1, max_prompt_tokens=n, max_tokens_limit=16)
    client = TestClient(create_app(svc))
    r = client.post("/v1/chat/completions", json={**BODY, "max_tokens": 17})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens" and "16" in r.json()["error"]["message"]
    long = {"messages": [{"role": "user", "content": "hello there again"}], "max_tokens": 4}
    r = client.post("/v1/chat/completions", json=long)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/completions", json={"prompt": list(range(3, 4 + n)), "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert client.post("/v1/completions", json={"prompt": [3, 4, 5], "max_tokens": 16}).status_code == 200
    with pytest.raises(ValueError, match="max_prompt_tokens"):
        service(target, max_prompt_tokens=0)


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_full_queue_answers_429_with_retry_after(target, service, max_batch):
    svc = service(target, max_batch=max_batch, max_queue=2, start=False)
    client = TestClient(create_app(svc))
    results, threads = {}, []
    hold = svc.lock if max_batch == 1 else threading.Lock()  # batched: the thread is not started yet
    with hold:
        for i in range(2):
            threads.append(_post_in_thread(client, {**BODY, "stream": i == 1}, results, i))
            _wait_queued(svc, i + 1)
        for stream in (False, True):
            r = client.post("/v1/chat/completions", json={**BODY, "stream": stream})
            assert r.status_code == 429, r.text
            assert r.json()["error"]["code"] == "queue_full" and 1 <= int(r.headers["Retry-After"]) <= 120
        assert svc.refused == 2
    svc.start()
    for th in threads:
        th.join(120)
    assert sorted(results) == [0, 1] and all(code == 200 for code, _ in results.values())
    assert client.get("/health").json()["refused"] == 2


def test_the_bound_counts_the_running_loops_free_rows(target, service):
    """While the batching loop runs, the requests it will take into free rows before its next step do not count
    against ``max_queue``: a burst that reaches an idle server is refused past ``max_batch + max_queue``, not past
    ``max_queue``. With no loop running, nothing takes them."""
    svc = service(target, max_batch=4, max_queue=2, start=False)
    sch = svc.scheduler
    assert sch._bound() == 2
    svc.start()
    for _ in range(2000):
        if sch._looping:
            break
        time.sleep(0.005)
    assert sch._bound() == 2 + 4  # idle: every row free
    sch._current = [object(), None, object()]  # a call with two live rows (one finished)
    assert sch._bound() == 2 + 2
    sch._current = []
    svc.close()
    assert not sch._looping and sch._bound() == 2


def test_retry_after_grows_with_the_queue():
    assert retry_after_s(0, 4, 2.0) == 2 and retry_after_s(40, 4, 2.0) == 20 and retry_after_s(10**6, 4, 9) == 120
    assert retry_after_s(3, 8, 0.01) == 1


@pytest.mark.parametrize("max_batch", [1, 4])
def test_a_request_whose_client_left_stops_and_is_not_logged(target, tmp_path, service, max_batch):
    """Cancelled while queued (dropped before decoding) and while decoding (stopped at the next step): neither
    is logged, both are counted; the service goes on serving."""
    svc = service(target, max_batch=max_batch, log_dir=tmp_path / "logs", start=False)
    spec = svc.spec(*_parsed(BODY))
    queued = threading.Event()
    gen = svc.run(spec, "queued", queued)
    queued.set()
    svc.start()
    with pytest.raises(Cancelled):
        next(gen)
    decoding = threading.Event()
    long = svc.spec(*_parsed({**BODY, "max_tokens": 200}))
    gen = svc.run(long, "decoding", decoding)
    next(gen)  # one step decoded
    decoding.set()
    with pytest.raises(Cancelled):
        for _ in range(400):
            next(gen)
    assert svc.aborted == 2 and svc.served == 0 and not _log_records(target, tmp_path / "logs")
    r = TestClient(create_app(svc)).post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200 and svc.served == 1


def _parsed(body):
    from draftsmith.serve.schema import ChatRequest  # the schema's model, as the routes build it
    return ChatRequest.model_validate(body), body


def test_logs_without_bodies_keep_ids_and_settings_only(target, tmp_path, service):
    svc = service(target, max_batch=1, log_dir=tmp_path / "logs", log_bodies=False)
    client = TestClient(create_app(svc))
    r = client.post("/v1/chat/completions", json={**BODY, "messages": [{"role": "user", "content": "my secret"}]})
    assert r.status_code == 200
    raw = b"".join(f.read_bytes() for f in (tmp_path / "logs").glob("*.jsonl"))
    assert b"my secret" not in raw and r.json()["choices"][0]["message"]["content"].encode() not in raw
    (rec,) = _log_records(target, tmp_path / "logs")
    assert rec.response_ids and rec.prompt_ids  # what the online job trains on


def test_requests_arriving_mid_batch_join_it_and_equal_plain(target, tmp_path, service):
    """Continuous batching: with one long request decoding, later requests join its call (no second call)
    and every greedy response equals plain decoding."""
    svc = service(target, max_batch=4, log_dir=tmp_path / "logs", start=False)
    client = TestClient(create_app(svc))
    results, threads = {}, []
    first = {"messages": MSGS[0], "max_tokens": 120, "temperature": 0, "stream": True}
    threads.append(_post_in_thread(client, first, results, 0))
    _wait_queued(svc, 1)
    svc.start()
    while not svc.batch_sizes:
        threading.Event().wait(0.002)
    for i in (1, 2):
        threads.append(_post_in_thread(client, {"messages": MSGS[i], "max_tokens": 10, "temperature": 0}, results, i))
    for th in threads:
        th.join(120)
    assert svc.batch_sizes == [1] and svc.admitted == 2, (svc.batch_sizes, svc.admitted)
    assert results[0][1][0] == _plain(target, MSGS[0], 120)[1]
    for i in (1, 2):
        assert results[i][1]["choices"][0]["message"]["content"] == _plain(target, MSGS[i], 10)[1]
    assert len(_log_records(target, tmp_path / "logs")) == 3


def test_queue_full_is_an_error_type_with_its_numbers():
    e = QueueFull(7, 3)
    assert e.waiting == 7 and e.retry_after == 3 and "7 requests" in str(e)


def test_a_failing_call_errors_the_rows_that_joined_it_too(target, service, monkeypatch):
    """A call that fails after admitting rows: every caller, those of the rows that joined included, gets the
    error (none waits forever), and the thread goes on serving."""
    svc = service(target, max_batch=4, start=False)
    first = svc.run(svc.spec(*_parsed(BODY)), "a")
    original = svc.batched.generate

    def generate(*a, admit=None, **kw):
        original([[1, 2]], 1, max_rows=kw["max_rows"], capacity=kw["capacity"])  # the call's cache, as it would be
        svc.scheduler._waiting.append(joined)  # arrives while the call runs
        assert len(admit(3)) == 1
        raise RuntimeError("boom")

    joined = _job(svc)
    monkeypatch.setattr(svc.batched, "generate", generate)
    svc.start()
    with pytest.raises(RuntimeError, match="boom"):
        next(first)
    ev = joined.events.get(timeout=60)  # queue.Empty (a failure) if the joined row's caller was left waiting
    assert isinstance(ev.get("error"), RuntimeError) and "boom" in str(ev["error"])
    monkeypatch.setattr(svc.batched, "generate", original)
    r = TestClient(create_app(svc)).post("/v1/chat/completions", json=BODY)
    assert r.status_code == 200


def _job(svc):
    return Job(svc.spec(*_parsed(BODY)), "joined")
