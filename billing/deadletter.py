"""``DeadLetter``: usage events that could not be stored, kept for an operator (never dropped, never blocking).

One JSON object per line in ``<data dir>/dead-letter.jsonl`` (mode 0600, created with it, never in the system
temp directory): ``{"at", "source", "error", "line"}`` where ``line`` is the event's JSON text exactly as it was
journaled. An operator fixes ``line`` in place (any editor) and runs ``kvroute billing dead-letter retry``: every
entry whose line now parses and inserts is removed; the others stay, with the new error. Appends and retries hold
an exclusive ``flock`` on the file, so several proxy workers and the CLI can share it.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kvroute.billing.events import UsageEvent, event_from_json
from kvroute.billing.unavailable import is_unavailable

FILE_NAME = "dead-letter.jsonl"


@dataclass(frozen=True)
class DeadEntry:
    """One dead-lettered event: where it came from, why it failed, and its JSON line."""

    index: int
    at: str
    source: str
    error: str
    line: str


@dataclass(frozen=True)
class RetryResult:
    inserted: int
    remaining: int
    errors: list[str]


class DeadLetter:
    """The dead-letter file of one data directory."""

    def __init__(self, path: str | Path) -> None:
        path = Path(path)
        self.path = path / FILE_NAME if path.suffix != ".jsonl" else path

    def _open(self, flags: int) -> int:
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, flags | os.O_CREAT | os.O_CLOEXEC, 0o600)
        os.fchmod(fd, 0o600)  # also when the file existed with laxer bits
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def append(self, line: str | bytes, error: str, source: str) -> None:
        """Keep one event line (fsync'd) with the reason it was refused."""
        text = line.decode(errors="replace") if isinstance(line, bytes) else line
        entry = {"at": datetime.now(UTC).isoformat().replace("+00:00", "Z"), "source": source,
                 "error": error[:500], "line": text}
        fd = self._open(os.O_WRONLY | os.O_APPEND)
        try:
            os.write(fd, (json.dumps(entry, ensure_ascii=False) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def entries(self) -> list[DeadEntry]:
        """Every entry in file order (a line that is not an entry object is shown with its text as ``line``)."""
        if not self.path.exists():
            return []
        out = []
        for i, raw in enumerate(self.path.read_text(errors="replace").splitlines()):
            if not raw.strip():
                continue
            try:
                d = json.loads(raw)
                if not isinstance(d, dict):
                    raise ValueError
                line = d.get("line")
                if not isinstance(line, str):  # an operator may paste the event object itself
                    line = json.dumps(d.get("event", line))
                out.append(DeadEntry(i, str(d.get("at", "")), str(d.get("source", "")), str(d.get("error", "")),
                                     line))
            except ValueError:
                out.append(DeadEntry(i, "", "unreadable", "not a dead-letter entry", raw))
        return out

    def __len__(self) -> int:
        return len(self.entries())

    def retry(self, insert: Callable[[Sequence[UsageEvent]], Any]) -> RetryResult:
        """Parse and insert every entry; stored ones leave the file, the rest stay with their new error."""
        if not self.path.exists():
            return RetryResult(0, 0, [])
        fd = self._open(os.O_RDWR)
        try:
            keep: list[str] = []
            errors: list[str] = []
            inserted = 0
            for e in self.entries():
                try:
                    event = event_from_json(json.loads(e.line), archive=True)
                    insert([event])
                    inserted += 1
                except Exception as exc:
                    if is_unavailable(exc):
                        raise  # the database is down: nothing about this entry is known yet
                    error = str(exc)
                    errors.append(f"entry {e.index}: {error}")
                    keep.append(json.dumps({"at": e.at, "source": e.source, "error": error[:500], "line": e.line},
                                           ensure_ascii=False))
            tmp = self.path.with_suffix(".tmp")
            tfd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                os.write(tfd, "".join(k + "\n" for k in keep).encode())
                os.fsync(tfd)
            finally:
                os.close(tfd)
            os.replace(tmp, self.path)
            return RetryResult(inserted, len(keep), errors)
        finally:
            os.close(fd)
