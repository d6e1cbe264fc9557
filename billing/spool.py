"""``Journal``: the local append-only file every accepted usage event is written to before ``record()`` returns.

Durability contract:

- ``append(line)`` is one ``write(2)`` of a whole JSON line to a file opened ``O_APPEND``: once it returns the line
  is in the kernel's page cache and survives ``kill -9``, SIGTERM or any crash *of the process*.
- ``sync()`` (called by the recorder's housekeeping thread every ``fsync_interval_s``, default 1 s, and on close)
  fsyncs it. A crash *of the machine* (power, kernel) can lose the lines written since the last fsync: at most
  ``fsync_interval_s`` of events.
- Each process owns one segment, ``journal-<pid>-<random>.jsonl``, under an exclusive ``flock`` while it writes
  it (created under a hidden name, locked, then renamed: a reader never sees it unlocked before it is used). A
  large segment is rotated: a fresh one is opened first, then the old one is closed.
- The drainer (``kvroute.billing.drain``, one per journal folder) reads every segment by offset: a locked one up
  to its last complete line, an unlocked one (its writer closed it or died) to the end, after which it deletes
  it. A torn last line (a crash mid-``write``; never acknowledged) is ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec

PREFIX = "journal-"
LEGACY_PREFIX = "spool-"  # files of the pre-journal spool are replayed the same way
LOCK_FILE = ".drainer.lock"  # held (flock) by the one drainer of a journal folder
STATS_FILE = ".drainer.json"  # the drainer's progress: offsets per segment, counters, database state
PASS_FILE = ".drainer.pass"  # touched by a reader that wants every journaled line stored now (``flush``)


_NATIVE = msgspec.json.Encoder()
_OPTIONAL = ("end_user", "api_key_hash", "http_status", "error_type", "ttft_ms", "duration_ms", "attempt_key",
             "session_id")


def encode_event(event: Any) -> bytes:
    """One journal line (newline included) for a ``UsageEvent``."""
    try:
        return _NATIVE.encode(event) + b"\n"
    except (TypeError, ValueError, OverflowError, UnicodeEncodeError):  # e.g. a lone surrogate, a huge int
        return event.to_bytes() + b"\n"


def as_documented(data: Any) -> Any:
    """A parsed journal line in the documented JSON form (``UsageEvent.to_json``): msgspec's field names mapped
    (``tokens`` → ``usage``, ``is_final`` → ``final``), absent values dropped as ``to_json`` drops them."""
    if not isinstance(data, dict) or "tokens" not in data or "usage" in data:
        return data
    out = {k: v for k, v in data.items() if v is not None}
    out["usage"] = out.pop("tokens")
    if "is_final" in out:
        out["final"] = out.pop("is_final")
    for name in _OPTIONAL:
        if out.get(name) == "":
            del out[name]
    return out


@dataclass
class Segment:
    """One journal file of this process: its path and write fd."""

    path: Path
    fd: int


class Journal:
    """This process's append-only journal segment in ``directory`` (created 0700; files 0600)."""

    def __init__(self, directory: str | Path, *, rotate_bytes: int = 8 << 20) -> None:
        self.directory = Path(directory)
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._seg: Segment | None = None
        self.written = 0  # bytes appended to the current segment (under the lock)
        self._synced = 0
        self.closed: list[tuple[Path, int]] = []  # own segments rotated out, with their final size

    # -- request path -------------------------------------------------------------------------------------
    def append(self, line: bytes) -> None:
        """Write one newline-terminated line with a single ``write(2)`` (no fsync); raises ``OSError``."""
        with self._lock:
            seg = self._seg or self._open_locked()
            n = os.write(seg.fd, line)
            while n < len(line):  # a short write (disk nearly full): finish the line or raise
                n += os.write(seg.fd, line[n:])
            self.written += n

    # -- housekeeping -------------------------------------------------------------------------------------
    def open(self) -> Path:
        """Open (create and lock) the own segment now, so the drainer sees a live writer; returns its path."""
        with self._lock:
            return (self._seg or self._open_locked()).path

    def _open_locked(self) -> Segment:
        self._seg = _new_segment(self.directory)
        self.written = self._synced = 0
        return self._seg

    @property
    def path(self) -> Path | None:
        seg = self._seg
        return seg.path if seg else None

    def own(self) -> list[tuple[Path, int]]:
        """Every own segment not yet known to be consumed, with the bytes written to it so far."""
        with self._lock:
            cur = [(self._seg.path, self.written)] if self._seg else []
            return [*self.closed, *cur]

    def forget(self, path: Path) -> None:
        """A rotated-out segment was consumed (the drainer deleted it)."""
        with self._lock:
            self.closed = [c for c in self.closed if c[0] != path]

    def rotate_if_large(self) -> bool:
        """Open a fresh segment once the current one reached ``rotate_bytes``; the old one is fsync'd and closed
        (unlocked), so the drainer finishes and deletes it."""
        if self._seg is None or self.written < self.rotate_bytes:
            return False
        new = _new_segment(self.directory)  # outside the lock: record() does not wait on file creation
        with self._lock:
            old, size = self._seg, self.written
            self._seg = new
            self.written = self._synced = 0
            self.closed.append((old.path, size))
        with contextlib.suppress(OSError):
            os.fsync(old.fd)
        os.close(old.fd)
        return True

    def sync(self) -> None:
        """fsync the own segment if it grew since the last sync (bounds the machine-crash window)."""
        seg = self._seg
        if seg is not None and self.written != self._synced:
            size = self.written
            with contextlib.suppress(OSError):
                os.fsync(seg.fd)
                self._synced = size

    def close(self) -> tuple[Path, int] | None:
        """fsync and close (unlock) the own segment; returns it with its size (the drainer consumes the rest)."""
        with self._lock:
            seg, self._seg = self._seg, None
            written = self.written
            if seg is not None:
                self.closed.append((seg.path, written))
        if seg is None:
            return None
        with contextlib.suppress(OSError):
            os.fsync(seg.fd)
        os.close(seg.fd)
        return seg.path, written


def _new_segment(directory: Path) -> Segment:
    """A new locked segment: created under a hidden name, flock'd, then renamed into place."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    name = f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:10]}.jsonl"
    tmp = directory / f".new-{name}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    path = directory / name
    os.rename(tmp, path)
    _fsync_dir(directory)
    return Segment(path, fd)


def segment_paths(directory: Path) -> list[Path]:
    """Every journal segment in ``directory`` (current and legacy names), oldest name first."""
    if not directory.is_dir():
        return []
    return sorted([*directory.glob(f"{PREFIX}*.jsonl"), *directory.glob(f"{LEGACY_PREFIX}*.jsonl")])


@contextlib.contextmanager
def opened_segment(path: Path) -> Iterator[tuple[int, bool] | None]:
    """``(fd, live)`` of one segment (None when it is gone): ``live`` while its writer holds the lock; otherwise
    this fd holds the lock until the block ends (nobody writes an unlocked segment again)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield None
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            live = False
        except BlockingIOError:
            live = True
        yield fd, live
    finally:
        os.close(fd)


def is_live(path: Path) -> bool:
    """Whether a writer holds ``path`` (False when it is gone)."""
    with opened_segment(path) as seg:
        return seg is not None and seg[1]


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
