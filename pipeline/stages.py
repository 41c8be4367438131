"""The stages of a recipe: data -> cache -> train -> trees -> report -> bench.

It orchestrates train/ (data, cache, training) and eval/ (trees from measured
acceptance, held-out report, decoding benchmark), so it sits above both, next
to the CLI; train/ never imports eval/.

Everything lives under the recipe's output directory:
``data/{train,heldout}.jsonl`` and ``data/meta.json``, ``cache/{train,heldout}``,
``checkpoints/step-N``, ``final`` (the last checkpoint) and ``report.{json,md}``.
Every stage is resumable and skipped when its output is complete.
"""

from __future__ import annotations

import contextlib
import json
import os
import logging
import shutil
import time
from collections import Counter
from pathlib import Path


from draftsmith import paths, registry
from draftsmith.checkpoint import command_line, environment, load_checkpoint, update_metrics
from draftsmith.train.training import predictors as classifier_stage
from draftsmith.export.llamacpp_server import llamacpp_plain_methods
from draftsmith.eval.bench import (BASELINE, compile_seconds, default_methods, mark_fastest_plain, plain_in_dtype,
                                   prepare_plain_target, run_bench, table)
from draftsmith.eval.suffix import suffix_methods, suffix_stats
from draftsmith.drafters.suffix import SuffixConfig
from draftsmith.train.data.suffix_seed import save_index_from_data
from draftsmith.engine.cpu_layout import apply_cpu_layout
from draftsmith.engine.fastpath import decode_dtype, use_fast_forward
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.eval.head_accuracy import head_accuracy
from draftsmith.eval.mtbench import mtbench_prompts
from draftsmith.engine.sampling import SamplingParams
from draftsmith.engine.tree_build import (add_heldout_forecast, build_trees, measure_draft_cost, measure_step_cost,
                                          parse_tree, save_trees)
from draftsmith.common.chunks import calibration_split
from draftsmith.recipe import Recipe
from draftsmith.target import DtypeChoice, Target, dtype_name
from draftsmith.train.data import generate, remote, sources
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.cache import build_cache, merge_caches
from draftsmith.train.data.batchgen import warm_up
from draftsmith.drafters.own_tokenizer.training import heldout_figures
from draftsmith.train.training.trainer import train, train_on_text

log = logging.getLogger(__name__)


class EmptyDatasetError(ValueError):
    """A stage was given no usable data."""


#: SuffixDecoding's settings in the bench stage: the defaults with eval's and serve's score gate of 2 (DECISIONS),
#: and drafts of at most 7 tokens, so that the 8-row graph the trees stage compiled verifies them: a 24-token
#: draft needs the 32-row graph, 64 s of compiling in the quickstart, for no gain (20 MT-Bench first turns x 64,
#: qs-big's index: tau 1.36 alone and 1.91-1.92 beside the heads either way; docs/results-log.md §21)
BENCH_SUFFIX = SuffixConfig(min_score=2.0, max_spec_tokens=7)


def collect_prompts(recipe: Recipe, target: Target, skips: sources.SkipLog, stats: Counter,
                    magpie_deadline: generate.Deadline | None = None) -> list[sources.Conversation]:
    """Every source's conversations, in the recipe's order. ``magpie_deadline`` (``data.time_budget_s``):
    Magpie sources stop drawing by then, the time left split evenly among those not yet run."""
    holdout = sources.mtbench_holdout_keys()
    convs: list[sources.Conversation] = []
    seen: set[tuple[str, ...]] = set()
    for n, src in enumerate(recipe.data.sources):
        name = f"{src.type}{n}"
        if src.type == "magpie":
            until = None
            if magpie_deadline is not None:
                ahead = sum(s.type == "magpie" for s in recipe.data.sources[n:])
                until = generate.Deadline.after(magpie_deadline.left() / ahead)
            it = iter(_magpie(recipe, target, n, src.count or 100, holdout, stats,
                              generate.resolve_openers(src.openers), deadline=until))
        else:
            if not src.path:
                raise ValueError(f"data.sources[{n}] ({src.type}) needs a path")
            path = sources.resolve_path(src.path)
            reader = {"sharegpt": sources.read_sharegpt, "jsonl": sources.read_jsonl}.get(src.type)
            it = reader(path, name, skips) if reader else sources.read_hf_dataset(path, name, skips, src.split)
        kept = 0
        for c in sources.held_out(it, holdout, stats):
            if src.max_conversations and kept >= src.max_conversations:
                break
            key = tuple(sources.normalise(u) for u in c.user_turns[: recipe.data.max_turns])
            if key in seen:  # identical prompts (in the turns we use) give identical greedy data
                stats["duplicate_conversations"] += 1
                continue
            seen.add(key)
            convs.append(c)
            kept += 1
        stats[f"source_{name}"] = kept
    return convs


