"""engine.cache_kw: the KV-cache keyword a transformers module takes, and our calls raise no FutureWarning."""

import inspect
import warnings

import torch

from draftsmith.engine import cache_kw as ck
from draftsmith.engine.kvcache import KVCache
from tests.tiny import make_tiny_model


class _Old(torch.nn.Module):  # transformers before the rename
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return past_key_values


class _New(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return cache


class _Wrapper(torch.nn.Module):  # names neither: the installed transformers' name
    def forward(self, *args, **kwargs):
        return kwargs


def test_the_keyword_follows_the_signature():
    assert ck.cache_kw(_Old()) == "past_key_values"
    assert ck.cache_kw(_New()) == "cache"
    assert ck.cache_kw(_Wrapper()) == ck._installed_default()
    assert ck.cache_arg(_Old(), 7) == {"past_key_values": 7}
    assert _New()(**ck.cache_arg(_New(), 7)) == 7


def test_installed_transformers_bodies_and_layers_take_it_without_a_warning():
    model = make_tiny_model()
    body = model.get_decoder()
    params = inspect.signature(body.forward).parameters
    assert ck.cache_kw(body) == ("cache" if "cache" in params else "past_key_values")
    assert ck.cache_kw(body.layers[0]) == ck.cache_kw(body)
    cache = KVCache.for_model(model, 16)
    cache.set_write(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with torch.no_grad():
            h = body(input_ids=torch.tensor([[1, 5, 6]]), position_ids=torch.arange(3)[None],
                     **ck.cache_arg(body, cache), use_cache=True).last_hidden_state
    assert h.shape[:2] == (1, 3)
