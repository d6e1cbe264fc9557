"""``UsageRecorder``: every accepted usage event is journaled before ``record()`` returns, then drained to the ledger.

``record(event)`` serialises the event and appends it to the local journal with one ``write(2)`` (see
``kvroute.billing.spool``): from then on it survives ``kill -9`` and SIGTERM of the process. A background thread
fsyncs the journal every ``fsync_interval_s`` (the window a *machine* crash can lose), drains new journal lines into
the ledger in batches (idempotent inserts keyed by ``event_id``), replays the journals of dead processes on start
and on reconnect, and keeps going while the database is down (the journal just grows). A line that does not parse,
or a row the database refuses, goes to the dead-letter file (``kvroute.billing.deadletter``) and never blocks the
events after it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.billing.deadletter import DeadLetter
from kvroute.billing.events import UsageEvent, event_from_json
from kvroute.billing.ledger import Ledger
from kvroute.billing.spool import Journal, read_lines
from kvroute.policies.errors import InputError

log = logging.getLogger("kvroute.billing")


@dataclass
class RecorderStats:
    """Counters for metrics and tests (``drained``: own journal lines processed, stored or dead-lettered)."""

    recorded: int = 0
    drained: int = 0
    inserted: int = 0
    replayed: int = 0
    dead_lettered: int = 0
    journal_errors: int = 0
    db_errors: int = 0
    batches: int = 0


def is_unavailable(exc: BaseException) -> bool:
    """A connection-level failure (retry later) as opposed to a row the database refuses."""
    from sqlalchemy import exc as sa_exc
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, OSError,
                        sa_exc.TimeoutError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and bool(exc.connection_invalidated)


class UsageRecorder:
    """Journaled, non-blocking usage recording; ``start()``, ``record()``, ``flush()``, ``close()``.

    ``journal_dir`` holds the journal segments; ``dead_letter`` (a folder or a ``.jsonl`` path) defaults to the
    journal folder's parent, i.e. the data directory.
    """

    def __init__(self, db: str | Ledger | Callable[[], Ledger], journal_dir: str | Path, *,
                 dead_letter: str | Path | None = None, batch_size: int = 500, flush_interval_s: float = 0.2,
                 retry_interval_s: float = 2.0, fsync_interval_s: float = 1.0, rotate_bytes: int = 8 << 20) -> None:
        if isinstance(db, Ledger):
            self._factory: Callable[[], Ledger] = lambda: db
        elif isinstance(db, str):
            self._factory = lambda: Ledger.open(db)
        else:
            self._factory = db
        self.journal = Journal(journal_dir, rotate_bytes=rotate_bytes)
        self.dead_letter = DeadLetter(dead_letter if dead_letter is not None else Path(journal_dir).parent)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.fsync_interval_s = fsync_interval_s
        self.stats = RecorderStats()
        self._memory: deque[UsageEvent] = deque()  # only when the journal cannot be written (disk full)
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._stop = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self._ledger: Ledger | None = None
        self._next_try = 0.0
        self._last_sync = time.monotonic()

    @property
    def db_available(self) -> bool:
        return self._ledger is not None

    def start(self) -> UsageRecorder:
        """Start the writer thread; it opens the database and replays dead processes' journals (never blocks)."""
        if self._thread is None:
            self._stop = False
            self._closed = False
            self._thread = threading.Thread(target=self._run, name="kvroute-usage-recorder", daemon=True)
            self._thread.start()
        return self

    # -- request path -------------------------------------------------------------------------------------
    def record(self, event: UsageEvent) -> None:
        """Journal one event (one ``write(2)``, no fsync, no database); durable against a process crash on return."""
        line = event.to_bytes() + b"\n"
        try:
            self.journal.append(line, event)
        except OSError:  # disk full or gone: keep it in memory for the writer, never drop it
            self.stats.journal_errors += 1
            self._memory.append(event)
            self._wake.set()
        self.stats.recorded += 1

    # -- callers that wait --------------------------------------------------------------------------------
    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every event recorded before this call is in the ledger or dead-lettered (False on timeout).

        False does not mean lost: the events are in the journal and reach the ledger when it is back.
        """
        target = self.stats.recorded
        if self._thread is None or not self._thread.is_alive():
            with contextlib.suppress(Exception):
                self._cycle()
            return self.stats.drained >= target
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._progress:
            while self.stats.drained < target:
                self._wake.set()
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._progress.wait(min(left, 0.05) if left is not None else 0.05)
        return True

    def close(self, timeout: float = 30.0) -> None:
        """Stop the writer after a last drain; fsync and close the journal (what is not stored stays in it)."""
        if self._closed:
            return
        self._closed = True
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        with contextlib.suppress(Exception):
            self._cycle()
        self.journal.close()
        if self._ledger is not None:
            with contextlib.suppress(Exception):
                self._ledger.close()
            self._ledger = None

    # -- writer thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                self._cycle()
            except Exception:  # never let the writer thread die: events would pile up unseen
                log.exception("kvroute billing recorder loop failed; retrying")
                time.sleep(self.retry_interval_s)
            if self._stop:
                return
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()

    def _cycle(self) -> None:
        now = time.monotonic()
        if self._ledger is None and (now >= self._next_try or self._stop):
            self._connect()
        if self._ledger is not None:
            try:
                self._drain()
            except Exception as exc:
                if not is_unavailable(exc):
                    raise
                self.stats.db_errors += 1
                log.warning("billing database unavailable, events stay in the journal: %s", exc)
                self._mark_down()
        if now - self._last_sync >= self.fsync_interval_s or self._stop:
            self.journal.sync()
            self._last_sync = now

    def _connect(self) -> None:
        """Open the ledger (runs migrations) and replay dead processes' journals; on failure retry later."""
        try:
            self._ledger = self._ledger or self._factory()
            for path, fd in self.journal.orphans():
                self._replay_file(path, fd)
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

    def _replay_file(self, path: Path, fd: int) -> None:
        batch: list[UsageEvent] = []
        for _, raw in read_lines(fd):
            event = self._parse(raw, f"replay:{path.name}")
            if event is not None:
                batch.append(event)
            if len(batch) >= self.batch_size:
                self._insert_checked(batch)
                self.stats.replayed += len(batch)
                batch = []
        if batch:
            self._insert_checked(batch)
            self.stats.replayed += len(batch)
        path.unlink(missing_ok=True)
        log.info("kvroute billing: replayed journal %s", path.name)

    def _drain(self) -> None:
        while self._memory:
            event = self._memory[0]
            self._insert_checked([event])
            self._memory.popleft()
            self._progressed(1)
        while True:  # events queued in memory with their journal offsets: no re-parsing
            events, end = self.journal.take_queued(self.batch_size)
            if not events:
                break
            try:
                self._insert_checked(events)  # type: ignore[arg-type]
            except Exception:
                self.journal.spill()  # the journal holds them: read it from the drained offset when back
                raise
            self.journal.advance(end)
            self._progressed(len(events))
        while self.journal.from_disk:
            lines, end = self.journal.read_new()
            if not lines:
                self.journal.caught_up()
                if self.journal.from_disk:
                    continue
                break
            events = [e for e in (self._parse(raw, "journal") for raw in lines) if e is not None]
            for i in range(0, len(events), self.batch_size):
                self._insert_checked(events[i:i + self.batch_size])
            self.journal.advance(end)
            self._progressed(len(lines))
        self.journal.rotate_if_drained()

    def _progressed(self, n: int) -> None:
        with self._progress:
            self.stats.drained += n
            self._progress.notify_all()

    def _parse(self, raw: bytes, source: str) -> UsageEvent | None:
        if not raw.strip():
            return None
        try:
            return event_from_json(json.loads(raw))
        except (ValueError, InputError, TypeError) as exc:
            self._dead(raw, f"invalid event: {exc}", source)
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


def default_paths(data_dir: str | Path) -> tuple[str, Path]:
    """The embedded ledger URL and the journal folder of a data directory."""
    data = Path(data_dir)
    return f"sqlite:///{os.path.abspath(data / 'billing.db')}", data / "journal"
