"""`draftsmith serve`: responses equal plain greedy decoding, logs written and parseable, hot swap, bad requests,
one request at a time (max_batch=1) and batched (max_batch > 1: concurrent requests decoded together, swaps
between batches only, unbatchable drafters served one at a time)."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time

import pytest
from fastapi.testclient import TestClient

from draftsmith.checkpoint import save_checkpoint
from draftsmith.engine.decoder import plain_decoder
from draftsmith.engine.fastpath import use_fast_forward
from draftsmith.publish import PublishStore
from draftsmith.recipe import parse_recipe
from draftsmith.serve.app import DecodingService, create_app
from draftsmith.train.training.trainer import build_drafter
from draftsmith.traffic import chat_prompt_ids, parse_record
from tests.online_helpers import medusa_checkpoint
from tests.tiny import make_tiny_target

MSGS = [[{"role": "user", "content": "hello there"}], [{"role": "user", "content": "write code"}],
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]]


@pytest.fixture()
def target():
    return make_tiny_target(init_std=0.3)


@pytest.fixture()
def service():
    """``service(target, **kw)``: a DecodingService whose batching thread is stopped at teardown."""
    made = []

    def make(target, **kw):
        made.append(DecodingService(target, **kw))
        return made[-1]

    yield make
    for svc in made:
        svc.close()


def _wait_queued(svc, n):
    """Wait (bounded) until ``n`` requests are queued for a batching thread that has not started."""
    for _ in range(2000):
        if svc.queued() >= n:
            return
        time.sleep(0.005)
    raise AssertionError(f"{svc.queued()} requests queued, expected {n}")


def _plain(target, msgs, n):
    ids = chat_prompt_ids(target.tokenizer, msgs)
    out = plain_decoder(target).generate(ids, n).tokens
    return out, target.tokenizer.decode(out, skip_special_tokens=True)


def _stream_text(resp) -> tuple[str, list[dict]]:
    events = [x[6:] for x in resp.text.split("\n\n") if x.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]), chunks


@pytest.mark.parametrize("max_batch", [1, 4])
def test_greedy_responses_equal_plain_decoding_and_are_logged(target, tmp_path, service, max_batch):
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=max_batch)
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
        assert all("usage" not in c for c in chunks)  # usage only with stream_options.include_usage
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
    assert svc.batch_sizes == ([] if max_batch == 1 else [1] * 2 * len(MSGS))


@pytest.mark.parametrize("max_batch", [1, 4])
def test_hot_swap_between_requests(target, tmp_path, service, max_batch):
    store = PublishStore(tmp_path / "pub")
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=max_batch)
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


@pytest.mark.parametrize("max_batch", [1, 4])
def test_bad_requests_are_400(target, tmp_path, service, max_batch):
    client = TestClient(create_app(service(target, log_dir=tmp_path / "logs", max_batch=max_batch)))
    assert client.post("/v1/chat/completions", content=b"{nope").status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": []}).status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": MSGS[0], "max_tokens": 0}).status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": MSGS[0], "n": 2}).status_code == 400
    assert client.post("/v1/chat/completions", json={"messages": MSGS[0], "model": "x"}).status_code == 404
    r = client.post("/v1/chat/completions", json={"messages": MSGS[0], "max_tokens": 5000})
    assert r.status_code == 400 and "context" in r.json()["error"]["message"]
    assert not list((tmp_path / "logs").glob("*.jsonl")) or all(
        f.stat().st_size == 0 for f in (tmp_path / "logs").glob("*.jsonl"))


@pytest.mark.parametrize("max_batch", [1, 4])
def test_uvicorn_loopback_concurrent_clients_with_openai(target, tmp_path, service, max_batch):
    """The real HTTP stack on 127.0.0.1 with the openai client, 4 concurrent clients, publications meanwhile."""
    openai = pytest.importorskip("openai")
    import uvicorn
    store = PublishStore(tmp_path / "pub")
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=max_batch)
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
        assert sum(svc.batch_sizes) + svc.admitted == (0 if max_batch == 1 else 12)
    finally:
        server.should_exit = True
        th.join(10)


# ---------------------------------------------------------------------- batching (max_batch > 1)
def _post_in_thread(client, body, results, key):
    def go():
        r = client.post("/v1/chat/completions", json=body)
        results[key] = (r.status_code, _stream_text(r) if body.get("stream") and r.status_code == 200 else r.json())
    th = threading.Thread(target=go)
    th.start()
    return th


def _queued_then_started(svc, client, bodies) -> dict:
    """Post ``bodies`` one at a time, each queued before the next (so the queue order is theirs), to a service whose
    batching thread has not started; start it; return {index: (status, json or streamed text and chunks)}."""
    results, threads = {}, []
    for i, body in enumerate(bodies):
        threads.append(_post_in_thread(client, body, results, i))
        _wait_queued(svc, i + 1)
    svc.start()
    for th in threads:
        th.join(120)
    return results


def _log_records(target, logs):
    lines = [x for f in sorted(logs.glob("*.jsonl")) for x in f.read_bytes().splitlines()]
    return [parse_record(x, target.fingerprint, vocab_size=target.vocab_size, max_tokens=10_000) for x in lines]


def test_concurrent_requests_are_batched_and_equal_plain_greedy(target, tmp_path, service):
    """7 requests (some streaming, one sampled) queued before the batching thread starts: the greedy ones run
    as batches of up to 4 rows, the sampled one in a batch of its own; every greedy response (streamed token by
    token or not) equals plain greedy decoding, and every request is logged with per-row step data."""
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=4, start=False)
    client = TestClient(create_app(svc))
    n_new = [24, 9, 16, 24, 5, 20, 12]
    bodies = [{"messages": MSGS[i % 3], "max_tokens": n_new[i], "temperature": 0, "stream": i % 2 == 1}
              for i in range(7)]
    for b in bodies:
        if b["stream"]:
            b["stream_options"] = {"include_usage": True}
    bodies[2] = {"messages": MSGS[2], "max_tokens": 16, "temperature": 0.8, "seed": 5}  # cannot share a call
    results, threads = {}, []
    for i, body in enumerate(bodies):  # one at a time, so the queue order is the request order
        threads.append(_post_in_thread(client, body, results, i))
        _wait_queued(svc, i + 1)
    svc.start()
    for th in threads:
        th.join(120)
    assert sorted(results) == list(range(7)) and all(code == 200 for code, _ in results.values()), results
    # oldest first, compatible requests join it: greedy 0,1,3,4 | sampled 2 | greedy 5,6
    assert svc.batch_sizes == [4, 1, 2]
    for i, body in enumerate(bodies):
        if body["temperature"]:
            continue
        ids, text = _plain(target, body["messages"], body["max_tokens"])
        if body["stream"]:
            got, chunks = results[i][1]
            assert got == text
            assert sum(bool(c["choices"][0]["delta"].get("content")) for c in chunks if c["choices"]) > 1  # as it came
            assert chunks[-1]["usage"]["completion_tokens"] == len(ids)
        else:
            assert results[i][1]["choices"][0]["message"]["content"] == text
            assert results[i][1]["usage"]["completion_tokens"] == len(ids)
    recs = _log_records(target, tmp_path / "logs")  # every line is a valid record
    raw = [json.loads(x) for f in sorted((tmp_path / "logs").glob("*.jsonl")) for x in f.read_bytes().splitlines()]
    assert len(recs) == 7 and svc.served == 7
    for rec in recs:
        assert rec.drafter_version == "v000001"
        assert sum(st[3] for st in rec.steps) == len(rec.response_ids) and len(rec.steps) >= 1
    greedy = sorted((tuple(r["prompt_ids"]), tuple(r["response_ids"])) for r in raw if r["request"]["temperature"] == 0)
    assert greedy == sorted((tuple(chat_prompt_ids(target.tokenizer, b["messages"])),
                             tuple(_plain(target, b["messages"], b["max_tokens"])[0]))
                            for b in bodies if b["temperature"] == 0)
    assert sum(st[0] for rec in recs for st in rec.steps) > 0  # the drafter's tokens were accepted in batches


def test_max_batch_1_decodes_one_at_a_time_under_the_lock(target, tmp_path, service):
    """max_batch=1 is the original path: no batching thread, no queue, requests in the caller's thread under
    the lock (a request waits while the lock is held), responses equal plain greedy decoding."""
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=1)
    assert svc.scheduler is None and svc.batched is None
    client = TestClient(create_app(svc))
    results, threads = {}, []
    with svc.lock:  # nothing can be decoded while the test holds the lock
        for i in range(3):
            threads.append(_post_in_thread(client, {"messages": MSGS[i], "max_tokens": 16, "temperature": 0,
                                                    "stream": i == 1}, results, i))
        threads[0].join(0.5)
        assert not results and svc.served == 0 and svc.queued() == 3  # all three wait for the lock
    for th in threads:
        th.join(120)
    for i in range(3):
        text = _plain(target, MSGS[i], 16)[1]
        assert (results[i][1][0] if i == 1 else results[i][1]["choices"][0]["message"]["content"]) \
            == text
    assert svc.batch_sizes == [] and svc.unbatched == 0 and len(_log_records(target, tmp_path / "logs")) == 3


def test_hot_swap_only_between_batches(target, tmp_path, service):
    """A version published while a batch runs (here: as its first row finishes) is not used by the rows still
    in that batch; the next batch takes it."""
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=4, start=False)
    v2 = medusa_checkpoint(target, tmp_path / "c2", seed=2)
    finish = svc._finish

    def finish_then_publish(*a, **kw):
        rec = finish(*a, **kw)
        if store.current() == "v000001":
            store.publish(v2)  # mid-batch: the other rows are still decoding
        return rec

    svc._finish = finish_then_publish
    client = TestClient(create_app(svc))
    results, threads = {}, []
    for i, n in enumerate([3, 20, 20]):
        threads.append(_post_in_thread(client, {"messages": MSGS[i], "max_tokens": n, "temperature": 0,
                                                "stream": i == 2}, results, i))
        _wait_queued(svc, i + 1)
    svc.start()
    for th in threads:
        th.join(120)
    assert svc.batch_sizes == [3] and store.current() == "v000002"
    assert [r.drafter_version for r in _log_records(target, tmp_path / "logs")] == ["v000001"] * 3
    assert results[2][1][0] == _plain(target, MSGS[2], 20)[1]
    r = client.post("/v1/chat/completions", json={"messages": MSGS[0], "max_tokens": 8, "temperature": 0})
    assert r.json()["draftsmith"]["drafter_version"] == "v000002" and svc.batch_sizes == [3, 1]


def test_a_bad_request_fails_alone_in_its_batch(target, tmp_path, service):
    """A request that fits the context alone but not with the drafter's draft block is refused by the batched
    decoder's own check; the other rows of its batch are served."""
    store = PublishStore(tmp_path / "pub")
    store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=4, start=False)
    client = TestClient(create_app(svc))
    fits_alone = target.context_length - len(chat_prompt_ids(target.tokenizer, MSGS[1])) - 1
    bodies = [{"messages": MSGS[0], "max_tokens": 12, "temperature": 0},
              {"messages": MSGS[1], "max_tokens": fits_alone, "temperature": 0},  # no room for a draft block
              {"messages": MSGS[2], "max_tokens": 12, "temperature": 0, "stream": True}]
    results = _queued_then_started(svc, client, bodies)
    assert results[1][0] == 400 and "context" in results[1][1]["error"]["message"]
    assert results[0][1]["choices"][0]["message"]["content"] == _plain(target, MSGS[0], 12)[1]
    assert results[2][1][0] == _plain(target, MSGS[2], 12)[1]
    assert svc.batch_sizes == [2] and len(_log_records(target, tmp_path / "logs")) == 2


