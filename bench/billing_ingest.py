"""Billing benchmark: ``kvroute billing ingest`` events/s (JSONL file → rated rows in SQLite), this tree against a
baseline git revision in the same run, interleaved rounds (ABBA), medians; ``--record`` adds the
``UsageRecorder.record()`` latency (p50/p99) against a bare ``deque.append``.

Each round runs the ingest of the same file into a fresh database in a fresh process, once per tree. The
baseline tree is the given revision of ``billing/`` and ``policies/`` (``git archive``), imported as
``kvroute.*`` in place of the editable install. Prints JSON.

usage: python bench/billing_ingest.py [--events N] [--batch B] [--rounds R] [--baseline REV] [--record]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from datetime import UTC, datetime, timedelta
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRICES = {"backends": [{"id": f"b{i}", "provider": "p", "route_kind": "marketplace",
                        "rates": [{"effective_from": "2026-01-01", "input_per_mtok": "3", "output_per_mtok": "15",
                                   "cache_read_per_mtok": "0.3"}]} for i in range(4)],
          "price_books": [{"version": 1, "effective_from": "2026-01-01",
                           "rules": [{"name": "all", "markup_pct": "0.2",
                                      "surcharge_per_mtok": {"output": "1"}, "fee_per_request": "0.0001"}]}]}
#: Strips the editable finder so that ``sys.path[0]`` provides ``kvroute`` (the baseline tree).
_BOOT = ("import sys; sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f) "
         "and 'editable' not in getattr(f, '__module__', '')]; sys.path.insert(0, {pkg!r}); "
         "sys.argv = {argv!r}; import runpy; runpy.run_path({script!r}, run_name='__main__')")


def write_events(path: Path, n: int) -> None:
    """``n`` JSONL events of the documented schema, dated within the last day (inside every late-event window).

    Every third event carries a provider cost (decimal string: both trees read it), every fifth a raw usage."""
    t0 = datetime.now(UTC) - timedelta(days=1)
    with path.open("w") as f:
        for i in range(n):
            e = {"request_id": f"ing-{i}", "app_id": f"app{i % 20}",
                 "occurred_at": (t0 + timedelta(seconds=i % 80000)).isoformat().replace("+00:00", "Z"),
                 "served_model": f"m{i % 5}", "provider": "p", "backend_id": f"b{i % 4}", "route_kind": "marketplace",
                 "usage": {"input_uncached": 100 + i % 900, "cache_read": i % 3000, "output": 50 + i % 500},
                 "end_user": f"user-{i % 97}", "duration_ms": 1000 + i % 5000}
            if i % 3 == 0:
                e["provider_cost"] = str(i % 7 / 10000)
            if i % 5 == 0:
                e["raw_usage"] = {"prompt_tokens": 100 + i % 900 + i % 3000, "completion_tokens": 50 + i % 500,
                                  "prompt_tokens_details": {"cached_tokens": i % 3000}}
            f.write(json.dumps(e) + "\n")


def worker(path: str, batch: int) -> None:
    """One timed ingest into a fresh SQLite database (run in its own process by ``main``)."""
    from kvroute.billing.ingest import ingest_file
    from kvroute.billing.ledger import Ledger
    from kvroute.billing.price_file import parse_price_data
    from kvroute.billing.price_store import store_prices
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger.open(str(Path(d) / "bench.db"))
        store_prices(ledger, parse_price_data(PRICES))
        start, cpu_start = time.perf_counter(), time.process_time()
        result = ingest_file(ledger, path, batch_size=batch)
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        stored = ledger.count_events()
        ledger.close()
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "inserted": result.inserted, "stored": stored,
                      "errors": len(result.errors)}))


def baseline_tree(rev: str, into: Path) -> Path:
    """Extract ``billing/`` and ``policies/`` of ``rev`` and lay them out as an importable ``kvroute``."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "billing", "policies"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    pkg = into / "pkg" / "kvroute"
    pkg.mkdir(parents=True)
    for name in ("billing", "policies"):
        (pkg / name).symlink_to(src / name)
    return into / "pkg"


def run_once(pkg: Path | None, path: Path, batch: int) -> dict[str, float]:
    argv = [__file__, "--worker", str(path), "--batch", str(batch)]
    if pkg is None:
        cmd = [sys.executable, *argv]
    else:
        cmd = [sys.executable, "-c", _BOOT.format(pkg=str(pkg), argv=argv, script=__file__)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench_ingest(n: int, batch: int, rounds: int, baseline: str) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "events.jsonl"
        write_events(path, n)
        pkg = baseline_tree(baseline, Path(d) / "baseline")
        runs: dict[str, list[dict[str, float]]] = {"current": [], "baseline": []}
        loads = []
        for r in range(rounds):  # ABBA: each tree goes first in half of the rounds
            order = ("current", "baseline") if r % 2 == 0 else ("baseline", "current")
            for name in order:
                res = run_once(None if name == "current" else pkg, path, batch)
                assert res["stored"] == n and res["errors"] == 0, (name, res)
                runs[name].append(res)
            loads.append(os.getloadavg()[0])

    def medians(items: list[dict[str, float]]) -> dict[str, float]:
        return {"events_per_s": round(statistics.median(n / x["wall_s"] for x in items)),
                "events_per_cpu_s": round(statistics.median(n / x["cpu_s"] for x in items)),
                "wall_s_all_rounds": [round(x["wall_s"], 3) for x in items]}

    cur, base = medians(runs["current"]), medians(runs["baseline"])
    return {"events": n, "batch": batch, "rounds": rounds, "baseline_rev": baseline, "current": cur,
            "baseline": base, "ratio_current_vs_baseline_wall": round(cur["events_per_s"] / base["events_per_s"], 3),
            "ratio_current_vs_baseline_cpu": round(cur["events_per_cpu_s"] / base["events_per_cpu_s"], 3),
            "load_average_1m_per_round": loads, "cpus": os.cpu_count()}


def bench_record(n: int) -> dict[str, float]:
    """``record()`` against its unavoidable part (serialise the event, one ``write(2)`` of the line), interleaved
    event by event so both see the same machine noise; the recorder's writer thread runs meanwhile."""
    from kvroute.billing.events import UsageEvent
    from kvroute.billing.recorder import UsageRecorder
    from kvroute.billing.usage import TokenBuckets
    start = datetime(2026, 10, 1, tzinfo=UTC)
    events = [UsageEvent(request_id=f"rec-{i}", app_id=f"app{i % 20}", occurred_at=start + timedelta(seconds=i),
                         served_model=f"m{i % 5}", provider="p", backend_id=f"b{i % 4}",
                         tokens=TokenBuckets(100 + i % 900, i % 3000, 0, 0, 50 + i % 500, 0)) for i in range(n)]
    with tempfile.TemporaryDirectory() as d:
        rec = UsageRecorder(str(Path(d) / "rec.db"), Path(d) / "journal", batch_size=500, flush_interval_s=0.05)
        rec.start()
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
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--baseline", default="e4f2a42", help="git revision to compare with (default: the tree "
                                                              "before the issue 9 ingest work)")
    parser.add_argument("--record", action="store_true", help="also measure UsageRecorder.record() latency")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.batch)
        return
    result: dict[str, object] = {"ingest_sqlite": bench_ingest(args.events, args.batch, args.rounds, args.baseline)}
    if args.record:
        result["record"] = bench_record(args.events)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
