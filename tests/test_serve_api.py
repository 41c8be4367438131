"""The server as its clients see it: the official ``openai`` SDK against ``draftsmith serve`` on loopback (uvicorn),
one request at a time and batched, with a published drafter. Every request field the SDK knows is either
implemented (and shown to change the output), refused with a 400 naming it, or in the written list of fields
that change nothing; malformed requests get 400/404 naming the field."""

from __future__ import annotations

import time
import typing

import httpx
import pytest
import torch

from draftsmith.engine.decoder import plain_decoder
from draftsmith.engine.processors import Penalties, RequestProcessing
from draftsmith.publish import PublishStore
from draftsmith.serve.app import DecodingService
from draftsmith.serve.schema import IGNORED, IMPLEMENTED, REFUSED
from draftsmith.traffic import chat_prompt_ids
from benchmarks.common import serve_in_thread
from tests.online_helpers import medusa_checkpoint
from tests.tiny import make_tiny_target

openai = pytest.importorskip("openai")

MSGS = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": "hi"}, {"role": "user", "content": "why?"}]


@pytest.fixture(scope="module", params=[1, 4], ids=["max_batch=1", "max_batch=4"])
def api(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"api{request.param}")
    target = make_tiny_target(init_std=0.3)
    PublishStore(tmp / "pub").publish(medusa_checkpoint(target, tmp / "c1", seed=1))
    svc = DecodingService(target, publish_dir=tmp / "pub", log_dir=tmp / "logs", max_batch=request.param)
    server, port = serve_in_thread(svc)
    base = f"http://127.0.0.1:{port}"
    yield {"target": target, "svc": svc, "base": base, "tmp": tmp,
           "client": openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)}
    server.should_exit = True
    svc.close()


def _plain(target, prompt, n, pen: Penalties | None = None):
    dec = plain_decoder(target)
    dec.processing = RequestProcessing(pen) if pen else None
    out = dec.generate(prompt, n).tokens
    return out, target.tokenizer.decode(out, skip_special_tokens=True)


def _chat(api, **kw):
    kw.setdefault("model", api["target"].name)
    kw.setdefault("messages", MSGS)
    return api["client"].chat.completions.create(**kw)


def _raw(api, path, body):
    return httpx.post(f"{api['base']}{path}", json=body, timeout=60)


def test_models_list_and_retrieve(api):
    cl, name = api["client"], api["target"].name
    assert [m.id for m in cl.models.list()] == [name]
    assert cl.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError):
        cl.models.retrieve("nope")
    with pytest.raises(openai.NotFoundError) as e:
        _chat(api, model="nope", max_tokens=4)
    assert "nope" in str(e.value)