def kangaroo_checkpoint(target, path):
    r = parse_recipe({"name": "kg", "output_dir": str(path.parent / "kg-run"), "seed": 3,
                      "drafter": {"kind": "kangaroo", "exit_layer": 1, "threshold": 0.5, "max_draft_len": 4}})
    return save_checkpoint(path, build_drafter(r, target), target, recipe=r.model_dump(mode="json"))


@pytest.mark.parametrize("case", ["kangaroo", "dynamic-tree"])
def test_unbatchable_drafter_falls_back_to_one_at_a_time(target, tmp_path, service, caplog, case):
    """A drafter the batched decoder refuses is served one request at a time by the batching thread, with a
    log line when it is loaded; responses still equal plain greedy decoding and every request is logged."""
    store = PublishStore(tmp_path / "pub")
    if case == "kangaroo":
        store.publish(kangaroo_checkpoint(target, tmp_path / "k1"))
    else:
        store.publish(medusa_checkpoint(target, tmp_path / "c1", seed=1))
    with caplog.at_level(logging.WARNING, logger="draftsmith.serve"):
        svc = service(target, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=4, start=False,
                      tree="chain" if case == "kangaroo" else "dynamic:6,3,2")
    assert svc.version == "v000001" and svc.batched is None
    assert any("cannot be batched" in m and "one request at a time" in m for m in caplog.messages), caplog.messages
    client = TestClient(create_app(svc))
    results, threads = {}, []
    for i in range(3):
        threads.append(_post_in_thread(client, {"messages": MSGS[i], "max_tokens": 16, "temperature": 0,
                                                "stream": i == 1}, results, i))
        _wait_queued(svc, i + 1)
    svc.start()
    for th in threads:
        th.join(120)
    for i in range(3):
        text = _plain(target, MSGS[i], 16)[1]
        assert (results[i][1][0] if i == 1 else results[i][1]["choices"][0]["message"]["content"]) \
            == text
    assert svc.batch_sizes == [] and svc.unbatched == 3
    recs = _log_records(target, tmp_path / "logs")
    assert len(recs) == 3 and all(r.drafter_version == "v000001" and r.steps for r in recs)


