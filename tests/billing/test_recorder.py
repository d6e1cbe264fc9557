"""UsageRecorder: idempotency, the journal (outages, kill -9 and SIGTERM), dead letters, concurrent writers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from billing_helpers import event, wait_for

from kvroute.billing.ledger import Ledger
from kvroute.billing.recorder import UsageRecorder
from kvroute.billing.spool import is_live, segment_paths

HERE = Path(__file__).parent
WORKER = HERE / "recorder_worker.py"
N_KILL = 10000


def _spawn(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": str(HERE)}
    return subprocess.Popen([sys.executable, str(WORKER), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)


def _count(url: str) -> int:
    import sqlite3
    with sqlite3.connect(url.removeprefix("sqlite:///"), timeout=30) as conn:
        return conn.execute("SELECT count(*) FROM usage_event").fetchone()[0]


def _ids(url: str) -> list[str]:
    from sqlalchemy import select

    from kvroute.billing.models import UsageEventRow
    led = Ledger.open(url)
    try:
        with led.engine.connect() as conn:
            return list(conn.execute(select(UsageEventRow.event_id)).scalars())
    finally:
        led.close()


@pytest.mark.slow
def test_record_batches_and_is_idempotent(db_url: str, tmp_path: Path) -> None:
    rec = UsageRecorder(db_url, tmp_path / "spool", batch_size=100, flush_interval_s=0.05).start()
    try:
        for i in range(1000):
            rec.record(event(i))
        assert rec.flush(30)
        for i in range(1000):  # callbacks fired twice
            rec.record(event(i))
        assert rec.flush(30)
    finally:
        rec.close()
    ids = _ids(db_url)
    assert len(ids) == len(set(ids)) == 1000
    assert rec.stats.inserted == 1000 and rec.stats.recorded == 2000 and rec.stats.dead_lettered == 0


def test_sqlite_unavailable_then_back(tmp_path: Path) -> None:
    blocker = tmp_path / "dbdir"
    blocker.write_text("a file where the database folder should be")
    url = f"sqlite:///{blocker / 'billing.db'}"
    rec = UsageRecorder(url, tmp_path / "spool", batch_size=50, flush_interval_s=0.05, retry_interval_s=0.1).start()
    try:
        for i in range(300):
            rec.record(event(i))
        assert not rec.flush(1)  # not stored, but journaled
        assert rec.pending_bytes > 0 and not rec.db_available
        blocker.unlink()
        blocker.mkdir()  # the database can be created now
        assert wait_for(lambda: rec.stats.inserted == 300, 20)
        for i in range(250, 400):  # overlaps the spooled ones
            rec.record(event(i))
        assert rec.flush(30)
    finally:
        rec.close()
    ids = _ids(url)
    assert len(ids) == len(set(ids)) == 400
    assert not list((tmp_path / "spool").glob("journal-*.jsonl"))  # drained journals are gone


class _Cuttable:
    """A TCP forwarder on 127.0.0.1 in front of PostgreSQL that the test can cut and restore."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.listener.listen(64)
        self.up = True
        self.conns: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        self.listener.settimeout(0.1)
        while not self._stop:
            try:
                client, _ = self.listener.accept()
            except (TimeoutError, OSError):
                continue
            if not self.up:
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self.conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def cut(self) -> None:
        self.up = False
        for s in self.conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self.conns.clear()

    def restore(self) -> None:
        self.up = True

    def close(self) -> None:
        self._stop = True
        self.cut()
        self.listener.close()


