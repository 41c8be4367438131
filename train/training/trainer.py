"""One training loop for every trained drafter kind (`fit`), on accelerate.

Runs as ``draftsmith train RECIPE`` on one process, or under
``accelerate launch --config_file recipes/launch/<cfg>.yaml -m draftsmith.cli train RECIPE``
(multi-process CPU, multi-GPU DDP, DeepSpeed ZeRO-2).

Batches are a pure function of (seed, epoch, step, rank): the chunk order of
each epoch is a seeded permutation, so a resumed run sees exactly the batches
the interrupted run would have, and exact resume needs no dataloader state.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import time
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from draftsmith import registry
from draftsmith.chat import prompt_token_ids
from draftsmith.checkpoint import CheckpointError, read_json, read_manifest, read_safetensors, save_checkpoint
from draftsmith.common.chunks import calibration_split
from draftsmith.common.losses import predicted_chain_tau
from draftsmith.common.vocab import answer_coverage, draft_head, frequent_ids, kept_size
from draftsmith.recipe import Recipe
from draftsmith.target import check_fingerprint
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.sources import mtbench_questions
from draftsmith.train.training.state import latest_checkpoint, load_trainer_state, save_trainer_state

log = logging.getLogger(__name__)


class StopTraining(Exception):
    """Raised by the ``stop_after`` test hook to simulate a killed run."""


def build_drafter(recipe: Recipe, target) -> torch.nn.Module:
    cfg = recipe.drafter.model_dump()
    cfg.pop("kind")
    if cfg.get("vocab_keep") is not None:
        cfg["vocab_keep"] = kept_size(cfg["vocab_keep"], target.vocab_size)
    return registry.get(recipe.drafter.kind).for_target(target, **cfg)


def teach_over_draft_vocab(objective, model: torch.nn.Module) -> None:
    """An objective whose teacher must be restricted to the drafter's draft vocabulary (EAGLE-3) gets its kept
    ids; every other objective, or a drafter over the full vocabulary, is left as it is."""
    if hasattr(objective, "use_pruned_teacher"):
        objective.use_pruned_teacher(draft_head(model))


def set_draft_vocab(model: torch.nn.Module, cache: HiddenCache, exclude: set[int]) -> dict | None:
    """A drafter with a pruned head drafts over the most frequent assistant-token ids of its training
    sequences (the calibration split left out); returns what was kept, for the log and the manifest."""
    dh = draft_head(model)
    if dh is None:
        return None
    seqs = [i for i in range(len(cache)) if i not in exclude]
    ids = frequent_ids((cache.tokens(i) for i in seqs), (cache.mask(i) for i in seqs), dh.vocab_size,
                       len(dh.kept_ids))
    getattr(model, "module", model).set_draft_vocab(ids)
    covered, _ = answer_coverage((cache.tokens(i) for i in seqs), (cache.mask(i) for i in seqs), ids.numpy())
    return {"kept": len(ids), "vocab": dh.vocab_size, "assistant_token_coverage": covered}


def init_weights(model: torch.nn.Module, recipe: Recipe, target, path: str | Path) -> None:
    """Load ``path``'s drafter weights into ``model`` (train.init_from): the checkpoint must be of this
    target, kind and shape; a clear error names what differs."""
    path = Path(path)
    manifest = read_manifest(path)
    check_fingerprint(manifest["target"]["fingerprint"], target, what=f"train.init_from checkpoint {path}")
    if manifest["kind"] != recipe.drafter.kind:
        raise ValueError(f"train.init_from {path} holds a {manifest['kind']!r} drafter, this recipe trains "
                         f"{recipe.drafter.kind!r}")
    sd = read_safetensors(path / "model.safetensors", f"{manifest['kind']} weights")
    own = model.state_dict()
    bad = sorted(k for k in sd if k not in own or own[k].shape != sd[k].shape)
    missing = sorted(k for k, v in own.items() if k not in sd and not any(
        k == s or k.startswith(s + ".") for s in getattr(model, "shared_with_target", ())))
    if bad or missing:
        cfg = read_json(path / "config.json", "drafter config")
        raise CheckpointError(f"train.init_from {path}: its weights do not fit this recipe's drafter (config "
                              f"{cfg}); differing: {bad[:4]}, missing: {missing[:4]}")
    model.load_state_dict(sd, strict=False)


def make_objective(recipe: Recipe, cache: HiddenCache, target):
    t = recipe.train
    exclude = calibration_split(len(cache), t.calibration_every)
    return registry.get(recipe.drafter.kind).make_objective(recipe, cache, target, exclude)


def lr_lambda(t, total: int):
    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / (t.warmup_steps + 1)
        if t.schedule == "constant":
            return 1.0
        frac = (step - t.warmup_steps) / max(1, total - t.warmup_steps)
        decay = 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))) if t.schedule == "cosine" else 1.0 - min(frac, 1.0)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * decay
    return f


def _merge_hits(acc: dict, stats: dict) -> None:
    """Accumulate a micro-batch's stats: (hits, count) pairs add up, floats average."""
    for k, v in stats.items():
        if isinstance(v, tuple):
            a = acc.setdefault(k, [0, 0])
            a[0] += v[0]
            a[1] += v[1]
        else:
            acc.setdefault(k, []).append(v)