def test_an_eagle3_drafter_is_served_in_batches(tmp_path, service):
    """A published EAGLE-3 checkpoint runs in the batched decoder (its rows' target states from the batched
    forwards' hooks): three queued greedy requests decode as one batch, each equal to plain greedy decoding."""
    t = make_tiny_target(init_std=0.3, layers=4)
    r = parse_recipe({"name": "e3", "output_dir": str(tmp_path / "e3-run"), "seed": 3,
                      "drafter": {"kind": "eagle3", "aux_layers": [1, 2, 3], "vocab_keep": None}})
    PublishStore(tmp_path / "pub").publish(save_checkpoint(tmp_path / "e1", build_drafter(r, t), t,
                                                           recipe=r.model_dump(mode="json")))
    svc = service(t, publish_dir=tmp_path / "pub", log_dir=tmp_path / "logs", max_batch=4, start=False)
    assert svc.version == "v000001" and svc.batched is not None and svc.kind == "eagle3"
    client = TestClient(create_app(svc))
    results, threads = {}, []
    for i in range(3):
        threads.append(_post_in_thread(client, {"messages": MSGS[i], "max_tokens": 16, "temperature": 0}, results, i))
        _wait_queued(svc, i + 1)
    svc.start()
    for th in threads:
        th.join(120)
    assert [results[i][1]["choices"][0]["message"]["content"] for i in range(3)] == \
        [_plain(t, MSGS[i], 16)[1] for i in range(3)]
    assert svc.batch_sizes == [3] and svc.unbatched == 0
    recs = _log_records(t, tmp_path / "logs")
    assert len(recs) == 3 and all(r.drafter_version == "v000001" and r.steps for r in recs)
    raw = [json.loads(x) for f in sorted((tmp_path / "logs").glob("*.jsonl")) for x in f.read_bytes().splitlines()]
    assert {r["drafter"]["kind"] for r in raw} == {"eagle3"}
    assert sum(st[2] for rec in recs for st in rec.steps) > 0  # drafted in batches


