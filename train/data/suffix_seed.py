"""A SuffixDecoding global index seeded with the target's own answers from a data stage.

SuffixDecoding drafts from earlier responses of the same model. A server builds that history from its traffic;
a data stage has already written one: the target's greedy answers to thousands of prompts (data/train.jsonl). A
small model answers in stock phrases ("Here's a ...", list scaffolding, code idioms) that recur across prompts,
so an index of those answers drafts on prompts it never saw. Measured on the 20 MT-Bench first turns of the
Xeon AMX (docs/results-log.md §20): SuffixDecoding alone went from 1.07x our plain decoding with an index of the run's
own earlier answers to 1.51x with the data's 665k tokens indexed.

Each assistant reply is indexed as the training cache holds it (`sequence_from_line`: the chat template rendered,
the reply's tokens and its end-of-turn token when it finished), so the index holds the token sequences the target
generates. Only the training split is read: the held-out MT-Bench answers never enter the index.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

from draftsmith.drafters.suffix import SuffixConfig, SuffixIndex
from draftsmith.train.data.generate import sequence_from_line


def reply_runs(mask: list[int]) -> list[tuple[int, int]]:
    """(start, end) of every run of 1s in a 0/1 mask: the assistant replies of one rendered conversation."""
    runs, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            runs.append((start, i))
            start = None
    return runs


def index_from_data(path: str | Path, tokenizer, config: SuffixConfig | None = None,
                    max_seq_len: int = 1 << 20) -> tuple[SuffixIndex, dict]:
    """A `SuffixIndex` over every assistant reply in a conversations JSONL (a data stage's train.jsonl), and
    what was read: conversations, replies and tokens indexed, rows skipped by reason (a corrupt line, no
    assistant tokens). FIFO eviction applies as in serving: past ``max_cached_requests`` the oldest go."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no conversations file to index (run the data stage first)")
    index = SuffixIndex(config or SuffixConfig())
    stats: Counter = Counter()
    with path.open(encoding="utf-8", errors="replace") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            seq = sequence_from_line(line, tokenizer, max_seq_len, stats, where=f"{path.name}:{n}", warn=False)
            if seq is None:
                continue
            stats["conversations"] += 1
            for k, (s, e) in enumerate(reply_runs(seq["mask"])):
                index.add_response(seq["ids"][s:e], f"{seq['id']}#{k}")
                stats["replies"] += 1
    skipped = {k: stats.pop(k) for k in ("corrupt_rows", "no_assistant_tokens", "truncated_to_max_seq_len")
               if k in stats}
    return index, {**dict(stats), "indexed_tokens": index.indexed_tokens, "skipped": skipped,
                   "evicted": index.evicted}


def save_index_from_data(path: str | Path, tokenizer, out_dir: str | Path, fingerprint: str,
                         config: SuffixConfig | None = None, max_seq_len: int = 1 << 20) -> dict:
    """`index_from_data`, saved in ``out_dir`` with the target's fingerprint (the format `SuffixIndex.load`,
    ``serve --suffix-state`` and ``eval --suffix-index`` read); returns what was indexed and skipped, the
    index's memory and the seconds it took."""
    t0 = time.time()
    index, stats = index_from_data(path, tokenizer, config, max_seq_len)
    index.save(out_dir, fingerprint=fingerprint)
    return {**stats, "memory_bytes": index.memory_report()["bytes"], "build_s": round(time.time() - t0, 1)}
