"""Logged serving traffic: the JSONL record schema, the rotating writer, parsing and import.

One JSON object per line per finished request (schema ``draftsmith.serve/1``,
documented field by field in docs/online.md). The server writes records with
`TrafficLog`; the online job reads them back with `parse_record`, which
names the reason a line is unusable (the job counts and quarantines it).
`import_openai_logs` turns plain OpenAI-format request/response pairs (logs
of another server, no acceptance data) into records of the same schema.

Files: ``DIR/requests-<unix seconds>-<seq>.jsonl``. Rotation opens a new file
(the sequence number grows), it never renames one, so a file's name is a
stable identity for tailing; every line is written with one ``write`` and
flushed, so only a crash can leave a partly written last line.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from draftsmith.chat import prompt_token_ids

SCHEMA = "draftsmith.serve/1"
LOG_GLOB = "*.jsonl"
_NAME = re.compile(r"^requests-(\d+)-(\d{6})\.jsonl$")


class RecordError(ValueError):
    """A log line that cannot be used; ``reason`` is the short key it is counted under."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class TrafficRecord:
    """The parts of a logged request the online job uses."""

    prompt_ids: list[int]
    response_ids: list[int]
    steps: list[list[int]] | None  # per decoder step [accepted, attempted, drafted, emitted]; None: no acceptance data
    drafter_version: str | None
    request_id: str

    @property
    def ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def mask(self) -> list[int]:
        return [0] * len(self.prompt_ids) + [1] * len(self.response_ids)

    def rejected_positions(self) -> list[int]:
        """Absolute positions (in ``ids``) of tokens where the target rejected a drafted token.

        Convention (stated once, tested): in a step that emits ``emitted`` tokens starting at
        response index r, tokens r..r+accepted-1 are accepted drafts and token r+accepted is the
        target's own (residual or bonus). When ``attempted > accepted`` the draft for that token
        was tested and rejected, so position ``prompt_len + r + accepted`` is a rejected position:
        the token there is what the drafter should have proposed from the positions before it.
        """
        if not self.steps:
            return []
        out, r, P = [], 0, len(self.prompt_ids)
        for accepted, attempted, _drafted, emitted in self.steps:
            if attempted > accepted and r + accepted < len(self.response_ids):
                out.append(P + r + accepted)
            r += emitted
        return out


def make_record(*, request: dict, prompt_ids: list[int], response_ids: list[int], response_text: str,
                finish_reason: str, target_name: str, fingerprint: str, drafter_version: str | None,
                drafter_kind: str | None, steps: list[list[int]] | None, request_id: str,
                started: float, finished: float) -> dict:
    """One log line's object (schema ``draftsmith.serve/1``, see docs/online.md)."""
    return {
        "schema": SCHEMA, "id": request_id, "created": started, "latency_s": round(finished - started, 6),
        "target": {"name": target_name, "fingerprint": fingerprint},
        "drafter": {"version": drafter_version, "kind": drafter_kind},
        "request": request, "prompt_ids": prompt_ids, "response_ids": response_ids,
        "response_text": response_text, "finish_reason": finish_reason, "steps": steps,
    }


def _int_list(obj, key: str) -> list[int]:
    v = obj.get(key)
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v):
        raise RecordError("malformed", f"{key!r} must be a list of non-negative token ids")
    return v


def parse_record(line: bytes | str, fingerprint: str, *, vocab_size: int, max_tokens: int) -> TrafficRecord:
    """Validate one log line for a target; `RecordError` with reason ``malformed``, ``other_target``,
    ``oversized``, ``empty_response`` or ``bad_steps``."""
    try:
        obj = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RecordError("malformed", f"not JSON ({e.msg if hasattr(e, 'msg') else e})") from None
    if not isinstance(obj, dict) or obj.get("schema") != SCHEMA:
        raise RecordError("malformed", f"not a {SCHEMA} object")
    fp = (obj.get("target") or {}).get("fingerprint") if isinstance(obj.get("target"), dict) else None
    if fp != fingerprint:
        raise RecordError("other_target", f"target fingerprint {fp!r} is not {fingerprint!r}")
    prompt, resp = _int_list(obj, "prompt_ids"), _int_list(obj, "response_ids")
    if any(x >= vocab_size for x in prompt + resp):
        raise RecordError("malformed", f"token id outside the target's vocabulary ({vocab_size})")
    if not prompt:
        raise RecordError("malformed", "empty prompt_ids")
    if not resp:
        raise RecordError("empty_response", "no response tokens")
    if len(prompt) + len(resp) > max_tokens:
        raise RecordError("oversized", f"{len(prompt) + len(resp)} tokens > {max_tokens}")
    steps = obj.get("steps")
    if steps is not None:
        ok = isinstance(steps, list) and all(
            isinstance(s, list) and len(s) == 4 and all(isinstance(x, int) and x >= 0 for x in s) for s in steps)
        if not ok or sum(s[3] for s in steps) != len(resp):
            raise RecordError("bad_steps", "steps must be [accepted, attempted, drafted, emitted] lists whose "
                                           "emitted counts sum to the response length")
    drafter = obj.get("drafter") if isinstance(obj.get("drafter"), dict) else {}
    return TrafficRecord(prompt, resp, steps, drafter.get("version"), str(obj.get("id", "")))


