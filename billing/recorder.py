"""``UsageRecorder``: records usage off the request path, in batches, falling back to a durable spool.

``record(event)`` only appends to an in-memory queue. A background thread drains it in batches into the
ledger (idempotent inserts). When the database is unavailable, batches go to the fsync'd spool, which is replayed
on start and on reconnect. Nothing is dropped: rows the database rejects go to ``rejected-*.jsonl`` in the spool.
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
from typing import Any

from kvroute.billing.events import UsageEvent
from kvroute.billing.ledger import Ledger
from kvroute.billing.spool import Spool

log = logging.getLogger("kvroute.billing")


@dataclass
class RecorderStats:
    """Counters for metrics and tests."""

    recorded: int = 0
    inserted: int = 0
    spooled: int = 0
    replayed: int = 0
    rejected: int = 0
    db_errors: int = 0
    batches: int = 0


def _is_unavailable(exc: BaseException) -> bool:
    """A connection-level failure (retry later) as opposed to a row the database rejects."""
    from sqlalchemy import exc as sa_exc
    if isinstance(exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, OSError,
                        sa_exc.TimeoutError)):
        return True
    return isinstance(exc, sa_exc.DBAPIError) and exc.connection_invalidated


class UsageRecorder:
    """Batched, non-blocking usage recording with a durable spool; ``start()``, ``record()``, ``close()``."""

    def __init__(self, db: str | Ledger | Callable[[], Ledger], spool_dir: str | Path, *, batch_size: int = 500,
                 flush_interval_s: float = 0.2, retry_interval_s: float = 2.0) -> None:
        if isinstance(db, Ledger):
            self._factory: Callable[[], Ledger] = lambda: db
        elif isinstance(db, str):
            self._factory = lambda: Ledger.open(db)
        else:
            self._factory = db
        self.spool = Spool(spool_dir)
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.stats = RecorderStats()
        self._queue: deque[Any] = deque()
        self._wake = threading.Event()
        self._stop = False
        self._thread: threading.Thread | None = None
        self._ledger: Ledger | None = None
        self._next_try = 0.0

    @property
    def db_available(self) -> bool:
        return self._ledger is not None

    def start(self) -> UsageRecorder:
        """Start the writer thread; it opens the database and replays the spool (never blocks the caller)."""
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._run, name="kvroute-usage-recorder", daemon=True)
            self._thread.start()
        return self

    def record(self, event: UsageEvent) -> None:
        """Enqueue one event (a deque append: no I/O, no lock on the request path)."""
        self._queue.append(event)
        if len(self._queue) >= self.batch_size:
            self._wake.set()

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Block until every event recorded before this call is in the database or the spool."""
        if self._thread is None or not self._thread.is_alive():
            self._drain_all()
            return True
        marker = threading.Event()
        self._queue.append(marker)
        self._wake.set()
        return marker.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Stop the thread after writing everything queued (to the database, else the spool)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._drain_all()
        self.spool.close()
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    # -- writer thread ------------------------------------------------------------------------------------
    def _run(self) -> None:
        self._connect()
        while not self._stop:
            self._wake.wait(self.flush_interval_s)
            self._wake.clear()
            try:
                if self._ledger is None and time.monotonic() >= self._next_try:
                    self._connect()
                self._drain_all()
            except Exception:  # never let the writer thread die: events would pile up unseen
                log.exception("kvroute billing recorder loop failed; retrying")
                time.sleep(self.retry_interval_s)

    def _drain_all(self) -> None:
        while self._queue:
            batch: list[UsageEvent] = []
            markers: list[threading.Event] = []
            while self._queue and len(batch) < self.batch_size:
                item = self._queue.popleft()
                if isinstance(item, threading.Event):
                    markers.append(item)
                    break
                batch.append(item)
            self.stats.recorded += len(batch)
            if batch:
                self._persist(batch)
            for m in markers:
                m.set()

    def _connect(self) -> None:
        """Open the ledger (runs migrations) and replay the spool; on failure stay in spool mode."""
        try:
            ledger = self._ledger or self._factory()
            self._ledger = ledger
            if self.spool.pending():
                self.stats.replayed += self.spool.replay(self._insert_checked, self.batch_size)
        except Exception as exc:  # the database is unavailable (or the replay hit it going down)
            self.stats.db_errors += 1
            log.warning("billing database unavailable, spooling usage events: %s", exc)
            self._mark_down()

    def _mark_down(self) -> None:
        if self._ledger is not None:
            with contextlib.suppress(Exception):  # disposing a broken pool
                self._ledger.close()
        self._ledger = None
        self._next_try = time.monotonic() + self.retry_interval_s

    def _persist(self, batch: Sequence[UsageEvent]) -> None:
        self.stats.batches += 1
        if self._ledger is not None:
            try:
                self._insert_checked(batch)
                return
            except Exception as exc:
                self.stats.db_errors += 1
                log.warning("billing insert failed, spooling %d events: %s", len(batch), exc)
                self._mark_down()
        try:
            self.spool.append(batch)
            self.stats.spooled += len(batch)
        except OSError:  # spool disk failing too: keep the events queued, retry later
            log.exception("billing spool write failed; %d events kept in memory", len(batch))
            self._queue.extendleft(reversed(batch))
            time.sleep(self.retry_interval_s)

    def _insert_checked(self, batch: Sequence[UsageEvent]) -> None:
        """Insert a batch; rows the database rejects (not outages) are retried one by one, then set aside."""
        assert self._ledger is not None
        try:
            self.stats.inserted += self._ledger.insert_events(batch)
        except Exception as exc:
            if _is_unavailable(exc) or (len(batch) == 1 and not self._reject(batch[0], exc)):
                raise
            if len(batch) > 1:
                for event in batch:
                    self._insert_checked([event])

    def _reject(self, event: UsageEvent, exc: BaseException) -> None:
        self.stats.rejected += 1
        path = self.spool.directory / f"rejected-{os.getpid()}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps({"error": str(exc)[:500], "event": event.to_json()}) + "\n")
            f.flush()
            os.fsync(f.fileno())
        log.error("billing event %s rejected by the database: %s", event.event_id, exc)
