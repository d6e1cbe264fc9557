"""``Drainer``: moves journaled usage events into the ledger, one per journal folder, out of the request process.

The proxy's request processes only append to their journal segments (``kvroute.billing.spool``). One drainer per
journal folder -- the holder of an exclusive ``flock`` on ``.drainer.lock``; a second one exits at once, and the
recorders start a new one when the lock is free (the previous drainer died) -- reads every segment by offset,
inserts its events in batches (idempotent, keyed by ``event_id``; a live segment's new lines wait until they fill
``batch_bytes`` or the oldest has waited ``batch_wait_s``, or a reader asks for them with ``request_pass``), dead-
letters what does not parse or what the database refuses (never blocking the events after it), deletes segments
whose writer is gone once consumed (dead processes' journals are replayed the same way) and keeps going while the
database is down. Its progress -- offsets per segment, counters, whether the database is up -- is written atomically
to ``.drainer.json`` after every pass: the recorders read it for ``flush()`` and metrics; a new drainer resumes from
its offsets (an event inserted twice is a no-op). It stops once no writer has held a segment for ``idle_exit_s``
(its parents are gone), or after SIGTERM/SIGINT as soon as no writer is left (at most ``stop_grace_s`` later).

Run as ``python -m kvroute.billing.drain`` (its settings in the ``KVROUTE_DRAIN`` environment variable, so a
database password never shows in the process list), or in a thread of the recorder (embedded mode, same code).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvroute.billing.deadletter import DeadLetter
from kvroute.billing.events import UsageEvent, event_from_json
from kvroute.billing.spool import LOCK_FILE, PASS_FILE, STATS_FILE, as_documented, opened_segment, segment_paths
from kvroute.billing.unavailable import is_unavailable
from kvroute.policies.errors import InputError

log = logging.getLogger("kvroute.billing")
ENV = "KVROUTE_DRAIN"
_CHUNK = 4 << 20


@dataclass
class DrainStats:
    """Counters of one drainer since it started (``lines``: journal lines consumed, stored or dead-lettered)."""

    lines: int = 0
    inserted: int = 0
    replayed: int = 0
    dead_lettered: int = 0
    db_errors: int = 0
    batches: int = 0


def read_stats(journal_dir: Path) -> dict[str, Any]:
    """The drainer's last published progress ({} before the first one)."""
    try:
        data = json.loads((journal_dir / STATS_FILE).read_bytes())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def request_pass(journal_dir: Path) -> None:
    """Ask the folder's drainer to store every line it holds at its next poll, without waiting for a batch."""
    path = journal_dir / PASS_FILE
    stamp = time.time_ns()
    try:
        os.utime(path, ns=(stamp, stamp))
    except FileNotFoundError:
        with contextlib.suppress(OSError):
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
    except OSError:
        pass


def catch_up(journal_dir: Path, timeout_s: float = 10.0) -> bool:
    """Ask a running drainer to store what the journal holds now and wait until it has (False when none runs or
    the time is up: a report then reads what the ledger already has)."""
    if not drainer_running(journal_dir):
        return False
    written = {}
    for path in segment_paths(journal_dir):
        with contextlib.suppress(FileNotFoundError):  # a segment the drainer finished and deleted meanwhile
            written[path.name] = path.stat().st_size
    request_pass(journal_dir)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        offsets = read_stats(journal_dir).get("offsets") or {}
        if all(not (journal_dir / name).exists() or (isinstance(offsets.get(name), int) and offsets[name] >= size)
               for name, size in written.items()):
            return True
        time.sleep(0.05)
    return False


