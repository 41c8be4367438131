"""SuffixDecoding's global index in the server: started from its saved state or the request logs, taught every
logged response, saved every N responses and at shutdown (`draftsmith.serve.service.DecodingService`)."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

from draftsmith.drafters.suffix import SuffixConfig, SuffixDrafter, SuffixIndex
from draftsmith.target import Target

log = logging.getLogger("draftsmith.serve")


class SuffixState:
    """One `SuffixDrafter` (its global index) for a service's lifetime, whatever drafter is published.

    ``state_dir``: where the index is saved and loaded (None: nowhere); ``save_every``: save after this many
    indexed responses (0: at shutdown only); ``log_dir``: the request logs to rebuild it from when the saved
    state is missing or unusable."""

    def __init__(self, target: Target, cfg: SuffixConfig, state_dir: str | Path | None, save_every: int,
                 log_dir: str | Path | None):
        if save_every < 0:
            raise ValueError(f"suffix_save_every must be >= 0, got {save_every}")
        self.target = target
        self.state_dir = Path(state_dir) if state_dir else None
        self.save_every = save_every
        self.start: dict | None = None  # how the index was made at start (loaded, rebuilt, empty)
        self.saves = 0
        self._since_save = 0
        self._lock = threading.Lock()  # the index's writers and readers outside the decoding thread
        self.drafter = SuffixDrafter(cfg, self._start_index(cfg, log_dir), learn=False)  # the service teaches it
        if self.start["source"] == "logs":  # a rebuilt index is saved at once: the next start loads it
            self.save()

    def _start_index(self, cfg: SuffixConfig, log_dir: str | Path | None) -> SuffixIndex:
        """The saved index if it loads for this target, else one rebuilt from the request logs, else empty.
        Never raises: a corrupt state or log costs the drafts it would have given, not the server."""
        fp, state = self.target.fingerprint, self.state_dir
        why = "no saved state"
        if state is not None and (state / "suffix_index.json").exists():
            try:
                index = SuffixIndex.load(state, cfg, fingerprint=fp)
            except Exception as e:  # noqa: BLE001 (unreadable, torn, another target's: rebuild instead)
                why = f"saved state in {state} unusable: {e}"
                log.warning("suffix index: %s", why)
            else:
                self.start = {"source": "state", "dir": str(state), "responses": len(index)}
                log.info("suffix index loaded from %s: %d responses", state, len(index))
                return index
        if log_dir is None:
            self.start = {"source": "empty", "reason": why}
            return SuffixIndex(cfg)
        try:
            index, counts = SuffixIndex.rebuild_from_logs(log_dir, fp, vocab_size=self.target.vocab_size,
                                                          max_tokens=self.target.context_length, config=cfg)
        except Exception as e:  # noqa: BLE001 (an unreadable log directory: start empty rather than not at all)
            log.error("suffix index: could not rebuild from the request logs in %s (%s): starting empty", log_dir, e)
            self.start = {"source": "empty", "reason": f"{why}; logs unreadable: {e}"}
            return SuffixIndex(cfg)
        skipped = sum(counts["skipped"].values())
        self.start = {"source": "logs", "reason": why, "used": counts["used"], "skipped": skipped,
                      "skipped_by_reason": counts["skipped"], "responses": len(index)}
        log.log(logging.WARNING if skipped or why != "no saved state" else logging.INFO,
                "suffix index rebuilt from the request logs in %s (%s): %d records used, %d skipped %s",
                log_dir, why, counts["used"], skipped, counts["skipped"])
        return index

    def learn(self, response: list[int], request_id: str) -> None:
        """Index a finished response in the global index; save it every ``save_every`` responses."""
        with self._lock:
            self.drafter.index.add_response(response, request_id)
            self._since_save += 1
            due = self.save_every > 0 and self._since_save >= self.save_every
        if due:
            self.save()

    def save(self) -> bool:
        """Save the global index to ``state_dir`` (temporary files renamed); False when there is nothing to save
        it to or saving failed (logged: the server goes on)."""
        if self.state_dir is None:
            return False
        with self._lock:
            try:
                self.drafter.index.save(self.state_dir, self.target.fingerprint)
            except Exception as e:  # noqa: BLE001 (a full disk must not fail the request that triggered it)
                log.error("could not save the suffix index to %s: %s", self.state_dir, e)
                self._since_save = 0  # retried after the next save_every responses, not on every one
                return False
            self._since_save = 0
            self.saves += 1
        return True

    def report(self) -> dict:
        """The global index's memory report, where it is saved and how it was made at start."""
        with self._lock:
            rep = self.drafter.index.memory_report()
        return {**rep, "state_dir": None if self.state_dir is None else str(self.state_dir),
                "save_every": self.save_every, "saves": self.saves, "start": self.start}