def _summarise(acc: dict) -> dict:
    return {k: (v[0] / max(v[1], 1) if "/top" in k else sum(v) / len(v)) for k, v in acc.items()}


def make_accelerator(recipe: Recipe, run_dir: Path):
    """The run's `accelerate.Accelerator` (wandb offline by default, under ``run_dir``), seeded."""
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    t = recipe.train
    if t.tracker == "wandb":
        os.environ.setdefault("WANDB_MODE", "offline")
        os.environ.setdefault("WANDB_DIR", str(run_dir))
        os.environ.setdefault("WANDB_SILENT", "true")
    # cpu=True without a GPU: accelerate then joins torchrun-launched processes as MULTI_CPU over gloo.
    acc = Accelerator(gradient_accumulation_steps=t.grad_accum, log_with="wandb" if t.tracker == "wandb" else None,
                      project_dir=str(run_dir), mixed_precision=t.mixed_precision,
                      cpu=not torch.cuda.is_available() and os.environ.get("ACCELERATE_USE_DEEPSPEED") != "true")
    set_seed(recipe.seed)
    return acc


def train(recipe: Recipe, target, cache_dir: Path, run_dir: Path, *, resume: bool = True,
          stop_after: int | None = None, data_provenance: dict | None = None) -> tuple[Path, dict]:
    """Train the recipe's drafter on a cache of the target's states; returns (final checkpoint dir,
    timing/metrics)."""
    t = recipe.train
    acc = make_accelerator(recipe, run_dir)
    cache = HiddenCache(cache_dir, target)
    objective = make_objective(recipe, cache, target)
    model = build_drafter(recipe, target)
    vocab = set_draft_vocab(model, cache, calibration_split(len(cache), t.calibration_every))
    teach_over_draft_vocab(objective, model)
    if vocab and acc.is_main_process:
        print(f"draft vocabulary: {vocab['kept']} of {vocab['vocab']} ids, covering "
              f"{100 * vocab['assistant_token_coverage']:.2f}% of the training assistant tokens")
    fitted = model.fit_to_cache(cache, target, calibration_split(len(cache), t.calibration_every))
    if fitted and acc.is_main_process:
        print(f"fitted to the training data: {fitted}")
    if t.init_from and (latest_checkpoint(run_dir) is None or not resume):
        init_weights(model, recipe, target, t.init_from)
        if acc.is_main_process:
            print(f"weights from {t.init_from}" + (" (with its draft vocabulary)" if vocab else ""))

    def save(path: Path, module: torch.nn.Module, step: int) -> None:
        save_checkpoint(path, module, target, recipe=recipe.model_dump(mode="json"), data=data_provenance,
                        metrics={"step": step}, target_dtype=cache.index.get("target_dtype"))

    probe = None
    if t.probe_every:
        qs = mtbench_questions()
        qs = [qs[(i * len(qs)) // t.probe_prompts] for i in range(t.probe_prompts)]  # spread over the categories
        probe = tau_probe(target, [prompt_token_ids(target.tokenizer, [{"role": "user", "content": q["turns"][0]}])
                                   for q in qs], t.probe_tokens)
    return fit(acc, recipe, model, objective, run_dir, save, resume=resume, stop_after=stop_after, probe=probe)


def train_on_text(recipe: Recipe, target, out: Path, *, resume: bool = True,
                  stop_after: int | None = None) -> tuple[Path, dict]:
    """Train a kind that ``trains_on_text`` (the own-tokenizer drafter: its tokenizer, model and objective from
    the kind's registered text run) in the same loop; writes ``<out>/final`` and ``<out>/train_text.json``."""
    t0 = time.time()
    acc = make_accelerator(recipe, out)
    run = registry.text_run(recipe.drafter.kind)(recipe, target, out)

    def save(path: Path, module: torch.nn.Module, step: int) -> None:
        save_checkpoint(path, module, target, recipe=recipe.model_dump(mode="json"), data=run.data,
                        metrics={"step": step})

    _, timing = fit(acc, recipe, run.drafter, run.objective, out, save, resume=resume, stop_after=stop_after)
    final = out / "final"
    metrics = {"train_loss_last10": timing["loss_last10"], "steps": timing["steps"], **run.metrics}
    if timing["is_main"]:
        save_checkpoint(final, acc.unwrap_model(run.drafter).eval(), target, recipe=recipe.model_dump(mode="json"),
                        data=run.data, metrics=metrics)
    timing = {**timing, "train_s": round(timing["wall_s"], 1), "wall_s": round(time.time() - t0, 1), **metrics}
    (out / "train_text.json").write_text(json.dumps(timing, indent=2))
    return final, timing


def predicted_tau(summary: dict) -> float | None:
    """`predicted_chain_tau` of the logged top-1 accuracies (``.../top1`` keys, numbered heads or steps, in order;
    a step's accuracy conditional on the earlier steps', ``.../top1_cond``, where logged: EAGLE-3's); None when none
    is logged."""
    accs: dict[int, float] = {}
    for k, v in sorted(summary.items()):  # "..N/top1" sorts before "..N/top1_cond", which then replaces it
        m = re.search(r"(\d+)/top1(_cond)?$", k)
        if m and isinstance(v, (int, float)):
            accs[int(m.group(1))] = float(v)
    return predicted_chain_tau([accs[k] for k in sorted(accs)]) if accs else None


def tau_probe(target, prompts: list[list[int]], max_new_tokens: int) -> Callable[[torch.nn.Module], float]:
    """``probe(module)`` for `fit`: the module as its kind's decoder drafter (chains, its default length), greedy,
    on ``prompts``; returns the mean acceptance length (tokens per target forward) over them."""
    from draftsmith.engine.decoder import SpeculativeDecoder  # engine: only when a probe is asked for

    def probe(module: torch.nn.Module) -> float:
        dec = SpeculativeDecoder(target, module.decoder_drafter(target, target.fingerprint, "probe"))
        tokens = forwards = 0
        with torch.no_grad():
            for ids in prompts:
                res = dec.generate(ids, max_new_tokens)
                tokens, forwards = tokens + len(res.tokens), forwards + res.target_forwards
        return tokens / max(1, forwards)
    return probe


def train_step(model: torch.nn.Module, objective, optimizer, params: list, micro_batches: list[list[int]],
               max_grad_norm: float, *, acc=None, window: dict | None = None, timing: dict | None = None) -> float:
    """One optimizer step, the step both of draftsmith's training loops take (`fit`, and the online job's update,
    `draftsmith.train.online.update.update_module`): for each micro-batch (a list of the objective's chunk indices)
    prepare it, compute the objective's loss, backpropagate, clip ``params``' gradients to ``max_grad_norm`` and step
    ``optimizer`` where gradients are synchronised (every micro-batch without ``acc``; under an accelerate
    ``acc``, its accumulation decides). Returns the step's loss, the mean over its micro-batches. ``window``
    (optional) gathers the objective's stats and the loss (`_merge_hits`), ``timing`` data_s, math_s, stats_s and
    positions."""
    step_loss = 0.0
    device = acc.device if acc is not None else None
    for ids in micro_batches:
        t0 = time.perf_counter()
        batch = objective.prepare(ids)
        if device is not None:
            batch = batch.to(device)
        t1 = time.perf_counter()
        if acc is not None:
            with acc.accumulate(model):
                loss, aux = objective.loss(model, batch)
                acc.backward(loss)
                if acc.sync_gradients:
                    acc.clip_grad_norm_(params, max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        else:
            loss, aux = objective.loss(model, batch)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        value = float(loss.detach())
        step_loss += value / len(micro_batches)
        if window is not None:
            _merge_hits(window, {**objective.stats(aux, batch), "loss": value})
        if timing is not None:
            timing["data_s"] += t1 - t0
            timing["math_s"] += t2 - t1
            timing["stats_s"] += time.perf_counter() - t2
            timing["positions"] += batch.positions
    return step_loss


def fit(acc, recipe: Recipe, model: torch.nn.Module, objective, run_dir: Path,
        save: Callable[[Path, torch.nn.Module, int], None], *, resume: bool = True,
        stop_after: int | None = None, probe: Callable[[torch.nn.Module], float] | None = None) -> tuple[Path, dict]:
    """The training loop every trained kind runs: AdamW over ``model``'s trainable parameters, the recipe's
    schedule, accumulation, clipping, logging, and checkpoints every ``train.save_every`` steps written by
    ``save(path, unwrapped model, step)`` under ``run_dir/checkpoints/step-N`` with the optimizer's state
    beside them, from which a run resumes exactly.

    ``objective``: ``.chunks`` (the training examples, indexed), ``.prepare(indices)`` -> a batch with ``.to(device)``
    and ``.positions``, ``.loss(model, batch)`` -> (loss, aux), ``.stats(aux, batch)`` -> figures to log (a (hits,
    count) pair or a float each). Returns (the last checkpoint's directory, timing with the mean loss of the last
    ten steps). ``probe(module)``: the measured mean acceptance length of the module as it is, called every
    ``train.probe_every`` steps and after the last on the main process (`tau_probe`); each call is logged with the
    prediction of the last logged accuracies and kept in the timing's ``probes``."""
    t = recipe.train
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=t.lr, weight_decay=t.weight_decay)
    world, rank = acc.num_processes, acc.process_index
    per_step = t.batch_size * world * t.grad_accum
    steps_per_epoch = len(objective.chunks) // per_step
    if steps_per_epoch == 0:
        raise ValueError(f"{len(objective.chunks)} chunks are fewer than one optimizer step needs ({per_step}); "
                         f"lower train.batch_size or train.grad_accum, or add data")
    total = t.max_steps or max(1, int(steps_per_epoch * t.epochs))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(t, total))
    start = 0
    ckpt = latest_checkpoint(run_dir) if resume else None
    if ckpt is not None:
        from safetensors.torch import load_file
        model.load_state_dict(load_file(str(ckpt / "model.safetensors")), strict=False)
        meta = load_trainer_state(ckpt, optimizer, scheduler)
        if meta.get("world_size", world) != world:
            raise ValueError(f"{ckpt} was written by {meta['world_size']} process(es), this run has {world}: "
                             f"batches would differ, so exact resume is impossible (use --fresh to restart)")
        start = meta["step"]
        log.info("resumed from %s at step %d", ckpt, start)
    ds = getattr(acc.state, "deepspeed_plugin", None)
    if (ds is not None and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() != acc.num_processes):
        # Seen with accelerate 1.15 + DeepSpeed on CPU: each process believes it is rank 0 of 1,
        # so every rank would train on the same batches and write the same files.
        raise RuntimeError(
            f"accelerate reports {acc.num_processes} process(es) but torch.distributed has "
            f"{torch.distributed.get_world_size()}: multi-process DeepSpeed without GPUs is not supported "
            f"by accelerate; use recipes/launch/cpu_ddp2.yaml on CPU, or DeepSpeed with 1 process")
    if ds is not None:  # we feed batches ourselves, so DeepSpeed must be told their size
        ds.deepspeed_config["train_micro_batch_size_per_gpu"] = t.batch_size
        ds.deepspeed_config["gradient_accumulation_steps"] = t.grad_accum
        ds.deepspeed_config["train_batch_size"] = t.batch_size * t.grad_accum * acc.num_processes
    model, optimizer = acc.prepare(model, optimizer)
    if t.tracker == "wandb":
        acc.init_trackers(recipe.name, config=recipe.model_dump(mode="json"),
                          init_kwargs={"wandb": {"mode": os.environ["WANDB_MODE"], "dir": str(run_dir)}})
    orders: dict[int, list[int]] = {}

    def order(epoch: int) -> list[int]:
        if epoch not in orders:
            g = torch.Generator().manual_seed(recipe.seed * 1000 + epoch)
            orders[epoch] = torch.randperm(len(objective.chunks), generator=g).tolist()
        return orders[epoch]

    bar = tqdm(total=total, initial=start, desc=f"train {recipe.drafter.kind}", disable=not acc.is_main_process)
    timing = {"math_s": 0.0, "data_s": 0.0, "stats_s": 0.0, "checkpoint_s": 0.0, "positions": 0}
    losses: list[float] = []
    window: dict = {}
    last: dict = {}  # the last logged summary: its accuracies predict the probe's tau
    timing["probes"] = []
    loop_t0 = time.perf_counter()
    model.train()
    for step in range(start, total):
        epoch, within = divmod(step, steps_per_epoch)
        ids = order(epoch)
        micro = [(within * t.grad_accum + m) * t.batch_size * world + rank * t.batch_size for m in range(t.grad_accum)]
        losses.append(train_step(model, objective, optimizer, params, [ids[b: b + t.batch_size] for b in micro],
                                 t.max_grad_norm, acc=acc, window=window, timing=timing))
        scheduler.step()
        done = step + 1
        bar.update(1)
        if done % t.log_every == 0 or done == total:
            summary = _summarise(window)
            summary["lr"] = scheduler.get_last_lr()[0]
            window = {}
            acc.log(summary, step=done)
            last = summary
            top1 = next((v for k, v in sorted(summary.items()) if k.endswith("/top1")), 0.0)  # head 1 / step 1
            bar.set_postfix(loss=f"{summary['loss']:.3f}", top1=f"{top1:.3f}")
        if done % t.save_every == 0 or done == total:
            t3 = time.perf_counter()
            acc.wait_for_everyone()
            if acc.is_main_process:
                path = run_dir / "checkpoints" / f"step-{done}"
                save(path, acc.unwrap_model(model), done)
                if acc.distributed_type.name != "DEEPSPEED":
                    save_trainer_state(path, optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer,
                                       scheduler, done, {"epoch": epoch, "world_size": world})
            acc.wait_for_everyone()
            timing["checkpoint_s"] += time.perf_counter() - t3
        if probe is not None and t.probe_every and (done % t.probe_every == 0 or done == total) \
                and acc.is_main_process:
            t4 = time.perf_counter()
            module = acc.unwrap_model(model)
            trainable = [p.requires_grad for p in module.parameters()]
            module.eval()
            try:
                real = float(probe(module))
            finally:  # decoder drafters freeze the module they draft with (EAGLE-3's, the standalone kind's)
                for p, flag in zip(module.parameters(), trainable):
                    p.requires_grad_(flag)
                module.train()
            sim = predicted_tau(_summarise(window) if window else last)  # the freshest accuracies
            row = {"step": done, "tau_real": round(real, 4), "tau_sim": None if sim is None else round(sim, 4),
                   "ratio": None if not sim else round(real / sim, 4), "seconds": round(time.perf_counter() - t4, 1)}
            timing["probes"].append(row)
            acc.log({f"probe/{k}": v for k, v in row.items() if k != "step" and v is not None}, step=done)
            log.info("probe at step %d: tau measured %.3f, predicted %s", done, real, row["tau_sim"])
        if stop_after is not None and done >= stop_after:
            bar.close()
            raise StopTraining(f"stopped after step {done}")
    bar.close()
    wall = time.perf_counter() - loop_t0
    timing.update(wall_s=wall, steps=total - start, is_main=acc.is_main_process, world_size=world,
                  distributed_type=acc.distributed_type.name,
                  outside_math_share=(wall - timing["math_s"]) / wall if wall > 0 else 0.0,
                  loss_last10=sum(losses[-10:]) / max(1, len(losses[-10:])))
    acc.end_training()
    final = run_dir / "checkpoints" / f"step-{total}"
    return final, timing
