"""A small name-keyed registry of drafter kinds.

A drafter kind is an ``nn.Module`` class with:
  * ``kind``: its registry name (written into every checkpoint);
  * ``cache_needs(config) -> list[str]``: the target states it trains on
    (``"final"`` = last hidden state after the final norm, ``"layer:N"`` =
    output of decoder layer N), so one caching pass stores only those;
  * ``from_config(config: dict, target) -> module`` and ``.config`` (a dict).

Optional hooks, so the trainer and the decoder never branch on a kind's name:
  * ``for_target(target, **recipe_fields) -> module``: a fresh module initialised from the target;
  * ``make_objective(recipe, cache, target, exclude) -> objective``: the kind's training objective
    (``prepare``, ``loss``, ``stats``, ``chunks``; see heads/objective.py for the head kinds');
  * ``module.decoder_drafter(target, fingerprint, name)``: the module as a decoder drafter;
  * ``module.set_draft_vocab(kept_ids)`` with a ``draft_head`` (heads/vocab.py): a pruned vocabulary chosen
    by the trainer from the training data;
  * ``module.fit_to_cache(cache, target, exclude) -> dict | None``: statistics of the training data the
    module keeps, computed by the trainer before the first step (the standalone kind's RDK map).
"""

from __future__ import annotations

_KINDS: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: register a drafter kind under ``cls.kind``."""
    name = getattr(cls, "kind", None)
    if not name:
        raise TypeError(f"{cls.__name__} has no 'kind' attribute")
    if name in _KINDS and _KINDS[name] is not cls:
        raise ValueError(f"drafter kind {name!r} registered twice")
    _KINDS[name] = cls
    return cls


def get(kind: str) -> type:
    """Class of a registered drafter kind, with a clear error if unknown."""
    _load_builtin()
    if kind not in _KINDS:
        raise KeyError(f"unknown drafter kind {kind!r}; known kinds: {sorted(_KINDS)}")
    return _KINDS[kind]


def kinds() -> list[str]:
    _load_builtin()
    return sorted(_KINDS)


def _load_builtin() -> None:
    # Importing the modules registers their kinds (function-local: the kinds import this module, a real cycle).
    import draftsmith.drafters.kangaroo  # noqa: F401
    import draftsmith.drafters.own_tokenizer  # noqa: F401
    import draftsmith.drafters.standalone  # noqa: F401
    import draftsmith.heads.hydra  # noqa: F401
    import draftsmith.heads.medusa  # noqa: F401
