"""Self-distillation: the target writes the training responses (and prompts).

* ``generate_batch``: batched, left-padded generation with the target through
  Hugging Face ``generate`` (the reference path, ``data.engine: hf``).
* ``regenerate``: every assistant turn of every conversation rewritten by the
  target, resumable (one JSONL line per finished conversation); by default
  through continuous batching (`draftsmith.train.data.batchgen`, ``data.engine:
  batched``), which keeps every row of the batch busy.
* ``synthesize_prompts``: Magpie-style prompts: the instruct model is given only
  its chat template's user-turn prefix and writes the question itself.
* ``render_example``: a conversation as token ids plus a loss mask over the
  assistant tokens (the end-of-turn token included when the turn finished);
  ``sequence_from_line``: a written JSONL line as the cache stage reads it.
* ``FusedCacheWriter`` (``data.fused_cache``): the batched engine also keeps the final
  hidden states it computes, and the training cache is written from them as
  conversations are written (`draftsmith.train.data.cache.StreamingCacheWriter`).
* ``Deadline`` (``data.time_budget_s``): a point on `clock` after which no new
  Magpie draw or conversation is started; the work in flight finishes.
"""

from __future__ import annotations

import json
import logging
import os
import time
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from draftsmith.chat import has_template, prompt_token_ids
from draftsmith.common.chat import render_example
from draftsmith.recipe import default_forward
from draftsmith.target import Target
from draftsmith.train.data.batchgen import BatchGenerator, Captured, Job, suggested_rows
from draftsmith.train.data.cache import StreamingCacheWriter
from draftsmith.train.data.sources import Conversation, normalise

ENGINES = ("batched", "hf")
# KV-cache memory the batched engine may take (rows are reduced to fit); override with DRAFTSMITH_KV_BYTES
KV_BUDGET_BYTES = int(os.environ.get("DRAFTSMITH_KV_BYTES", 4 << 30))

log = logging.getLogger(__name__)

# The clock time budgets are read on (tests replace it with a fake one).
clock = time.monotonic


class Deadline:
    """A point on `clock` after which no new work is started (``data.time_budget_s``).

    Once `passed` has said True it always does, so the work admitted before it is a prefix of the
    admission order whatever the clock does afterwards.
    """

    def __init__(self, at: float):
        self.at = float(at)
        self._passed = False

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(clock() + seconds)

    def passed(self) -> bool:
        if not self._passed and clock() >= self.at:
            self._passed = True
        return self._passed

    def left(self) -> float:
        return max(0.0, self.at - clock())

    def __repr__(self) -> str:
        return f"Deadline(at={self.at!r}, passed={self._passed})"


NOT_REACHED = "not_reached_time_budget"  # the stats key of conversations a deadline left unstarted
CUT = "cut_at_time_budget"  # ... and of answers it cut where they were (``data.at_budget_end: cut``)


def budget_order(convs: list[Conversation], seed: int) -> list[Conversation]:
    """The admission order under a time budget: a seeded shuffle, so the conversations a deadline
    reaches are a uniform sample of every source (the unbudgeted length sort would reach the short
    prompts only, e.g. Magpie's and not ShareGPT's). Each conversation's place is a hash of the seed
    and its id: a resumed run keeps the order of what is left."""
    return sorted(convs, key=lambda c: zlib.crc32(f"{seed}:order:{c.id}".encode()))


def _token_ticker(bar, gen: BatchGenerator, extra=None):
    """A `BatchGenerator.run` step hook: the bar's postfix shows the tokens generated so far (and ``extra()``),
    redrawn at most every ``bar.mininterval`` seconds, so the bar moves while no job has ended yet (the first
    ones end only after a whole reply's worth of decode steps). The count and ETA stay the bar's own."""
    if getattr(bar, "disable", False):  # (a disabled tqdm has no mininterval)
        return None
    last, every = [0.0], bar.mininterval

    def on_step() -> None:
        now = time.monotonic()
        if now - last[0] >= every:
            last[0] = now
            tail = extra() if extra is not None else ""
            bar.set_postfix_str(f"{gen.stats['generated_tokens']} tok" + (f", {tail}" if tail else ""))
    return on_step


class PromptTooLongError(ValueError):
    """A prompt does not fit in the context with room for the response."""


