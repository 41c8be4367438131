"""Drafter kinds: the typed protocol every kind implements, and the registry that finds them.

A kind is one folder: ``heads/NAME/``, ``drafters/NAME/`` (drafter kinds) or ``classifiers/NAME/``
(length predictors). A drafter kind's folder holds

* ``config.py``: its recipe section, a `draftsmith.schema.KindConfig` subclass decorated with
  `register_config` (the recipe schema's union of kinds is built from these);
* ``model.py``: its ``nn.Module`` class, decorated with `register`, implementing `DrafterKind`
  (usually by subclassing `KindBase`, which supplies the optional hooks' defaults);
* whatever else it needs (objective, decoding and batched adapters, export), imported from those.

The registry imports the folders it finds (`importlib`, not an import statement), so the core, the
engine, the trainer, the pipeline and export never import a kind, and never compare a kind's name:
they call the hooks below. A new kind is a new folder and a recipe.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, ClassVar, Protocol, runtime_checkable

from pydantic import ValidationError

if TYPE_CHECKING:
    import torch

    from draftsmith.schema import KindConfig

DRAFTER_FAMILIES = ("draftsmith.heads", "draftsmith.drafters")
PREDICTOR_FAMILIES = ("draftsmith.classifiers",)

_KINDS: dict[str, type] = {}
_CONFIGS: dict[str, type] = {}
_PREDICTORS: dict[str, Any] = {}
_FORMATS: dict[str, "ExportFormat"] = {}
_UNTRAINED: dict[str, "Untrained"] = {}
_TEXT_RUNS: dict[str, Any] = {}


@runtime_checkable
class DrafterKind(Protocol):
    """What the trainer, the pipeline, the decoder and export call on a drafter kind.

    Class level (the module class):
      * ``kind``: the registry name, written into every checkpoint;
      * ``cache_needs(config) -> ["final" | "layer:N", ...]``: the target states it trains on;
      * ``from_config(config, target)``: the module a checkpoint's config.json describes;
      * ``for_target(target, **recipe_fields)``: a fresh module for a recipe;
      * ``make_objective(recipe, cache, target, exclude)``: its training objective (``prepare``,
        ``loss``, ``stats``, ``chunks``).
    Instance level:
      * ``config``: what config.json holds: the kind's pydantic config (`KindBase.config_class`: its recipe
        section and the target's shapes, the constructor's argument), or a JSON-able dict;
      * ``decoder_drafter(target, fingerprint, name)``: the module as a decoder drafter.
    Optional hooks with defaults in `KindBase`: ``fit_to_cache``, ``heldout_metrics``,
    ``trains_on_text``, ``conditional_accuracy``, ``builds_trees``.
    A kind that a serving engine loads also has ``export.py``, which registers its `ExportFormat`.
    """

    kind: ClassVar[str]
    config: Any

    @staticmethod
    def cache_needs(config: dict) -> list[str]: ...

    @classmethod
    def from_config(cls, config: dict, target) -> "DrafterKind": ...

    @classmethod
    def for_target(cls, target, **fields) -> "DrafterKind": ...

    @classmethod
    def make_objective(cls, recipe, cache, target, exclude: set[int]) -> Any: ...

    def decoder_drafter(self, target, target_fingerprint: str | None, name: str) -> Any: ...


class KindBase:
    """Defaults of a drafter kind's optional hooks (mix into the kind's ``nn.Module``)."""

    #: trains on re-tokenised text (its own tokenizer) instead of cached target states
    trains_on_text: ClassVar[bool] = False
    #: drafts read earlier drafts (Hydra): reports give acceptance conditional on the path too
    conditional_accuracy: ClassVar[bool] = False
    #: the trees stage builds static trees from its per-depth acceptance (heads)
    builds_trees: ClassVar[bool] = False
    #: the target's modules the kind shares (not stored in its checkpoint)
    shared_with_target: tuple[str, ...] = ()
    #: the kind's config.json and its constructor's one config argument: its recipe section plus the target's
    #: shapes (`draftsmith.schema.TargetShape`); None for a kind that keeps a plain dict
    config_class: ClassVar[Any] = None

    @classmethod
    def read_config(cls, config):
        """``config`` (a config.json's dict without or with its ``kind``, or the config itself) as `config_class`,
        validated: an unknown or missing field is a clear error naming it."""
        if isinstance(config, cls.config_class):
            return config
        try:
            return cls.config_class.model_validate({**dict(config), "kind": cls.kind})  # type: ignore[attr-defined]
        except ValidationError as e:  # one line a field, named
            raise ValueError("; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}"
                                       for err in e.errors())) from None

    def fit_to_cache(self, cache, target, exclude: set[int] | None = None) -> dict | None:
        """Statistics of the training data the module keeps, computed before the first step."""
        return None

    def heldout_metrics(self, cache, target) -> dict | None:
        """The kind's own held-out figures (None: the head report's per-depth accuracy)."""
        return None

    @classmethod
    def for_target(cls, target, **fields):
        """A fresh module for a recipe's fields (kinds that initialise from the target override this)."""
        return cls.from_config({"hidden_size": target.hidden_size, "vocab_size": target.vocab_size, **fields}, target)

    @classmethod
    def make_objective(cls, recipe, cache, target, exclude: set[int]):
        raise NotImplementedError(f"a {cls.kind!r} drafter has no objective on cached states")  # type: ignore[attr-defined]

    def set_draft_vocab(self, kept_ids: "torch.Tensor") -> None:
        raise ValueError(f"a {self.kind!r} drafter has no pruned draft vocabulary")  # type: ignore[attr-defined]

    def engine_gap(self, engine: str) -> str | None:
        """What of this drafter ``engine`` ("llama.cpp", "vllm") would not compute as we do (an option its loader
        ignores), or None; exports to that engine refuse with it rather than write a file it misreads."""
        return None


