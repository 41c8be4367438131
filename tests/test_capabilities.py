"""A drafter's capability record: read once, checked in one place, and the only reader of the declared attributes."""

import ast
import re

import pytest

from draftsmith.engine.batched import BatchedSpeculativeDecoder
from draftsmith.engine.capabilities import DrafterCaps, capabilities, check_drafter
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.engine.policies import FixedLength
from draftsmith.engine.trees import StaticTree
from tests.test_decoder import random_medusa, tiny
from tests.test_layering import MODULES


class _Bare:
    """The least a drafter is: start, propose, commit."""

    def start(self, dec, state):
        return None

    def propose(self, dec, state, tree, start, end):
        return None

    def commit(self, dec, state, tree, path):
        pass


def test_no_drafter_and_a_bare_drafter_get_the_defaults():
    none = capabilities(None)
    assert none.name == "none" and none.max_nodes == 0 and not none.builds_trees
    caps = capabilities(_Bare())
    assert caps == DrafterCaps(name="_Bare")
    assert caps.supports_trees and caps.max_depth is None and caps.verify_forward is None


def test_declared_attributes_are_read_into_the_record():
    d = _Bare()
    d.name, d.max_depth, d.supports_trees, d.needs_target_hidden = "mine", 3, False, True
    d.default_policy = FixedLength(2)
    d.max_nodes, d.model_free = 8, True
    d.draft_tree = lambda dec, state, tree, cap: False
    caps = capabilities(d)
    assert (caps.name, caps.max_depth, caps.supports_trees, caps.needs_target_hidden) == ("mine", 3, False, True)
    assert caps.default_policy is d.default_policy and caps.builds_trees and caps.max_nodes == 8 and caps.model_free


@pytest.mark.parametrize("attr,value,match", [
    ("max_depth", 0, "max_depth must be an integer >= 1"),
    ("max_depth", "3", "max_depth must be an integer"),
    ("vocab_size", True, "vocab_size must be an integer"),
    ("supports_trees", "no", "supports_trees must be True or False"),
    ("needs_target_hidden", 1, "needs_target_hidden must be True or False"),
    ("finish", 3, "finish must be a method"),
    ("draft_tree", lambda *a: False, "builds its own trees .* max_nodes=0"),
])
def test_a_wrong_declaration_is_refused_naming_the_attribute(attr, value, match):
    d = _Bare()
    setattr(d, attr, value)
    with pytest.raises(ValueError, match=match):
        capabilities(d)


def test_an_object_without_the_protocol_is_not_a_drafter():
    class NoCommit:
        def start(self, dec, state):
            return None

        def propose(self, *a):
            return None

    with pytest.raises(ValueError, match="not a drafter: it has no commit"):
        capabilities(NoCommit())


def test_check_drafter_refuses_what_does_not_fit_the_target_or_the_tree():
    tgt = tiny()
    d = _Bare()
    d.vocab_size = tgt.vocab_size + 1
    with pytest.raises(ValueError, match="vocabulary"):
        check_drafter(capabilities(d), tgt)
    d = _Bare()
    d.supports_trees = False
    check_drafter(capabilities(d), tgt)  # chains: fine
    with pytest.raises(ValueError, match="chains only"):
        check_drafter(capabilities(d), tgt, StaticTree([(0,), (1,)]))
    d = _Bare()
    d.max_depth = 1
    with pytest.raises(ValueError):
        check_drafter(capabilities(d), tgt, StaticTree([(0,), (0, 0)]))  # depth 2 from a drafter of depth 1


def test_both_decoders_hold_the_record_and_refuse_through_it():
    tgt = tiny()
    medusa = random_medusa(tgt, num_heads=2)
    for dec in (SpeculativeDecoder(tgt, medusa), BatchedSpeculativeDecoder(tgt, medusa)):
        assert dec.caps == capabilities(medusa) and dec.caps.max_depth == 2 and dec.caps.needs_target_hidden
    for make in (SpeculativeDecoder, BatchedSpeculativeDecoder):
        with pytest.raises(ValueError, match="depth"):
            make(tgt, medusa, tree=[(0,), (0, 0), (0, 0, 0)])


def test_the_batched_decoder_takes_a_drafter_by_its_own_adapter():
    tgt = tiny()
    with pytest.raises(ValueError, match="'_Bare' is not batched yet"):
        BatchedSpeculativeDecoder(tgt, _Bare())
    medusa = random_medusa(tgt, num_heads=2)
    assert type(BatchedSpeculativeDecoder(tgt, medusa).adapter).__name__ == "HeadRows"


FIELDS = "|".join(f.name for f in DrafterCaps.__dataclass_fields__.values() if f.name != "name")
PROBE = re.compile(rf"""(getattr|hasattr)\([^,()]+,\s*["']({FIELDS})["']""")


def test_only_the_capability_module_probes_a_drafters_declared_attributes():
    """Every `getattr`/`hasattr` of a capability attribute in the package is in engine/capabilities.py, so what a
    drafter can do is decided in one place (a kind may still set its own attributes)."""
    found = []
    for mod, path in MODULES.items():
        if mod == "draftsmith.engine.capabilities":
            continue
        src = path.read_text()
        ast.parse(src)  # the file is Python
        for i, line in enumerate(src.splitlines(), 1):
            if PROBE.search(line):
                found.append(f"{path.name}:{i}: {line.strip()}")
    assert not found, "\n".join(found)


def test_the_probe_scan_has_teeth():
    assert PROBE.search('x = getattr(drafter, "supports_trees", True)')
    assert PROBE.search("if hasattr(d, 'verify_forward'):")
    assert not PROBE.search('getattr(d, "compile_s", 0.0)')


# ---------------------------------------------------------------------------------------------- one resolver
def test_every_decoder_only_drafter_resolves_behind_one_function(tmp_path):
    from draftsmith import registry  # the registry of kinds, read as the CLI reads it
    from draftsmith.checkpoint import resolve_drafter
    from draftsmith.drafters.suffix.drafter import PromptLookupDrafter, SuffixDrafter

    assert {"first-layers", "early-exit", "suffix", "prompt-lookup"} <= set(registry.untrained_drafters())
    tgt = tiny()
    assert resolve_drafter("first-layers:2", tgt).name == "first-2-layers"
    assert resolve_drafter("early-exit:1", tgt).name == "early-exit-1"
    assert isinstance(resolve_drafter("suffix", tgt), SuffixDrafter)
    pl = resolve_drafter("prompt-lookup:5", tgt)
    assert isinstance(pl, PromptLookupDrafter) and pl.k == 5
    for spec, match in (("first-layers:x", "expected first-layers:N with N an integer"),
                        ("first-layers", "expected first-layers:N"),
                        ("suffix:3", "suffix takes no argument"),
                        ("prompt-lookup:0", "K must be >= 1"),
                        ("first-layers:99", "n_layers must be in")):
        with pytest.raises(ValueError, match=match):
            resolve_drafter(spec, tgt)
    assert registry.untrained_drafter_name("early-exit:3") == "early-exit"
    assert registry.untrained_drafter_name("runs/my-ckpt") is None
    (tmp_path / "suffix").mkdir()  # a directory of a spec's name is a checkpoint (here: an empty one, refused)
    with pytest.raises(Exception, match="suffix"):
        resolve_drafter(tmp_path / "suffix", tgt)
    with pytest.raises(Exception, match="no-such-checkpoint"):
        resolve_drafter(tmp_path / "no-such-checkpoint", tgt)
