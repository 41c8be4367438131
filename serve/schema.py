"""The request bodies the server accepts, as typed models: every field is implemented, refused, or listed as ignored.

Rules (docs/DECISIONS.md):
  * an unknown field is a 400 naming it (no field is silently dropped);
  * a field of the OpenAI API that would change the output is either implemented or refused with a 400
    naming it (`REFUSED`); only the fields in `IGNORED` are accepted and ignored: they change nothing in
    the output (who asked, storage and billing hints);
  * ranges as the OpenAI API defines them; no bool where a number is meant (``max_tokens: true`` is a
    400), no string where a number is meant;
  * roles: system, developer, user, assistant, tool; content: a string or a list of ``{"type": "text"}``
    parts (joined with newlines, as vLLM does); any other part type is a 400 naming it.

`ChatRequest` is ``POST /v1/chat/completions``, `CompletionRequest` is ``POST /v1/completions``.
`request_error` turns a pydantic error into one message naming each bad field.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

#: Accepted and ignored: they change nothing in the output.
IGNORED = {
    "user": "an end-user id for abuse monitoring",
    "metadata": "tags stored with the request by OpenAI",
    "store": "whether OpenAI stores the completion",
    "service_tier": "the billing / latency tier",
    "prompt_cache_key": "a hint for the provider's prompt cache",
    "prompt_cache_options": "the provider's prompt cache settings",
    "prompt_cache_retention": "the provider's prompt cache lifetime",
    "safety_identifier": "an end-user id for abuse monitoring",
}

#: Fields of the OpenAI API that would change the output and are not implemented: a 400 when set to
#: anything but their "off" value.
REFUSED = {
    "tools": "tool calling is not supported",
    "tool_choice": "tool calling is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "parallel_tool_calls": "tool calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "reasoning_effort": "the target is not a reasoning model",
    "verbosity": "verbosity control is not supported",
    "web_search_options": "web search is not supported",
    "suffix": "insertion (suffix) is not supported",
    "moderation": "moderation is not run by this server",
}

#: Implemented (each changes the output as the API defines; tested in tests/test_serve_api.py). ``n``,
#: ``best_of``, ``response_format`` and ``modalities`` only in their one-choice / text value (others: 400).
IMPLEMENTED = {
    "chat": ["messages", "model", "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
             "max_tokens", "max_completion_tokens", "n", "seed", "stop", "stream", "stream_options", "temperature",
             "top_p", "response_format", "modalities"],
    "completion": ["prompt", "model", "echo", "best_of", "frequency_penalty", "presence_penalty", "logit_bias",
                   "logprobs", "max_tokens", "n", "seed", "stop", "stream", "stream_options", "temperature", "top_p"],
    # vLLM's extensions, on both routes
    "extensions": ["top_k", "min_p", "repetition_penalty"],
}

Float = Annotated[float, Field(strict=True)]
Int = Annotated[int, Field(strict=True)]
Penalty = Annotated[float, Field(strict=True, ge=-2.0, le=2.0)]
Temperature = Annotated[float, Field(strict=True, ge=0.0, le=2.0)]
Probability = Annotated[float, Field(strict=True, ge=0.0, le=1.0)]
PositiveInt = Annotated[int, Field(strict=True, ge=1)]
Str = Annotated[str, Field(strict=True)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: Annotated[bool, Field(strict=True)] = False
    continuous_usage_stats: Annotated[bool, Field(strict=True)] = False


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Str | list[dict] | None = None
    name: Str | None = None
    tool_call_id: Str | None = None
    tool_calls: list | None = None
    refusal: Str | None = None

    @field_validator("content")
    @classmethod
    def _text_parts(cls, v):
        if isinstance(v, list):
            for i, part in enumerate(v):
                kind = part.get("type")
                if kind != "text":
                    raise ValueError(f"content part {i} has type {kind!r}: only 'text' parts are supported")
                extra = set(part) - {"type", "text"}
                if extra:
                    raise ValueError(f"content part {i} has unknown fields {sorted(extra)}")
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"content part {i} needs a string 'text'")
        return v

    @model_validator(mode="after")
    def _no_tools(self):
        if self.tool_calls:
            raise ValueError("'tool_calls' in a message: tool calling is not supported")
        if self.content is None:
            raise ValueError(f"a {self.role} message needs 'content'")
        return self

    def text(self) -> str:
        """The message's text: the string, or the text parts joined with newlines."""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p["text"] for p in self.content)

    def template_dict(self) -> dict:
        """What the chat template gets: role and text (and name / tool_call_id when given)."""
        d: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.name is not None:
            d["name"] = self.name
        if self.tool_call_id is not None:
            d["tool_call_id"] = self.tool_call_id
        return d


