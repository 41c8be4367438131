"""Training a drafter with its own tokenizer: sequence-level distillation on target-written text.

The pipeline's train stage for kinds with ``trains_on_text`` (``own-tokenizer``):
  1. train a byte-level BPE tokenizer on the rendered self-distilled conversations (chat template of
     the target, special tokens of the target);
  2. build the small Llama of the recipe over it;
  3. next-token cross-entropy on the same conversations re-tokenised with its own tokenizer, on the
     assistant tokens only (the target's greedy replies and their end-of-turn token): sequence-level
     distillation (the target's outputs as hard labels). Token-level distillation against the
     target's distributions would need both vocabularies aligned position by position; it is out of
     scope here (docs/DECISIONS.md).
Conversations are packed into one stream cut into ``chunk_len`` windows (attention crosses
conversation boundaries, as in GPT pre-training); batches are a seeded permutation of the windows.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import Counter
from pathlib import Path

import torch

from draftsmith.checkpoint import load_checkpoint, save_checkpoint
from draftsmith.drafters.own_tokenizer.model import (OwnTokenizerDrafter, describe, init_from_target,
                                               target_special_tokens, train_bpe_tokenizer)
from draftsmith.recipe import Recipe
from draftsmith.target import Target
from draftsmith.common.chat import render_example

log = logging.getLogger(__name__)


class NoTextError(ValueError):
    """No usable conversation in the training file."""


def read_conversations(path: Path, stats: Counter) -> list[tuple[str, list[dict], list[bool]]]:
    """(id, messages, finished) of every usable row of a data/train.jsonl; bad rows are counted and skipped."""
    out = []
    if not path.is_file():
        raise NoTextError(f"{path} is missing: run the data stage first")
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            msgs = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + row["messages"]
            if not any(m["role"] == "assistant" for m in msgs):
                stats["no_assistant_turn"] += 1
                continue
            out.append((row["id"], msgs, list(row["finished"])))
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            stats["corrupt_rows"] += 1
            log.warning("%s:%d skipped (%s)", path.name, n, e)
    if not out:
        raise NoTextError(f"{path} holds no usable conversation ({dict(stats)})")
    return out


def encode_stream(hf_tok, convs, max_seq_len: int, stats: Counter) -> tuple[torch.Tensor, torch.Tensor]:
    """All conversations in the drafter's tokens, concatenated: ids [N], assistant mask [N]."""
    ids, mask = [], []
    for cid, msgs, fin in convs:
        try:
            i, m = render_example(hf_tok, msgs, fin)
        except ValueError as e:
            stats["unrenderable"] += 1
            log.warning("%s skipped (%s)", cid, e)
            continue
        if len(i) > max_seq_len:
            i, m = i[:max_seq_len], m[:max_seq_len]
            stats["truncated_to_max_seq_len"] += 1
        ids += i
        mask += m
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.bool)


def _lr(step: int, total: int, recipe: Recipe) -> float:
    t = recipe.train
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    frac = (step - t.warmup_steps) / max(1, total - t.warmup_steps)
    shape = 0.5 * (1 + math.cos(math.pi * frac)) if t.schedule == "cosine" else 1 - frac
    return t.lr * (t.min_lr_ratio + (1 - t.min_lr_ratio) * shape)


