"""What a decoder-side drafter can do, read once and checked in one place.

A drafter (engine/drafters.py gives the protocol: ``start``, ``propose``, ``commit``) declares what it can do with
plain attributes and optional methods. `capabilities` reads them all here, checks their types and values, and
returns one frozen `DrafterCaps` record; the single and batched decoders, the server, the evaluation and the
pipeline read that record instead of probing the drafter themselves. `check_drafter` is the one check of a drafter
against a target and a tree shape, for every decoder.

Declared attributes (all optional; the default in brackets):
  * ``name`` [the class name], ``target_fingerprint`` [None: not checked], ``vocab_size`` [None: not checked],
    ``context_length`` [None: no limit of its own];
  * ``supports_trees`` [True]: False for a drafter that drafts chains only;
  * ``max_depth`` [None]: the most tokens it drafts in a row (Medusa's head count);
  * ``needs_target_hidden`` [False]: the target's prefill runs before the first draft (head drafters);
  * ``any_range`` [False]: ``propose`` takes any node range, not only one depth at a time;
  * ``default_policy`` [None]: the chain-length policy when the decoder is given none;
  * ``draft_tree(dec, state, tree, cap)`` and ``max_nodes``: a drafter that builds each step's tree itself
    (``model_free`` [False] when it needs no model at all: the batched decoder takes those);
  * ``verify_forward(dec, state, tree)``: a self-drafter's own verification forward (Kangaroo);
  * ``finish(dec, state)``: called after each generation (a global suffix index learns from it);
  * ``batch_adapter()``: the drafter's own batched adapter (a kind that brings one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from draftsmith.target import check_fingerprint


@dataclass(frozen=True)
class DrafterCaps:
    """One drafter's declared capabilities (see the module docstring for each field)."""
    name: str
    target_fingerprint: Any = None
    vocab_size: int | None = None
    context_length: int | None = None
    supports_trees: bool = True
    max_depth: int | None = None
    needs_target_hidden: bool = False
    any_range: bool = False
    default_policy: Any = None
    draft_tree: Callable | None = None
    max_nodes: int = 0
    model_free: bool = False
    verify_forward: Callable | None = None
    finish: Callable | None = None
    batch_adapter: Callable | None = None

    @property
    def builds_trees(self) -> bool:
        """Whether it builds each step's tree itself (``draft_tree``)."""
        return self.draft_tree is not None


_NO_DRAFTER = DrafterCaps(name="none")


def _opt_int(name: str, field: str, v: Any, low: int) -> int | None:
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise ValueError(f"drafter {name!r}: {field} must be an integer >= {low} or None, got {v!r}")
    return int(v)


def _flag(name: str, field: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"drafter {name!r}: {field} must be True or False, got {v!r}")
    return v


def _hook(name: str, field: str, v: Any) -> Callable | None:
    if v is not None and not callable(v):
        raise ValueError(f"drafter {name!r}: {field} must be a method or None, got {type(v).__name__}")
    return v


def capabilities(drafter: Any) -> DrafterCaps:
    """The drafter's capability record (a record with every default for ``None``, plain decoding). The only place
    that probes a drafter's optional attributes; a wrong type or value is refused with the attribute's name."""
    if drafter is None:
        return _NO_DRAFTER
    for m in ("start", "propose", "commit"):
        if not callable(getattr(drafter, m, None)):
            raise ValueError(f"{type(drafter).__name__} is not a drafter: it has no {m}() method "
                             "(see draftsmith.engine.drafters)")
    name = str(getattr(drafter, "name", None) or type(drafter).__name__)
    g = lambda field, default=None: getattr(drafter, field, default)  # noqa: E731
    draft_tree = _hook(name, "draft_tree", g("draft_tree"))
    max_nodes = _opt_int(name, "max_nodes", g("max_nodes", 0), 0) or 0
    if draft_tree is not None and max_nodes < 1:
        raise ValueError(f"drafter {name!r} builds its own trees (draft_tree) but declares max_nodes={max_nodes}: "
                         "give the largest tree it builds")
    return DrafterCaps(
        name=name,
        target_fingerprint=g("target_fingerprint"),
        vocab_size=_opt_int(name, "vocab_size", g("vocab_size"), 1),
        context_length=_opt_int(name, "context_length", g("context_length") or None, 1),
        supports_trees=_flag(name, "supports_trees", g("supports_trees", True)),
        max_depth=_opt_int(name, "max_depth", g("max_depth"), 1),
        needs_target_hidden=_flag(name, "needs_target_hidden", g("needs_target_hidden", False)),
        any_range=bool(g("any_range", False)),  # a truthy value, as the decoders always read it
        default_policy=g("default_policy"),
        draft_tree=draft_tree,
        max_nodes=max_nodes,
        model_free=_flag(name, "model_free", g("model_free", False)),
        verify_forward=_hook(name, "verify_forward", g("verify_forward")),
        finish=_hook(name, "finish", g("finish")),
        batch_adapter=_hook(name, "batch_adapter", g("batch_adapter")),
    )


def batch_adapter(caps: DrafterCaps) -> Any:
    """The drafter's batched adapter (its ``batch_adapter()``: each kind brings its own), or a clear error for a
    drafter that is not batched yet. An adapter serves every live row of the batched decoder in one call:
    ``start(dec, states, capacity, rows)``, ``join(dec, state)``, ``begin_step(states)``, ``propose(rows, states,
    trees, ranges)``, ``commit(row, dec, state, tree, path)``, ``history(state, old, new)`` and ``move_row(src,
    dst, state)`` (heads/decode.py's `HeadRows` is one)."""
    if caps.batch_adapter is None:
        raise ValueError(f"drafter {caps.name!r} is not batched yet (it has no batch_adapter()): use "
                         "SpeculativeDecoder (batch size 1); head drafters (Medusa, Hydra, Hydra++), standalone "
                         "model drafters and EAGLE-3 are batched")
    return caps.batch_adapter()


def check_drafter(caps: DrafterCaps, target: Any, tree: Any = None) -> None:
    """Refuse a drafter that does not fit ``target`` (fingerprint, vocabulary) or the decoder's tree shape
    (``tree``: None for chains, a `StaticTree` or a `DynamicTree`), naming what differs."""
    if caps.target_fingerprint is not None:
        check_fingerprint(caps.target_fingerprint, target, what=f"drafter {caps.name!r}")
    if caps.vocab_size is not None and caps.vocab_size != target.vocab_size:
        raise ValueError(f"drafter vocabulary ({caps.vocab_size}) differs from the target's ({target.vocab_size})")
    if tree is None:
        return
    if not caps.supports_trees:
        raise ValueError(f"drafter {caps.name!r} drafts chains only: trees are not supported with it "
                         "(use tree=None, i.e. --tree chain)")
    check_depth = getattr(tree, "check_depth", None)  # a static tree checks its depth against max_depth
    if check_depth is not None:
        check_depth(caps.max_depth)
