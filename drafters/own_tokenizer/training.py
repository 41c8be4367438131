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
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from draftsmith.chat import render
from draftsmith import registry
from draftsmith.checkpoint import load_checkpoint
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


@dataclass
class _TextBatch:
    x: torch.Tensor  # [b, L] input ids
    y: torch.Tensor  # [b, L] next ids, -100 where not an assistant token

    def to(self, device) -> "_TextBatch":
        return _TextBatch(self.x.to(device), self.y.to(device))

    @property
    def positions(self) -> int:
        return int((self.y != -100).sum())


class TextObjective:
    """Next-token cross-entropy on the assistant tokens of one token stream cut into ``L``-token windows: an
    objective of the training loop (`draftsmith.train.training.trainer.fit`)."""

    def __init__(self, ids: torch.Tensor, mask: torch.Tensor, L: int):
        n = (len(ids) - 1) // L
        if n < 1:
            raise NoTextError(f"{len(ids)} tokens: fewer than one chunk of {L}")
        self.x = ids[: n * L].view(n, L)
        self.y = ids[1: n * L + 1].view(n, L).clone()
        self.y[~mask[1: n * L + 1].view(n, L)] = -100
        self.chunks = range(n)

    def prepare(self, idx: list[int]) -> _TextBatch:
        return _TextBatch(self.x[idx], self.y[idx])

    def loss(self, model, batch: _TextBatch) -> tuple[torch.Tensor, None]:
        logits = model(input_ids=batch.x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), batch.y.flatten(),
                                                 ignore_index=-100), None

    def stats(self, aux, batch: _TextBatch) -> dict:
        return {}


@dataclass
class TextRun:
    """What the training loop needs to train an own-tokenizer drafter (`text_run`)."""
    drafter: torch.nn.Module
    objective: TextObjective
    data: dict  # the data's provenance, for every checkpoint
    metrics: dict  # figures of the data and the tokenizer, for the final checkpoint


@registry.register_text_run(OwnTokenizerDrafter.kind)
def text_run(recipe: Recipe, target: Target, out: Path) -> TextRun:
    """Steps 1-2 of the module docstring (the tokenizer, the drafter over it) and the objective of step 3 over
    ``<out>/data/train.jsonl``; the training loop (`draftsmith.train.training.trainer.train_on_text`) runs
    it."""
    cfg = recipe.drafter.model_dump()
    cfg.pop("kind")
    stats: Counter = Counter()
    convs = read_conversations(out / "data" / "train.jsonl", stats)
    texts = [render(target.tokenizer, m) for _, m, _ in convs]
    tok = train_bpe_tokenizer(texts, cfg["tokenizer_vocab_size"], target_special_tokens(target.tokenizer),
                              cfg["tokenizer_min_frequency"])
    drafter = OwnTokenizerDrafter(cfg, tok, target)
    init = init_from_target(drafter, target) if cfg.get("init") == "target" else {"init": "scratch"}
    ids, mask = encode_stream(drafter.hf_tokenizer(target), convs, recipe.data.max_seq_len, stats)
    objective = TextObjective(ids, mask, recipe.train.chunk_len)
    return TextRun(drafter, objective,
                   data={"data_dir": str(out / "data"), "conversations": len(convs), "skipped": dict(stats)},
                   metrics={"tokens": int(len(ids)), "assistant_tokens": int(mask.sum()),
                            "chunks": len(objective.chunks), **describe(tok, target), **init,
                            "objective": "sequence-level distillation: next-token CE on the target's replies, "
                                         "own tokens"})


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