def drainer_running(journal_dir: Path) -> bool:
    """Whether a drainer holds the folder's lock."""
    try:
        fd = os.open(journal_dir / LOCK_FILE, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class Drainer:
    """Drains every journal segment of ``journal_dir`` into the ledger (see the module docstring)."""

    def __init__(self, db: str | Any | Callable[[], Any], journal_dir: str | Path, *,
                 dead_letter: str | Path | None = None, batch_size: int = 500, poll_interval_s: float = 0.2,
                 retry_interval_s: float = 2.0, batch_wait_s: float = 1.0, batch_bytes: int = 64 << 10) -> None:
        from kvroute.billing.ledger import Ledger

        if isinstance(db, Ledger):
            self._factory: Callable[[], Any] = lambda: db
        elif isinstance(db, str):
            self._factory = lambda: Ledger.open(db)
        else:
            self._factory = db
        self.directory = Path(journal_dir)
        self.dead_letter = DeadLetter(dead_letter if dead_letter is not None else self.directory.parent)
        self.batch_size = batch_size
        self.poll_interval_s = poll_interval_s
        self.retry_interval_s = retry_interval_s
        # a database pass costs the same for one line as for hundreds: a live segment's lines wait (at most
        # ``batch_wait_s``) until ``batch_bytes`` of them are there
        self.batch_wait_s = batch_wait_s
        self.batch_bytes = batch_bytes
        self._waiting: dict[str, float] = {}  # segment -> when its oldest unstored line was first seen
        self._pass_stamp: int | None = None
        self.stats = DrainStats()
        self.offsets: dict[str, int] = {}
        self._ledger: Any = None
        self._next_try = 0.0
        self._lock_fd = -1
        self._dirty = True

    @property
    def db_up(self) -> bool:
        return self._ledger is not None

    # -- the folder's lock --------------------------------------------------------------------------------
    def acquire(self) -> bool:
        """Become the folder's drainer (False: another one is); resumes from the published offsets."""
        if self._lock_fd >= 0:
            return True
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.directory / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        offsets = read_stats(self.directory).get("offsets")
        if isinstance(offsets, dict):
            self.offsets = {str(k): v for k, v in offsets.items() if isinstance(v, int) and v >= 0}
        self._dirty = True
        return True

    def release(self) -> None:
        """Publish the progress one last time, close the ledger and free the lock."""
        if self._lock_fd >= 0:
            with contextlib.suppress(OSError):
                self._publish()
        if self._ledger is not None:
            with contextlib.suppress(Exception):
                self._ledger.close()
            self._ledger = None
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1

    # -- one pass -----------------------------------------------------------------------------------------
    def cycle(self, *, force: bool = False) -> int:
        """Connect if due, drain every segment whose batch is due (every one when ``force`` or a reader asked with
        ``request_pass``) as far as it goes; returns how many segments have a live writer."""
        if not self.directory.is_dir():
            return 0  # the folder was removed: nothing left to drain, no writer left
        force = self._pass_requested() or force
        if self._ledger is None and time.monotonic() >= self._next_try:
            self._connect()
        live = 0
        paths = segment_paths(self.directory)
        for path in paths:
            with opened_segment(path) as seg:
                if seg is None:
                    continue
                fd, is_live = seg
                live += is_live
                if self._ledger is None:
                    continue
                if is_live and not force and not self._due(path.name, fd):
                    continue
                try:
                    self._drain_segment(path, fd, is_live)
                except Exception as exc:
                    if not is_unavailable(exc):
                        raise
                    self.stats.db_errors += 1
                    log.warning("billing database unavailable, events stay in the journal: %s", exc)
                    self._mark_down()
        names = {p.name for p in paths}
        for name in [n for n in self.offsets if n not in names]:
            del self.offsets[name]
            self._dirty = True
        for name in [n for n in self._waiting if n not in names]:
            del self._waiting[name]
        if self._dirty:
            self._publish()
        return live

    def _pass_requested(self) -> bool:
        """Whether a reader touched the pass file since the last look (the first look only notes its time)."""
        try:
            stamp = os.stat(self.directory / PASS_FILE).st_mtime_ns
        except OSError:
            stamp = None
        asked = stamp is not None and stamp != self._pass_stamp
        self._pass_stamp = stamp
        return asked

    def _due(self, name: str, fd: int) -> bool:
        """Whether a live segment's unstored lines fill a batch or the oldest has waited ``batch_wait_s``."""
        pending = os.fstat(fd).st_size - self.offsets.get(name, 0)
        if pending <= 0:
            self._waiting.pop(name, None)
            return False
        now = time.monotonic()
        since = self._waiting.setdefault(name, now)
        if pending >= self.batch_bytes or now - since >= self.batch_wait_s:
            del self._waiting[name]
            return True
        return False

    def _connect(self) -> None:
        try:
            self._ledger = self._factory()
            self._dirty = True
        except Exception as exc:
            self.stats.db_errors += 1
            log.warning("billing database unavailable, journaling usage events: %s", exc)
            self._mark_down()

    def _mark_down(self) -> None:
        if self._ledger is not None:
            with contextlib.suppress(Exception):  # disposing a broken pool
                self._ledger.close()
        self._ledger = None
        self._next_try = time.monotonic() + self.retry_interval_s
        self._dirty = True

    def _drain_segment(self, path: Path, fd: int, live: bool) -> None:
        """Insert the complete lines past the segment's offset; a segment nobody writes is deleted afterwards."""
        name = path.name
        self._waiting.pop(name, None)
        offset = self.offsets.get(name, 0)
        size = os.fstat(fd).st_size
        while offset < size:
            data = os.pread(fd, min(size - offset, _CHUNK), offset)
            cut = data.rfind(b"\n") + 1
            if cut == 0 and len(data) < size - offset:  # one line longer than a chunk: read it whole
                data = os.pread(fd, size - offset, offset)
                cut = data.rfind(b"\n") + 1
            if cut == 0:
                break  # only a line being written (live) or a torn one (dead): never acknowledged
            lines = data[:cut].split(b"\n")[:-1]
            pos = offset
            for i in range(0, len(lines), self.batch_size):
                chunk = lines[i:i + self.batch_size]
                events = [e for e in (self._parse(raw, f"replay:{name}" if not live else "journal")
                                      for raw in chunk) if e is not None]
                if events:
                    self._insert_checked(events)
                pos += sum(len(raw) + 1 for raw in chunk)
                self.offsets[name] = pos
                self.stats.lines += len(chunk)
                if not live:
                    self.stats.replayed += len(events)
                self._dirty = True
            offset = pos
        if not live:
            path.unlink(missing_ok=True)
            self.offsets.pop(name, None)
            self._dirty = True
            log.info("kvroute billing: drained and removed journal %s", name)

    def _parse(self, raw: bytes, source: str) -> UsageEvent | None:
        if not raw.strip():
            return None
        data: Any = None
        try:
            data = as_documented(json.loads(raw))
            return event_from_json(data, archive=True)
        except (ValueError, InputError, TypeError) as exc:  # kept in the documented form, for the operator
            line = json.dumps(data).encode() if isinstance(data, dict) else raw
            self._dead(line, f"invalid event: {exc}", source)
            return None

    def _insert_checked(self, batch: Sequence[UsageEvent]) -> None:
        """Insert a batch; rows the database refuses (not outages) are retried one by one, then dead-lettered."""
        assert self._ledger is not None
        self.stats.batches += 1
        try:
            self.stats.inserted += self._ledger.insert_events(batch)
        except Exception as exc:
            if is_unavailable(exc):
                raise
            if len(batch) == 1:
                self._dead(batch[0].to_line().encode(), f"refused by the database: {exc}", "insert")
                return
            for event in batch:
                self._insert_checked([event])

    def _dead(self, raw: bytes, error: str, source: str) -> None:
        self.stats.dead_lettered += 1
        log.error("kvroute billing: event dead-lettered (%s): %s", source, error[:300])
        try:
            self.dead_letter.append(raw, error, source)
        except OSError:
            log.exception("kvroute billing: cannot write the dead-letter file %s", self.dead_letter.path)
            raise

    def _publish(self) -> None:
        """Write the progress file atomically (write a temporary file, rename it over the old one)."""
        data = {"pid": os.getpid(), "at": time.time(), "db_up": self.db_up, "offsets": self.offsets,
                **asdict(self.stats)}
        tmp = self.directory / f"{STATS_FILE}.{os.getpid()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, json.dumps(data).encode())
        finally:
            os.close(fd)
        os.replace(tmp, self.directory / STATS_FILE)
        self._dirty = False

    # -- the process ----------------------------------------------------------------------------------------
    def serve(self, *, idle_exit_s: float = 2.0, stop_grace_s: float = 10.0) -> None:
        """Drain until no writer is left for ``idle_exit_s`` (or, after SIGTERM/SIGINT, none is left)."""
        stopping: list[float] = []

        def on_signal(signum: int, frame: object) -> None:
            stopping.append(time.monotonic())

        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, on_signal)
        last_live = time.monotonic()
        while True:
            try:
                live = self.cycle(force=bool(stopping))
            except Exception:  # one bad pass: retry (the idle rule still ends a drainer whose folder is gone)
                log.exception("kvroute billing drainer pass failed; retrying")
                live = 0
                time.sleep(self.retry_interval_s)
            now = time.monotonic()
            if live:
                last_live = now
            if not live and (stopping or now - last_live >= idle_exit_s):
                return
            if stopping and now - stopping[0] >= stop_grace_s:
                return
            time.sleep(self.poll_interval_s)


