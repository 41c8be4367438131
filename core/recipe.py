"""Recipes: YAML validated by one typed schema (pydantic, unknown keys rejected).

``load_recipe(path, overrides)`` reads YAML, applies dotted ``key=value``
overrides (CLI beats YAML beats defaults) and validates. Every error names
the offending key, e.g. ``recipe key 'train.lrr': unknown key``.
"""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path
from typing import Annotated, Literal, Optional, Union

import yaml
from pydantic import AliasChoices, Field, ValidationError, field_validator

from draftsmith import registry
from draftsmith.schema import StrictModel


class SourceConfig(StrictModel):
    type: Literal["sharegpt", "jsonl", "hf_dataset", "magpie"] = Field(
        description="sharegpt/jsonl/hf_dataset read prompts from `path`; magpie has the target write `count` prompts")
    path: Optional[str] = Field(None, description="file or directory; 'builtin:sharegpt-dummy' = fastchat's "
                                                  "dummy_conversation.json")
    max_conversations: Optional[int] = Field(None, ge=1, description="keep at most this many from the source")
    count: Optional[int] = Field(None, ge=1, description="magpie: number of prompts to synthesise")
    split: Optional[str] = Field(None, description="hf_dataset: split name")
    openers: Optional[Union[Literal["builtin:tasks"], list[str]]] = Field(
        None, description="magpie: words the user turn starts with, one per draw in turn (the target writes the "
        "rest), for prompts of more kinds of tasks; 'builtin:tasks' = generic task openers (writing, role-play, "
        "reasoning, maths, code, extraction, explanation); '' in a list = unsteered")


class ServerConfig(StrictModel):
    url: str = Field(description="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (vLLM, "
                     "SGLang, draftsmith serve)")
    model: str = Field(description="the model name the server serves the target under")
    concurrency: int = Field(8, ge=1, le=1024, description="requests in flight")
    api_key_env: Optional[str] = Field(None, description="environment variable holding the API key, if any")
    check: Literal["probe", "models", "none"] = Field(
        "probe", description="probe: greedy probe prompts must match the local target's tokens; models: "
        "/v1/models must list `model`; none: no check")
    timeout_s: float = Field(600.0, gt=0)


class DataConfig(StrictModel):
    sources: list[SourceConfig] = Field(default_factory=list)
    max_new_tokens: int = Field(256, ge=1, description="response budget per regenerated assistant turn")
    max_turns: int = Field(1, ge=1, description="user turns kept per conversation")
    server: Optional[ServerConfig] = Field(None, description="regenerate through this OpenAI-compatible server "
                                           "instead of the local target (the local target still caches states)")
    regenerate: bool = Field(True, description="true: the target rewrites every assistant turn (self-distillation); "
                             "false: train on the sources' conversations as they are (teacher-forced; for logs the "
                             "target already wrote, e.g. served traffic)")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy responses (match greedy serving)")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    batch_size: int = Field(16, ge=1, description="engine hf: sequences generated together per padded batch")
    engine: Literal["batched", "hf"] = Field("batched", description="batched: continuous batching on a "
                                             "pre-allocated cache (fast); hf: Hugging Face generate (reference)")
    max_rows: int = Field(96, ge=1, description="engine batched: sequences in flight at once (fewer if the KV "
                                                "cache would exceed DRAFTSMITH_KV_BYTES, default 4 GiB)")
    forward: Literal["eager", "fast", "compile"] = Field(
        default_factory=lambda: default_forward(), description="engine batched: the decode step, compile = one "
        "fused step over the cache with native ragged attention, compiled once (about half a minute) for every "
        "batch size, fast = the same step eager, eager = the model's own forward (default: $DRAFTSMITH_FORWARD, "
        "else compile)")
    max_seq_len: int = Field(2048, ge=16, description="longest training conversation in tokens")
    on_long_prompt: Literal["error", "truncate", "skip"] = Field("error", description="prompt + response longer "
                                                                                      "than the context")
    heldout_mtbench: bool = Field(True, description="target answers to MT-Bench first turns form the held-out set")
    heldout_max_new_tokens: int = Field(128, ge=1)
    magpie_max_new_tokens: int = Field(64, ge=1)
    fused_cache: bool = Field(True, description="engine batched, drafters that need only the final hidden state: "
                              "the generator keeps the states it computes and the data stage writes the training "
                              "cache from them (no second pass over the data); conversations whose re-tokenised "
                              "text differs from the generated tokens get the cache stage's forward, counted")
    time_budget_s: Optional[float] = Field(
        None, gt=0, description="wall-clock seconds for writing the training data (Magpie prompts + regenerated "
        "answers; the held-out MT-Bench answers are not counted and always written in full): no new conversation "
        "is started after it (those in flight: at_budget_end), source counts (magpie count, max_conversations) become "
        "upper bounds, and what was not reached is counted in data/meta.json. None = no limit")
    magpie_budget_share: float = Field(
        0.35, gt=0, lt=1, description="with time_budget_s: the share of it Magpie prompt writing may take (split "
        "among magpie sources); no new draw is started after it, and the rest (with what Magpie left unused) "
        "goes to regenerating answers")
    at_budget_end: Literal["cut", "finish"] = Field(
        "cut", description="with time_budget_s, engine batched: what happens to the answers in flight when the "
        "budget ends. cut: each ends where it is, kept as an unfinished reply (as max_new_tokens ends one), so the "
        "budget holds to a decode step; finish: they run to their end (up to max_new_tokens more steps; the data "
        "is then a subset of an unbudgeted run's)")


