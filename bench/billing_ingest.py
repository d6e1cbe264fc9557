"""Billing benchmark: ``kvroute billing ingest`` events/s (JSONL file → rated rows in SQLite), this tree against a
baseline git revision in the same run, interleaved rounds (ABBA), medians; ``--record`` adds the
``UsageRecorder.record()`` latency (p50/p99/max) with the drainer out of process, in a thread, and the baseline
tree's recorder, each against its floor (serialise + one ``write(2)``), while the drainer inserts.

Each round runs the ingest of the same file into a fresh database in a fresh process, once per tree. The
baseline tree is the given revision of ``billing/`` and ``policies/`` (``git archive``), imported as
``kvroute.*`` in place of the editable install. Prints JSON.

usage: python bench/billing_ingest.py [--events N] [--batch B] [--rounds R] [--baseline REV] [--record]
                                      [--record-only] [--record-events N] [--record-rounds R] [--record-baseline REV]
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


RECORD_VARIANTS = ("process", "thread", "baseline")


def record_worker(variant: str, n: int, seed: int) -> None:
    """One ``record()`` latency run in this process (started by ``bench_record``), printed as JSON.

    ``variant``: ``process`` (this tree, drainer process), ``thread`` (this tree, embedded drainer thread: the old
    in-process mode) or ``baseline`` (the baseline tree's recorder, imported in place of this one). Two cases, each
    timed event by event against its floor (serialise the event as that tree's ``record()`` does + one
    ``write(2)`` of the line to a plain file,
    interleaved so both see the same noise, which one goes first alternating) while the drainer inserts:
    ``paced_busy`` (arrivals 0.5-2 ms apart, i.e. 500-2000 req/s, the process busy in between as a proxy serving
    that rate is), ``paced_idle`` (the same gaps slept: each event starts cold) and ``burst`` (back to back).
    """
    import inspect
    import random

    from kvroute.billing.events import UsageEvent
    from kvroute.billing.recorder import UsageRecorder
    from kvroute.billing.usage import TokenBuckets
    try:
        from kvroute.billing.spool import encode_event  # this tree: what record() serialises
    except ImportError:  # the baseline tree serialised the documented form

        def encode_event(e: UsageEvent) -> bytes:
            return e.to_bytes() + b"\n"
    rng = random.Random(seed)
    start = datetime(2026, 10, 1, tzinfo=UTC)
    events = [UsageEvent(request_id=f"rec-{seed}-{i}", app_id=f"app{i % 20}",
                         occurred_at=start + timedelta(seconds=i), served_model=f"m{i % 5}", provider="p",
                         backend_id=f"b{i % 4}", tokens=TokenBuckets(100 + i % 900, i % 3000, 0, 0, 50 + i % 500, 0))
              for i in range(3 * n + 1)]
    kwargs: dict[str, object] = {"batch_size": 500, "flush_interval_s": 0.05}
    if "drain" in inspect.signature(UsageRecorder).parameters:
        kwargs["drain"] = "thread" if variant == "thread" else "process"
    out: dict[str, object] = {"variant": variant}
    with tempfile.TemporaryDirectory() as d:
        rec = UsageRecorder(str(Path(d) / "rec.db"), Path(d) / "journal", **kwargs)  # type: ignore[arg-type]
        rec.start()
        rec.record(events[0])
        rec.flush(60)  # the database is migrated and the drainer runs before timing starts
        fd = os.open(Path(d) / "raw.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        clock = time.perf_counter_ns
        for case, batch in (("paced_busy", events[1:n + 1]), ("paced_idle", events[n + 1:2 * n + 1]),
                            ("burst", events[2 * n + 1:])):
            next_at = clock()
            samples, floor = [], []
            for k, e in enumerate(batch):  # which goes first alternates: after a sleep the first one runs cold
                if k % 2:
                    t0 = clock()
                    rec.record(e)
                    t1 = clock()
                    os.write(fd, encode_event(e))
                    t2 = clock()
                    samples.append(t1 - t0)
                    floor.append(t2 - t1)
                else:
                    t0 = clock()
                    os.write(fd, encode_event(e))
                    t1 = clock()
                    rec.record(e)
                    t2 = clock()
                    floor.append(t1 - t0)
                    samples.append(t2 - t1)
                gap = rng.uniform(0.0005, 0.002)
                if case == "paced_idle":
                    time.sleep(gap)
                elif case == "paced_busy":  # the process works between requests (as a proxy at 500-2000 req/s)
                    next_at += int(gap * 1e9)
                    while clock() < next_at:
                        pass
            q, qf = statistics.quantiles(samples, n=100), statistics.quantiles(floor, n=100)
            out[case] = {"p50_us": q[49] / 1000, "p99_us": q[98] / 1000, "max_us": max(samples) / 1000,
                         "floor_p50_us": qf[49] / 1000, "floor_p99_us": qf[98] / 1000,
                         "floor_max_us": max(floor) / 1000}
        os.close(fd)
        out["stored"] = rec.flush(120)
        rec.close()
        out["inserted"] = rec.stats.inserted
    print(json.dumps(out))


def bench_record(n: int, rounds: int, baseline: str) -> dict[str, object]:
    """``record()`` p50/p99/max per variant (see ``record_worker``), each round a fresh process per variant,
    variants rotated between rounds; medians over rounds."""
    runs: dict[str, list[dict]] = {v: [] for v in RECORD_VARIANTS}
    with tempfile.TemporaryDirectory() as d:
        pkg = baseline_tree(baseline, Path(d) / "baseline")
        loads = []
        for r in range(rounds):
            order = RECORD_VARIANTS[r % 3:] + RECORD_VARIANTS[:r % 3]
            for variant in order:
                argv = [__file__, "--record-worker", variant, "--events", str(n), "--seed", str(r)]
                cmd = ([sys.executable, *argv] if variant != "baseline" else
                       [sys.executable, "-c", _BOOT.format(pkg=str(pkg), argv=argv, script=__file__)])
                res = subprocess.run(cmd, capture_output=True, text=True, timeout=1800,
                                     env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
                if res.returncode != 0:
                    raise RuntimeError(f"{variant} round {r} failed: {res.stderr[-3000:]}")
                one = json.loads(res.stdout.strip().splitlines()[-1])
                assert one["stored"] and one["inserted"] == 3 * n + 1, one
                runs[variant].append(one)
            loads.append(os.getloadavg()[0])
    out: dict[str, object] = {"events_per_case": n, "rounds": rounds, "baseline_rev": baseline,
                              "load_average_1m_per_round": loads, "cpus": os.cpu_count()}
    for case in ("paced_busy", "paced_idle", "burst"):
        table: dict[str, dict[str, float]] = {}
        for variant, items in runs.items():
            table[variant] = {k: round(statistics.median(x[case][k] for x in items), 2) for k in items[0][case]}
            table[variant]["p99_all_rounds"] = [round(x[case]["p99_us"], 1) for x in items]  # type: ignore[assignment]
        table["ratio_p99_process_vs_floor"] = round(table["process"]["p99_us"] / table["process"]["floor_p99_us"], 2)
        table["ratio_p99_process_vs_thread"] = round(table["process"]["p99_us"] / table["thread"]["p99_us"], 2)
        table["ratio_p99_process_vs_baseline"] = round(table["process"]["p99_us"] / table["baseline"]["p99_us"], 2)
        out[case] = table
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--batch", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--baseline", default="e4f2a42", help="git revision to compare with (default: the tree "
                                                              "before the batched ingest work)")
    parser.add_argument("--record", action="store_true", help="also measure UsageRecorder.record() latency")
    parser.add_argument("--record-only", action="store_true", help="only the record() latency")
    parser.add_argument("--record-events", type=int, default=3000, help="events per record() case and round")
    parser.add_argument("--record-rounds", type=int, default=3)
    parser.add_argument("--record-baseline", default="e9da8e7", help="tree whose recorder is the 'baseline' "
                                                                     "variant (default: the in-process writer)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--record-worker", choices=RECORD_VARIANTS, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.batch)
        return
    if args.record_worker:
        record_worker(args.record_worker, args.events, args.seed)
        return
    result: dict[str, object] = {}
    if not args.record_only:
        result["ingest_sqlite"] = bench_ingest(args.events, args.batch, args.rounds, args.baseline)
    if args.record or args.record_only:
        result["record"] = bench_record(args.record_events, args.record_rounds, args.record_baseline)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
