from pathlib import Path

import pytest

from draftsmith.recipe import RecipeError, load_recipe, parse_recipe

RECIPES = sorted((Path(__file__).resolve().parent.parent / "recipes").glob("*.yaml"))


def test_shipped_recipes_validate():
    assert RECIPES, "no recipes shipped"
    for p in RECIPES:
        r = load_recipe(p)
        assert r.name and r.drafter.kind


def test_unknown_key_is_named():
    with pytest.raises(RecipeError, match=r"'train\.lrr': unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa"}, "train": {"lrr": 1e-3}})


def test_unknown_top_level_and_drafter_keys():
    with pytest.raises(RecipeError, match=r"'bogus': unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa"}, "bogus": 1})
    with pytest.raises(RecipeError, match=r"'drafter\.heads': unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa", "heads": 3}})


def test_mistyped_value_is_named():
    with pytest.raises(RecipeError, match=r"'drafter\.num_heads'"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa", "num_heads": "four"}})
    with pytest.raises(RecipeError, match=r"'data\.on_long_prompt'"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa"}, "data": {"on_long_prompt": "ignore"}})


def test_overrides_beat_yaml_and_are_validated():
    r = parse_recipe({"name": "x", "drafter": {"kind": "medusa"}, "train": {"lr": 1.0}},
                     ["train.lr=0.0005", "drafter.num_heads=3"])
    assert r.train.lr == 0.0005 and r.drafter.num_heads == 3
    with pytest.raises(RecipeError, match=r"'train\.nope': unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "medusa"}}, ["train.nope=1"])


def test_unknown_drafter_kind():
    with pytest.raises(RecipeError, match="drafter"):
        parse_recipe({"name": "x", "drafter": {"kind": "eagle"}})


def test_hydra_keys_and_fair_comparison_recipes():
    with pytest.raises(RecipeError, match=r"'drafter\.prefix': unknown key"):
        parse_recipe({"name": "x", "drafter": {"kind": "hydra", "prefix": True}})
    with pytest.raises(RecipeError, match=r"'drafter\.num_layers'"):
        parse_recipe({"name": "x", "drafter": {"kind": "hydra", "num_layers": 0}})
    rs = {n: load_recipe(n) for n in ("compare-medusa", "compare-hydra", "compare-hydra-pp")}
    # same data, same shared data directory, same optimizer steps and batches
    for r in rs.values():
        assert r.data == rs["compare-medusa"].data and r.shared_data == rs["compare-medusa"].shared_data
        for k in ("max_steps", "batch_size", "chunk_len", "lr", "warmup_steps", "calibration_every"):
            assert getattr(r.train, k) == getattr(rs["compare-medusa"].train, k), k
    pp = rs["compare-hydra-pp"]
    assert (pp.drafter.prefix_layer, pp.drafter.num_layers, pp.drafter.dropout) == (True, 4, 0.2)
    assert pp.train.loss == "soft" and pp.train.head_decay == 1.0


def test_mixed_precision_reads_yaml_no_and_refuses_others():
    assert load_recipe("quickstart").train.mixed_precision is None  # accelerate's own config decides
    assert load_recipe("quickstart", ["train.mixed_precision=no"]).train.mixed_precision == "no"  # YAML: false
    assert load_recipe("quickstart", ["train.mixed_precision=bf16"]).train.mixed_precision == "bf16"
    with pytest.raises(RecipeError, match="mixed_precision"):
        load_recipe("quickstart", ["train.mixed_precision=fp8"])