def _magpie(recipe: Recipe, target: Target, n: int, count: int, holdout: set[str],
            stats: Counter, openers: list[str] | None = None,
            deadline: generate.Deadline | None = None) -> list[sources.Conversation]:
    """Synthesised prompts, saved as they come (``data/magpie{n}.jsonl`` and its ``.state.json``), so a
    restarted data stage continues the draws instead of redoing them (with a time budget: within the
    restarted stage's own budget)."""
    path = recipe.out / "data" / f"magpie{n}.jsonl"
    state = path.with_suffix(".state.json")
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
    done = [sources.Conversation(r["id"], "magpie", [r["prompt"]]) for r in rows]
    draws = json.loads(state.read_text())["draws"] if state.exists() else 0
    if len(done) >= count or (rows and not state.exists()):  # complete (or written whole by an older version)
        return done[:count]

    def save(new: list[sources.Conversation], draws_so_far: int) -> None:
        with path.open("a") as f:
            f.write("".join(json.dumps({"id": c.id, "prompt": c.user_turns[0]}) + "\n" for c in new))
        state.write_text(json.dumps({"draws": draws_so_far}))

    got, mstats = generate.synthesize_prompts(
        target, count, batch_size=recipe.data.batch_size, max_new_tokens=recipe.data.magpie_max_new_tokens,
        seed=recipe.seed + n, exclude=holdout, engine=recipe.data.engine, max_rows=recipe.data.max_rows,
        done=done, draws_done=draws, on_round=save if recipe.data.engine == "batched" else None,
        openers=openers, deadline=deadline, forward=recipe.data.forward)
    stats.update({f"magpie_{k}": v for k, v in mstats.items()})
    if mstats["stopped_time_budget"]:
        print(f"magpie{n}: {len(got)} of {count} prompts written: its share of data.time_budget_s "
              f"(data.magpie_budget_share) was spent")
    if recipe.data.engine != "batched":
        path.write_text("".join(json.dumps({"id": c.id, "prompt": c.user_turns[0]}) + "\n" for c in got))
    return got


def stage_data(recipe: Recipe, target: Target) -> Path:
    """Prompts from every source, assistant turns regenerated by the target."""
    for_target(recipe, target)  # the fused cache's plan reads the drafter's states (EAGLE-3's aux layers)
    out = recipe.out / "data"
    meta_path = out / "meta.json"
    if meta_path.exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    d = recipe.data
    # data.time_budget_s bounds the training data's generation from here (the target is loaded, the batched
    # engine's step compiled): Magpie prompts by `magpie_budget_share` of it, answers by the whole; the held-out
    # answers are not counted.
    budget = d.time_budget_s
    warm = {"seconds": 0.0, "graphs": []}
    if budget and d.regenerate and d.server is None and d.engine == "batched":
        warm = warm_up(target.model, d.forward, d.max_rows)
        if warm["graphs"]:
            print(f"data: compiled the batched engine's step for {warm['graphs']} rows in {warm['seconds']:.0f} s, "
                  "before data.time_budget_s starts")
    t_budget = generate.clock()
    deadline = generate.Deadline(t_budget + budget) if budget else None
    skips, stats = sources.SkipLog(), Counter()
    convs = collect_prompts(recipe, target, skips, stats,
                            generate.Deadline(t_budget + budget * d.magpie_budget_share) if budget else None)
    t_prompts = generate.clock()
    print(skips.report())
    if not convs:
        raise EmptyDatasetError("no usable conversations in any data source "
                                f"({skips.total} rows skipped); nothing to train on")
    kw = dict(max_new_tokens=d.max_new_tokens, max_turns=d.max_turns, batch_size=d.batch_size,
              max_seq_len=d.max_seq_len, temperature=d.temperature, top_p=d.top_p, seed=recipe.seed,
              on_long_prompt=d.on_long_prompt, engine=d.engine, max_rows=d.max_rows, forward=d.forward,
              at_budget_end=d.at_budget_end)
    t_gen = time.time()
    if d.regenerate and d.server is not None:
        srv = d.server
        gstats = remote.regenerate_remote(
            target, convs, out / "train.jsonl", url=srv.url, model=srv.model, concurrency=srv.concurrency,
            api_key_env=srv.api_key_env, check=srv.check, timeout_s=srv.timeout_s, deadline=deadline,
            **{k: v for k, v in kw.items()
               if k not in ("batch_size", "engine", "max_rows", "forward", "at_budget_end")})
    elif d.regenerate:
        fused, why = fused_cache_plan(recipe)
        if fused:
            c = recipe.cache
            kw["fused"] = generate.FusedCacheWriter(recipe.out / "cache" / "train", dtype=c.dtype,
                                                    shard_tokens=c.shard_tokens)
            log.info("data.fused_cache: the training cache is written during generation (%s)", why)
        elif d.fused_cache:
            log.info("data.fused_cache: not fused, the cache stage runs its separate pass: %s", why)
        gstats = generate.regenerate(target, convs, out / "train.jsonl", deadline=deadline, **kw)
        if budget:
            convs, gstats = more_rounds(recipe, target, convs, gstats, stats, deadline, out / "train.jsonl", kw)
        kw.pop("fused", None)
    else:
        gstats = write_as_is(convs, out / "train.jsonl", d.max_turns)
    if d.fused_cache and (not d.regenerate or d.server is not None):
        log.info("data.fused_cache: not fused, the cache stage runs its separate pass: %s", fused_cache_plan(recipe)[1])
    gen_s = time.time() - t_gen
    gstats["generation_seconds"] = round(gen_s, 1)
    gstats["response_tokens_per_s"] = round(gstats["response_tokens"] / max(gen_s, 1e-9), 1)
    budget_meta = None
    if budget:
        budget_meta = time_budget_report(recipe, stats, gstats, len(convs), t_prompts - t_budget,
                                         generate.clock() - t_budget)
        print(budget_meta.pop("line"))
    hstats = Counter()
    if d.heldout_mtbench:
        qs = [sources.Conversation(id=f"mtbench:{q['question_id']}", source=f"mtbench:{q['category']}",
                                   user_turns=[q["turns"][0]]) for q in sources.mtbench_questions()]
        # Greedy MT-Bench answers depend only on the target and the budget: generated once per target.
        shared = paths.home() / "heldout" / (f"{target.fingerprint.split(':')[1]}-mtbench-"
                                             f"{d.heldout_max_new_tokens}.jsonl")
        shared.parent.mkdir(parents=True, exist_ok=True)
        hkw = {**kw, "max_new_tokens": d.heldout_max_new_tokens, "temperature": 0.0, "max_turns": 1,
               "on_long_prompt": "skip"}
        if d.regenerate and fused_cache_plan(recipe, "heldout")[0]:
            # the held-out cache from these answers' own states, as the training cache (answers already in the
            # shared file, from an earlier run, are written without states: the cache stage computes those)
            c = recipe.cache
            hkw["fused"] = generate.FusedCacheWriter(recipe.out / "cache" / "heldout", dtype=c.dtype,
                                                     shard_tokens=c.shard_tokens)
        hstats = generate.regenerate(target, qs, shared, **hkw)
        shutil.copyfile(shared, out / "heldout.jsonl")
    meta = {"skipped": skips.as_dict(), "sources": dict(stats), "generation": dict(gstats),
            "heldout_generation": dict(hstats), "seconds": round(time.time() - t0, 1),
            "target_fingerprint": target.fingerprint}
    if budget_meta is not None:
        meta["time_budget"] = budget_meta
    if warm["graphs"]:
        meta["engine_compile"] = warm
    meta_path.write_text(json.dumps(meta, indent=2))
    return out