def train_text_drafter(recipe: Recipe, target: Target, out: Path | None = None) -> tuple[Path, dict]:
    """Tokenizer + drafter + training for an ``own-tokenizer`` recipe; writes ``<out>/final``."""
    out = Path(out or recipe.out)
    cfg = recipe.drafter.model_dump()
    cfg.pop("kind")
    t0 = time.time()
    stats: Counter = Counter()
    convs = read_conversations(out / "data" / "train.jsonl", stats)
    texts = [target.tokenizer.apply_chat_template(m, tokenize=False) for _, m, _ in convs]
    tok = train_bpe_tokenizer(texts, cfg["tokenizer_vocab_size"], target_special_tokens(target.tokenizer),
                              cfg["tokenizer_min_frequency"])
    torch.manual_seed(recipe.seed)
    drafter = OwnTokenizerDrafter(cfg, tok, target)
    init = init_from_target(drafter, target) if cfg.get("init") == "target" else {"init": "scratch"}
    ids, mask = encode_stream(drafter.hf_tokenizer(target), convs, recipe.data.max_seq_len, stats)
    t = recipe.train
    L = t.chunk_len
    n_chunks = (len(ids) - 1) // L
    if n_chunks < 1:
        raise NoTextError(f"{len(ids)} tokens: fewer than one chunk of {L}")
    x = ids[: n_chunks * L].view(n_chunks, L)
    y = ids[1: n_chunks * L + 1].view(n_chunks, L).clone()
    y[~mask[1: n_chunks * L + 1].view(n_chunks, L)] = -100
    per_epoch = math.ceil(n_chunks / t.batch_size)
    total = t.max_steps or max(1, int(round(per_epoch * t.epochs)))
    model = drafter.model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=t.lr, weight_decay=t.weight_decay)
    gen = torch.Generator().manual_seed(recipe.seed)
    order = torch.empty(0, dtype=torch.long)
    losses, math_s = [], 0.0
    t_train = time.time()
    for step in range(total):
        if len(order) < t.batch_size:
            order = torch.cat([order, torch.randperm(n_chunks, generator=gen)])
        b, order = order[: t.batch_size], order[t.batch_size:]
        for g in opt.param_groups:
            g["lr"] = _lr(step, total, recipe)
        tm = time.time()
        logits = model(input_ids=x[b]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y[b].flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        opt.step()
        math_s += time.time() - tm
        losses.append(loss.item())
        if step % t.log_every == 0 or step == total - 1:
            print(f"step {step + 1}/{total} loss {losses[-1]:.3f} lr {_lr(step, total, recipe):.2e}", flush=True)
    model.eval()
    wall = time.time() - t_train
    final = out / "final"
    vocab = describe(tok, target)
    metrics = {"train_loss_last10": sum(losses[-10:]) / len(losses[-10:]), "steps": total,
               "tokens": int(len(ids)), "assistant_tokens": int(mask.sum()), "chunks": n_chunks, **vocab, **init,
               "objective": "sequence-level distillation: next-token CE on the target's replies, own tokens"}
    save_checkpoint(final, drafter, target, recipe=recipe.model_dump(mode="json"),
                    data={"data_dir": str(out / "data"), "conversations": len(convs), "skipped": dict(stats)},
                    metrics=metrics)
    timing = {"steps": total, "wall_s": round(time.time() - t0, 1), "train_s": round(wall, 1),
              "distributed_type": "NO", "world_size": 1, "is_main": True,
              "outside_math_share": max(0.0, 1 - math_s / max(wall, 1e-9)), **metrics}
    (out / "train_text.json").write_text(json.dumps(timing, indent=2))
    return final, timing


@torch.no_grad()
def heldout_figures(recipe: Recipe, target: Target, ckpt: Path, max_convs: int = 80) -> dict:
    """Held-out figures in the drafter's own tokens: CE and top-1 on the target's MT-Bench answers
    (``data/heldout.jsonl``), plus the vocabulary intersection (the pipeline writes the report)."""
    module, _ = load_checkpoint(ckpt, target)
    stats: Counter = Counter()
    src = recipe.out / "data" / "heldout.jsonl"
    figures: dict = describe(module.tokenizer, target)
    if src.is_file():
        convs = read_conversations(src, stats)[:max_convs]
        ids, mask = encode_stream(module.hf_tokenizer(target), convs, recipe.data.max_seq_len, stats)
        logits = torch.cat([module.model(input_ids=ids[i:i + 512][None]).logits[0]
                            for i in range(0, len(ids) - 1, 512)])[: len(ids) - 1]
        keep = mask[1:]
        y = ids[1:][keep]
        lg = logits[keep].float()
        # TLI can only draft shared strings: the share of the target's answer tokens that are shared bounds
        # its per-token acceptance
        tids, tmask = encode_stream(target.tokenizer, convs, recipe.data.max_seq_len, stats)
        t2d = module.bridge(target).t2d
        shared = torch.tensor([t in t2d for t in tids[tmask].tolist()])
        figures["target_answer_tokens_shared"] = float(shared.float().mean()) if len(shared) else 0.0
        figures.update(heldout_conversations=len(convs), heldout_positions=int(keep.sum()),
                       heldout_ce=float(torch.nn.functional.cross_entropy(lg, y)),
                       heldout_top1=float((lg.argmax(-1) == y).float().mean()))
    return figures