class CacheConfig(StrictModel):
    dtype: Literal["float16", "bfloat16", "float32"] = "float16"
    batch_tokens: int = Field(8192, ge=64, description="padded tokens per target forward")
    shard_tokens: int = Field(200_000, ge=1000)
    extra_states: list[str] = Field(
        default_factory=list, description="states cached beyond what the drafter kind needs ('layer:N' or "
        "'final'), so one cache serves several recipes, e.g. a Kangaroo sweep over exit layers")

    @field_validator("extra_states")
    @classmethod
    def _states(cls, v: list[str]) -> list[str]:
        for s in v:
            if s != "final" and not (s.startswith("layer:") and s[6:].isdigit() and int(s[6:]) >= 1):
                raise ValueError(f"cache.extra_states: {s!r} is not 'final' or 'layer:N' (N >= 1)")
        return v


DrafterConfig = Annotated[Union[tuple(registry.config_models())], Field(discriminator="kind")]


class TrainConfig(StrictModel):
    epochs: float = Field(1.0, gt=0)
    max_steps: Optional[int] = Field(None, ge=1, description="overrides epochs")
    batch_size: int = Field(8, ge=1, description="chunks per micro-batch per process")
    chunk_len: int = Field(128, ge=8, description="positions per chunk")
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(20, ge=0)
    schedule: Literal["cosine", "constant", "linear"] = "cosine"
    max_grad_norm: float = Field(1.0, gt=0)
    loss: Literal["hard", "soft", "mix"] = Field("hard", description="hard labels, teacher distribution, or both")
    soft_weight: float = Field(0.5, ge=0, le=1, description="weight of the soft term when loss = mix")
    head_decay: float = Field(0.8, gt=0, le=1, description="head k loss weight = head_decay**k (1 = equal)")
    calibration_every: int = Field(20, ge=0, description="hold every N-th cached sequence out of training to "
                                   "measure acceptance for tree building (0 = none)")
    tree_budgets: list[int] = Field([8, 16], description="node budgets of the trees built after training")
    save_every: int = Field(200, ge=1)
    probe_every: int = Field(0, ge=0, description="every N optimizer steps (and after the last), decode "
                             "probe_prompts MT-Bench first turns (evaluation only, never trained on) with the "
                             "lossless decoder, greedy chains of the kind's default, probe_tokens new tokens each, "
                             "and log the measured mean acceptance length (probe/tau_real) beside the one the last "
                             "logged top-1 accuracies predict (probe/tau_sim = 1 + sum_k prod_j<=k top1_j) and "
                             "their ratio, to the tracker and the final checkpoint's training_timing.probes; 0 = off "
                             "(the quickstart: off, its budget)")
    probe_prompts: int = Field(4, ge=1, le=80)
    probe_tokens: int = Field(32, ge=1)
    log_every: int = Field(10, ge=1)
    init_from: Optional[str] = Field(None, description="start from this checkpoint's weights (same kind and shape, "
                                     "same target; fresh optimizer and schedule), e.g. to go on training a drafter "
                                     "on more data; a pruned head keeps the checkpoint's kept ids")
    tracker: Literal["wandb", "none"] = Field("wandb",
                                              description="wandb runs offline unless WANDB_MODE says otherwise")
    mixed_precision: Optional[Literal["no", "bf16", "fp16"]] = Field(
        None, description="accelerate's autocast for the drafter's forward and backward (weights and optimizer "
                          "stay float32); unset = what `accelerate launch --mixed_precision` or its config says, "
                          "else no (EAGLE-3 on a 2-core AMX Xeon: no faster in bf16)")

    @field_validator("mixed_precision", mode="before")
    @classmethod
    def _yaml_no(cls, v):
        return "no" if v is False else v  # YAML reads a bare `no` as false