def register(cls: type) -> type:
    """Class decorator: register a drafter kind under ``cls.kind``."""
    name = getattr(cls, "kind", None)
    if not name:
        raise TypeError(f"{cls.__name__} has no 'kind' attribute")
    if name in _KINDS and _KINDS[name] is not cls:
        raise ValueError(f"drafter kind {name!r} registered twice")
    missing = [h for h in ("cache_needs", "from_config", "for_target", "make_objective", "decoder_drafter")
               if not callable(getattr(cls, h, None))]
    if missing:
        raise TypeError(f"drafter kind {name!r} ({cls.__name__}) lacks {missing}")
    _KINDS[name] = cls
    return cls


def register_config(cls: "type[KindConfig]") -> "type[KindConfig]":
    """Class decorator: a drafter kind's recipe section (its ``kind`` field is a one-value Literal)."""
    literal = cls.model_fields["kind"].annotation
    names = getattr(literal, "__args__", ())
    if len(names) != 1:
        raise TypeError(f"{cls.__name__}.kind must be a Literal of one name, got {literal}")
    _CONFIGS[names[0]] = cls
    return cls


@dataclass(frozen=True)
class ExportFormat:
    """A serving layout a kind can be written in (``draftsmith export --to NAME``) and read back from."""

    name: str
    holds: Callable[[Any], bool]  # (export source: .module, .manifest, .kind) -> can this format hold it
    what: str  # what it holds, for error messages
    write: Callable[..., list[str]]  # (source, out_dir, target, base_model, provenance) -> files written
    usage: str  # how a consumer loads it (model card)
    #: (source, out_dir, target) -> (source logits, reloaded logits, exact?): the reload check
    check: Callable[..., tuple] | None = None
    note: str = ""  # a model-card paragraph
    #: config.json of a directory -> is it in this format (``draftsmith import``, ``load_drafter``)
    recognizes: Callable[[dict], bool] | None = None
    #: (dir, target) -> (module, its config.json, provenance for the imported checkpoint's manifest)
    read: Callable[..., tuple] | None = None


def register_format(fmt: ExportFormat) -> ExportFormat:
    """Register a kind's serving format (from the kind's ``export.py``)."""
    _FORMATS[fmt.name] = fmt
    return fmt


def export_formats() -> dict[str, ExportFormat]:
    """The serving formats kinds bring, by name."""
    _discover(DRAFTER_FAMILIES, "export")
    return dict(_FORMATS)


def register_predictor(name: str):
    """Decorator for a length predictor's fitting function (a ``classifiers/NAME/`` folder)."""
    def deco(fn):
        _PREDICTORS[name] = fn
        return fn
    return deco