class TrafficLog:
    """Thread-safe writer of one JSON line per record to rotating files in a directory."""

    def __init__(self, directory: str | Path, max_bytes: int = 64 << 20, fsync: bool = False):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.fsync = max_bytes, fsync
        self._lock = threading.Lock()
        seqs = [int(m.group(2)) for p in self.dir.iterdir() if (m := _NAME.match(p.name))]
        self._seq = max(seqs, default=0)
        self._f = None
        self.written = 0

    def _open_new(self) -> None:
        if self._f is not None:
            self._f.close()
        self._seq += 1
        self.path = self.dir / f"requests-{int(time.time())}-{self._seq:06d}.jsonl"
        self._f = open(self.path, "ab")

    def write(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()
        with self._lock:
            if self._f is None or (self._f.tell() > 0 and self._f.tell() + len(line) > self.max_bytes):
                self._open_new()
            self._f.write(line)
            self._f.flush()
            if self.fsync:
                os.fsync(self._f.fileno())
            self.written += 1

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                self._f.close()
                self._f = None


def chat_prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Prompt ids of a conversation, as the data stage renders them (chat template text, then tokens)."""
    return prompt_token_ids(tokenizer, messages)


def _content(message) -> str:
    c = message.get("content") if isinstance(message, dict) else None
    if isinstance(c, list):  # content parts: keep the text ones
        c = "".join(p.get("text", "") for p in c if isinstance(p, dict))
    if not isinstance(c, str):
        raise ValueError("message content is not text")
    return c


def import_openai_logs(src: str | Path, out_dir: str | Path, target, *, max_tokens: int) -> dict:
    """Convert plain OpenAI-format logs into ``draftsmith.serve/1`` records (no acceptance data).

    Each input line: ``{"request": {"messages": [...], ...}, "response": {"choices": [{"message":
    {"content": ...}, "finish_reason": ...}]}}`` (the chat-completions request body and response
    object). The prompt is rendered with the target's chat template; the response text is
    tokenised (special tokens not added) and the end-of-turn token appended when
    ``finish_reason == "stop"``. Unusable lines are counted by reason, not fatal. Returns the counts.
    """
    tok = target.tokenizer
    src, out_dir = Path(src), Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dest = out_dir / f"requests-{int(time.time())}-{0:06d}-import-{src.stem}.jsonl"
    counts = {"imported": 0, "skipped": {}}
    eos = tok.eos_token_id
    with open(src, "rb") as fin, open(dest.with_suffix(".tmp"), "w") as fout:
        for n, raw in enumerate(fin, 1):
            try:
                obj = json.loads(raw)
                req, resp = obj["request"], obj["response"]
                msgs = req["messages"]
                choice = resp["choices"][0]
                text = _content(choice["message"])
                for m in msgs:
                    _content(m)
                prompt = chat_prompt_ids(tok, msgs)
                ids = tok(text, add_special_tokens=False)["input_ids"]
                if choice.get("finish_reason") == "stop" and eos is not None:
                    ids = ids + [eos]
                if not ids:
                    raise ValueError("empty response")
                if len(prompt) + len(ids) > max_tokens:
                    raise RecordError("oversized", f"{len(prompt) + len(ids)} tokens")
            except RecordError as e:
                counts["skipped"][e.reason] = counts["skipped"].get(e.reason, 0) + 1
                continue
            except (json.JSONDecodeError, KeyError, IndexError, TypeError, ValueError):
                counts["skipped"]["malformed"] = counts["skipped"].get("malformed", 0) + 1
                continue
            rec = make_record(request=req, prompt_ids=list(prompt), response_ids=ids, response_text=text,
                              finish_reason=str(choice.get("finish_reason")), target_name=target.name,
                              fingerprint=target.fingerprint, drafter_version=None, drafter_kind=None, steps=None,
                              request_id=str(resp.get("id") or f"import-{src.stem}-{n}"), started=time.time(),
                              finished=time.time())
            fout.write(json.dumps(rec, ensure_ascii=False) + "\n")
            counts["imported"] += 1
    # the tailer only reads *.jsonl, so the file appears whole
    os.replace(dest.with_suffix(".tmp"), dest)
    counts["file"] = str(dest)
    return counts