def default_forward() -> str:
    """``eval.forward`` when a recipe sets none: ``$DRAFTSMITH_FORWARD`` if set (eager, fast or compile), else
    compile."""
    v = os.environ.get("DRAFTSMITH_FORWARD", "compile")
    if v not in ("eager", "fast", "compile"):
        raise ValueError(f"DRAFTSMITH_FORWARD must be eager, fast or compile, got {v!r}")
    return v


class EvalConfig(StrictModel):
    prompts: int = Field(8, ge=1, le=80, description="MT-Bench first turns, spread over the categories")
    max_new_tokens: int = Field(64, ge=1)
    trees: list[str] = Field(["chain", "built:8"], description="chain | built:BUDGET | dynamic[:B,D,W] | JSON paths")
    hf_generate: bool = Field(True, description="also time Hugging Face generate (speedup baseline)")
    llamacpp: list[str] = Field(["shipped"], description="also time llama.cpp's plain decoding on the target's GGUF "
                                "of these types (shipped = the file the default or a named target ships as, Q4_1 "
                                "and Q4_K_M; f32, bf16, q8_0, q4_1, ... converted from the target) when a llama.cpp "
                                "build exists (scripts/llamacpp_env.sh); [] = never. Every speedup then names it too")
    dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]] = Field(
        None, description="the dtype the trees stage's step costs and the bench's decoding run the target in. None: "
        "the recipe's dtype, where `auto` then means float32 on a CPU for a target that ships as a low-bit GGUF file "
        "(decoding reads its packed 4/8-bit blocks, fewer bytes a step than bf16; "
        "`draftsmith.engine.fastpath.decode_dtype`) and the recipe's choice otherwise; data and cache keep the "
        "recipe's dtype")
    plain_other_dtype: Optional[bool] = Field(
        None, validation_alias=AliasChoices("plain_other_dtype", "plain_float32"),
        description="also time our plain decoding in the other dtype of the run (float32, or the recipe's dtype "
        "where decoding runs in float32) when the two differ, so the table holds the fastest plain decoding on the "
        "machine (costs one more compiled 1-row graph). None (auto): on a CPU; true: always; false: never. "
        "`plain_float32` is its former name")
    suffix_from_data: bool = Field(
        False, description="also bench SuffixDecoding alone and beside the trained drafter (the hybrid), its global "
        "index seeded with the training split's answers (data/train.jsonl; the held-out MT-Bench answers never), "
        "saved as OUT/suffix_index for `draftsmith serve --suffix --suffix-state` and `draftsmith eval "
        "--suffix-index`")
    forward: Literal["eager", "fast", "compile"] = Field(
        default_factory=default_forward, description="the target's decoding forward in the trees and bench stages: "
        "compile = our static-shape forward compiled with inductor (once per row bucket: 1, 4, 8, 16, 32 "
        "rows), fast = the same forward eager, eager = the model's own forward (default: $DRAFTSMITH_FORWARD, "
        "else compile)")


