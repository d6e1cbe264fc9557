"""Durable local spool: fsync'd append-only JSONL files holding usage events while the database is unavailable.

Each process appends to its own file (``spool-<pid>-<random>.jsonl``) and holds an exclusive ``flock`` on it
while alive, so a replay never takes a file another live process is still writing. Files of dead processes are
replayed by whoever starts next. A torn last line (a crash mid-write, never acknowledged) is dropped.
"""

from __future__ import annotations

import fcntl
import json
import os
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO

from kvroute.billing.events import UsageEvent, event_from_json
from kvroute.policies.errors import InputError


class Spool:
    """An fsync'd append-only event spool in ``directory``; one writer file per process."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._file: IO[bytes] | None = None
        self._path: Path | None = None

    def _own(self) -> IO[bytes]:
        if self._file is None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._path = self.directory / f"spool-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            fd = os.open(self._path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
            self._file = os.fdopen(fd, "ab")
            fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)
            _fsync_dir(self.directory)
        return self._file

    def append(self, events: Sequence[UsageEvent]) -> None:
        """Append and fsync; when this returns the events survive a crash of the process or the machine."""
        if not events:
            return
        f = self._own()
        f.write("".join(e.to_line() + "\n" for e in events).encode())
        f.flush()
        os.fsync(f.fileno())

    def pending(self) -> int:
        """Spool files present (own or abandoned), a cheap check before a replay."""
        return sum(1 for p in self.directory.glob("spool-*.jsonl") if p.stat().st_size) if self.directory.exists() \
            else 0

    def replay(self, insert: Callable[[Sequence[UsageEvent]], object], batch_size: int = 1000) -> int:
        """Insert every spooled event (own file and files of dead processes), then drop them. Returns events read.

        ``insert`` must be idempotent; if it raises, the files stay for the next replay.
        """
        if not self.directory.exists():
            return 0
        total = 0
        for path in sorted(self.directory.glob("spool-*.jsonl")):
            if path == self._path:
                total += self._replay_own(insert, batch_size)
                continue
            try:
                fd = os.open(path, os.O_RDWR)
            except FileNotFoundError:
                continue  # another process replayed and removed it
            with os.fdopen(fd, "r+b") as f:
                try:
                    fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a live writer owns it
                if not path.exists():
                    continue
                total += self._insert_lines(f, path, insert, batch_size)
                path.unlink()
                _fsync_dir(self.directory)
        return total

    def _replay_own(self, insert: Callable[[Sequence[UsageEvent]], object], batch_size: int) -> int:
        f = self._own()
        with open(self._path, "rb") as reader:  # type: ignore[arg-type]
            n = self._insert_lines(reader, self._path, insert, batch_size)  # type: ignore[arg-type]
        f.truncate(0)
        os.fsync(f.fileno())
        return n

    def _insert_lines(self, f: IO[bytes], path: Path, insert: Callable[[Sequence[UsageEvent]], object],
                      batch_size: int) -> int:
        f.seek(0)
        batch: list[UsageEvent] = []
        n = 0
        for event in self._read(f, path):
            batch.append(event)
            if len(batch) >= batch_size:
                insert(batch)
                n += len(batch)
                batch = []
        if batch:
            insert(batch)
            n += len(batch)
        return n

    def _read(self, f: IO[bytes], path: Path) -> Iterator[UsageEvent]:
        bad: list[str] = []
        for lineno, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # torn final write: never acknowledged
            try:
                yield event_from_json(json.loads(raw))
            except (ValueError, InputError) as exc:
                bad.append(json.dumps({"file": path.name, "line": lineno, "error": str(exc),
                                       "raw": raw.decode(errors="replace").rstrip("\n")}))
        if bad:  # keep what cannot be parsed for an operator, never drop it silently
            with open(self.directory / f"rejected-{path.stem}.jsonl", "a") as out:
                out.write("\n".join(bad) + "\n")
                out.flush()
                os.fsync(out.fileno())

    def close(self) -> None:
        """Close the own file; an empty one is removed."""
        if self._file is not None:
            if self._path is not None and self._path.exists() and self._path.stat().st_size == 0:
                self._path.unlink(missing_ok=True)
            self._file.close()
            self._file = None


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