MIN_ROUND_S = 30.0  # a further data round needs this much of data.time_budget_s left (each round ends with a drain)


def more_rounds(recipe: Recipe, target: Target, convs: list, gstats: Counter, stats: Counter,
                deadline: "generate.Deadline", out_path: Path, kw: dict) -> tuple[list, Counter]:
    """Use what the time budget has left once every written prompt is answered: another round of Magpie
    prompts (``magpie_budget_share`` of the time left; the draws go on from the saved state) and their
    answers (appended: `generate.regenerate` resumes past the rows already written, and a fused cache goes on
    filling its last shard), while at least `MIN_ROUND_S` is left and the last round's Magpie draws were cut
    by the budget (not by their count). Returns every conversation and the rounds' generation counts summed."""
    d = recipe.data
    rounds = 1
    while (deadline.left() >= MIN_ROUND_S and stats.get("magpie_stopped_time_budget")
           and not gstats.get(generate.NOT_REACHED)):
        more = Counter()
        nxt = collect_prompts(recipe, target, sources.SkipLog(), more,
                              generate.Deadline.after(deadline.left() * d.magpie_budget_share))
        for k, v in more.items():  # rejected draws of this round add up; accepted and kept counts are totals
            if k.startswith("magpie_rejected"):
                stats[k] += v
            elif k.startswith("source_") or k == "magpie_accepted":
                stats[k] = v
        stats["magpie_stopped_time_budget"] = more.get("magpie_stopped_time_budget", 0)
        if len(nxt) <= len(convs):
            break
        g = generate.regenerate(target, nxt, out_path, deadline=deadline, **kw)
        rounds += 1
        for k, v in g.items():
            if k == generate.NOT_REACHED:
                gstats[k] = v
            elif k != "resumed":
                gstats[k] += v
        convs = nxt
    gstats["data_rounds"] = rounds
    return convs, gstats


def time_budget_report(recipe: Recipe, stats: Counter, gstats: Counter, conversations: int, prompt_s: float,
                       used_s: float) -> dict:
    """``data/meta.json``'s ``time_budget``: the budget, the seconds used (prompts, and prompts + answers)
    and what it left out; ``line`` is the one line printed. Magpie ``kept``: its prompts in the training
    set (after the held-out and duplicate filters)."""
    d = recipe.data
    magpie = [(n, s) for n, s in enumerate(d.sources) if s.type == "magpie"]
    not_reached = gstats.get(generate.NOT_REACHED, 0)
    rep = {"budget_s": d.time_budget_s, "magpie_budget_share": d.magpie_budget_share,
           "seconds_used": round(used_s, 1), "prompt_seconds": round(prompt_s, 1),
           "magpie_prompts": {"asked": sum(s.count or 100 for _, s in magpie),
                              "kept": sum(stats.get(f"source_magpie{n}", 0) for n, _ in magpie),
                              "stopped_by_budget": bool(stats.get("magpie_stopped_time_budget", 0))},
           "conversations": conversations, "written": gstats.get("conversations", 0),
           "resumed": gstats.get("resumed", 0), "not_reached": not_reached,
           "at_budget_end": d.at_budget_end, "cut": gstats.get(generate.CUT, 0)}
    if not d.regenerate:
        why = "the answers are the sources' own (data.regenerate: false)"
    elif not_reached:
        why = f"the budget ran out after {used_s:.0f} s; they are not in train.jsonl"
    else:
        why = f"all were reached in {used_s:.0f} s"
    cut = gstats.get(generate.CUT, 0)
    rep["line"] = (f"data.time_budget_s={d.time_budget_s:g}: {not_reached} of {conversations} conversations not "
                   f"reached ({why})" + (f"; {cut} answers in flight at its end cut there, kept as unfinished "
                                         "replies (data.at_budget_end: cut)" if cut else ""))
    return rep


