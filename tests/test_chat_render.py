"""A conversation's text: the chat template where the target has one, plain completion for a base model."""

import pytest

from draftsmith.chat import has_template, prompt_token_ids, render
from draftsmith.common.chat import render_example
from draftsmith.eval.mtbench import chat_ids
from draftsmith.train.data.generate import user_prefix_ids
from tests.tiny import make_tokenizer


@pytest.fixture()
def base():
    tok = make_tokenizer(96)
    tok.chat_template = None  # a base model's tokenizer: no template
    return tok


def test_templated_target_uses_its_template():
    tok = make_tokenizer(96)
    assert has_template(tok)
    msgs = [{"role": "user", "content": "hi"}]
    assert render(tok, msgs, True).endswith("<|im_start|>assistant\n")
    assert prompt_token_ids(tok, msgs) == chat_ids(tok, "hi")
    assert user_prefix_ids(tok)  # Magpie's user header


def test_base_model_is_plain_completion(base):
    msgs = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": " sat"}]
    assert not has_template(base)
    assert render(base, msgs[:1], True) == base.bos_token + "the cat"
    assert render(base, msgs) == base.bos_token + "the cat sat"
    ids, mask = render_example(base, msgs, [True])
    assert base.decode([i for i, m in zip(ids, mask) if m]) == " sat"  # the reply's tokens, and only those
    assert chat_ids(base, "the cat")[0] == base.bos_token_id


def test_magpie_refuses_a_base_model_by_name(base):
    with pytest.raises(ValueError, match="no chat template"):
        user_prefix_ids(base)