@pytest.mark.slow
def test_postgres_outage_spools_and_replays(pg_url: str, tmp_path: Path) -> None:
    from sqlalchemy.engine import make_url
    url = make_url(pg_url)
    proxy = _Cuttable((url.host or "127.0.0.1", url.port or 5432))
    proxied = url.set(host="127.0.0.1", port=proxy.port).render_as_string(hide_password=False)
    rec = UsageRecorder(proxied, tmp_path / "spool", batch_size=50, flush_interval_s=0.05,
                        retry_interval_s=0.2).start()
    try:
        for i in range(200):
            rec.record(event(i))
        assert rec.flush(30) and rec.stats.inserted == 200
        proxy.cut()
        for i in range(150, 500):
            rec.record(event(i))
        assert not rec.flush(2)
        assert rec.pending_bytes > 0
        proxy.restore()
        assert wait_for(lambda: rec.db_available and rec.pending_bytes == 0, 30)
        rec.record(event(500))
        assert rec.flush(30)
    finally:
        rec.close()
        proxy.close()
    ids = _ids(pg_url)
    assert len(ids) == len(set(ids)) == 501


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_every_recorded_event_survives_a_kill_without_any_flush(tmp_path: Path, sig: signal.Signals) -> None:
    """record() returned = in the journal: kill -9 / SIGTERM right after, with the database down, loses nothing."""
    blocker = tmp_path / "dbdir"
    blocker.write_text("not a folder")
    down_url = f"sqlite:///{blocker / 'billing.db'}"
    journal = tmp_path / "journal"
    proc = _spawn("record", down_url, str(journal), "0", "300", "300", "hang")
    try:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        assert line.startswith("recorded 300"), proc.stderr.read()  # type: ignore[union-attr]
        assert all(is_live(p) for p in segment_paths(journal)), "a live writer's journal looked dead"
    finally:
        proc.send_signal(sig)
        proc.wait(10)
    files = list(journal.glob("journal-*.jsonl"))
    assert len(files) == 1 and files[0].stat().st_mode & 0o777 == 0o600
    with files[0].open("a") as f:
        f.write('{"request_id": "torn", "app_')  # a write the crash cut short: never acknowledged
    blocker.unlink()
    blocker.mkdir()
    rec = UsageRecorder(down_url, journal, flush_interval_s=0.05).start()
    try:
        assert wait_for(lambda: rec.stats.replayed == 300, 30)
    finally:
        rec.close()
    ids = _ids(down_url)
    assert len(ids) == len(set(ids)) == 300
    assert not list(journal.glob("journal-*.jsonl")) and rec.stats.dead_lettered == 0


