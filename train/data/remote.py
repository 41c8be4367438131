"""Self-distillation through any OpenAI-compatible server (vLLM, SGLang, ``draftsmith serve``).

For users who outgrow one machine: the data stage sends each conversation's
turns to ``/v1/chat/completions`` with several requests in flight, and writes
the same JSONL rows as the local engines (resumable the same way). The server
must serve the very target the drafter is trained for; this is checked before
any data is written:

* ``check: probe`` (default): a few fixed prompts decoded greedily by the server
  must give the tokens the local target gives (the local copy is loaded anyway:
  the cache pass needs it). A server in another precision may differ at
  near-ties; then use ``check: models``;
* ``check: models``: ``/v1/models`` must list ``server.model``;
* ``check: none``: trust the configuration.

Only the standard library is used (``urllib``), so nothing is added to the
dependencies; an API key, when needed, is read from the environment variable
``server.api_key_env`` (never from the recipe).
"""

from __future__ import annotations

import json
import os
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tqdm.auto import tqdm

from draftsmith.target import Target
from draftsmith.train.data.generate import (NOT_REACHED, Deadline, _messages, _resume, _row, _turn_prompt,
                                       budget_order, generate_batch, job_seed, prompt_ids)
from draftsmith.train.data.sources import Conversation

PROBES = ("Name three primary colors.", "Write a haiku about the sea.", "What is 12 times 7?")


class ServerError(RuntimeError):
    """The server could not be used (unreachable, wrong model, bad answers)."""


class ChatClient:
    """A minimal OpenAI chat-completions client (stdlib only)."""

    def __init__(self, url: str, model: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.base = url.rstrip("/")
        if not self.base.endswith("/v1"):
            self.base += "/v1"
        self.model, self.api_key, self.timeout_s = model, api_key, timeout_s

    def _request(self, path: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.base + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json"})
        if self.api_key:
            req.add_header("Authorization", f"Bearer {self.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            raise ServerError(f"{self.base}{path}: HTTP {e.code}: {e.read()[:300]!r}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            raise ServerError(f"{self.base}{path}: {e}") from None
        except json.JSONDecodeError as e:
            raise ServerError(f"{self.base}{path}: the answer is not JSON ({e.msg})") from None

    def models(self) -> list[str]:
        return [m.get("id") for m in self._request("/models").get("data", [])]

    def chat(self, messages: list[dict], max_tokens: int, temperature: float, top_p: float,
             seed: int | None = None) -> tuple[str, bool, int | None]:
        """(reply text, finished on its own, completion tokens if reported)."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": temperature,
                "top_p": top_p, "stream": False}
        if seed is not None:
            body["seed"] = seed
        out = self._request("/chat/completions", body)
        try:
            ch = out["choices"][0]
            text, reason = ch["message"]["content"], ch.get("finish_reason")
        except (KeyError, IndexError, TypeError):
            raise ServerError(f"{self.base}/chat/completions: unexpected answer {str(out)[:300]}") from None
        usage = out.get("usage") or {}
        return text or "", reason == "stop", usage.get("completion_tokens")


def check_identity(client: ChatClient, target: Target, mode: str, tokens: int = 12) -> dict:
    """Refuse a server that does not serve ``target`` (see the module docstring); returns what was checked."""
    if mode == "none":
        return {"check": "none"}
    if mode == "models":
        names = client.models()
        if client.model not in names:
            raise ServerError(f"{client.base} does not serve model {client.model!r} (it lists {names})")
        return {"check": "models", "models": names}
    tok = target.tokenizer
    mism = []
    for p in PROBES:
        msgs = [{"role": "user", "content": p}]
        local, _ = generate_batch(target, [prompt_ids(tok, msgs)], tokens)[0]
        text, _, _ = client.chat(msgs, tokens, 0.0, 1.0)
        want = tok.decode(local, skip_special_tokens=True)
        if text.strip() != want.strip():
            mism.append((p, want, text))
    if mism:
        p, want, got = mism[0]
        raise ServerError(
            f"{client.base} model {client.model!r} is not the target {target.name} ({target.fingerprint}): "
            f"{len(mism)}/{len(PROBES)} greedy probes differ, e.g. {p!r}: local {want!r}, server {got!r}. "
            f"If it serves the same weights in another precision, set data.server.check: models")
    return {"check": "probe", "probes": len(PROBES), "tokens": tokens}


def regenerate_remote(target: Target, convs: list[Conversation], out_path: Path, *, url: str, model: str,
                      concurrency: int = 8, api_key_env: str | None = None, check: str = "probe",
                      timeout_s: float = 600.0, max_new_tokens: int, max_turns: int, max_seq_len: int,
                      temperature: float = 0.0, top_p: float = 1.0, seed: int = 0,
                      on_long_prompt: str = "error", retries: int = 2, deadline: Deadline | None = None) -> Counter:
    """`generate.regenerate` through a server: same rows, same resume, ``concurrency`` requests in flight.

    ``deadline``: as `generate.regenerate`'s (`budget_order`, then no conversation's first request is sent
    once it has passed; the conversations in flight finish all their turns).
    """
    api_key = os.environ.get(api_key_env) if api_key_env else None
    if api_key_env and not api_key:
        raise ServerError(f"data.server.api_key_env names {api_key_env!r}, which is not set")
    client = ChatClient(url, model, api_key, timeout_s)
    stats: Counter = Counter()
    ident = check_identity(client, target, check)
    stats["identity_check_" + ident["check"]] = 1
    done = _resume(out_path, stats)
    todo = [c for c in convs if c.id not in done]
    stats["resumed"] = len(convs) - len(todo)
    if deadline is not None:
        todo = budget_order(todo, seed)
        stats[NOT_REACHED] = 0
    tok = target.tokenizer
    budget = min(max_seq_len, target.context_length)
    lock = threading.Lock()
    bar = tqdm(total=len(todo), desc=f"self-distill via {client.base}", unit="conv")

    def one(c: Conversation):
        local: Counter = Counter()
        if deadline is not None and deadline.passed():
            local[NOT_REACHED] += 1
            return c, [], [], local
        replies: list[str] = []
        finished: list[bool] = []
        for turn in range(min(max_turns, len(c.user_turns))):
            if turn and not finished[-1]:
                break
            ids = _turn_prompt(tok, c, turn, replies, budget, max_new_tokens, on_long_prompt, local)
            if ids is None:
                break
            msgs = _messages(c.system, c.user_turns[: turn + 1], replies)
            for attempt in range(retries + 1):
                try:
                    text, fin, n = client.chat(msgs, max_new_tokens, temperature, top_p,
                                               seed=job_seed(seed, c.id, turn) % (2 ** 31) if temperature else None)
                    break
                except ServerError:
                    if attempt == retries:
                        local["server_errors"] += 1
                        return c, replies, finished, local
                    time.sleep(0.5 * (attempt + 1))
            replies.append(text)
            finished.append(fin)
            local["responses"] += 1
            local["response_tokens"] += n if n is not None else len(tok(text, add_special_tokens=False)["input_ids"])
            local["unfinished_responses"] += int(not fin)
        return c, replies, finished, local

    last_sync = time.time()
    with out_path.open("a") as f, ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        for c, replies, finished, local in pool.map(one, todo):
            with lock:
                stats.update(local)
                if replies:
                    f.write(json.dumps(_row(c, replies, finished)) + "\n")
                    stats["conversations"] += 1
                bar.update(1)
                if time.time() - last_sync > 10:
                    f.flush()
                    os.fsync(f.fileno())
                    last_sync = time.time()
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    return stats
