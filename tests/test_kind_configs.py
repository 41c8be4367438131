"""One pydantic config per drafter kind: the recipe's section, plus the target's shapes, is config.json and the
module's constructor argument.

For every kind trained on cached states: its `config_class` derives from the recipe section registered for it
(the fields are written once), a fresh module's config validates as that class, the checkpoint's config.json is
its dump, loading gives the same config back, and a config.json with an unknown or a mistyped field, or one for
another target's sizes, is refused naming it.
"""

from __future__ import annotations

import json

import pytest

from draftsmith import registry
from draftsmith.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from tests.tiny import make_tiny_target

# a recipe's fields for each kind, small enough for the tiny target (4 layers)
FIELDS = {
    "medusa": {"num_heads": 2},
    "hydra": {"num_heads": 2, "num_layers": 2, "prefix_layer": True},
    "eagle3": {"aux_layers": [1, 2, 3], "vocab_keep": None},
    "dflash": {"target_layers": [1, 2, 3], "vocab_keep": None, "block_size": 4, "mask_token_id": 5},
    "kangaroo": {"exit_layer": 1, "adapter_mlp": True},
    "standalone": {"init": "target", "num_layers": 1},
}


@pytest.fixture(scope="module")
def target():
    return make_tiny_target(init_std=0.3, layers=4)


def test_every_state_trained_kind_is_listed():
    """A new kind that keeps a pydantic config is covered here (own-tokenizer needs its tokenizer: its own
    tests build it)."""
    have = {k for k in registry.kinds() if getattr(registry.get(k), "config_class", None) is not None}
    assert have - {"own-tokenizer"} == set(FIELDS)


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_config_is_the_recipe_section_and_round_trips(kind, target, tmp_path):
    cls = registry.get(kind)
    section = {c.model_fields["kind"].annotation.__args__[0]: c for c in registry.config_models()}[kind]
    assert issubclass(cls.config_class, section) and cls.config_class is not section
    assert set(section.model_fields) <= set(cls.config_class.model_fields)
    m = cls.for_target(target, **FIELDS[kind])
    assert isinstance(m.config, cls.config_class)
    for k, v in FIELDS[kind].items():
        assert getattr(m.config, k) == v
    ck = save_checkpoint(tmp_path / "ck", m, target)
    written = json.loads((ck / "config.json").read_text())
    assert written == {"kind": kind, **m.config.model_dump(mode="json", exclude={"kind"})}
    back, _ = load_checkpoint(ck, target)
    assert type(back.config) is cls.config_class
    assert back.config.model_dump(mode="json") == written | {"kind": kind}  # as JSON keeps it (string keys)


@pytest.mark.parametrize("kind", sorted(FIELDS))
def test_bad_config_json_is_refused_naming_the_field(kind, target, tmp_path):
    cls = registry.get(kind)
    ck = save_checkpoint(tmp_path / "ck", cls.for_target(target, **FIELDS[kind]), target)
    good = json.loads((ck / "config.json").read_text())
    for bad, named in (({**good, "bogus_field": 1}, "bogus_field"),
                       ({**good, "draft_len" if "draft_len" in good else "vocab_keep": "many"},
                        "draft_len" if "draft_len" in good else "vocab_keep")):
        (ck / "config.json").write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=named):
            load_checkpoint(ck, target)


@pytest.mark.parametrize("kind", ["medusa", "hydra", "eagle3", "dflash", "kangaroo"])
def test_config_for_other_sizes_is_refused(kind, target, tmp_path):
    cls = registry.get(kind)
    ck = save_checkpoint(tmp_path / "ck", cls.for_target(target, **FIELDS[kind]), target)
    good = json.loads((ck / "config.json").read_text())
    (ck / "config.json").write_text(json.dumps({**good, "hidden_size": good["hidden_size"] * 2}))
    with pytest.raises(CheckpointError, match="hidden size 64"):
        load_checkpoint(ck, target)
