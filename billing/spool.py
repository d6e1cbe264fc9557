"""``Journal``: the local append-only file every accepted usage event is written to before ``record()`` returns.

Durability contract:

- ``append(line)`` is one ``write(2)`` of a whole JSON line to a file opened ``O_APPEND``: once it returns the line
  is in the kernel's page cache and survives ``kill -9``, SIGTERM or any crash *of the process*.
- ``sync()`` (called by the recorder's background thread every ``fsync_interval_s``, default 1 s, and on close)
  fsyncs it. A crash *of the machine* (power, kernel) can lose the lines written since the last fsync: at most
  ``fsync_interval_s`` of events.
- Each process owns one segment, ``journal-<pid>-<random>.jsonl``, under an exclusive ``flock`` while it lives.
  Its writer thread drains the segment into the database (``read_new``/``advance``) and, once everything in it is
  stored, starts a fresh segment and deletes the old one (``rotate_if_drained``). Segments whose owner died
  (``flock`` free) are replayed by the next process that connects to the database (``orphans``).
- A torn last line (a crash mid-``write``; never acknowledged) is ignored.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import uuid
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

PREFIX = "journal-"
LEGACY_PREFIX = "spool-"  # files of the pre-journal spool are replayed the same way


@dataclass
class Segment:
    """One journal file: its path, the write fd (own segment only) and how far the writer has drained it."""

    path: Path
    fd: int = -1
    drained: int = 0


class Journal:
    """Append-only, per-process journal segments in ``directory`` (created 0700; files 0600)."""

    def __init__(self, directory: str | Path, *, rotate_bytes: int = 8 << 20, max_queue: int = 50_000) -> None:
        self.directory = Path(directory)
        self.rotate_bytes = rotate_bytes
        self._lock = threading.Lock()
        self._seg: Segment | None = None
        self.written = 0  # bytes appended to the current segment (under the lock)
        self._synced = 0
        self.queue: deque[tuple[int, object]] = deque()  # (end offset, event) of lines not yet drained
        self.max_queue = max_queue
        self.from_disk = False

    # -- request path -------------------------------------------------------------------------------------
    def append(self, line: bytes, item: object = None) -> None:
        """Write one newline-terminated line with a single ``write(2)`` (no fsync); raises ``OSError``.

        ``item`` (the event object) is queued with the line's end offset for the writer, so it need not re-read
        the line -- unless the in-memory queue overflowed, then the writer reads the journal itself.
        """
        with self._lock:
            seg = self._seg or self._open_segment()
            n = os.write(seg.fd, line)
            while n < len(line):  # a short write (disk nearly full): finish the line or raise
                n += os.write(seg.fd, line[n:])
            self.written += n
            if item is not None and not self.from_disk:
                if len(self.queue) >= self.max_queue:
                    self.queue.clear()
                    self.from_disk = True  # the writer reads the journal from its drained offset instead
                else:
                    self.queue.append((self.written, item))

    # -- writer thread ------------------------------------------------------------------------------------
    def _open_segment(self) -> Segment:
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        path = self.directory / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:10]}.jsonl"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        _fsync_dir(self.directory)
        self._seg = Segment(path, fd)
        self.written = self._synced = 0
        return self._seg

    def read_new(self, limit: int = 4 << 20) -> tuple[list[bytes], int]:
        """Complete lines of the own segment past the drained offset (up to ``limit`` bytes), and their end offset."""
        with self._lock:
            seg, end = self._seg, self.written
        if seg is None or end <= seg.drained:
            return [], seg.drained if seg else 0
        with open(seg.path, "rb") as f:
            f.seek(seg.drained)
            data = f.read(min(end - seg.drained, limit))
        cut = data.rfind(b"\n") + 1
        if cut == 0:
            if len(data) >= limit:  # one line longer than limit: read it whole
                with open(seg.path, "rb") as f:
                    f.seek(seg.drained)
                    data = f.read(end - seg.drained)
                cut = data.rfind(b"\n") + 1
            if cut == 0:
                return [], seg.drained
        return data[:cut].splitlines(), seg.drained + cut

    def advance(self, offset: int) -> None:
        """Everything before ``offset`` of the own segment is stored (or dead-lettered)."""
        if self._seg is not None:
            self._seg.drained = max(self._seg.drained, offset)

    @property
    def pending_bytes(self) -> int:
        """Bytes appended but not yet drained into the database."""
        seg = self._seg
        return 0 if seg is None else self.written - seg.drained

    def take_queued(self, limit: int) -> tuple[list[object], int]:
        """Up to ``limit`` queued events and the end offset of the last one ([] when reading from disk)."""
        with self._lock:
            if self.from_disk:
                return [], 0
            if len(self.queue) <= limit:  # swap the whole queue out: O(1) under the lock record() waits on
                items: deque[tuple[int, object]] | list[tuple[int, object]] = self.queue
                self.queue = deque()
            else:
                items = [self.queue.popleft() for _ in range(limit)]
        return [i for _, i in items], (items[-1][0] if items else 0)

    def caught_up(self) -> None:
        """The writer read the journal up to its end: queue events in memory again."""
        with self._lock:
            if self.from_disk and (self._seg is None or self._seg.drained >= self.written):
                self.from_disk = False

    def spill(self) -> None:
        """Forget the queued events (the database is down): the writer re-reads them from the journal."""
        with self._lock:
            self.queue.clear()
            self.from_disk = True

    def rotate_if_drained(self, force: bool = False) -> bool:
        """Start a new segment and delete the old one when it is fully drained and large (or ``force``)."""
        with self._lock:
            seg = self._seg
            if seg is None or seg.drained < self.written or (not force and self.written < self.rotate_bytes):
                return False
            self._seg = None
            self.written = self._synced = 0
        os.close(seg.fd)
        seg.path.unlink(missing_ok=True)
        return True

    def sync(self) -> None:
        """fsync the own segment if it grew since the last sync (bounds the machine-crash window)."""
        seg = self._seg
        if seg is not None and self.written != self._synced:
            size = self.written
            with contextlib.suppress(OSError):
                os.fsync(seg.fd)
                self._synced = size

    def orphans(self) -> Iterator[tuple[Path, int]]:
        """Segments of dead processes, each yielded with an open, exclusively locked fd (closed after use)."""
        if not self.directory.exists():
            return
        own = self._seg.path if self._seg else None
        paths = sorted([*self.directory.glob(f"{PREFIX}*.jsonl"), *self.directory.glob(f"{LEGACY_PREFIX}*.jsonl")])
        for path in paths:
            if path == own:
                continue
            try:
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
            except FileNotFoundError:
                continue  # another process replayed and removed it
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue  # a live writer owns it
            try:
                if path.exists():
                    yield path, fd
            finally:
                os.close(fd)

    def close(self) -> None:
        """fsync and close the own segment; a fully drained one is removed."""
        with self._lock:
            seg, self._seg = self._seg, None
            written = self.written
        if seg is None:
            return
        with contextlib.suppress(OSError):
            os.fsync(seg.fd)
        os.close(seg.fd)
        if seg.drained >= written:
            seg.path.unlink(missing_ok=True)


def read_lines(fd: int) -> Iterator[tuple[int, bytes]]:
    """(line number, line) of a whole file; a torn last line (no newline) is skipped."""
    with os.fdopen(os.dup(fd), "rb") as f:
        f.seek(0)
        for lineno, raw in enumerate(f, 1):
            if raw.endswith(b"\n"):
                yield lineno, raw.rstrip(b"\n")


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