@pytest.mark.parametrize("hold, groups, held", [(50, [4], 2), (1, [3, 1], 2), (0, [3, 1], 0)])
def test_admissions_into_a_running_batch_are_grouped(target, tmp_path, service, hold, groups, held):
    """While a call decodes, requests that arrive are held until ``admit_group`` of them can join together (one
    prefill forward), for at most ``admit_hold_steps`` steps. Three requests arrive at the call's 3rd step and a
    fourth at its 5th: with a long hold the four join as one group after 2 held steps; with a hold of 1 step the
    three join at the 4th step and the fourth alone at the 6th (each held once); with none, nothing is held.
    Every response still equals plain greedy decoding."""
    svc = service(target, log_dir=tmp_path / "logs", max_batch=8, start=False, admit_group=4,
                  admit_hold_steps=hold)
    client = TestClient(create_app(svc))
    dec = svc.batched
    results: dict = {}
    threads = []
    bodies = [{"messages": MSGS[i % 3], "max_tokens": 60 if i == 0 else 12, "temperature": 0} for i in range(5)]
    arrivals = {3: [1, 2, 3], 5: [4]}  # the call's admission check (one a step) -> requests that arrive first
    generate = dec.generate

    def scripted(*args, admit=None, **kw):
        steps = [0]

        def admit_after_arrivals(free):
            steps[0] += 1
            for i in arrivals.get(steps[0], []):
                queued = svc.queued()
                threads.append(_post_in_thread(client, bodies[i], results, i))
                _wait_queued(svc, queued + 1)
            return admit(free)
        return generate(*args, admit=admit_after_arrivals if admit is not None else None, **kw)

    dec.generate = scripted
    threads.append(_post_in_thread(client, bodies[0], results, 0))
    _wait_queued(svc, 1)
    svc.start()
    for _ in range(2000):
        if len(threads) == 5:
            break
        time.sleep(0.005)
    for th in threads:
        th.join(120)
    assert sorted(results) == list(range(5)) and all(code == 200 for code, _ in results.values()), results
    assert svc.batch_sizes == [1]
    assert svc.scheduler.admit_groups == groups and svc.scheduler.held_steps == held
    assert svc.batching()["admissions"] == len(groups)
    for i, body in enumerate(bodies):
        assert results[i][1]["choices"][0]["message"]["content"] == _plain(target, body["messages"],
                                                                           body["max_tokens"])[1]


