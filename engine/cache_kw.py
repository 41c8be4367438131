"""The keyword a transformers module takes its KV cache under, for every call we make with one.

transformers 5.x renamed the cache argument of model bodies, decoder layers and attention modules from
``past_key_values`` to ``cache``; ``past_key_values`` stays accepted there as a deprecated alias that
raises a FutureWarning on every call (removal announced for 5.40). The versions before the rename
(``transformers>=4.56`` is allowed) only know ``past_key_values``. So each call site asks this module:

    h = body(input_ids=ids, **cache_arg(body, cache), use_cache=True).last_hidden_state

The name is read from the module's ``forward`` signature once per module class (the deprecation
decorator keeps the wrapped signature), so the cost per call is a dict lookup.
"""

from __future__ import annotations

import inspect
from typing import Any

_BY_CLASS: dict[type, str] = {}
_DEFAULT: str | None = None


def _installed_default() -> str:
    """The installed transformers' name, for a forward that shows neither (``*args, **kwargs`` wrappers)."""
    global _DEFAULT
    if _DEFAULT is None:
        from transformers import LlamaModel
        params = inspect.signature(LlamaModel.forward).parameters
        _DEFAULT = "cache" if "cache" in params else "past_key_values"
    return _DEFAULT


def cache_kw(module: Any) -> str:
    """``"cache"`` or ``"past_key_values"``: the keyword ``module(...)`` takes its KV cache under."""
    cls = type(module)
    kw = _BY_CLASS.get(cls)
    if kw is None:
        try:
            params = inspect.signature(module.forward if hasattr(module, "forward") else module).parameters
        except (TypeError, ValueError):
            params = {}
        if "cache" in params:
            kw = "cache"
        elif "past_key_values" in params:
            kw = "past_key_values"
        else:
            kw = _installed_default()
        _BY_CLASS[cls] = kw
    return kw


def cache_arg(module: Any, cache: Any) -> dict[str, Any]:
    """``{cache_kw(module): cache}``, to splat into the call: ``module(..., **cache_arg(module, cache))``."""
    return {cache_kw(module): cache}
