"""``UsageRecorder``: every accepted usage event is journaled before ``record()`` returns, then drained to the ledger.

``record(event)`` serialises the event and appends it to this process's journal segment with one ``write(2)``
(see ``kvroute.billing.spool``): from then on it survives ``kill -9`` and SIGTERM of the process. That is all the
request path does. A housekeeping thread (awake a few times a second, never touching the database) fsyncs the
journal every ``fsync_interval_s`` (the window a *machine* crash can lose), rotates large segments, and makes
sure the journal folder's drainer runs (``kvroute.billing.drain``): by default a separate process, shared by
every recorder of the folder (proxy workers), started again by any of them when it died. The drainer inserts
the events (idempotent, keyed by ``event_id``), replays dead processes' journals, dead-letters bad lines and keeps
going while the database is down. ``drain="thread"`` runs the same drainer in a thread of this process instead
(for the SDK and tests; it competes with the request path for the GIL).
"""

from __future__ import annotations

import contextlib
import logging
import subprocess
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from kvroute.billing.deadletter import DeadLetter
from kvroute.billing.drain import (
    Drainer,
    drain_env,
    drainer_running,
    read_stats,
    request_pass,
    spawn_command,
)
from kvroute.billing.events import UsageEvent
from kvroute.billing.spool import Journal, encode_event, is_live, segment_paths
from kvroute.billing.unavailable import is_unavailable

log = logging.getLogger("kvroute.billing")

__all__ = ["RecorderStats", "UsageRecorder", "is_unavailable"]


@dataclass
class RecorderStats:
    """Counters for metrics and tests. ``recorded`` and ``journal_errors`` are this process's; the others are the
    journal folder's drainer's since it started (``drained``: journal lines it consumed, stored or dead-lettered;
    ``dead_lettered`` adds this process's own callback dead letters)."""

    recorded: int = 0
    drained: int = 0
    inserted: int = 0
    replayed: int = 0
    dead_lettered: int = 0
    journal_errors: int = 0
    db_errors: int = 0
    batches: int = 0