class OnlineConfig(StrictModel):
    """`draftsmith online`: continual distillation from served traffic (train/online/job.py, docs/online.md)."""

    every_records: int = Field(64, ge=1, description="update after this many new log records")
    every_seconds: float = Field(300.0, gt=0, description="... or this long after the first unapplied record")
    replay_ratio: float = Field(1.0, ge=0, description="replayed earlier records per new record (against forgetting)")
    replay_buffer: int = Field(5000, ge=1, description="replay draws from this many most recent applied records")
    osd_weight: int = Field(1, ge=0, description="OSD emphasis: each rejected position adds this many copies of a "
                            "short window ending at it to the update's chunks (0 = off; logs without acceptance "
                            "data get none)")
    osd_max_share: Optional[float] = Field(
        1.0, ge=0, description="at most this many emphasis windows per training chunk of the update (a seeded "
        "sample when there are more; None = no cap). At acceptance ~0.4 a reply has a rejected position every "
        "few tokens: uncapped, the windows outnumbered the chunks 27 to 1 on the real target and the update "
        "memorised its records")
    anchor_data: Optional[str] = Field(
        None, description="a regenerated conversations JSONL (a data stage's data/train.jsonl, e.g. the one the "
        "drafter was trained on): anchor_ratio x the new records' count of its conversations join every update, "
        "a seeded sample, against forgetting the general traffic while adapting to the new")
    anchor_ratio: float = Field(0.5, ge=0, description="anchor conversations per new record (with anchor_data)")
    lr: float = Field(1e-4, gt=0, description="constant learning rate of an update (OSD: 1e-4)")
    epochs: float = Field(1.0, gt=0, description="passes over an update's chunks")
    max_steps: Optional[int] = Field(None, ge=1, description="cap on optimizer steps per update")
    batch_size: int = Field(8, ge=1, description="chunks per optimizer step")
    holdout_every: int = Field(10, ge=2, description="every N-th record (by a hash of its id) is held back for "
                               "evaluation, never trained on")
    holdout_window: int = Field(32, ge=1, description="the most recent held-back records the gate decodes")
    eval_max_new_tokens: int = Field(64, ge=1, description="tokens decoded per held-back prompt by the gate")
    gate_metric: Literal["acceptance", "tau"] = Field(
        "acceptance", description="acceptance: P(first draft accepted); tau: tokens per target forward")
    margin: float = Field(0.0, ge=0, description="publish when candidate >= current - margin on the held-back window")
    keep: int = Field(5, ge=1, description="published versions kept")
    max_record_tokens: int = Field(4096, ge=16, description="longer records are quarantined as oversized")
    init: Optional[str] = Field(None, description="checkpoint the job starts from (default: the published "
                                "current one, else a fresh drafter of the recipe)")
    state_dir: Optional[str] = Field(None, description="ledger, models and quarantine (default: OUT/online)")
    publish_dir: Optional[str] = Field(None, description="where versions are published (default: OUT/publish)")
    poll_seconds: float = Field(1.0, gt=0, description="how often the job looks for new log lines")


class Recipe(StrictModel):
    name: str
    target: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16", "float16", "auto"] = Field(
        "float32", description="the dtype the target is loaded and run in (data generation, cache features, "
        "decoding); auto = bf16 on a CUDA device that supports it else fp16, bf16 on a CPU with native bf16 "
        "(avx512_bf16 / amx_bf16) else float32. Training reads the target in float32 whatever this says; the "
        "fingerprint does not depend on it; decoding is lossless w.r.t. the target as computed in this dtype")
    output_dir: str = "runs/${name}"
    shared_data: Optional[str] = Field(None, description="a directory whose data/ and cache/ this run uses "
                                       "(created there if missing): recipes that compare drafters on the same data")
    seed: int = 0
    threads: Optional[int] = Field(None, ge=1, description="torch CPU threads (default: all cores)")
    data: DataConfig = Field(default_factory=DataConfig)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    drafter: DrafterConfig
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    online: OnlineConfig = Field(default_factory=OnlineConfig)

    @property
    def out(self) -> Path:
        return Path(self.output_dir.replace("${name}", self.name))


class RecipeError(ValueError):
    """A recipe that does not validate; the message names each bad key."""


def _set_dotted(d: dict, dotted: str, value) -> None:
    keys = dotted.split(".")
    cur = d
    for k in keys[:-1]:
        if not isinstance(cur.get(k, {}), dict):
            raise RecipeError(f"recipe key {dotted!r}: {k!r} is not a section")
        cur = cur.setdefault(k, {})
    cur[keys[-1]] = value


def _format(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"] if not (isinstance(x, str) and x in registry.config_names()))
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"recipe key {loc!r}: {msg}")
    return "invalid recipe:\n  " + "\n  ".join(lines)


def parse_recipe(raw: dict, overrides: list[str] | None = None) -> Recipe:
    raw = dict(raw or {})
    for ov in overrides or []:
        if "=" not in ov:
            raise RecipeError(f"override {ov!r} must look like key.sub=value")
        k, v = ov.split("=", 1)
        _set_dotted(raw, k.strip(), yaml.safe_load(v))
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        raise RecipeError(_format(e)) from None


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read and validate a recipe; a bare name like 'quickstart' means recipes/<name>.yaml."""
    p = Path(path)
    if not p.exists() and not p.suffix:
        p = Path(str(importlib.resources.files("draftsmith.recipes") / f"{path}.yaml"))
    if not p.exists():
        raise FileNotFoundError(f"recipe {str(path)!r} not found")
    raw = yaml.safe_load(p.read_text())
    if not isinstance(raw, dict):
        raise RecipeError(f"recipe {p} must be a YAML mapping")
    return parse_recipe(raw, overrides)
