"""Billing benchmark: batched ingest into SQLite (events/s) and ``UsageRecorder.record()`` latency (p50/p99).

Baselines measured in the same run: a raw ``sqlite3.executemany`` of the same rows (ingest) and a bare
``deque.append`` (record). Prints JSON.  usage: python bench/billing_ingest.py [--events N] [--batch B]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import tempfile
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path

from kvroute.billing.events import UsageEvent
from kvroute.billing.ledger import Ledger
from kvroute.billing.price_file import parse_price_data
from kvroute.billing.price_store import store_prices
from kvroute.billing.recorder import UsageRecorder
from kvroute.billing.usage import TokenBuckets

PRICES = {"backends": [{"id": f"b{i}", "provider": "p", "route_kind": "marketplace",
                        "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "3", "output_per_mtok": "15",
                                   "cache_read_per_mtok": "0.3"}]} for i in range(4)],
          "price_books": [{"version": 1, "effective_from": "2026-01-01",
                           "rules": [{"name": "all", "markup_pct": "0.2",
                                      "surcharge_per_mtok": {"output": "1"}, "fee_per_request": "0.0001"}]}]}


def make_events(n: int, tag: str) -> list[UsageEvent]:
    t0 = datetime(2026, 10, 1, tzinfo=UTC)
    return [UsageEvent(request_id=f"{tag}-{i}", app_id=f"app{i % 20}", occurred_at=t0 + timedelta(seconds=i),
                       served_model=f"m{i % 5}", provider="p", backend_id=f"b{i % 4}",
                       tokens=TokenBuckets(100 + i % 900, i % 3000, 0, 0, 50 + i % 500, 0),
                       provider_cost=Decimal("0.0001") * (i % 7) if i % 3 == 0 else None) for i in range(n)]


def bench_ingest(n: int, batch: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger.open(str(Path(d) / "bench.db"))
        store_prices(ledger, parse_price_data(PRICES))
        events = make_events(n, "ing")
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(0, n, batch):
            ledger.insert_events(events[i:i + batch])
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        start = time.perf_counter()
        for i in range(0, n, batch):  # everything again: all ignored as duplicates
            ledger.insert_events(events[i:i + batch])
        dup_elapsed = time.perf_counter() - start
        assert ledger.count_events() == n
        ledger.close()
        # baseline: the same number of 50-column rows through sqlite3.executemany, no rating, no ORM
        conn = sqlite3.connect(str(Path(d) / "raw.db"))
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"CREATE TABLE t (id TEXT PRIMARY KEY, {', '.join(f'c{i} INTEGER' for i in range(49))})")
        rows = [(e.event_id, *range(49)) for e in events]
        start, cpu_start = time.perf_counter(), time.process_time()
        for i in range(0, n, batch):
            with conn:
                conn.executemany(f"INSERT OR IGNORE INTO t VALUES ({', '.join('?' * 50)})", rows[i:i + batch])
        raw, raw_cpu = time.perf_counter() - start, time.process_time() - cpu_start
        conn.close()
    # On a shared machine wall time includes waiting for a core; CPU time is what the ingest itself costs.
    return {"events": n, "batch": batch, "events_per_s": round(n / elapsed), "events_per_cpu_s": round(n / cpu),
            "duplicate_events_per_s": round(n / dup_elapsed), "baseline_raw_sqlite_rows_per_s": round(n / raw),
            "baseline_raw_sqlite_rows_per_cpu_s": round(n / raw_cpu),
            "ratio_vs_raw_sqlite_cpu": round(cpu / raw_cpu, 2), "load_average_1m": os.getloadavg()[0]}


def bench_record(n: int) -> dict[str, float]:
    """``record()`` against its unavoidable part (serialise the event, one ``write(2)`` of the line), interleaved
    event by event so both see the same machine noise; the recorder's writer thread runs meanwhile."""
    with tempfile.TemporaryDirectory() as d:
        rec = UsageRecorder(str(Path(d) / "rec.db"), Path(d) / "journal", batch_size=500, flush_interval_s=0.05)
        rec.start()
        events = make_events(n, "rec")
        fd = os.open(Path(d) / "raw.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        samples, raw, base = [], [], []
        baseline: deque[object] = deque()
        clock = time.perf_counter_ns
        for i, e in enumerate(events):
            t0 = clock()
            rec.record(e)
            t1 = clock()
            os.write(fd, (e.to_line() + "\n").encode())
            t2 = clock()
            baseline.append(e)
            t3 = clock()
            samples.append(t1 - t0)
            raw.append(t2 - t1)
            base.append(t3 - t2)
            if i % 1000 == 999:
                time.sleep(0.002)  # requests arrive over time; the writer thread runs meanwhile
        os.close(fd)
        rec.flush(120)
        rec.close()
    q, qr, qb = (statistics.quantiles(x, n=100) for x in (samples, raw, base))
    return {"events": n, "record_p50_us": round(q[49] / 1000, 3), "record_p99_us": round(q[98] / 1000, 3),
            "record_max_us": round(max(samples) / 1000, 1), "baseline_deque_append_p99_us": round(qb[98] / 1000, 3),
            "baseline_serialise_write_p50_us": round(qr[49] / 1000, 3),
            "baseline_serialise_write_p99_us": round(qr[98] / 1000, 3),
            "record_p99_over_serialise_write_p99": round(q[98] / qr[98], 2), "inserted": rec.stats.inserted}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=50000)
    parser.add_argument("--batch", type=int, default=1000)
    args = parser.parse_args()
    result = {"ingest_sqlite": bench_ingest(args.events, args.batch), "record": bench_record(args.events),
              "targets": {"ingest_events_per_s": 20000, "record_p99_us": 50}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