def write_as_is(convs: list[sources.Conversation], out_path: Path, max_turns: int) -> Counter:
    """Teacher-forced data: each conversation with its own assistant turns, no generation.

    A conversation without a reply to its first user turn is skipped and counted; replies are taken
    as finished (their end-of-turn token is learned).
    """
    stats: Counter = Counter()
    with out_path.open("w") as f:
        for c in convs:
            n = min(max_turns, len(c.user_turns), len(c.replies or []))
            if n == 0:
                stats["skipped_no_assistant_turn"] += 1
                continue
            msgs = ([{"role": "system", "content": c.system}] if c.system else [])
            for u, r in zip(c.user_turns[:n], c.replies[:n]):
                msgs += [{"role": "user", "content": u}, {"role": "assistant", "content": r}]
            f.write(json.dumps({"id": c.id, "source": c.source, "system": c.system,
                                "messages": msgs[1 if c.system else 0:], "finished": [True] * n}) + "\n")
            stats["conversations"] += 1
            stats["responses"] += n
    stats["teacher_forced"] = 1
    return stats


def load_sequences(path: Path, tokenizer, max_seq_len: int, stats: Counter | None = None) -> list[dict]:
    """Rendered conversations ({id, ids, mask}) from a regenerated JSONL file, in the file's order."""
    stats = stats if stats is not None else Counter()
    seqs = (generate.sequence_from_line(line, tokenizer, max_seq_len, stats, where=f"{path.name}:{n}")
            for n, line in enumerate(path.read_text().splitlines(), 1))
    return [s for s in seqs if s is not None]


def fused_cache_plan(recipe: Recipe, split: str = "train") -> tuple[bool, str]:
    """Whether the data stage writes ``split``'s cache (train or heldout) from its generator's states, and why
    not."""
    d = recipe.data
    if not d.fused_cache:
        return False, "data.fused_cache is off"
    if _trains_on_text(recipe):
        return False, f"a {recipe.drafter.kind} drafter trains on text and needs no cached states"
    if not d.regenerate:
        return False, "data.regenerate is off: nothing is generated"
    if d.server is not None:
        return False, "data.server generates remotely: no states here"
    if d.engine != "batched":
        return False, f"data.engine {d.engine!r}: only the batched engine keeps its states"
    needs = cache_needs(recipe)
    if needs != ["final"]:
        return False, (f"the cache needs {needs} ({recipe.drafter.kind}"
                       f"{' + cache.extra_states' if recipe.cache.extra_states else ''}); the generator keeps "
                       "only the final hidden state")
    if (recipe.out / "cache" / split / "index.json").exists():
        return False, f"cache/{split} is already complete"
    return True, "the batched engine keeps the final hidden states it computes"


def cache_needs(recipe: Recipe) -> list[str]:
    needs = registry.get(recipe.drafter.kind).cache_needs(recipe.drafter.model_dump())
    return needs + [s for s in recipe.cache.extra_states if s not in needs]


def _trains_on_text(recipe: Recipe) -> bool:
    """A kind that trains on re-tokenised text (its own tokenizer) needs no cached target states."""
    return registry.get(recipe.drafter.kind).trains_on_text


def for_target(recipe: Recipe, target: Target) -> Recipe:
    """``recipe`` with its drafter section's target-derived defaults filled in (`KindConfig.with_target`: EAGLE-3's
    aux layers from the target's layer count), in place; every stage that reads the section calls it."""
    recipe.drafter = recipe.drafter.with_target(target)
    return recipe