def _messages(conv_system: str | None, users: list[str], replies: list[str]) -> list[dict]:
    msgs = [{"role": "system", "content": conv_system}] if conv_system else []
    for i, u in enumerate(users):
        msgs.append({"role": "user", "content": u})
        if i < len(replies):
            msgs.append({"role": "assistant", "content": replies[i]})
    return msgs


def prompt_ids(tokenizer, messages: list[dict]) -> list[int]:
    return prompt_token_ids(tokenizer, messages)


@torch.no_grad()
def generate_batch(target: Target, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
                   top_p: float = 1.0, seed: int = 0) -> list[tuple[list[int], bool]]:
    """Generate for a batch of token-id prompts; returns (response ids, finished).

    A response stops at (and includes) the first end-of-turn token; ``finished``
    is False when it was cut by ``max_new_tokens``.
    """
    model, tok = target.model, target.tokenizer
    eos = target.eos_token_ids
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos[0]
    width = max(len(p) for p in prompts)
    dev = model.device
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding keeps every prompt's end aligned
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    kw = dict(do_sample=temperature > 0, max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
    if temperature > 0:
        kw.update(temperature=temperature, top_p=top_p, top_k=0)
        torch.manual_seed(seed)
    else:
        kw.update(temperature=None, top_p=None, top_k=None)
    out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kw)[:, width:].tolist()
    results = []
    eos_set = set(eos)
    for row in out:
        cut = next((j for j, t in enumerate(row) if t in eos_set), None)
        results.append((row[: cut + 1], True) if cut is not None else (row, False))
    return results


def fit_prompt(ids: list[int], limit: int, policy: str, where: str) -> list[int] | None:
    """Apply the long-prompt policy: 'error', 'truncate' (keep the end) or 'skip'."""
    if len(ids) <= limit:
        return ids
    if policy == "error":
        raise PromptTooLongError(
            f"{where}: prompt is {len(ids)} tokens but only {limit} fit with the response budget "
            f"(context minus max_new_tokens); set data.on_long_prompt to 'truncate' or 'skip'")
    if policy == "truncate":
        return ids[-limit:]
    return None


def _resume(out_path: Path, stats: Counter) -> set[str]:
    """Ids of the conversations already written; a torn last line (a kill mid-write) is cut off.

    Only whole conversations are ever written, so a restart neither loses nor repeats one.
    """
    done: set[str] = set()
    if not out_path.exists():
        return done
    data = out_path.read_bytes()
    good = 0  # byte offset after the last complete, valid line
    pos = 0
    while pos < len(data):
        nl = data.find(b"\n", pos)
        line = data[pos:] if nl < 0 else data[pos:nl]
        try:
            if nl < 0:
                raise ValueError("no newline: torn write")
            done.add(json.loads(line)["id"])
            good = nl + 1
        except (ValueError, KeyError, TypeError):
            if nl < 0 or data[nl + 1:].strip() == b"":
                stats["torn_resume_lines"] += 1  # the last line: cut it, it is regenerated
                break
            stats["corrupt_resume_lines"] += 1  # a bad line in the middle: kept, skipped when read
            good = nl + 1
        pos = len(data) if nl < 0 else nl + 1
    if good < len(data):
        with out_path.open("r+b") as f:
            f.truncate(good)
    return done


@dataclass
class FusedCacheWriter:
    """Where the data stage writes the training cache from the generator's states (``data.fused_cache``).

    Only the final hidden state is kept (kinds whose ``cache_needs`` are ``["final"]``). A conversation
    whose rendered tokens (`sequence_from_line`, what the cache stage reads) leave the generated ones more
    than ``max_feed`` tokens before their end, or do not fit the row, is written without states and
    counted by reason; the cache stage computes those with its normal forward.
    """

    out_dir: Path
    dtype: str = "float16"
    shard_tokens: int = 200_000
    max_feed: int = 32
    margin: int = 16  # row capacity beyond prompt + budget: the template's tail after the end-of-turn token


