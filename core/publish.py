"""Published drafters: versioned directories and an atomically switched ``current`` pointer.

Layout of a publish directory::

    PUB/versions/v000001/   a complete drafter checkpoint (immutable once published)
    PUB/versions/v000002/
    PUB/current             symlink -> versions/v000002 (replaced with os.replace)
    PUB/history.jsonl       one line per switch (publish or rollback)

A version is copied into ``versions/.tmp-*``, every file and the directory
are fsynced, then the directory is renamed to its final name; only then is
``current`` switched, by creating a new symlink beside it and ``os.replace``-ing
it over the old one (atomic on POSIX). A reader resolves ``current`` once and
loads from the resolved directory, so it sees one whole version or the previous
one, never a mix. Old versions beyond ``keep`` are deleted (never the current
one, nor the one before it); `load_current` retries if the version it resolved
disappears under it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")
_VERSION = re.compile(r"^v(\d{6})$")


class PublishError(ValueError):
    """A publish directory that cannot be used as asked (no version to roll back to, a bad source, ...)."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(path: Path) -> None:
    for p in sorted(path.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for p in sorted([d for d in path.rglob("*") if d.is_dir()] + [path]):
        _fsync_dir(p)


class PublishStore:
    """A publish directory (see the module docstring)."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.versions_dir = self.root / "versions"
        self.pointer = self.root / "current"

    def versions(self) -> list[str]:
        """Published version names, oldest first."""
        if not self.versions_dir.is_dir():
            return []
        return sorted(p.name for p in self.versions_dir.iterdir() if _VERSION.match(p.name) and p.is_dir())

    def current(self) -> str | None:
        """The current version's name, or None when nothing is published."""
        try:
            return Path(os.readlink(self.pointer)).name
        except (FileNotFoundError, OSError):
            return None

    def path(self, version: str) -> Path:
        return self.versions_dir / version

    def current_path(self) -> Path | None:
        v = self.current()
        return None if v is None else self.path(v)

    def next_name(self) -> str:
        """The name the next version gets (numbers are never reused)."""
        return self._next_name()

    def _next_name(self) -> str:
        vs = self.versions()
        n = int(_VERSION.match(vs[-1]).group(1)) + 1 if vs else 1
        hist = self.history()
        if hist:  # never reuse a number, even after its directory was pruned
            n = max(n, 1 + max(int(_VERSION.match(h["version"]).group(1))
                               for h in hist if _VERSION.match(h["version"])))
        return f"v{n:06d}"

    def history(self) -> list[dict]:
        p = self.root / "history.jsonl"
        if not p.exists():
            return []
        out = []
        for line in p.read_text().splitlines():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:  # a torn last line of a crashed switch: the pointer is the truth
                continue
        return out

    def _switch(self, version: str, event: dict) -> None:
        tmp = self.root / f".current-{os.getpid()}-{time.monotonic_ns()}"
        os.symlink(Path("versions") / version, tmp)
        os.replace(tmp, self.pointer)
        _fsync_dir(self.root)
        with open(self.root / "history.jsonl", "a") as f:
            f.write(json.dumps({"version": version, "time": time.time(), **event}) + "\n")
            f.flush()
            os.fsync(f.fileno())

    def publish(self, source: str | Path, *, keep: int = 5, info: dict | None = None,
                name: str | None = None) -> str:
        """Copy a checkpoint directory in as a new version, switch ``current`` to it, prune to ``keep``.

        ``name`` (optional, e.g. derived from the online job's update number) makes a retried
        publication idempotent: an existing complete version of that name is switched to, not copied again.
        """
        source = Path(source)
        if not (source / "manifest.json").exists():
            raise PublishError(f"{source} is not a drafter checkpoint (no manifest.json)")
        if keep < 1:
            raise PublishError(f"keep must be >= 1, got {keep}")
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        version = name or self._next_name()
        if not _VERSION.match(version):
            raise PublishError(f"version names look like v000001, got {version!r}")
        final = self.path(version)
        if not final.exists():
            tmp = self.versions_dir / f".tmp-{version}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            shutil.copytree(source, tmp)
            _fsync_tree(tmp)
            os.replace(tmp, final)
            _fsync_dir(self.versions_dir)
        self._switch(version, {"event": "publish", **(info or {})})
        self.prune(keep)
        return version

    def rollback(self, to: str | None = None) -> str:
        """Switch ``current`` back to ``to`` or else to the newest kept version older than the current one."""
        vs, cur = self.versions(), self.current()
        if to is None:
            older = [v for v in vs if cur is None or v < cur]
            if not older:
                raise PublishError(f"nothing to roll back to in {self.root}: kept versions {vs}, current {cur}")
            to = older[-1]
        elif to not in vs:
            raise PublishError(f"version {to!r} is not kept in {self.root} (kept: {vs})")
        self._switch(to, {"event": "rollback", "from": cur})
        return to

    def prune(self, keep: int) -> list[str]:
        """Delete the oldest versions beyond ``keep``, never the current one nor the one just before it."""
        vs, cur = self.versions(), self.current()
        protect = {cur}
        if cur in vs and vs.index(cur) > 0:
            protect.add(vs[vs.index(cur) - 1])
        removed = []
        for v in vs[: max(0, len(vs) - keep)]:
            if v in protect:
                continue
            shutil.rmtree(self.path(v), ignore_errors=True)
            removed.append(v)
        for stale in self.versions_dir.glob(".tmp-*"):  # a copy a crashed publisher left behind
            if time.time() - stale.stat().st_mtime > 600:
                shutil.rmtree(stale, ignore_errors=True)
        return removed


def load_current(store: PublishStore, load: Callable[[Path], T], retries: int = 5) -> tuple[str | None, T | None]:
    """(version, load(path)) for the current version, or (None, None) when nothing is published.

    If the resolved version is pruned while it loads (the load fails and ``current`` has moved),
    resolve again; a load that fails with ``current`` unchanged is re-raised.
    """
    for _ in range(retries):
        v = store.current()
        if v is None:
            return None, None
        try:
            return v, load(store.path(v))
        except Exception:
            if store.current() == v and store.path(v).exists():
                raise
    raise PublishError(f"{store.root}: current kept moving while loading it ({retries} tries)")
