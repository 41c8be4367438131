"""Continual online distillation from logged serving traffic (docs/methods.md section 7).

One cycle of `OnlineJob`:
  1. tail the log directory (`draftsmith.train.online.ledger.Tailer`); parse each new
     line (`draftsmith.traffic.parse_record`); a line that is malformed, of
     another target, oversized, ... is quarantined with its reason; every
     ``holdout_every``-th record (by a hash of its id) is held back for evaluation;
  2. every ``every_records`` lines or ``every_seconds`` after the first
     unapplied one: a cache pass (`build_cache`) over the new training records
     plus a replay sample of earlier ones, an update of the drafter through its
     kind's objective (the registry's, as in train/training/trainer.py) with the OSD
     emphasis on rejected positions, the updated model written and fsynced, then
     ONE ledger transaction (offsets + records + model pointer, see ledger.py);
  3. the gate: the candidate and the published current drafter decode the
     held-back window with the real decoder; the candidate is published (atomic
     switch, `draftsmith.publish`) if its acceptance is not worse than current's
     by more than ``margin``.

The update itself (OSD emphasis, its cap, anchor conversations): `train/online/update.py`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from draftsmith import registry
from draftsmith.checkpoint import load_checkpoint, read_manifest, save_checkpoint
from draftsmith.engine.decoder import SpeculativeDecoder
from draftsmith.checkpoint import drafter_from_checkpoint
from draftsmith.engine.metrics import acceptance_by_position, summarize
from draftsmith.publish import PublishStore
from draftsmith.recipe import Recipe
from draftsmith.traffic import RecordError, parse_record
from draftsmith.common.hidden_cache import HiddenCache
from draftsmith.train.data.cache import build_cache
from draftsmith.train.online.ledger import Ledger, Pending, PendingRecord, Tailer, fsync_tree
from draftsmith.train.online.update import load_anchor_lines, sample_anchors, update_module
from draftsmith.train.training.trainer import build_drafter, set_draft_vocab

log = logging.getLogger(__name__)


class Crash(Exception):
    """Raised by the ``crash_at`` test hook (a simulated kill at a named point)."""


def is_holdout(src: str, every: int) -> bool:
    """Deterministic hold-back choice: every ``every``-th record by a hash of its id."""
    return int(hashlib.sha1(src.encode()).hexdigest()[:8], 16) % every == 0


def decode_acceptance(target, checkpoint: Path | None, prompts: list[tuple[list[int], int]]) -> dict:
    """Greedy decoding of (prompt ids, new tokens) pairs with a checkpoint's drafter (None: plain decoding).

    Returns acceptance (P(first draft accepted), docs/methods.md section 11), tau and the per-position acceptance."""
    if not prompts:
        return {"prompts": 0, "acceptance": None, "tau": None}
    if checkpoint is None:
        return {"prompts": len(prompts), "acceptance": 0.0, "tau": 1.0, "plain": True}
    dec = SpeculativeDecoder(target, drafter_from_checkpoint(checkpoint, target))
    results = []
    for prompt, n in prompts:
        try:
            results.append(dec.generate(prompt, n, seed=0))
        except ValueError:  # a prompt too long for the context with this drafter's block: not measurable
            continue
    s = summarize(results)
    acc = acceptance_by_position(results)
    return {"prompts": len(results), "acceptance": (acc[0] or 0.0) if acc else 0.0, "tau": s["tau"],
            "acceptance_by_position": s["acceptance_by_position"]}


def evaluate(target, checkpoint: Path | None, window: list[dict], max_new_tokens: int) -> dict:
    """`decode_acceptance` on held-back records (their prompts, up to their response length)."""
    return decode_acceptance(target, checkpoint, [
        (r["ids"][: r["prompt_len"]], min(max_new_tokens, len(r["ids"]) - r["prompt_len"])) for r in window])


class OnlineJob:
    """The online distillation job on one recipe, log directory, state directory and publish directory."""

    def __init__(self, recipe: Recipe, target, logs: str | Path, *, state_dir: str | Path | None = None,
                 publish_dir: str | Path | None = None, crash_at: str | None = None):
        self.state = Path(state_dir or recipe.online.state_dir or recipe.out / "online")
        self.store = PublishStore(publish_dir or recipe.online.publish_dir or recipe.out / "publish")
        self.ledger = Ledger(self.state)
        recipe = self._drafter_of_start(recipe)
        recipe.drafter = recipe.drafter.with_target(target)  # target-derived defaults (EAGLE-3's aux layers)
        kind = registry.get(recipe.drafter.kind)
        if kind.trains_on_text:
            raise ValueError(f"drafter kind {recipe.drafter.kind!r} trains on re-tokenised text, not on cached "
                             f"target states: the online job does not support it")
        self.recipe, self.target, self.o = recipe, target, recipe.online
        self.logs = Path(logs)
        self.tailer = Tailer(self.logs, self.ledger.offsets())
        self.pending = Pending()
        self.needs = kind.cache_needs(recipe.drafter.model_dump())
        self.crash_at = crash_at
        self.anchors = load_anchor_lines(self.o.anchor_data)
        self._sync_quarantine_file()

    def anchor_sample(self, n: int, uid: int) -> tuple[list[dict], dict]:
        """``n`` anchor conversations for update ``uid`` (seeded), as {ids, mask}; skipped rows counted."""
        return sample_anchors(self.anchors, n, self.recipe.seed * 1_000_033 + uid, self.target.tokenizer,
                              self.o.max_record_tokens, str(self.o.anchor_data))

    # ------------------------------------------------------------------ helpers
    def _start_checkpoint(self, recipe: Recipe) -> Path | None:
        name = self.ledger.meta("model")
        if name is not None and name != "none":
            return self.state / "models" / name
        if recipe.online.init:
            return Path(recipe.online.init)
        return self.store.current_path()

    def _drafter_of_start(self, recipe: Recipe) -> Recipe:
        """The drafter section of the checkpoint the job continues from (its kind's objective must match it)."""
        src = self._start_checkpoint(recipe)
        if src is None:
            return recipe
        d = (read_manifest(src).get("recipe") or {}).get("drafter")
        if not d or d == recipe.drafter.model_dump(mode="json"):
            return recipe
        log.info("drafter settings taken from %s: %s", src, d)
        return Recipe.model_validate({**recipe.model_dump(mode="json"), "drafter": d})

    def _crash(self, point: str) -> None:
        if self.crash_at == point:
            raise Crash(point)

    def _sync_quarantine_file(self) -> None:
        """Make ``quarantine.jsonl`` hold exactly the ledger's quarantined lines (after a crash, append the missing)."""
        path = self.state / "quarantine.jsonl"
        have = set()
        if path.exists():
            raw = path.read_bytes()
            if raw and not raw.endswith(b"\n"):  # torn by a kill: cut it, it is rewritten below
                raw = raw[: raw.rfind(b"\n") + 1]
                path.write_bytes(raw)
            for line in raw.splitlines():
                try:
                    have.add(json.loads(line)["src"])
                except (json.JSONDecodeError, KeyError):
                    continue
        missing = [q for q in self.ledger.quarantine_rows() if q[0] not in have]
        if missing:
            with open(path, "a") as f:
                for src, reason, line in missing:
                    f.write(json.dumps({"src": src, "reason": reason, "line": line}) + "\n")

    def _initial_model(self, cache_dir: Path | None) -> torch.nn.Module:
        src = self._start_checkpoint(self.recipe)
        if src:
            module, _ = load_checkpoint(src, self.target)
            return module
        module = build_drafter(self.recipe, self.target)
        if cache_dir is not None:
            set_draft_vocab(module, HiddenCache(cache_dir, self.target), set())
        return module

    # ------------------------------------------------------------------ reading
    def read(self) -> int:
        """Parse new log lines into the pending set; returns how many lines were read."""
        lines = self.tailer.poll()
        for src, raw, torn in lines:
            if self.pending.since is None:
                self.pending.since = time.time()
            text = raw[:2000].decode("utf-8", "replace")
            if torn:
                self.pending.quarantined.append((src, "torn", text))
                continue
            if len(raw) > 64 * self.o.max_record_tokens + 65536:
                self.pending.quarantined.append((src, "oversized", text))
                continue
            try:
                rec = parse_record(raw, self.target.fingerprint, vocab_size=self.target.vocab_size,
                                   max_tokens=self.o.max_record_tokens)
            except RecordError as e:
                self.pending.quarantined.append((src, e.reason, text))
                continue
            self.pending.records.append(PendingRecord(
                src=src, holdout=is_holdout(src, self.o.holdout_every), prompt_len=len(rec.prompt_ids),
                ids=rec.ids, rejected=rec.rejected_positions(), drafter_version=rec.drafter_version))
        self.pending.offsets = dict(self.tailer.offsets)
        return len(lines)

    def due(self) -> bool:
        p = self.pending
        if p.lines == 0:
            return False
        return p.lines >= self.o.every_records or time.time() - (p.since or time.time()) >= self.o.every_seconds

    # ------------------------------------------------------------------ one update
    def apply(self) -> dict:
        """Train on the pending records (+ replay), commit everything in one transaction, then run the gate."""
        p = self.pending
        last = self.ledger.last_update()
        uid = (last["update_id"] if last else 0) + 1
        applied_before = self.ledger.meta("records_applied", 0)
        new = p.train_records()
        replay = self.ledger.replay_sample(round(self.o.replay_ratio * len(new)), self.o.replay_buffer,
                                           seed=self.recipe.seed * 1_000_003 + uid)
        work = self.state / "work"
        shutil.rmtree(work, ignore_errors=True)
        train_stats = None
        seqs = [{"ids": r.ids, "mask": [0] * r.prompt_len + [1] * (len(r.ids) - r.prompt_len)} for r in new]
        seqs += [{"ids": r["ids"], "mask": [0] * r["prompt_len"] + [1] * (len(r["ids"]) - r["prompt_len"])}
                 for r in replay]
        anchors, anchor_skips = self.anchor_sample(round(self.o.anchor_ratio * len(new)), uid) if new else ([], {})
        seqs += anchors  # after new + replay: the rejected positions below index those
        rejected = {i: r.rejected for i, r in enumerate(new) if r.rejected}
        rejected.update({len(new) + i: r["rejected"] for i, r in enumerate(replay) if r["rejected"]})
        prev = self.ledger.meta("model")
        out_name = f"u{uid:06d}"
        out = self.state / "models" / out_name
        if new:
            build_cache(self.target, seqs, self.needs, work / "cache", dtype=self.recipe.cache.dtype,
                        batch_tokens=self.recipe.cache.batch_tokens)
            self._crash("after_cache")
            if prev is None or prev == "none":
                module = self._initial_model(work / "cache")
            else:
                module, _ = load_checkpoint(self.state / "models" / prev, self.target)
            train_stats = update_module(module, self.recipe, self.target, work / "cache", rejected,
                                        seed=self.recipe.seed * 7919 + uid)
            train_stats.update({"anchors": len(anchors), "anchor_rows_skipped": anchor_skips})
            self._crash("after_train")
            applied = applied_before + len(new)
            tmp = self.state / "models" / f".tmp-{out_name}"
            shutil.rmtree(tmp, ignore_errors=True)
            save_checkpoint(tmp, module, self.target, recipe=self.recipe.model_dump(mode="json"),
                            metrics={"update_id": uid, "records_applied": applied, "online": train_stats})
            fsync_tree(tmp)
            shutil.rmtree(out, ignore_errors=True)
            tmp.rename(out)
            self._crash("before_commit")
        else:  # only held-back or quarantined lines: commit offsets, the model does not change
            applied, out_name = applied_before, prev or "none"
        self.ledger.commit(p, update_id=uid, model=out_name, records_applied=applied, n_replay=len(replay),
                           train=train_stats)
        self._crash("after_commit")
        self._sync_quarantine_file()
        self.pending = Pending(offsets=dict(self.tailer.offsets))
        shutil.rmtree(work, ignore_errors=True)
        self._prune_models(keep={out_name, prev})
        res = {"update_id": uid, "new": len(new), "replay": len(replay), "held_back": sum(r.holdout for r in p.records),
               "quarantined": len(p.quarantined), "records_applied": applied, "train": train_stats}
        if new:
            res["gate"] = self.gate(uid)
        return res

    def _prune_models(self, keep: set) -> None:
        root = self.state / "models"
        for d in root.iterdir() if root.is_dir() else []:
            if d.name not in keep:
                shutil.rmtree(d, ignore_errors=True)

    # ------------------------------------------------------------------ the gate
    def gate(self, uid: int) -> dict:
        """Evaluate the committed model against the published current one; publish it if it passes."""
        o = self.o
        cand = self.state / "models" / self.ledger.meta("model")
        window = self.ledger.holdout_window(o.holdout_window)
        cur_path = self.store.current_path()
        cur_version = self.store.current()
        c = evaluate(self.target, cand, window, o.eval_max_new_tokens)
        b = evaluate(self.target, cur_path, window, o.eval_max_new_tokens)
        m = o.gate_metric
        if c[m] is None:
            ok, why = False, "no held-back records yet"
        else:
            # against plain decoding (nothing published) a drafter must actually help: strictly better
            ok = c[m] >= b[m] - o.margin if cur_path is not None else c[m] > b[m]
            why = f"{m} {c[m]:.4f} vs current {cur_version or 'plain'} {b[m]:.4f} (margin {o.margin})"
        gate = {"candidate": c, "current": b, "current_version": cur_version, "passed": ok, "why": why,
                "window": len(window)}
        version = None
        if ok:
            version = self._version_name(uid)
            self.ledger.set_gate(uid, {**gate, "publishing": True}, version)  # the name, before it exists
            self._crash("before_publish")
            self.store.publish(cand, keep=o.keep, name=version,
                               info={"update_id": uid, m: c[m], "records_applied":
                                     read_manifest(cand)["metrics"].get("records_applied")})
        self.ledger.set_gate(uid, gate, version)
        log.info("update %d: %s -> %s", uid, why, f"published {version}" if version else "not published")
        return {**gate, "published": version}

    def _version_name(self, uid: int) -> str:
        """The version this update publishes as: the one named before a crash (if its copy is ours or absent),
        else the store's next free name."""
        row = next((u for u in self.ledger.updates() if u["update_id"] == uid), None)
        name = row and row["version"]
        if name:
            p = self.store.path(name)
            if not p.exists() or read_manifest(p).get("metrics", {}).get("update_id") == uid:
                return name
        return self.store.next_name()

    def resume_gate(self) -> dict | None:
        """After a restart: an update committed but killed before its gate finished gets its gate now."""
        last = self.ledger.last_update()
        unfinished = last and (last["gate"] is None or json.loads(last["gate"]).get("publishing"))
        if unfinished and last["n_new"] > 0 and last["model"] == self.ledger.meta("model"):
            return self.gate(last["update_id"])
        return None

    # ------------------------------------------------------------------ loops
    def run(self, once: bool = False, max_seconds: float | None = None) -> list[dict]:
        """Tail and update until stopped (``once``: read what is there, apply it, return)."""
        results = []
        g = self.resume_gate()
        if g is not None:
            results.append({"resumed_gate": g})
        t0 = time.time()
        while True:
            self.read()
            if once:
                while self.pending.lines:
                    results.append(self._apply_batch())
                    self.read()
                return results
            if self.due():
                results.append(self._apply_batch())
                print(json.dumps(results[-1], default=str)[:2000], flush=True)
            if max_seconds is not None and time.time() - t0 > max_seconds:
                return results
            time.sleep(self.o.poll_seconds)

    def _apply_batch(self) -> dict:
        """Apply at most ``every_records`` pending lines (the rest stays pending with its offsets)."""
        p = self.pending
        if p.lines <= self.o.every_records:
            return self.apply()
        # split: keep the first every_records lines; offsets must then stop at the last kept line
        items = sorted([(r.src, "r", r) for r in p.records] + [(q[0], "q", q) for q in p.quarantined],
                       key=lambda x: _src_key(x[0]))
        head, tail = items[: self.o.every_records], items[self.o.every_records:]
        # files read to the end advance to the tailer's offset; a file with untaken lines stops at the first one
        offsets = dict(self.tailer.offsets)
        for src, _, _ in reversed(tail):
            name, off = src.rsplit(":", 1)
            offsets[name] = int(off)
        self.pending = Pending(records=[x[2] for x in head if x[1] == "r"],
                               quarantined=[x[2] for x in head if x[1] == "q"], offsets=offsets, since=p.since)
        res = self.apply()
        # rebuild the rest as pending, with the tailer's offsets
        self.pending = Pending(records=[x[2] for x in tail if x[1] == "r"],
                               quarantined=[x[2] for x in tail if x[1] == "q"],
                               offsets=dict(self.tailer.offsets), since=time.time() if tail else None)
        return res


def _src_key(src: str) -> tuple[str, int]:
    name, off = src.rsplit(":", 1)
    return name, int(off)