def sequence_from_line(line: str, tokenizer, max_seq_len: int, stats: Counter, where: str = "",
                       warn: bool = True) -> dict | None:
    """One training-file line as the cache holds it: {id, ids, mask} (truncated to ``max_seq_len``), or
    None (counted in ``stats``) for a corrupt row or one without assistant tokens."""
    try:
        row = json.loads(line)
        msgs = ([{"role": "system", "content": row["system"]}] if row.get("system") else []) + row["messages"]
        ids, mask = render_example(tokenizer, msgs, row["finished"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        stats["corrupt_rows"] += 1
        if warn:
            log.warning("%s skipped (%s)", where, e)
        return None
    if len(ids) > max_seq_len:
        ids, mask = ids[:max_seq_len], mask[:max_seq_len]
        stats["truncated_to_max_seq_len"] += 1
    if sum(mask) == 0:
        stats["no_assistant_tokens"] += 1
        return None
    return {"id": row["id"], "ids": ids, "mask": mask}


def _row(c: Conversation, replies: list[str], finished: list[bool]) -> dict:
    return {"id": c.id, "source": c.source, "system": c.system,
            "messages": _messages(c.system, c.user_turns[: len(replies)], replies)[1 if c.system else 0:],
            "finished": finished}


def job_seed(seed: int, key: str, turn: int) -> int:
    """A job's sampling seed: a function of the run's seed, the conversation and the turn only."""
    return zlib.crc32(f"{seed}:{key}:{turn}".encode()) + (seed << 32)


def regenerate(target: Target, convs: list[Conversation], out_path: Path, *, max_new_tokens: int,
               max_turns: int, batch_size: int, max_seq_len: int, temperature: float = 0.0,
               top_p: float = 1.0, seed: int = 0, on_long_prompt: str = "error", engine: str = "batched",
               max_rows: int = 96, fused: FusedCacheWriter | None = None, attention: str = "auto",
               shared_prefix: bool = True, deadline: Deadline | None = None, forward: str | None = None,
               at_budget_end: str = "cut") -> Counter:
    """Rewrite every assistant turn with the target; resumable.

    Finished conversations are appended to ``out_path`` (JSONL); on restart
    conversations already there are skipped and a torn last line is cut off.
    ``engine="batched"`` (default): continuous batching with up to ``max_rows``
    sequences in flight, a conversation's next turn queued as soon as its
    previous reply ends. ``engine="hf"``: the reference path, Hugging Face
    ``generate`` on padded batches of ``batch_size`` in lock-step turns.

    ``fused`` (batched engine only): the training cache is written as conversations are (`FusedCacheWriter`);
    on a resumed run the conversations already in ``out_path`` keep the shards they filled, and those
    after the last full shard are left to the cache stage's forward.

    ``deadline`` (``data.time_budget_s``): no conversation is started once it has passed, and those not started
    are counted (``not_reached_time_budget``). Those in flight: with ``at_budget_end="cut"`` (the batched
    engine; ``data.at_budget_end``) each answer ends where it is at the deadline, written as an unfinished
    reply (as ``max_new_tokens`` ends one; a conversation's later turns are not started) and counted
    (``cut_at_time_budget``), so the budget holds to a decode step; with ``"finish"`` they finish all their
    turns, and the rows are then those of an unbudgeted run. Conversations are admitted in `budget_order` (a
    seeded shuffle, a fair sample of the sources) instead of by prompt length, so the file's line order is
    not an unbudgeted run's. The hf engine checks the deadline between its batches (it finishes a batch).

    ``forward`` (batched engine): its decode step, ``compile``, ``fast`` or ``eager`` (`BatchGenerator`); None:
    `draftsmith.recipe.default_forward`.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown generation engine {engine!r}; choose one of {ENGINES}")
    if fused is not None and engine != "batched":
        raise ValueError(f"a fused cache needs the batched engine, not {engine!r}")
    stats: Counter = Counter()
    done = _resume(out_path, stats)
    writer = None
    if fused is not None:
        lines = out_path.read_text().splitlines() if out_path.exists() else []
        prior = [sequence_from_line(x, target.tokenizer, max_seq_len, Counter(), warn=False) for x in lines]
        writer = StreamingCacheWriter(fused.out_dir, target.hidden_size, dtype=fused.dtype,
                                      shard_tokens=fused.shard_tokens, prior=[p for p in prior if p is not None])
    todo = [c for c in convs if c.id not in done]
    stats["resumed"] = len(convs) - len(todo)
    if at_budget_end not in ("cut", "finish"):
        raise ValueError(f"at_budget_end must be 'cut' or 'finish', not {at_budget_end!r}")
    if deadline is None:
        # Similar lengths in one batch waste less padding (and attention span in the batched engine).
        todo.sort(key=lambda c: len(c.user_turns[0]))
    else:
        todo = budget_order(todo, seed)
        stats[NOT_REACHED] = 0
        stats[CUT] = 0
    kw = dict(max_new_tokens=max_new_tokens, max_turns=max_turns, max_seq_len=max_seq_len,
              temperature=temperature, top_p=top_p, seed=seed, on_long_prompt=on_long_prompt, deadline=deadline)
    if engine == "hf":
        _regenerate_hf(target, todo, out_path, stats, batch_size=batch_size, **kw)
    else:
        _regenerate_batched(target, todo, out_path, stats, max_rows=max_rows, fused=fused, writer=writer,
                            attention=attention, shared_prefix=shared_prefix, forward=forward,
                            at_budget_end=at_budget_end, **kw)
    if writer is not None:
        stats.update({f"fused_{k}": v for k, v in writer.close().items()})
    return stats


def _turn_prompt(tok, c: Conversation, turn: int, replies: list[str], budget: int, max_new_tokens: int,
                 on_long_prompt: str, stats: Counter) -> list[int] | None:
    """Token ids of turn ``turn``'s prompt, or None when the conversation cannot go on (counted)."""
    ids = prompt_ids(tok, _messages(c.system, c.user_turns[: turn + 1], replies))
    if turn == 0:
        ids = fit_prompt(ids, budget - max_new_tokens, on_long_prompt, c.id)
        if ids is None:
            stats["skipped_long_prompt"] += 1
        return ids
    if len(ids) + max_new_tokens > budget:
        stats["cut_at_context"] += 1
        return None
    return ids


def _regenerate_batched(target: Target, todo: list[Conversation], out_path: Path, stats: Counter, *,
                        max_new_tokens: int, max_turns: int, max_seq_len: int, temperature: float, top_p: float,
                        seed: int, on_long_prompt: str, max_rows: int, fused: FusedCacheWriter | None = None,
                        writer: StreamingCacheWriter | None = None, attention: str = "auto",
                        shared_prefix: bool = True, deadline: Deadline | None = None,
                        forward: str | None = None, at_budget_end: str = "cut") -> None:
    tok = target.tokenizer
    budget = min(max_seq_len, target.context_length)
    replies: dict[int, list[str]] = {}
    finished: dict[int, list[bool]] = {}
    jobs: list[Job] = []
    for i, c in enumerate(todo):
        ids = _turn_prompt(tok, c, 0, [], budget, max_new_tokens, on_long_prompt, stats)
        if ids is not None:
            replies[i], finished[i] = [], []
            jobs.append(Job((i, 0), ids, max_new_tokens, job_seed(seed, c.id, 0)))
    if not jobs:
        return
    # A row holds at most `budget` entries; single-turn jobs need only their own length.
    capacity = budget if max_turns > 1 else max(len(j.prompt) for j in jobs) + max_new_tokens
    if fused is not None:
        capacity += fused.margin  # the template's tokens after the reply are fed to the row for their states
    p = next(target.model.parameters())
    rows = suggested_rows(target.model.config, capacity, p.dtype, KV_BUDGET_BYTES, max_rows)
    gen = BatchGenerator(target.model, target.eos_token_ids, max_rows=rows, capacity=capacity,
                         temperature=temperature, top_p=top_p, keep_states=fused is not None,
                         state_dtype=getattr(torch, fused.dtype) if fused else torch.float16,
                         max_feed=fused.max_feed if fused else 0, attention=attention,
                         forward=forward or default_forward(),
                         shared_prefix=shared_prefix)
    bar = tqdm(total=len(jobs), desc="self-distill", unit="conv")
    cutting = deadline is not None and at_budget_end == "cut"
    last_sync = [time.time()]
    follows: dict[tuple, Job | None] = {}  # a turn's follow-up, decided when the row ended (fused)
    lines: dict[int, str] = {}
    seqs: dict[int, dict | None] = {}
    with out_path.open("a") as f:
        def write(i: int, captured: Captured | None) -> None:
            if replies[i]:
                line = lines.pop(i, None) or json.dumps(_row(todo[i], replies[i], finished[i]))
                f.write(line + "\n")
                stats["conversations"] += 1
                if writer is not None:
                    seq = seqs.pop(i) if i in seqs else sequence_from_line(line, tok, max_seq_len, Counter(),
                                                                           warn=False)
                    if seq is not None:
                        f.flush()  # a shard never holds a conversation the file does not
                        if captured is not None and captured.states is not None:
                            writer.add(seq, captured.states)
                            stats["fused_fed_tokens"] += captured.fed
                            stats["fused_rewound"] += int(captured.rewound > 0)
                        else:
                            writer.add(seq, None, captured.reason if captured is not None else "no_states")
            bar.update(1)
            if time.time() - last_sync[0] > 10:  # a kill loses at most ~10 s of conversations
                f.flush()
                os.fsync(f.fileno())
                last_sync[0] = time.time()

        def close_turn(job: Job, out: list[int], fin: bool) -> Job | None:
            """Record a reply; the conversation's next turn, or None when it is complete."""
            i, turn = job.key
            replies[i].append(tok.decode(out, skip_special_tokens=True))
            finished[i].append(fin)
            stats["responses"] += 1
            stats["response_tokens"] += len(out)
            stats["unfinished_responses"] += int(not fin)
            c = todo[i]
            if cutting and deadline.passed():  # no later turn past the budget: the conversation ends here
                return None
            if fin and turn + 1 < min(max_turns, len(c.user_turns)):
                ids = _turn_prompt(tok, c, turn + 1, replies[i], budget, max_new_tokens, on_long_prompt, stats)
                if ids is not None:
                    return Job((i, turn + 1), ids, max_new_tokens, job_seed(seed, c.id, turn + 1))
            return None

        def want(job: Job, out: list[int], fin: bool) -> list[int] | None:
            """The token ids the cache will hold for a complete conversation (its last turn's row has them)."""
            nxt = follows[job.key] = close_turn(job, out, fin)
            if nxt is not None:
                return None
            i = job.key[0]
            lines[i] = json.dumps(_row(todo[i], replies[i], finished[i]))
            seqs[i] = seq = sequence_from_line(lines[i], tok, max_seq_len, Counter(), warn=False)
            return None if seq is None else seq["ids"]

        def on_done(job: Job, out: list[int], fin: bool, captured: Captured | None = None):
            nxt = follows.pop(job.key) if job.key in follows else close_turn(job, out, fin)
            if nxt is not None:
                return [nxt]
            write(job.key[0], captured)
            return None

        def admit(job: Job) -> bool:
            """A conversation's first turn is not started past the deadline; a started one goes on."""
            return job.key[1] > 0 or not deadline.passed()

        dropped = gen.run(jobs, on_done, want=want if fused is not None else None, on_step=_token_ticker(bar, gen),
                          admit=admit if deadline is not None else None,
                          cut=deadline.passed if cutting else None)
        if deadline is not None:
            stats[NOT_REACHED] += len(dropped)
            stats[CUT] += gen.stats["cut_rows"]
        f.flush()
        os.fsync(f.fileno())
    bar.close()
    stats["batched_rows"] = rows
    stats["forwards"] = gen.stats["forwards"] + gen.stats["prefill_forwards"]


def _regenerate_hf(target: Target, todo: list[Conversation], out_path: Path, stats: Counter, *, batch_size: int,
                   max_new_tokens: int, max_turns: int, max_seq_len: int, temperature: float, top_p: float,
                   seed: int, on_long_prompt: str, deadline: Deadline | None = None) -> None:
    tok = target.tokenizer
    budget = min(max_seq_len, target.context_length)
    bar = tqdm(total=len(todo), desc="self-distill (hf)", unit="conv", disable=not todo)
    with out_path.open("a") as f:
        for b in range(0, len(todo), batch_size):
            if deadline is not None and deadline.passed():  # a batch started runs all its turns
                stats[NOT_REACHED] += len(todo) - b
                break
            batch = todo[b:b + batch_size]
            replies: list[list[str]] = [[] for _ in batch]
            finished: list[list[bool]] = [[] for _ in batch]
            live = list(range(len(batch)))
            for turn in range(max_turns):
                live = [i for i in live if turn < len(batch[i].user_turns) and (turn == 0 or finished[i][-1])]
                prompts, keep = [], []
                for i in live:
                    ids = _turn_prompt(tok, batch[i], turn, replies[i], budget, max_new_tokens, on_long_prompt,
                                       stats)
                    if ids is not None:
                        prompts.append(ids)
                        keep.append(i)
                live = keep
                if not live:
                    break
                outs = generate_batch(target, prompts, max_new_tokens, temperature, top_p,
                                      seed=seed * 1_000_003 + b * 101 + turn)
                for i, (resp, fin) in zip(live, outs):
                    replies[i].append(tok.decode(resp, skip_special_tokens=True))
                    finished[i].append(fin)
                    stats["responses"] += 1
                    stats["response_tokens"] += len(resp)
                    stats["unfinished_responses"] += int(not fin)
            for c, rep, fin in zip(batch, replies, finished):
                if rep:
                    f.write(json.dumps(_row(c, rep, fin)) + "\n")
                    stats["conversations"] += 1
            f.flush()
            os.fsync(f.fileno())
            bar.update(len(batch))
    bar.close()


def user_prefix_ids(tokenizer) -> list[int]:
    """Token ids of the chat template up to where a user's words begin."""
    if not has_template(tokenizer):
        raise ValueError("magpie prompts are written by the target after its chat template's user header, and this "
                         "target's tokenizer has no chat template (a base model): use prompt sources (sharegpt, "
                         "jsonl, humaneval) instead")
    marker = "\x00MAGPIE\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text[: text.index(marker)], add_special_tokens=False)["input_ids"]


# Generic openers of instruction-following tasks (self-instruct style task verbs): a user turn that starts
# with one of them makes the target write a prompt of that kind of task, where plain Magpie prompts of a
# small model are mostly "Can you help me with ..." requests. '' keeps some draws unsteered.
TASK_OPENERS = (
    "", "Write a", "Write a short story about", "Compose an email to", "Write a poem about", "Draft a",
    "Pretend you are", "Imagine you are a", "Act as a", "Solve", "Calculate", "What is the value of", "If a",
    "Suppose", "How many", "Write a Python function that", "Implement a", "Write a program that", "Fix the bug in",
    "Write a SQL query", "Extract", "Summarize the following", "Given the following", "Classify", "Explain how",
    "Explain why", "What is the difference between", "Describe the", "How does", "Discuss the", "Compare",
    "What are the main", "List", "Give me", "Rewrite the following", "Edit", "Create a", "Help me", "Evaluate",
    "Analyze", "Provide", "Why do", "Translate",
)


def resolve_openers(openers) -> list[str] | None:
    """A magpie source's ``openers``: None, 'builtin:tasks' or a list of strings."""
    if openers is None:
        return None
    if openers == "builtin:tasks":
        return list(TASK_OPENERS)
    if isinstance(openers, str) or not openers or not all(isinstance(o, str) for o in openers):
        raise ValueError(f"magpie openers must be 'builtin:tasks' or a non-empty list of strings, got {openers!r}")
    return list(openers)


def synthesize_prompts(target: Target, count: int, *, batch_size: int = 32, max_new_tokens: int = 64,
                       temperature: float = 1.0, top_p: float = 0.99, seed: int = 0,
                       exclude: set[str] = frozenset(), min_chars: int = 12, engine: str = "batched",
                       max_rows: int = 96, done: list[Conversation] | None = None, draws_done: int = 0,
                       on_round=None, round_size: int = 512, openers: list[str] | None = None,
                       deadline: Deadline | None = None, forward: str | None = None
                       ) -> tuple[list[Conversation], Counter]:
    """Magpie-style prompts written by the target from its user-turn prefix.

    With ``openers``, draw k's user turn starts with ``openers[k % len(openers)]`` and the target writes
    the rest (the prompt is the opener plus what it wrote).

    With the batched engine every draw has its own seed (``job_seed(seed, "magpie", draw)``), so the
    prompts do not depend on the batch size, and draws are made in rounds of at most ``round_size``:
    after each, ``on_round(new_prompts, draws_so_far)`` lets the caller save progress, and a restart
    passes back what was saved (``done``, ``draws_done``) to continue where it stopped.

    ``deadline`` (a share of ``data.time_budget_s``): no draw is started once it has passed (the hf
    engine: no batch); the draws in flight finish and are taken as usual, in draw order, so the prompts
    returned are the first ones an unbudgeted call returns (``stats["stopped_time_budget"]`` = 1 when it
    cut them short), and ``on_round`` is told only the draws made.

    ``forward``: the batched engine's decode step, as in `regenerate`.
    """
    if engine not in ENGINES:
        raise ValueError(f"unknown generation engine {engine!r}; choose one of {ENGINES}")
    prefix = user_prefix_ids(target.tokenizer)
    opener_ids = [target.tokenizer(o, add_special_tokens=False)["input_ids"] if o else [] for o in openers or [""]]

    def start(draw: int) -> list[int]:
        return prefix + opener_ids[draw % len(opener_ids)]

    out: list[Conversation] = list(done or [])
    seen: set[str] = {normalise(c.user_turns[0]) for c in out}
    stats: Counter = Counter()
    bar = tqdm(total=count, initial=min(len(out), count), desc="magpie prompts", unit="prompt")

    def take(ids: list[int], fin: bool, draw: int = 0) -> None:
        text = target.tokenizer.decode(opener_ids[draw % len(opener_ids)] + ids, skip_special_tokens=True).strip()
        key = normalise(text)
        reason = ("unfinished" if not fin else "too_short" if len(text) < min_chars else
                  "duplicate" if key in seen else "mtbench" if key in exclude else None)
        if reason:
            stats[f"rejected_{reason}"] += 1
            return
        seen.add(key)
        out.append(Conversation(id=f"magpie:{seed}:{len(out)}", source="magpie", user_turns=[text]))
        bar.update(1)

    def out_of_time() -> bool:
        if deadline is not None and len(out) < count and deadline.passed():
            stats["stopped_time_budget"] = 1
            return True
        return False

    if engine == "hf":
        attempt = 0
        while len(out) < count and attempt < 8 * (count // batch_size + 1) and not out_of_time():
            draws = [attempt * batch_size + i for i in range(batch_size)]
            res = generate_batch(target, [start(d) for d in draws], max_new_tokens, temperature, top_p,
                                 seed=seed * 7919 + attempt)
            attempt += 1
            for d, (ids, fin) in zip(draws, res):
                if len(out) < count:
                    take(ids, fin, d)
    else:
        gen = BatchGenerator(target.model, target.eos_token_ids, max_rows=max_rows,
                             capacity=len(prefix) + max(map(len, opener_ids)) + max_new_tokens,
                             temperature=temperature, top_p=top_p, forward=forward or default_forward())
        draws = draws_done
        limit = draws_done + 8 * (count - len(out)) + 64  # a target that cannot write prompts stops somewhere
        got: dict[int, tuple[list[int], bool]] = {}  # a round's results not taken yet
        nxt = [draws]  # the next draw to take: results are taken in draw order, each as soon as it can be

        def done_draw(j: Job, ids: list[int], fin: bool) -> None:
            got[j.key] = (ids, fin)
            while nxt[0] in got:
                k = nxt[0]
                if len(out) < count:
                    take(*got[k], k)
                del got[k]
                nxt[0] = k + 1

        def rejected() -> str:
            return f"{sum(v for k, v in stats.items() if k.startswith('rejected_'))} rejected"

        ticker = _token_ticker(bar, gen, rejected)
        while len(out) < count and draws < limit and not out_of_time():
            # ask for what is missing plus a margin for rejections
            n = min(round_size, int((count - len(out)) * 1.3) + 8)
            jobs = [Job(draws + k, start(draws + k), max_new_tokens, job_seed(seed, "magpie", draws + k))
                    for k in range(n)]
            before, nxt[0] = len(out), draws
            # past the deadline the rest of the round is dropped: the draws made are a prefix (`Deadline`)
            dropped = gen.run(jobs, done_draw, on_step=ticker,
                              admit=(lambda j: not deadline.passed()) if deadline is not None else None)
            draws += n - len(dropped)
            if on_round is not None:
                on_round(out[before:], draws)
    bar.close()
    stats["accepted"] = len(out)
    return out, stats