def stage_cache(recipe: Recipe, target: Target) -> dict:
    for_target(recipe, target)
    if _trains_on_text(recipe):
        return {}
    data = recipe.out / "data"
    res = {}
    for split in ("train", "heldout"):
        src = data / f"{split}.jsonl"
        out = recipe.out / "cache" / split
        if (out / "index.json").exists():
            res[split] = json.loads((out / "index.json").read_text())
            continue
        if not src.exists():
            if split == "train":
                raise EmptyDatasetError(f"{src} is missing: run the data stage first")
            continue
        stats = Counter()
        seqs = load_sequences(src, target.tokenizer, recipe.data.max_seq_len, stats)
        if not seqs:
            raise EmptyDatasetError(f"{src} holds no usable sequence ({dict(stats)})")
        needs = cache_needs(recipe)
        n_layers = target.model.config.num_hidden_layers
        bad = [n for n in needs if n.startswith("layer:") and int(n[6:]) >= n_layers]
        if bad:
            raise ValueError(f"cache states {bad}: the target has {n_layers} layers, so layer:N needs N < {n_layers} "
                             "(the last layer's output is 'final')")
        res[split] = build_cache(target, seqs, needs, out, dtype=recipe.cache.dtype,
                                 batch_tokens=recipe.cache.batch_tokens, shard_tokens=recipe.cache.shard_tokens,
                                 provenance={"source": str(src), **stats})
        st = res[split]["provenance"]["states"]
        if st["from_generation"]:
            print(f"cache/{split}: states of {st['from_generation']}/{len(seqs)} sequences from the data stage's "
                  f"generation; computed here: {st['forward'] or 'none'}")
    return res


def stage_train(recipe: Recipe, target: Target, resume: bool = True,
                stop_after: int | None = None) -> tuple[Path, dict]:
    for_target(recipe, target)
    if _trains_on_text(recipe):
        return train_on_text(recipe, target, recipe.out, resume=resume, stop_after=stop_after)
    meta = (json.loads((recipe.out / "data" / "meta.json").read_text())
            if (recipe.out / "data" / "meta.json").exists() else {})
    ckpt, timing = train(recipe, target, recipe.out / "cache" / "train", recipe.out, resume=resume,
                         stop_after=stop_after, data_provenance={"data_dir": str(recipe.out / "data"), **meta})
    final = recipe.out / "final"
    if ckpt.exists() and timing["is_main"]:
        shutil.rmtree(final, ignore_errors=True)
        shutil.copytree(ckpt, final, ignore=shutil.ignore_patterns("trainer_state*"))
        update_metrics(final, {"training_timing": timing})
    return final, timing


