"""One request's types in the server: what to decode (`Spec`), its growing text (`TextStream`), and the 400 it
can raise (`BadRequest`)."""

from __future__ import annotations

from dataclasses import dataclass

from draftsmith.engine.processors import Penalties, RequestProcessing
from draftsmith.engine.sampling import SamplingParams


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400), with a message naming the field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class Spec:
    """What to decode for one request, from its validated body."""

    body: dict  # the request as received (logged)
    kind: str  # "chat" | "completion"
    prompt: list[int]
    sampling: SamplingParams
    max_tokens: int
    seed: int | None
    penalties: Penalties
    top_logprobs: int | None  # None: no logprobs
    stops: list[str]

    def processing(self, vocab_size: int) -> RequestProcessing | None:
        if not self.penalties.active and self.top_logprobs is None:
            return None
        return RequestProcessing(self.penalties, vocab_size, self.top_logprobs)


class TextStream:
    """Incremental text of a response: holds back an incomplete UTF-8 character and any tail that could still
    grow into a stop sequence; cuts the text at the first stop sequence."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.sent = ""
        self.text = ""
        self.stopped = False

    def push(self, ids: list[int], final: bool) -> str:
        """The new text to send after the response grew to ``ids``; sets ``stopped`` at a stop sequence."""
        text = self.tok.decode(ids, skip_special_tokens=True)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text, self.stopped, final = text[:cut], True, True
        self.text = text
        end = len(text)
        if not final:
            if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the rest
                return ""
            end = max(len(self.sent), end - self.hold)
        delta, self.sent = text[len(self.sent):end], text[:end]
        return delta