class UsageRecorder:
    """Journaled, non-blocking usage recording; ``start()``, ``record()``, ``flush()``, ``close()``.

    ``journal_dir`` holds the journal segments; ``dead_letter`` (a folder or a ``.jsonl`` path) defaults to the
    journal folder's parent, i.e. the data directory. ``drain``: ``"process"`` (default; needs a database URL) or
    ``"thread"`` (embedded; also used when ``db`` is a ``Ledger`` or a factory).
    """

    def __init__(self, db: str | Any | Callable[[], Any], journal_dir: str | Path, *,
                 dead_letter: str | Path | None = None, batch_size: int = 500, flush_interval_s: float = 0.2,
                 retry_interval_s: float = 2.0, fsync_interval_s: float = 1.0, rotate_bytes: int = 8 << 20,
                 drain: Literal["process", "thread"] = "process", drainer_idle_exit_s: float = 2.0) -> None:
        self.db = db
        self.journal_dir = Path(journal_dir)
        self.journal = Journal(journal_dir, rotate_bytes=rotate_bytes)
        self.dead_letter = DeadLetter(dead_letter if dead_letter is not None else self.journal_dir.parent)
        self.drain = drain if isinstance(db, str) else "thread"
        self.batch_size = batch_size
        self.flush_interval_s = flush_interval_s
        self.retry_interval_s = retry_interval_s
        self.fsync_interval_s = fsync_interval_s
        self.drainer_idle_exit_s = drainer_idle_exit_s
        self._stats = RecorderStats()
        self._own_dead = 0
        self._memory: deque[bytes] = deque()  # lines the journal could not take (disk full), retried
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._drainer: Drainer | None = None  # thread mode (or an inline pass before start)
        self._child: subprocess.Popen[bytes] | None = None
        self._next_spawn = 0.0
        self._spawn_backoff = 1.0
        self._last_sync = time.monotonic()
        self._started_at = 0.0
        self._closed = False

    # -- lifecycle ----------------------------------------------------------------------------------------
    def start(self) -> UsageRecorder:
        """Open the own journal segment, start the housekeeping thread and the drainer (never blocks on the DB)."""
        if self._thread is None:
            self._stop.clear()
            self._closed = False
            self.journal.open()
            self._started_at = time.time()
            if self.drain == "process":
                self._ensure_drainer()
            else:
                self._drainer = self._new_drainer()
            self._thread = threading.Thread(target=self._run, name="kvroute-usage-journal", daemon=True)
            self._thread.start()
        return self

    def _new_drainer(self) -> Drainer:
        return Drainer(self.db, self.journal_dir, dead_letter=self.dead_letter.path, batch_size=self.batch_size,
                       poll_interval_s=self.flush_interval_s, retry_interval_s=self.retry_interval_s)

    # -- request path -------------------------------------------------------------------------------------
    def record(self, event: UsageEvent) -> None:
        """Journal one event (msgspec-encoded, one ``write(2)``, no fsync, no database); durable against a process
        crash on return."""
        line = encode_event(event)
        try:
            self.journal.append(line)
        except OSError:  # disk full or gone: keep it in memory, the housekeeping thread retries; never drop it
            self._stats.journal_errors += 1
            self._memory.append(line)
        self._stats.recorded += 1

    # -- what the drainer published -----------------------------------------------------------------------
    def _published(self) -> dict[str, Any]:
        return read_stats(self.journal_dir)

    @property
    def stats(self) -> RecorderStats:
        st, pub = self._stats, self._published()
        for name, key in (("drained", "lines"), ("inserted", "inserted"), ("replayed", "replayed"),
                          ("db_errors", "db_errors"), ("batches", "batches")):
            value = pub.get(key)
            setattr(st, name, value if isinstance(value, int) else 0)
        dead = pub.get("dead_lettered")
        st.dead_lettered = (dead if isinstance(dead, int) else 0) + self._own_dead
        return st

    def note_dead_letter(self) -> None:
        """Count an event this process dead-lettered itself (a callback payload that makes no valid event)."""
        self._own_dead += 1

    @property
    def db_available(self) -> bool:
        """Whether the drainer last reached the database."""
        return bool(self._published().get("db_up"))

    @property
    def pending_bytes(self) -> int:
        """Bytes this process journaled that the drainer has not consumed yet (the journal lag)."""
        offsets = self._published().get("offsets") or {}
        total = 0
        for path, written in self.journal.own():
            done = offsets.get(path.name, 0)
            if path != self.journal.path and not path.exists():
                continue  # a rotated-out segment the drainer finished and deleted
            total += max(0, written - (done if isinstance(done, int) else 0))
        return total + sum(len(x) for x in self._memory)

    # -- callers that wait --------------------------------------------------------------------------------
    def _consumed(self, own: list[tuple[Path, int]], others: list[Path]) -> bool:
        if self._memory:
            return False
        offsets = self._published().get("offsets") or {}
        for path, written in own:
            done = offsets.get(path.name, 0)
            if written and not (isinstance(done, int) and done >= written) and path.exists():
                return False
        return not any(p.exists() for p in others)

    def flush(self, timeout: float | None = 30.0) -> bool:
        """Wait until every event recorded before this call, and every dead process's journal present now, is in
        the ledger or dead-lettered (False on timeout: not lost, the events stay in the journal)."""
        own = self.journal.own()
        own_paths = {p for p, _ in own}
        others = [p for p in segment_paths(self.journal_dir) if p not in own_paths and not is_live(p)]
        if self._thread is None or not self._thread.is_alive():  # not started: one pass inline
            drainer = self._drainer or self._new_drainer()
            if drainer.acquire():
                with contextlib.suppress(Exception):
                    drainer.cycle(force=True)
                drainer.release()
            return self._consumed(own, others)
        request_pass(self.journal_dir)  # the drainer stores what it holds at its next poll, not at its next batch
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self._consumed(own, others):
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(0.01)
        return True

    def close(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout``) for the drainer to reach the database (a fresh one) and, while it is up, to
        consume this process's events; then stop, fsync and close the journal. What is not stored yet stays in the
        journal (replayed later)."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            deadline = time.monotonic() + timeout
            while not self._drainer_reported() and time.monotonic() < deadline and self._drainer_may_report():
                time.sleep(0.02)  # a drainer just started has not reached the database yet: wait for its word
            if self.db_available:
                self.flush(max(0.0, deadline - time.monotonic()))
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._retry_memory()
        closed = self.journal.close()
        if self._drainer is not None:  # embedded: a last pass, then free the folder's lock
            if self._drainer.acquire():
                with contextlib.suppress(Exception):
                    self._drainer.cycle(force=True)
            self._drainer.release()
        if closed is not None:
            path, written = closed
            done = self._published().get("offsets", {}).get(path.name, 0)
            if isinstance(done, int) and done >= written and not is_live(path):
                path.unlink(missing_ok=True)  # fully consumed: nothing left for the drainer
        if self._child is not None:
            with contextlib.suppress(Exception):
                self._child.poll()  # reap it if it exited; a running one stops once its writers are gone

    def _drainer_reported(self) -> bool:
        """Whether the folder's drainer published its state since this recorder started."""
        at = self._published().get("at")
        return isinstance(at, int | float) and at >= self._started_at

    def _drainer_may_report(self) -> bool:
        if self._drainer is not None:
            return True  # embedded: the housekeeping thread publishes
        alive = self._child is not None and self._child.poll() is None
        return alive or drainer_running(self.journal_dir)

    # -- housekeeping thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        tick = self.flush_interval_s if self.drain == "thread" else min(0.25, self.fsync_interval_s)
        while not self._stop.wait(tick):
            try:
                self._housekeep()
            except Exception:  # never let the thread die: the journal would stop being fsync'd
                log.exception("kvroute billing journal housekeeping failed; retrying")

    def _housekeep(self) -> None:
        now = time.monotonic()
        self._retry_memory()
        if now - self._last_sync >= self.fsync_interval_s:
            self.journal.sync()  # releases the GIL while the disk works
            self._last_sync = now
        self.journal.rotate_if_large()
        for path, _ in self.journal.own():
            if path != self.journal.path and not path.exists():
                self.journal.forget(path)
        if self._drainer is not None:
            if self._drainer.acquire():
                self._drainer.cycle()
        else:
            self._ensure_drainer()

    def _retry_memory(self) -> None:
        while self._memory:
            try:
                self.journal.append(self._memory[0])
            except OSError:
                return
            self._memory.popleft()

    def _ensure_drainer(self) -> None:
        """Start the folder's drainer process when none holds its lock (backing off while starts fail)."""
        if self._child is not None and self._child.poll() is None:
            self._spawn_backoff = 1.0
            return
        now = time.monotonic()
        if now < self._next_spawn or drainer_running(self.journal_dir):
            return
        assert isinstance(self.db, str)
        if self._child is not None and self._child.returncode not in (0, None):
            self._spawn_backoff = min(self._spawn_backoff * 2, 30.0)
            log.warning("kvroute billing: the journal drainer exited with %s; starting a new one",
                        self._child.returncode)
        self._next_spawn = now + self._spawn_backoff
        env = drain_env(self.db, self.journal_dir, self.dead_letter.path, batch_size=self.batch_size,
                        poll_interval_s=self.flush_interval_s, retry_interval_s=self.retry_interval_s,
                        idle_exit_s=self.drainer_idle_exit_s)
        try:
            self._child = subprocess.Popen(spawn_command(), env=env, stdin=subprocess.DEVNULL,
                                           stdout=subprocess.DEVNULL, close_fds=True)
        except OSError as exc:
            log.warning("kvroute billing: cannot start the journal drainer: %s", exc)