class _Common(_Strict):
    """The fields chat and text completions share."""

    model: Str | None = None
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: Annotated[float, Field(strict=True, gt=0.0, le=10.0)] = 1.0  # vLLM's extension
    logit_bias: dict[str, Annotated[float, Field(strict=True, ge=-100.0, le=100.0)]] | None = None
    n: PositiveInt = 1
    seed: Int | None = None
    stop: Str | list[Str] | None = None
    stream: Annotated[bool, Field(strict=True)] = False
    stream_options: StreamOptions | None = None
    temperature: Temperature | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Field(strict=True, ge=-1)] | None = None  # vLLM's extension; -1 / 0: off
    min_p: Probability | None = None  # vLLM's extension
    # accepted and ignored (IGNORED)
    user: Str | None = None
    metadata: dict[str, Str] | None = None
    store: Annotated[bool, Field(strict=True)] | None = None
    service_tier: Str | None = None
    prompt_cache_key: Str | None = None
    prompt_cache_options: dict | None = None
    prompt_cache_retention: Str | None = None
    safety_identifier: Str | None = None
    # refused unless off (REFUSED)
    suffix: Any = None

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, v):
        for k in v or {}:
            if not k.lstrip("-").isdigit() or int(k) < 0:
                raise ValueError(f"logit_bias keys are token ids (non-negative integers as strings), got {k!r}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(s == "" for s in stops):
            raise ValueError("a stop sequence must not be empty")
        return v

    @model_validator(mode="after")
    def _common_rules(self):
        if self.n != 1:
            raise ValueError("'n' must be 1 (one choice per request)")
        if self.stream_options is not None and not self.stream:
            raise ValueError("'stream_options' is only allowed when 'stream' is true")
        if self.suffix is not None:
            raise ValueError(f"'suffix': {REFUSED['suffix']}")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def bias(self) -> tuple[tuple[int, float], ...]:
        return tuple(sorted((int(k), float(v)) for k, v in (self.logit_bias or {}).items()))

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: PositiveInt | None = None
    max_completion_tokens: PositiveInt | None = None
    logprobs: Annotated[bool, Field(strict=True)] | None = None
    top_logprobs: Annotated[int, Field(strict=True, ge=0, le=20)] | None = None
    response_format: dict | None = None
    modalities: list[Str] | None = None
    tools: list | None = None
    tool_choice: Any = None
    functions: list | None = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    verbosity: Any = None
    web_search_options: Any = None
    moderation: Any = None

    @model_validator(mode="after")
    def _chat_rules(self):
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise ValueError(f"'{name}': {REFUSED[name]}")
        if self.tool_choice not in (None, "none"):
            raise ValueError(f"'tool_choice': {REFUSED['tool_choice']}")
        for name in ("function_call", "parallel_tool_calls", "audio", "prediction", "reasoning_effort",
                     "verbosity", "web_search_options", "moderation"):
            if getattr(self, name) is not None:
                raise ValueError(f"'{name}': {REFUSED[name]}")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ValueError(f"'response_format' {self.response_format.get('type')!r} is not supported "
                             f"(only {{'type': 'text'}}: structured output is not implemented)")
        if self.modalities is not None and self.modalities != ["text"]:
            raise ValueError(f"'modalities' {self.modalities}: only ['text'] is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("'top_logprobs' needs 'logprobs': true")
        return self

    def max_new(self, default: int) -> int:
        return self.max_completion_tokens or self.max_tokens or default

    def want_logprobs(self) -> int | None:
        """None: no logprobs; else how many alternatives per token."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Common):
    """``POST /v1/completions`` (text prompts)."""

    prompt: Str | Annotated[list[Str], Field(min_length=1, max_length=1)] | \
        Annotated[list[Annotated[int, Field(strict=True, ge=0)]], Field(min_length=1)] | \
        Annotated[list[list[Annotated[int, Field(strict=True, ge=0)]]], Field(min_length=1, max_length=1)]
    max_tokens: PositiveInt = 16
    echo: Annotated[bool, Field(strict=True)] = False
    best_of: PositiveInt | None = None
    logprobs: Annotated[int, Field(strict=True, ge=0, le=5)] | None = None

    @model_validator(mode="after")
    def _completion_rules(self):
        if self.best_of not in (None, 1):
            raise ValueError("'best_of' must be 1 (one candidate per request)")
        if isinstance(self.prompt, str) and not self.prompt:
            raise ValueError("'prompt' must not be empty")
        return self

    def max_new(self, default: int) -> int:
        return self.max_tokens

    def want_logprobs(self) -> int | None:
        return self.logprobs


def request_error(e: ValidationError) -> tuple[str, str | None]:
    """One message naming every bad field, and the first bad field's name (OpenAI's ``param``)."""
    parts, param = [], None
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"] if not str(x).startswith(("function-", "list[", "str", "int",
                                                                             "constrained-", "json-or-python")))
        msg = err["msg"].removeprefix("Value error, ")
        named = re.match(r"^'([a-z_]+)'", msg)  # a rule over several fields names the one it refuses
        if param is None and (loc or named):
            param = loc or named.group(1)
        if err["type"] == "extra_forbidden":
            msg = "unknown field (not part of the API this server implements)"
        elif err["type"] == "missing":
            msg = "required field missing"
        elif "input" in err and err["type"] not in ("value_error",):
            msg = f"{msg} (got {err['input']!r:.80})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    # a union reports every alternative: keep each field's first message
    seen, out = set(), []
    for p in parts:
        key = p.split(":", 1)[0]
        if key not in seen:
            seen.add(key)
            out.append(p)
    return "; ".join(out), param