@pytest.mark.slow
def test_kill_during_ingest_loses_and_duplicates_nothing(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    src = tmp_path / "events.jsonl"
    src.write_text("".join(event(i).to_line() + "\n" for i in range(N_KILL)))
    Ledger.open(url).close()  # migrate first so the kill lands in inserts
    proc = _spawn("ingest", url, str(src), "500")
    try:
        assert wait_for(lambda: _count(url) >= 1000, 60, 0.005)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    partial = _ids(url)
    assert len(partial) == len(set(partial)) and len(partial) % 500 == 0  # whole batches only
    assert 0 < len(partial) < N_KILL, "the kill should land mid-import"
    proc = _spawn("ingest", url, str(src), "500")
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert out.strip() == f"done {N_KILL - len(partial)}"
    ids = _ids(url)
    assert len(ids) == len(set(ids)) == N_KILL


@pytest.mark.slow
def test_kill_during_recording_keeps_every_recorded_event(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    Ledger.open(url).close()
    journal = tmp_path / "journal"
    proc = _spawn("record", url, str(journal), "0", "100000", "500")
    recorded = 0
    try:
        while recorded < 3000:
            line = proc.stdout.readline()  # type: ignore[union-attr]
            assert line, proc.stderr.read()  # type: ignore[union-attr]
            recorded = int(line.split()[1])
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    dead = segment_paths(journal)  # the killed writer's segments (the next recorder opens one of its own)
    assert dead and not any(is_live(p) for p in dead)
    rec = UsageRecorder(url, journal, flush_interval_s=0.05).start()  # the next start replays the dead journal
    try:
        assert wait_for(lambda: not any(p.exists() for p in dead), 30), "the dead journal was not replayed"
        assert rec.flush(30)
    finally:
        rec.close()
    ids = _ids(url)
    expected = {event(i).event_id for i in range(100000)}
    assert len(ids) == len(set(ids)) >= recorded
    assert set(ids) <= expected and {event(i).event_id for i in range(recorded)} <= set(ids)


def _unchecked(e, **fields):
    """``e`` with fields set past ``UsageEvent``'s own checks (a row only the database can refuse)."""
    for name, value in fields.items():
        object.__setattr__(e, name, value)
    return e


def test_a_bad_event_is_dead_lettered_and_never_blocks_the_others(db_url: str, tmp_path: Path) -> None:
    from kvroute.billing.deadletter import DeadLetter
    data = tmp_path / "data"
    rec = UsageRecorder(db_url, data / "journal", batch_size=50, flush_interval_s=0.05).start()
    try:
        for i in range(100):
            rec.record(event(i))
        # events FIELD_LIMITS would refuse today (an older writer's, or one built around the checks): no column
        # holds these, on SQLite or PostgreSQL
        rec.record(_unchecked(event(100), attempt=2**70))
        rec.record(_unchecked(event(101), duration_ms=2**70))
        for i in range(102, 200):
            rec.record(event(i))
        assert rec.flush(30)
        for i in range(200, 210):  # later flushes are not blocked either
            rec.record(event(i))
        assert rec.flush(30)
    finally:
        rec.close()
    assert rec.stats.dead_lettered == 2 and rec.stats.inserted == 208
    dead = DeadLetter(data)
    assert dead.path.parent == data and dead.path.stat().st_mode & 0o777 == 0o600
    entries = dead.entries()
    # the drainer reads them back from the journal, where the event checks refuse them before the database
    assert len(entries) == 2 and all("invalid event" in e.error or "refused by the database" in e.error
                                     for e in entries)
    assert {e.error.split(":")[1].strip() for e in entries} <= {"attempt", "duration_ms"}
    # an operator fixes the lines, then retries: both go in, the file empties
    lines = [json.loads(e.line) for e in entries]
    for d in lines:
        d["attempt"] = 3 if d["attempt"] > 1000 else d["attempt"]
        d["duration_ms"] = 5 if d.get("duration_ms", 0) > 1000 else d.get("duration_ms")
        d.pop("event_id")
    dead.path.write_text("".join(json.dumps({"at": e.at, "source": e.source, "error": e.error,
                                             "line": json.dumps(d)}) + "\n" for e, d in zip(entries, lines,
                                                                                            strict=True)))
    led = Ledger.open(db_url)
    try:
        result = dead.retry(led.insert_events)
    finally:
        led.close()
    assert (result.inserted, result.remaining) == (2, 0) and dead.entries() == []
    assert len(_ids(db_url)) == 210


def test_an_unreadable_journal_line_is_dead_lettered(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    journal = tmp_path / "journal"
    journal.mkdir()
    (journal / "journal-1-dead.jsonl").write_text(event(1).to_line() + "\n" + '{"request_id": ""}\n'
                                                  + event(2).to_line() + "\n")
    rec = UsageRecorder(url, journal, flush_interval_s=0.05).start()
    try:
        assert wait_for(lambda: rec.stats.replayed == 2, 20)
    finally:
        rec.close()
    assert rec.stats.dead_lettered == 1 and len(_ids(url)) == 2
    from kvroute.billing.deadletter import DeadLetter
    (entry,) = DeadLetter(tmp_path).entries()
    assert "invalid event" in entry.error and entry.source.startswith("replay:")


@pytest.mark.slow
def test_two_processes_write_at_once(db_url: str, tmp_path: Path) -> None:
    """Two workers start on a fresh database at once (both run the migrations) and write overlapping events."""
    procs = [_spawn("record", db_url, str(tmp_path / "journal"), str(start), "3000", "1000")
             for start in (0, 1500)]  # overlapping ranges: both write 1500..2999
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert "stored True" in out
    ids = _ids(db_url)
    assert len(ids) == len(set(ids)) == 4500
    assert not list((tmp_path / "journal").glob("journal-*.jsonl"))  # drained journals are removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with contextlib.suppress(ChildProcessError):  # our own child: reap it once it exited
        if os.waitpid(pid, os.WNOHANG)[0] == pid:
            return False
    return True


@pytest.mark.slow
def test_one_drainer_process_per_folder_taken_over_after_kill_9(tmp_path: Path) -> None:
    """Two recorders (two proxy workers) share one drainer process; kill -9 of it: a new one takes over."""
    from kvroute.billing.drain import drainer_running, read_stats
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    journal = tmp_path / "journal"
    recs = [UsageRecorder(url, journal, batch_size=50, flush_interval_s=0.05).start() for _ in range(2)]
    try:
        for i in range(400):
            recs[i % 2].record(event(i))
        assert all(r.flush(30) for r in recs)
        first = read_stats(journal)["pid"]
        assert first != os.getpid() and drainer_running(journal) and _alive(first)
        os.kill(first, signal.SIGKILL)
        assert wait_for(lambda: not _alive(first), 10)
        for i in range(400, 800):  # recorded while no drainer runs: journaled, stored once a new one started
            recs[i % 2].record(event(i))
        assert all(r.flush(30) for r in recs)
        second = read_stats(journal)["pid"]
        assert second not in (first, os.getpid())
    finally:
        for r in recs:
            r.close()
    ids = _ids(url)
    assert len(ids) == len(set(ids)) == 800
    assert wait_for(lambda: not _alive(second), 15), "the drainer outlived its writers"
    assert not list(journal.glob("journal-*.jsonl"))


def test_rotated_segments_are_drained_and_removed(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    journal = tmp_path / "journal"
    rec = UsageRecorder(url, journal, batch_size=20, flush_interval_s=0.05, rotate_bytes=4000).start()
    seen: set[str] = set()
    try:
        for i in range(600):
            rec.record(event(i))
            if i % 50 == 0:
                seen |= {p.name for p in journal.glob("journal-*.jsonl")}
                rec.journal.rotate_if_large()
        assert rec.flush(30)
        assert wait_for(lambda: len(list(journal.glob("journal-*.jsonl"))) == 1, 10)  # only the open one
    finally:
        rec.close()
    assert len(seen) > 3
    ids = _ids(url)
    assert len(ids) == len(set(ids)) == 600 and rec.pending_bytes == 0


def test_embedded_thread_mode_is_the_same_drainer(db_url: str, tmp_path: Path) -> None:
    from kvroute.billing.drain import read_stats
    rec = UsageRecorder(db_url, tmp_path / "journal", batch_size=50, flush_interval_s=0.05, drain="thread").start()
    try:
        for i in range(300):
            rec.record(event(i))
        assert rec.flush(30)
        assert read_stats(tmp_path / "journal")["pid"] == os.getpid()
    finally:
        rec.close()
    assert rec.stats.inserted == 300 and len(_ids(db_url)) == 300


def test_client_strings_over_column_limits_are_stored_alike(db_url: str, tmp_path: Path) -> None:
    """A 201-character ``user`` (and other long client strings) makes a valid row on SQLite and PostgreSQL."""
    from kvroute.billing.litellm_events import event_from_callback
    kwargs = {"user": "u" * 201, "model": "m" * 300, "litellm_params": {"metadata": {
        "user_api_key_alias": "k" * 250, "user_api_key_hash": "h" * 129}}}
    response = {"usage": {"prompt_tokens": 5, "completion_tokens": 2}, "choices": [{"finish_reason": "stop"}]}
    e = event_from_callback(kwargs, response, request_id="r" * 230, attempt=2**40, backend_id="b" * 260)
    assert e is not None
    rec = UsageRecorder(db_url, tmp_path / "journal", flush_interval_s=0.05).start()
    try:
        rec.record(e)
        assert rec.flush(30)
    finally:
        rec.close()
    assert rec.stats.inserted == 1 and rec.stats.dead_lettered == 0
    assert _ids(db_url) == [e.event_id]


def test_the_journal_line_reads_back_as_the_same_event() -> None:
    """record() writes msgspec's encoding of the event; replay maps it to the documented form: the event reads back
    exactly as its documented line does (where "" and absent mean the same)."""
    from decimal import Decimal

    from kvroute.billing.events import event_from_json
    from kvroute.billing.spool import as_documented, encode_event
    samples = [event(1), event(2, provider_cost=Decimal("0.0012345678"), end_user="", http_status=502,
                                raw_usage={"prompt_tokens": 9, "completion_tokens": 2, "cost": 0.5,
                                           "prompt_tokens_details": {"cached_tokens": None}}),
               event(3, end_user="é", attempt_key="outcome", raw_usage={"prompt_tokens": 1, "completion_tokens": 1,
                                                                         "note": "\ud800"}),  # msgspec refuses it
               event(4, session_id="sess-1", tags=("team:a", "batch")), event(5, session_id="")]
    for e in samples:
        line = encode_event(e)
        assert line.endswith(b"\n") and line.count(b"\n") == 1
        back = event_from_json(as_documented(json.loads(line)), archive=True)
        assert back == event_from_json(json.loads(e.to_bytes()), archive=True), e  # as the documented line reads back
        assert back.event_id == e.event_id and back.tokens == e.tokens and back.provider_cost == e.provider_cost
        assert (back.session_id, back.tags) == (e.session_id, e.tags)
    assert samples[3].tags == ("batch", "team:a") and samples[4].session_id is None
    assert b'"tokens"' in encode_event(samples[0]) and b'"usage"' in encode_event(samples[2])


def test_close_right_after_start_stores_everything(tmp_path: Path) -> None:
    """close() without a flush, before the new drainer process even reached the database: nothing is left over."""
    url = f"sqlite:///{tmp_path / 'billing.db'}"
    rec = UsageRecorder(url, tmp_path / "journal").start()
    for i in range(20):
        rec.record(event(i))
    rec.close()
    assert len(_ids(url)) == 20 and not list((tmp_path / "journal").glob("journal-*.jsonl"))


def test_a_live_segment_waits_for_a_batch_a_deadline_or_a_pass(tmp_path: Path) -> None:
    """A writer's few new lines wait for company (one database pass per batch, not per poll) until a batch's
    bytes are there, the oldest has waited ``batch_wait_s``, or a reader asks for a pass; none is lost meanwhile."""
    from kvroute.billing.drain import Drainer, request_pass
    from kvroute.billing.spool import Journal, encode_event

    url = f"sqlite:///{tmp_path / 'billing.db'}"
    journal = Journal(tmp_path / "journal")
    line = encode_event(event(0))
    drainer = Drainer(url, tmp_path / "journal", batch_wait_s=3600, batch_bytes=10 * len(line))
    assert drainer.acquire()
    try:
        for i in range(3):
            journal.append(encode_event(event(i)))
        drainer.cycle()
        assert drainer.stats.inserted == 0 and drainer.stats.lines == 0  # 3 lines: no batch yet, not due
        request_pass(tmp_path / "journal")  # what flush() does
        drainer.cycle()
        assert drainer.stats.inserted == 3
        drainer.cycle()  # the pass was taken once
        for i in range(3, 13):  # a batch's worth of bytes
            journal.append(encode_event(event(i)))
        drainer.cycle()
        assert drainer.stats.inserted == 13
        journal.append(encode_event(event(13)))
        drainer.batch_wait_s = 0.0  # the oldest line has waited long enough
        drainer.cycle()
        drainer.cycle()
        assert drainer.stats.inserted == 14
    finally:
        drainer.release()
        journal.close()
    assert len(_ids(url)) == 14