def _write_report(recipe: Recipe, target: Target, ckpt: Path, figures: dict, heldout: str) -> dict:
    """report.{json,md} of a kind that brings its own held-out figures; the figures also go into the checkpoint."""
    report = {"recipe": recipe.name, "kind": recipe.drafter.kind, "checkpoint": str(ckpt),
              "target": {"name": target.name, "fingerprint": target.fingerprint},
              "heldout": heldout, **figures, "command": command_line(), "environment": environment()}
    update_metrics(ckpt, {"heldout": figures})
    (recipe.out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"# {recipe.name}: {recipe.drafter.kind} on {target.name}", "", "| figure | value |", "|---|---|"]
    lines += [f"| {k} | {v:.4f} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in figures.items()]
    (recipe.out / "report.md").write_text("\n".join(lines) + "\n")
    return report


def stage_report(recipe: Recipe, target: Target, ckpt: Path) -> dict:
    if _trains_on_text(recipe):
        return _write_report(recipe, target, ckpt, heldout_figures(recipe, target, ckpt),
                             "MT-Bench first turns, target greedy answers, in the drafter's own tokens")
    model, manifest = load_checkpoint(ckpt, target)
    cache_dir = recipe.out / "cache" / "heldout"
    if not (cache_dir / "index.json").exists():
        raise EmptyDatasetError("no held-out cache; enable data.heldout_mtbench")
    own = model.heldout_metrics(HiddenCache(cache_dir, target), target)
    if own is not None:  # a kind with its own held-out figures (Kangaroo: expected acceptance at the same position)
        return _write_report(recipe, target, ckpt, own, "MT-Bench first turns, target greedy answers")
    acc = head_accuracy(model, HiddenCache(cache_dir, target), model.num_heads, ranks=10)
    report = {"recipe": recipe.name, "kind": recipe.drafter.kind, "checkpoint": str(ckpt),
              "target": {"name": target.name, "fingerprint": target.fingerprint},
              "heldout": "MT-Bench first turns, target greedy answers", **acc,
              "command": command_line(), "environment": environment()}
    update_metrics(ckpt, {"heldout": {k: acc[k] for k in ("top1", "top5", "predicted_chain_tau", "positions")}})
    (recipe.out / "report.json").write_text(json.dumps(report, indent=2))
    lines = [f"# {recipe.name}: {recipe.drafter.kind} heads on {target.name}", "",
             f"held-out: {report['heldout']}, {int(acc['positions'][0])} labelled positions for head 1", "",
             "| head | predicts | top-1 | top-5 |", "|---|---|---|---|"]
    for k, (a1, a5) in enumerate(zip(acc["top1"], acc["top5"]), 1):
        lines.append(f"| {k} | t+{k + 1} | {a1:.3f} | {a5:.3f} |")
    lines += ["", f"predicted chain acceptance length (1 + sum_k prod_j<=k top1_j): "
                  f"**{acc['predicted_chain_tau']:.3f}**"]
    (recipe.out / "report.md").write_text("\n".join(lines) + "\n")
    return report


def stage_trees(recipe: Recipe, target: Target, ckpt: Path, cost_target: Target | None = None) -> dict:
    """Build static trees from acceptance measured on the calibration split (sequences held out of training).
    Step costs are measured on ``cost_target`` (default ``target``): the target as decoding runs it (its dtype)."""

    model, manifest = load_checkpoint(ckpt, target, device=next(target.model.parameters()).device)
    if not model.builds_trees:
        return {"skipped": f"a {recipe.drafter.kind} drafter has no static trees to build"}
    # Checkpoints trained before the calibration split existed saw every sequence: say so, not "held out".
    held_out = bool((manifest.get("recipe") or {}).get("train", {}).get("calibration_every"))
    cache = HiddenCache(recipe.out / "cache" / "train", target)
    calib = calibration_split(len(cache), recipe.train.calibration_every)
    if not calib:
        raise EmptyDatasetError("train.calibration_every is 0: no held-out sequences to build trees from")
    own = getattr(model, "rank_acceptance", None)  # a kind that measures its own (EAGLE-3: by training-time step)

    def rank_acc(c: HiddenCache, sequences=None) -> dict:
        return own(c, target, sequences=sequences, ranks=10) if callable(own) else head_accuracy(
            model, c, model.num_heads, ranks=10, sequences=sequences)

    acc = rank_acc(cache, calib)
    cost_target = cost_target or target
    apply_cpu_layout(cost_target)  # step costs measured on the layout decoding uses (bench and eval apply it too)
    use_fast_forward(cost_target, recipe.eval.forward)  # ... and with the forward decoding uses
    med: dict = {}
    step_cost = measure_step_cost(cost_target, recipe.train.tree_budgets, medians_out=med)
    # drafting's own cost per step (fixed + per tree level), decoded as bench will decode, relative to a 1-row step
    drafter = drafter_from_checkpoint(ckpt, cost_target)
    apply_cpu_layout(cost_target, drafter)
    dc = measure_draft_cost(cost_target, drafter, len(acc["rank_acc"]))
    draft_cost = {k: v / med[1] for k, v in dc.items()}
    trees = build_trees(acc["rank_acc"], recipe.train.tree_budgets,
                        {"split": f"every {recipe.train.calibration_every}-th training sequence, " + (
                             "held out of training" if held_out else
                             "NOT held out: this checkpoint was trained on every sequence"),
                         "held_out": held_out, "sequences": len(calib), "positions": acc["positions"],
                         "conditional": model.conditional_accuracy},
                        step_cost=step_cost, draft_cost=draft_cost)
    trees["plain_step_ms"] = round(med[1] * 1e3, 2)
    trees["draft_cost_ms"] = {k: round(v * 1e3, 2) for k, v in dc.items()}
    # The calibration split is the training data's distribution, which the drafter predicts better than the
    # bench's prompts (docs/results-log.md §40.3: forecast tau 0.87-0.93 of the bench's). The same trees are
    # forecast again on the held-out MT-Bench answers the report reads: a forecast only, never a choice.
    held_dir = recipe.out / "cache" / "heldout"
    if (held_dir / "index.json").exists():
        held = rank_acc(HiddenCache(held_dir, target))
        add_heldout_forecast(trees, held["rank_acc"], {"split": "MT-Bench first turns, the target's greedy answers",
                                                       "positions": held["positions"]})
    save_trees(ckpt, trees)
    return trees


def stage_traces(recipe: Recipe, target: Target, **options) -> dict:
    """Acceptance traces of the recipe's drafter on its training prompts (classifiers/traces.py), for the
    acceptance predictors (DISCO, SpecDec++); see `draftsmith.train.training.predictors.stage_traces` for options."""
    return classifier_stage.stage_traces(recipe, target, **options)


def stage_bench(recipe: Recipe, target: Target, ckpt: Path, plain_targets: tuple[Target, ...] = ()) -> dict:
    """Decode MT-Bench first turns with the trained drafter: tau and speedup, measured interleaved.

    ``plain_targets``: the same target loaded in other dtypes (`plain_dtypes` says which the recipe asks for),
    each timed as one more plain decoding, ``plain (ours, DTYPE)``, in the same interleaved run; the speedups
    then also name the fastest plain decoding measured (``figures["fastest_plain"]``)."""

    e = recipe.eval
    drafter = drafter_from_checkpoint(ckpt, target)
    drafter.name = recipe.name
    apply_cpu_layout(target, drafter)  # decoding only from here on (see draftsmith.engine.cpu_layout)
    forward = use_fast_forward(target, e.forward)
    trees = [(t, parse_tree(t, ckpt)) for t in e.trees]
    greedy = SamplingParams(0.0)
    methods = default_methods(target, greedy, drafter_layers=None, hf=e.hf_generate,
                              hf_assisted_too=False, heads=drafter, trees=trees)
    for other in plain_targets:
        if other.fingerprint != target.fingerprint:
            raise ValueError(f"plain_targets must be the bench's target in another dtype: {other.name} "
                             f"({other.fingerprint}) is not {target.name} ({target.fingerprint})")
        prepare_plain_target(other, e.forward)
        methods.insert(1, plain_in_dtype(other, greedy))
    seeded = members = None
    if e.suffix_from_data:
        seeded = stage_suffix_index(recipe, target)
        extra, members = suffix_methods(target, greedy, [(drafter, trees)], config=BENCH_SUFFIX,
                                        hf_lookup=False, ours_lookup=False, index_dir=recipe.out / "suffix_index")
        methods += extra
    left_out: dict = {}
    with contextlib.ExitStack() as servers:  # llama.cpp's plain decoding, interleaved with ours
        methods += llamacpp_plain_methods(servers, left_out, target, e.llamacpp)
        figures = run_bench(methods, mtbench_prompts(target.tokenizer, e.prompts, spread=True), e.max_new_tokens,
                            log=None, compile_clock=lambda: compile_seconds(target, [drafter]) + sum(
                                compile_seconds(t) for t in plain_targets))
    figures.update(left_out)
    if seeded is not None:
        figures["suffix_index"], figures["suffix"] = seeded, suffix_stats(members)
    mark_fastest_plain(figures)
    figures["forecast"] = forecast_vs_measured(figures, ckpt, e.trees, drafter.name)
    figures["dtype"] = dtype_name(target.dtype)
    figures["table"] = table(figures)
    figures["forward"] = dict(forward, compile_s=round(getattr(target.fast_body, "compile_s", 0.0), 1),
                              drafter_compile_s=round(getattr(drafter, "compile_s", 0.0), 1),
                              plain_compile_s={dtype_name(t.dtype): round(compile_seconds(t), 1)
                                               for t in plain_targets})
    figures["command"], figures["environment"] = command_line(), environment()
    (recipe.out / "bench.json").write_text(json.dumps(figures, indent=2))
    return figures


FORECAST_MIN_SEQUENCES = 8  # held-out sequences under which the trees' forecast is called noise


def forecast_warning(source: dict) -> str | None:
    """What to say when the trees stage's acceptance comes from too few held-out sequences to forecast from (2
    sequences of memorised data forecast tau 3.00 where 1.24 was measured, docs/results-log.md §33.8); else None."""
    n = int(source.get("sequences", 0))
    if n >= FORECAST_MIN_SEQUENCES:
        return None
    return (f"trees: only {n} held-out sequence(s) measured the acceptance these trees are built from (fewer than "
            f"{FORECAST_MIN_SEQUENCES}): their expected tau is noise, the bench's measurement is what counts; lower "
            "train.calibration_every or add data")


def forecast_vs_measured(figures: dict, ckpt: Path, specs: list[str], name: str) -> dict:
    """The trees stage's forecast (``trees.json`` in the checkpoint: expected tau and speed relative to plain
    decoding, from held-out acceptance and measured step costs) beside what the bench measured with that tree:
    {method: {tree, forecast_tau, measured_tau, tau_ratio, forecast_speedup, measured_speedup, speedup_ratio}}.
    Built trees only (``built:N``, ``built:best``); the hybrid with SuffixDecoding is not what was forecast.
    Where the trees stage also forecast on the held-out MT-Bench answers (`add_heldout_forecast`), that forecast
    and its ratios too (``heldout_forecast_tau``, ``heldout_tau_ratio``, ``heldout_forecast_speedup``,
    ``heldout_speedup_ratio``).

    Where both decoders' step times were measured (``step_ms``: draft, verify, other) the speed's miss is split
    into its factors, speedup_ratio = tau_ratio / step_cost_ratio x rest_ratio: ``forecast_step_cost`` (the
    tree's step, drafting included, in plain steps, as the trees stage measured it alone) against
    ``measured_step_cost`` (the same ratio of mean step times in the bench), and ``rest_ratio`` for what is
    neither (the prefill, which plain decoding fuses into its first step and a drafter that reads the target's
    states runs apart; time outside the steps)."""
    path = Path(ckpt) / "trees.json"
    if not path.exists():
        return {}
    trees = json.loads(path.read_text())
    plain = figures["methods"].get(BASELINE, {}).get("tokens_per_s")
    out = {}
    for spec in specs:
        if not spec.startswith("built:"):
            continue
        budget = trees.get("best") if spec == "built:best" else spec.split(":", 1)[1]
        fc, got = trees.get("trees", {}).get(str(budget)), figures["methods"].get(f"ours {name} {spec}")
        if not fc or not got:
            continue
        row = {"tree": f"built:{budget}", "forecast_tau": round(fc["expected_tau"], 3),
               "measured_tau": round(got["tau"], 3), "tau_ratio": round(got["tau"] / fc["expected_tau"], 3)}
        if fc.get("heldout_expected_tau"):  # the same tree forecast on the held-out MT-Bench answers
            row.update(heldout_forecast_tau=round(fc["heldout_expected_tau"], 3),
                       heldout_tau_ratio=round(got["tau"] / fc["heldout_expected_tau"], 3))
        if plain and fc.get("relative_speed"):
            measured = got["tokens_per_s"] / plain
            row.update(forecast_speedup=round(fc["relative_speed"], 3), measured_speedup=round(measured, 3),
                       speedup_ratio=round(measured / fc["relative_speed"], 3))
            if fc.get("heldout_relative_speed"):
                row.update(heldout_forecast_speedup=round(fc["heldout_relative_speed"], 3),
                           heldout_speedup_ratio=round(measured / fc["heldout_relative_speed"], 3))
            step, plain_step = got.get("step_ms"), figures["methods"][BASELINE].get("step_ms")
            if fc.get("step_cost") and step and plain_step and sum(plain_step.values()) > 0:
                cost = sum(step.values()) / sum(plain_step.values())
                steady = got["tau"] / cost  # the speedup if nothing but the steps took time
                row.update(forecast_step_cost=round(fc["step_cost"], 3), measured_step_cost=round(cost, 3),
                           step_cost_ratio=round(cost / fc["step_cost"], 3), rest_ratio=round(measured / steady, 3))
        out[f"ours {name} {spec}"] = row
    return out


def decode_choice(recipe: Recipe, device: str = "cpu") -> DtypeChoice:
    """The dtype the trees stage's step costs and the bench's decoding run the target in: ``eval.dtype``, else
    the recipe's ``dtype``, each through `decode_dtype` (``auto`` on a CPU: float32 for a target that ships as a
    low-bit GGUF file)."""
    return decode_dtype(recipe.eval.dtype or recipe.dtype, recipe.target, device, recipe.eval.forward)


def plain_dtypes(recipe: Recipe, dtype: str, device: str = "cpu", data_dtype: str | None = None) -> list[str]:
    """The other dtypes the bench stage times plain decoding in, besides ``dtype`` (the one decoding runs in,
    resolved): float32 and the recipe's data dtype ``data_dtype`` (resolved), those of them that are not
    ``dtype``, where ``eval.plain_other_dtype`` asks for them (None: on a CPU)."""
    want = recipe.eval.plain_other_dtype
    if want is None:
        want = device == "cpu"
    return [d for d in dict.fromkeys(("float32", data_dtype or dtype)) if d != dtype] if want else []


def stage_suffix_index(recipe: Recipe, target: Target) -> dict:
    """SuffixDecoding's global index over the training split's answers, saved as OUT/suffix_index."""
    return save_index_from_data(recipe.out / "data" / "train.jsonl", target.tokenizer, recipe.out / "suffix_index",
                                target.fingerprint, BENCH_SUFFIX, max_seq_len=recipe.data.max_seq_len)


def merge_runs(out: Path, runs: list[Path]) -> dict:
    """Data and cache of several finished data runs as one (for ``shared_data``): train.jsonl concatenated,
    the training caches merged by linking their shards (`merge_caches`), the held-out split of the first
    run (every run must hold the same one). Prompts found in more than one run are counted, not removed
    (their cached shards are shared)."""
    out, runs = Path(out), [Path(r) for r in runs]
    for r in runs:
        for need in ("data/meta.json", "data/train.jsonl", "cache/train/index.json"):
            if not (r / need).exists():
                raise FileNotFoundError(f"{r} has no {need}: run its data and cache stages first")
    held = [r / "cache" / "heldout" / "index.json" for r in runs]
    if held[0].exists():
        toks = [json.loads(h.read_text())["tokens"] if h.exists() else None for h in held]
        if any(t != toks[0] for t in toks):
            raise ValueError(f"the runs' held-out caches differ ({toks} tokens): they must share one held-out set")
    if (out / "data" / "meta.json").exists():
        raise FileExistsError(f"{out} already holds merged data; merge into a new directory")
    (out / "data").mkdir(parents=True, exist_ok=True)
    index = merge_caches(out / "cache" / "train", [r / "cache" / "train" for r in runs])
    if held[0].exists():
        link = out / "cache" / "heldout"
        if not link.exists():
            link.symlink_to(os.path.relpath((runs[0] / "cache" / "heldout").resolve(), link.parent.resolve()),
                            target_is_directory=True)
        shutil.copyfile(runs[0] / "data" / "heldout.jsonl", out / "data" / "heldout.jsonl")
    seen: set[str] = set()
    ids: set[str] = set()
    stats = Counter()
    with (out / "data" / "train.jsonl").open("w") as f:
        for r in runs:
            for line in (r / "data" / "train.jsonl").read_text().splitlines():
                row = json.loads(line)
                if row["id"] in ids:
                    raise ValueError(f"conversation id {row['id']!r} appears in two runs; they cannot be merged")
                ids.add(row["id"])
                key = json.dumps([m["content"] for m in row["messages"] if m["role"] == "user"])
                stats["prompts_in_more_than_one_run"] += key in seen
                seen.add(key)
                f.write(line + "\n")
    metas = [json.loads((r / "data" / "meta.json").read_text()) for r in runs]
    gen = Counter()
    for m in metas:
        for k, v in m.get("generation", {}).items():
            if isinstance(v, (int, float)) and not k.endswith("per_s"):
                gen[k] += v
    meta = {"merged_from": [str(r) for r in runs], "runs": metas, "generation": dict(gen),
            "sources": dict(stats), "target_fingerprint": metas[0].get("target_fingerprint"),
            "cache_sequences": index["sequences"], "cache_tokens": index["tokens"]}
    (out / "data" / "meta.json").write_text(json.dumps(meta, indent=2))
    return meta