def test_chat_greedy_usage_streaming_with_include_usage(api):
    t = api["target"]
    prompt = chat_prompt_ids(t.tokenizer, MSGS)
    ids, text = _plain(t, prompt, 20)
    r = _chat(api, max_completion_tokens=20, temperature=0)
    assert r.choices[0].message.content == text and r.choices[0].message.role == "assistant"
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)
    assert r.usage.total_tokens == len(prompt) + len(ids)
    assert r.choices[0].finish_reason == ("length" if len(ids) == 20 else "stop")
    chunks = list(_chat(api, max_completion_tokens=20, temperature=0, stream=True,
                        stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ids)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    plain_stream = list(_chat(api, max_tokens=20, temperature=0, stream=True))
    assert all(c.usage is None for c in plain_stream)  # usage only when asked for
    assert r.model == t.name and r.object == "chat.completion"


def test_roles_and_text_parts(api):
    t = api["target"]
    parts = [{**m, "content": [{"type": "text", "text": m["content"][:3]}, {"type": "text", "text": m["content"][3:]}]}
             for m in MSGS]
    joined = [{**m, "content": m["content"][:3] + "\n" + m["content"][3:]} for m in MSGS]
    want = _plain(t, chat_prompt_ids(t.tokenizer, joined), 12)[1]
    assert _chat(api, messages=parts, max_tokens=12, temperature=0).choices[0].message.content == want
    for role in ("developer", "tool"):
        msgs = [{"role": role, "content": "x", **({"tool_call_id": "c1"} if role == "tool" else {})}, MSGS[1]]
        assert _chat(api, messages=msgs, max_tokens=4, temperature=0).choices[0].message.content is not None


def test_stop_sequences(api):
    t = api["target"]
    _, text = _plain(t, chat_prompt_ids(t.tokenizer, MSGS), 24)
    assert len(text) > 8
    stop = text[5:7]
    want = text[:text.find(stop)]
    r = _chat(api, max_tokens=24, temperature=0, stop=[stop, "\x00never"])
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    s = list(_chat(api, max_tokens=24, temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in s if c.choices) == want
    assert [c.choices[0].finish_reason for c in s if c.choices][-1] == "stop"


def test_seed_sampling_and_top_p_zero(api):
    runs = {s: _chat(api, max_tokens=12, temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)}
    assert _chat(api, max_tokens=12, temperature=1.0, seed=1).choices[0].message.content == runs[1]
    assert len(set(runs.values())) > 1
    greedy = _chat(api, max_tokens=12, temperature=0).choices[0].message.content
    assert _chat(api, max_tokens=12, temperature=1.5, top_p=0.0, seed=4).choices[0].message.content == greedy


def test_logprobs_are_the_targets(api):
    t = api["target"]
    prompt = chat_prompt_ids(t.tokenizer, MSGS)
    ids, _ = _plain(t, prompt, 10)
    r = _chat(api, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == len(ids) == r.usage.completion_tokens
    with torch.no_grad():
        for j, (tokid, lp) in enumerate(zip(ids, content)):
            logits = t.model(torch.tensor([prompt + ids[:j]])).logits[0, -1]
            want = torch.log_softmax(logits.double(), -1)
            assert abs(lp.logprob - float(want[tokid])) < 1e-4
            assert lp.token == t.tokenizer.decode([tokid]) and len(lp.top_logprobs) == 2
            assert abs(lp.top_logprobs[0].logprob - float(want.max())) < 1e-4
    s = list(_chat(api, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2, stream=True))
    streamed = [x for c in s if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in content], abs=1e-6)
    assert _chat(api, max_tokens=4, temperature=0).choices[0].logprobs is None


def test_penalties_and_logit_bias_are_applied(api):
    t = api["target"]
    prompt = chat_prompt_ids(t.tokenizer, MSGS)
    base = _plain(t, prompt, 16)[1]
    pen = Penalties(frequency=1.0, presence=0.5, repetition=1.3, logit_bias=((40, 3.0),))
    want = _plain(t, prompt, 16, pen)[1]
    assert want != base
    r = _chat(api, max_tokens=16, temperature=0, frequency_penalty=1.0, presence_penalty=0.5,
              logit_bias={"40": 3.0}, extra_body={"repetition_penalty": 1.3})
    assert r.choices[0].message.content == want
    # sampled, with vLLM's extensions too: accepted and decoded
    r = _chat(api, max_tokens=8, temperature=0.8, seed=3, frequency_penalty=0.5,
              extra_body={"top_k": 5, "min_p": 0.05})
    assert r.usage.completion_tokens >= 1


def test_text_completions(api):
    t, cl = api["target"], api["client"]
    prompt = [int(x) for x in t.tokenizer("once upon a time")["input_ids"]]
    ids, text = _plain(t, prompt, 12)
    r = cl.completions.create(model=t.name, prompt="once upon a time", max_tokens=12, temperature=0)
    assert r.choices[0].text == text and r.usage.completion_tokens == len(ids) and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(prompt)
    s = list(cl.completions.create(model=t.name, prompt="once upon a time", max_tokens=12, temperature=0,
                                   stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in s if c.choices) == text and s[-1].usage.completion_tokens == len(ids)
    r = cl.completions.create(model=t.name, prompt=prompt, max_tokens=12, temperature=0, echo=True, logprobs=2)
    assert r.choices[0].text == t.tokenizer.decode(prompt, skip_special_tokens=True) + text
    lp = r.choices[0].logprobs  # echo: the prompt's tokens too, the first without a logprob
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(prompt) + len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(d) >= 2 for d in lp.top_logprobs[1:])
    with torch.no_grad():
        want = torch.log_softmax(t.model(torch.tensor([prompt + ids])).logits[0].double(), -1)
    for i, tokid in enumerate((prompt + ids)[1:], 1):
        assert abs(lp.token_logprobs[i] - float(want[i - 1, tokid])) < 1e-4
    assert all(r.choices[0].text[o:].startswith(tk) for o, tk in zip(lp.text_offset, lp.tokens))
    s = list(cl.completions.create(model=t.name, prompt=prompt, max_tokens=12, temperature=0, echo=True, logprobs=2,
                                   stream=True))
    assert [x for c in s if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.token_logprobs] \
        == pytest.approx(lp.token_logprobs, abs=1e-6)
    assert cl.completions.create(model=t.name, prompt="ab", max_tokens=3, temperature=0).usage.completion_tokens <= 3


BAD_CHAT = [  # (body change, status, the field the message names)
    ({"messages": []}, 400, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ({"messages": [{"role": "user"}]}, 400, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "image_url"),
    ({"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ({"temperature": 1e6}, 400, "temperature"),
    ({"temperature": -0.1}, 400, "temperature"),
    ({"temperature": "hot"}, 400, "temperature"),
    ({"top_p": 1.5}, 400, "top_p"),
    ({"max_tokens": True}, 400, "max_tokens"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"max_tokens": 2.5}, 400, "max_tokens"),
    ({"max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ({"max_tokens": 100000}, 400, "max_tokens"),
    ({"n": 2}, 400, "n"),
    ({"seed": "x"}, 400, "seed"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ({"stop": [""]}, 400, "stop"),
    ({"frequency_penalty": 3}, 400, "frequency_penalty"),
    ({"presence_penalty": -2.5}, 400, "presence_penalty"),
    ({"logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"logit_bias": {"5": 101}}, 400, "logit_bias"),
    ({"logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    ({"top_logprobs": 2}, 400, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({"logprobs": 1}, 400, "logprobs"),
    ({"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, 400, "include_usage"),
    ({"repetition_penalty": 0}, 400, "repetition_penalty"),
    ({"min_p": 2}, 400, "min_p"),
    ({"unknown_field": 1}, 400, "unknown_field"),
    ({"model": "other"}, 404, "other"),
]
BAD_COMPLETION = [
    ({"prompt": ""}, 400, "prompt"),
    ({"prompt": ["a", "b"]}, 400, "prompt"),
    ({"prompt": [999999]}, 400, "prompt"),
    ({"suffix": "x"}, 400, "suffix"),
    ({"best_of": 2}, 400, "best_of"),
    ({"logprobs": 6}, 400, "logprobs"),
    ({"echo": 1}, 400, "echo"),
    ({"max_tokens": True}, 400, "max_tokens"),
]


def test_malformed_requests_name_the_field(api):
    name = api["target"].name
    for change, status, field in BAD_CHAT:
        r = _raw(api, "/v1/chat/completions", {"model": name, "messages": MSGS[1:2], "max_tokens": 4, **change})
        assert r.status_code == status, (change, r.text)
        err = r.json()["error"]
        assert field in err["message"] and err["type"] == "invalid_request_error", (change, err)
    for change, status, field in BAD_COMPLETION:
        r = _raw(api, "/v1/completions", {"model": name, "prompt": "hi", "max_tokens": 4, **change})
        assert r.status_code == status, (change, r.text)
        assert field in r.json()["error"]["message"], (change, r.text)
    assert httpx.post(f"{api['base']}/v1/chat/completions", content=b"{nope", timeout=10).status_code == 400
    with pytest.raises(openai.BadRequestError) as e:  # the SDK surfaces the message
        _chat(api, max_tokens=4, temperature=5)
    assert e.value.status_code == 400 and "temperature" in str(e.value)


# A value per SDK field that is not its "off" value: implemented ones must change the response, refused ones must be
# a 400 naming the field, ignored ones must change nothing.
ON_VALUES = {
    "audio": {"voice": "alloy", "format": "mp3"}, "function_call": "auto", "functions": [{"name": "f"}],
    "moderation": {"input": True}, "parallel_tool_calls": True, "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "tool_choice": "auto",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "verbosity": "low",
    "web_search_options": {}, "suffix": "x",
    "metadata": {"a": "b"}, "prompt_cache_key": "k", "prompt_cache_options": {"mode": "explicit"},
    "prompt_cache_retention": "24h", "safety_identifier": "s", "service_tier": "auto", "store": True, "user": "u",
}


def _sdk_fields(module) -> list[str]:
    return sorted(typing.get_type_hints(module.CompletionCreateParamsBase))


def test_no_output_changing_field_is_silently_ignored(api):
    """Every field of the SDK's request types (chat and text completions) is implemented, refused or ignored;
    refused ones are 400s naming the field, ignored ones change nothing, implemented ones change the response."""
    from openai.types import completion_create_params as text_params
    from openai.types.chat import completion_create_params as chat_params
    t = api["target"]
    table = {}
    for route, path, fields, base in [
            ("chat", "/v1/chat/completions", _sdk_fields(chat_params),
             {"model": t.name, "messages": MSGS, "max_tokens": 8, "temperature": 0}),
            ("completion", "/v1/completions", _sdk_fields(text_params),
             {"model": t.name, "prompt": "once upon", "max_tokens": 8, "temperature": 0})]:
        ref = _raw(api, path, base).json()
        text = (lambda j: j["choices"][0]["message"]["content"]) if route == "chat" else \
            (lambda j: j["choices"][0]["text"])
        for f in fields:
            if f in ("model", "messages", "prompt"):
                table[(route, f)] = "implemented"
                continue
            if f in IGNORED:
                r = _raw(api, path, {**base, f: ON_VALUES[f]})
                assert r.status_code == 200 and text(r.json()) == text(ref), (route, f, r.text)
                table[(route, f)] = "ignored (changes nothing)"
            elif f in REFUSED:
                r = _raw(api, path, {**base, f: ON_VALUES[f]})
                assert r.status_code == 400 and f in r.json()["error"]["message"], (route, f, r.text)
                table[(route, f)] = "refused (400)"
            else:
                assert f in IMPLEMENTED[route], f"{route}: SDK field {f!r} is neither implemented, refused nor ignored"
                table[(route, f)] = "implemented"
    # implemented ones visibly change the response (EOS banned so that the answer is long enough to repeat itself)
    ban = {str(e): -100 for e in t.eos_token_ids}
    chat = {"model": t.name, "messages": MSGS, "max_tokens": 40, "temperature": 0, "logit_bias": ban}
    base_text = _raw(api, "/v1/chat/completions", chat).json()["choices"][0]["message"]["content"]
    changes = {"frequency_penalty": 2.0, "presence_penalty": 2.0, "logit_bias": {**ban, "41": 100},
               "temperature": 1.5, "max_tokens": 2, "max_completion_tokens": 2, "stop": base_text[2:4],
               "top_k": 1, "min_p": 0.5, "repetition_penalty": 2.0}
    for f, v in changes.items():
        sampled = {"seed": 5, "temperature": 1.0} if f in ("temperature", "top_k", "min_p") else {}
        body = {**chat, **sampled, f: v}
        got = _raw(api, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        if f in ("top_k", "min_p"):  # versus the same seed without it
            got_without = _raw(api, "/v1/chat/completions", {**chat, **sampled}).json()["choices"][0]["message"]
            assert got != got_without["content"], f
        else:
            assert got != base_text, f
    assert _raw(api, "/v1/chat/completions", {**chat, "logprobs": True}).json()["choices"][0]["logprobs"]
    for f, v in [("n", 2), ("response_format", {"type": "json_object"}), ("modalities", ["audio"])]:
        r = _raw(api, "/v1/chat/completions", {**chat, f: v})
        assert r.status_code == 400 and f in r.json()["error"]["message"], (f, r.text)
    for (route, f), how in sorted(table.items()):  # the listing (pytest -s shows it)
        print(f"{route:10s} {f:24s} {how}")
    silently_ignored = [k for k, v in table.items() if v not in ("implemented", "refused (400)",
                                                                 "ignored (changes nothing)")]
    assert silently_ignored == []
    assert {k[1] for k, v in table.items() if v.startswith("ignored")} <= set(IGNORED)


def test_every_answer_is_logged_once(api):
    svc = api["svc"]
    lines = [x for f in (api["tmp"] / "logs").glob("*.jsonl") for x in f.read_text().splitlines()]
    assert len(lines) == svc.served and len({__import__("json").loads(x)["id"] for x in lines}) == len(lines)


def test_a_client_that_disconnects_mid_stream_stops_its_request(api):
    """The stream is closed after two chunks: the server stops that request (counted, not logged) and goes on
    serving (the lock / batch slot is freed)."""
    t, svc = api["target"], api["svc"]
    before_aborted, before_served = svc.aborted, svc.served
    body = {"model": t.name, "messages": MSGS, "max_tokens": 400, "temperature": 0, "stream": True,
            "logit_bias": {str(e): -100 for e in t.eos_token_ids}}
    with httpx.Client(timeout=60) as c:
        with c.stream("POST", f"{api['base']}/v1/chat/completions", json=body) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 2:
                    break
    for _ in range(600):
        if svc.aborted > before_aborted:
            break
        time.sleep(0.05)
    assert svc.aborted == before_aborted + 1 and svc.served == before_served
    r = _chat(api, max_tokens=4, temperature=0)
    assert r.usage.completion_tokens >= 1 and svc.served == before_served + 1