def test_batched_rows_share_the_chat_template_prefix_and_equal_plain_greedy(tmp_path, service):
    """With our forward on the target, the batched decoder prefills the chat template's shared prefix once and
    copies it into each row (`BatchedSpeculativeDecoder.set_prefix`); every response still equals plain greedy
    decoding: streamed, not streamed (whose text is made once, at the end), and not streamed with a stop
    sequence (looked for at every step)."""
    target = make_tiny_target(init_std=0.3)
    use_fast_forward(target, "fast")
    svc = service(target, log_dir=tmp_path / "logs", max_batch=4, start=False)
    a, b = (chat_prompt_ids(target.tokenizer, m) for m in MSGS[:2])
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert n >= 2 and svc.prompt_prefix == a[:n]
    texts = [_plain(target, m, 20)[1] for m in MSGS]
    stop = texts[1][4:7]
    assert stop and texts[1].find(stop) > 0
    bodies = [{"messages": MSGS[0], "max_tokens": 20, "temperature": 0},
              {"messages": MSGS[1], "max_tokens": 20, "temperature": 0, "stop": [stop]},
              {"messages": MSGS[2], "max_tokens": 20, "temperature": 0, "stream": True},
              {"messages": MSGS[1], "max_tokens": 20, "temperature": 0}]
    client = TestClient(create_app(svc))
    results = _queued_then_started(svc, client, bodies)
    assert all(results[i][0] == 200 for i in range(4)), results
    assert results[0][1]["choices"][0]["message"]["content"] == texts[0]
    assert results[1][1]["choices"][0]["message"]["content"] == texts[1][:texts[1].find(stop)]
    assert results[1][1]["choices"][0]["finish_reason"] == "stop"
    assert results[2][1][0] == texts[2]
    assert results[3][1]["choices"][0]["message"]["content"] == texts[1]
    assert svc.batch_sizes == [4]
    # the one-message prompts share the whole prefix, the one with its own system prompt the template's first tokens
    c = chat_prompt_ids(target.tokenizer, MSGS[2])
    part = next(i for i, (x, y) in enumerate(zip(c, a)) if x != y)
    assert 2 <= part < n
    assert svc.batched.prefix_stats == {"rows": 4, "tokens_reused": 3 * n + part}