def spawn_command() -> list[str]:
    """The command line of a drainer process (settings travel in ``KVROUTE_DRAIN``)."""
    return [sys.executable, "-m", "kvroute.billing.drain"]


def drain_env(db: str, journal_dir: Path, dead_letter: Path, *, batch_size: int, poll_interval_s: float,
              retry_interval_s: float, idle_exit_s: float) -> dict[str, str]:
    """The environment of a drainer process: this one's plus its settings."""
    cfg = {"db": db, "journal": str(journal_dir), "dead_letter": str(dead_letter), "batch_size": batch_size,
           "poll_interval_s": poll_interval_s, "retry_interval_s": retry_interval_s, "idle_exit_s": idle_exit_s}
    from kvroute.billing.settings import child_environment

    return child_environment(**{ENV: json.dumps(cfg)})


def main() -> int:
    from pydantic import ValidationError

    from kvroute.billing.settings import DrainSettings

    logging.basicConfig(level=logging.WARNING, format="kvroute billing drainer %(process)d: %(message)s")
    try:
        cfg = DrainSettings().drain
    except ValidationError:
        cfg = None
    if cfg is None:
        print(f"kvroute billing drainer: set {ENV} (started by the usage recorder)", file=sys.stderr)
        return 2
    drainer = Drainer(cfg["db"], cfg["journal"], dead_letter=cfg["dead_letter"], batch_size=cfg["batch_size"],
                      poll_interval_s=cfg["poll_interval_s"], retry_interval_s=cfg["retry_interval_s"])
    if not drainer.acquire():
        return 0  # another drainer serves this folder
    try:
        drainer.serve(idle_exit_s=cfg["idle_exit_s"])
    finally:
        drainer.release()
    return 0


if __name__ == "__main__":
    sys.exit(main())