@dataclass(frozen=True)
class Untrained:
    """A decoder-only drafter made without a checkpoint, named by a spec ``NAME`` or ``NAME:ARG``."""
    name: str
    make: Callable  # (target, arg: int | None) -> decoder drafter
    arg: str | None  # what ARG is (None: the spec takes none)
    help: str


def register_untrained(name: str, help: str, arg: str | None = None):
    """Decorator for the factory ``make(target, arg)`` of a decoder-only drafter (``first-layers:N``,
    ``early-exit:L``, ``suffix``, ``prompt-lookup:K``), registered by the kind whose decoding it uses."""
    def deco(fn):
        _UNTRAINED[name] = Untrained(name, fn, arg, help)
        return fn
    return deco


def register_text_run(kind: str):
    """Decorator for the function ``run(recipe, target, out)`` of a kind that ``trains_on_text`` (from the kind's
    ``training.py``): its drafter, objective and data figures for the training loop."""
    def deco(fn):
        _TEXT_RUNS[kind] = fn
        return fn
    return deco


def text_run(kind: str):
    """The registered ``run(recipe, target, out)`` of a kind that trains on text, with a clear error if none."""
    if kind not in _TEXT_RUNS:
        _discover(DRAFTER_FAMILIES, "training")
    if kind not in _TEXT_RUNS:
        raise KeyError(f"drafter kind {kind!r} registers no text training; kinds that do: {sorted(_TEXT_RUNS)}")
    return _TEXT_RUNS[kind]


def untrained_drafters() -> dict[str, Untrained]:
    """Every registered decoder-only drafter, by name."""
    _discover(DRAFTER_FAMILIES, "decode")
    _discover(DRAFTER_FAMILIES, "drafter")
    return dict(sorted(_UNTRAINED.items()))


def untrained_drafter_name(spec: str) -> str | None:
    """The registered decoder-only drafter's name a spec ``NAME[:ARG]`` starts with, or None."""
    name = str(spec).partition(":")[0]
    return name if name in untrained_drafters() else None


def untrained_drafter(spec: str, target: Any) -> Any | None:
    """The decoder drafter a spec ``NAME[:ARG]`` names (``first-layers:4``, ``early-exit:8``, ``suffix``,
    ``prompt-lookup:10``), or None when its NAME is not one (then the spec is a checkpoint path). A known name
    with a missing, extra or non-integer ARG is a ValueError naming the expected form."""
    name, sep, arg = str(spec).partition(":")
    known = untrained_drafters()
    u = known.get(name)
    if u is None:
        return None
    form = f"{name}:{u.arg}" if u.arg else name
    if u.arg is None:
        if sep:
            raise ValueError(f"{spec!r}: {name} takes no argument (expected {form!r})")
        return u.make(target, None)
    try:
        n = int(arg)
    except ValueError:
        raise ValueError(f"{spec!r}: expected {form} with {u.arg} an integer") from None
    return u.make(target, n)


def _discover(families: tuple[str, ...], module: str) -> None:
    """Import ``FAMILY.KIND.<module>`` for every kind folder of the families (registers them)."""
    for family in families:
        pkg = importlib.import_module(family)
        for info in pkgutil.iter_modules(pkg.__path__):
            if not info.ispkg:
                continue
            name = f"{family}.{info.name}.{module}"
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if e.name != name:
                    raise


def get(kind: str) -> type:
    """Class of a registered drafter kind, with a clear error if unknown."""
    if kind not in _KINDS:
        _discover(DRAFTER_FAMILIES, "model")
    if kind not in _KINDS:
        raise KeyError(f"unknown drafter kind {kind!r}; known kinds: {sorted(_KINDS)}")
    return _KINDS[kind]


def kinds() -> list[str]:
    _discover(DRAFTER_FAMILIES, "model")
    return sorted(_KINDS)


def config_models() -> list[type]:
    """Every drafter kind's recipe section, in name order."""
    _discover(DRAFTER_FAMILIES, "config")
    return [_CONFIGS[k] for k in sorted(_CONFIGS)]


def predictors() -> dict[str, Any]:
    """Length predictors by name: ``fit(traces, target, where, temperature) -> headline``."""
    _discover(PREDICTOR_FAMILIES, "model")
    return dict(sorted(_PREDICTORS.items()))


def config_names() -> set[str]:
    """The kind names of every registered recipe section."""
    config_models()
    return set(_CONFIGS)
