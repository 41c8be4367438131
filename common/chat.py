"""Rendering a conversation for training: token ids and the assistant-token loss mask (the text as
`draftsmith.chat.render` gives it: the chat template's, or a base model's plain completion)."""

from __future__ import annotations

from typing import Iterable

from draftsmith.chat import render


def render_example(tokenizer, messages: list[dict], finished: Iterable[bool]) -> tuple[list[int], list[int]]:
    """Token ids of a whole conversation and a 0/1 mask over assistant tokens.

    Each assistant reply's character span is located by rendering the
    conversation up to that reply (chat templates are prefix-consistent; this
    is checked), and tokens inside it are marked; the end-of-turn token right
    after a reply is marked too when that reply finished on its own.
    """
    text = render(tokenizer, messages)
    spans = []
    fin = list(finished)
    a = 0
    for j, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = render(tokenizer, messages[:j], True)
        start, end = len(head), len(head) + len(m["content"])
        if text[start:end] != m["content"]:
            raise ValueError("chat template is not prefix-consistent; cannot locate assistant turns")
        spans.append((start, end, fin[a] if a < len(fin) else True))
        a += 1
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    eos = tokenizer.eos_token_id
    mask = [0] * len(ids)
    for start, end, done in spans:
        after = None
        for i, (s, e) in enumerate(offsets):
            if e > s and start <= s and e <= end:
                mask[i] = 1
            elif after is None and s >= end:
                after = i
        if done and after is not None and ids[after] == eos:
            mask[after] = 1  # the end-of-turn token that closes this reply
    return ids, mask
