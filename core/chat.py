"""A conversation's text as the target reads it.

A target's tokenizer carries its chat template (read from the target's files, never assumed). A base model has
none (Gemma-3-270M as shipped): its conversations are plain completion, the text of the messages one after the
other behind the tokenizer's BOS, each reply continuing the text before it. Such a target has no user turn to
write prompts from, so Magpie refuses it by name; a chat request to its server is rendered the same way.
"""

from __future__ import annotations


def has_template(tokenizer) -> bool:
    """Whether the tokenizer carries a chat template (an instruction-tuned target; a base model has none)."""
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer, messages: list[dict], generation: bool = False) -> str:
    """The conversation's text: the chat template's (``generation``: with the assistant's header after it), or for
    a base model the BOS and the messages' contents, one after the other (nothing to add for a reply to follow)."""
    if has_template(tokenizer):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
    return (getattr(tokenizer, "bos_token", None) or "") + "".join(m["content"] for m in messages)


def prompt_token_ids(tokenizer, messages: list[dict]) -> list[int]:
    """Token ids of a prompt (`render` with the generation header), special tokens as the rendered text has them."""
    return [int(x) for x in tokenizer(render(tokenizer, messages, True), add_special_tokens=False)["input_ids"]]


def shared_len(a, b, limit: int | None = None) -> int:
    """Length of the common prefix of the token sequences ``a`` and ``b``, at most ``limit``."""
    n = min(len(a), len(b)) if limit is None else min(limit, len(a), len(b))
    return next((t for t in range(n) if a[t] != b[t]), n)


def shared_prompt_prefix(tokenizer) -> list[int]:
    """The tokens every one-user-message prompt starts with: the chat template's default system prompt and user
    header (for a base model, its BOS), found as the common prefix of two prompts that differ in their message
    only; [] if rendering fails. A server prefills it once and copies its cache entries into each row."""
    try:
        a, b = (prompt_token_ids(tokenizer, [{"role": "user", "content": c}]) for c in ("Hello", "Why?"))
    except Exception:  # noqa: BLE001 (a template that needs more than one user message: no shared prefix)
        return []
    return a[:shared_len(a, b)]
