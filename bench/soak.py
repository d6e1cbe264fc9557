"""Memory soak: a LiteLLM proxy with kvroute and the same proxy without it under the same mixed load; is RSS flat?

Each arm has its own fake fleet (``--replicas`` self-hosted replicas, group ``llama``, falling back to one hosted-style
fake, group ``hosted``) and its own ``litellm`` proxy; both arms run at once and get the same request mix at the same
rate (``--rate`` requests/s each): streamed and whole answers, many distinct prompts beside a few shared system
prompts, a new session id every few requests, client-cancelled streams (closed after a few chunks), and faults the
fleet injects on a timer (500s, 429s with ``Retry-After``, streams cut upstream). Every ``--sample-s`` seconds the
resident memory (VmRSS) of each proxy's process tree is read from ``/proc``.

Reports per arm the RSS at the end of warm-up (``--warmup-minutes``), at the end, and the least-squares slope after
warm-up in MB per 10 minutes. Verdict ``flat`` when kvroute's slope exceeds the plain proxy's by at most
``TOLERANCE_MB_PER_10MIN``: LiteLLM's own growth is the baseline, and 2 MB/10 min is under 1 KB per request at
the default rate (2,400 requests) -- less than one kept per-request record, above the allocator's jitter.
``--trace`` adds ``bench/soak_trace.py``'s callback to each proxy: the sizes of kvroute's containers (and with
``SOAK_TRACEMALLOC=1`` tracemalloc's top growth), kept in the result under ``trace``. Usage::

    LITELLM_LOCAL_MODEL_COST_MAP=True flock /tmp/kvroute-cpu.lock .venv/bin/python bench/soak.py --minutes 30
        [--rate 4] [--warmup-minutes 2] [--sample-s 5] [--no-plain] [--trace] [--json] [--save]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx

from kvroute.plugin.dev.child_processes import tree_rss_by_process
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
TOLERANCE_MB_PER_10MIN = 2.0
LOG_TAIL_CHARS = 8000
SYSTEMS = [f"System prompt {k}: you are assistant {k}; " + "follow the shared house rules carefully. " * 40
           for k in range(8)]
FAULTS = ({"mode": "500", "count": 2}, {"mode": "429", "count": 2, "retry_after": 1}, {"mode": "cut", "count": 1,
                                                                                       "cut_after_chunks": 2})
REPLICA = ReplicaOptions(capacity_tokens=32768, prefill_tokens_per_s=200000, decode_ms=2.0, slots=16)
HOSTED_PRICES = {"input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6}


@dataclass
class Arm:
    """One proxy under load: its fleet's api bases, what its requests did, and its RSS samples."""

    name: str
    proxy: ProxyProcess
    bases: list[str]
    outcomes: Counter = field(default_factory=Counter)
    served: Counter = field(default_factory=Counter)  # answers by the deployment that gave them (x-litellm-model-id)
    samples: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MB)
    processes: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (seconds, {process: MB})
    exited: tuple[float, int] | None = None  # (seconds since start, exit code) once the proxy has died


def slope_mb_per_10min(samples: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, MB) in MB per 10 minutes (None with fewer than 2 distinct times)."""
    n = len(samples)
    if n < 2:
        return None
    mt = sum(t for t, _ in samples) / n
    mm = sum(m for _, m in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return None
    return sum((t - mt) * (m - mm) for t, m in samples) / var * 600


def request(i: int, rng: random.Random) -> tuple[dict[str, Any], dict[str, str], str]:
    """The ``i``-th request of the mix: (body, headers, kind) with kind ``stream``, ``cancel`` or ``whole``."""
    if rng.random() < 0.6:
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)},
                    {"role": "user", "content": f"question {i}: " + "tell me more " * rng.randint(1, 30)}]
    else:
        text = f"one-off prompt {i} {rng.random()} " + "words " * rng.randint(20, 400)
        messages = [{"role": "user", "content": text}]
    model = "hosted" if rng.random() < 0.1 else "llama"
    body: dict[str, Any] = {"model": model, "messages": messages, "max_tokens": rng.randint(4, 24),
                            "user": f"user-{i // 5}", "metadata": {"tags": [f"soak-{i % 7}"]}}
    headers = {"x-session-id": f"session-{i // 3}"}
    draw = rng.random()
    kind = "whole" if draw < 0.45 else "cancel" if draw < 0.6 else "stream"
    if kind != "whole":
        body.update(stream=True, stream_options={"include_usage": True})
    return body, headers, kind


async def send(c: httpx.AsyncClient, arm: Arm, body: dict[str, Any], headers: dict[str, str], kind: str) -> None:
    """One request; counts its outcome on the arm (``cancel`` closes the stream after two chunks)."""
    url = arm.proxy.base_url + "/v1/chat/completions"
    try:
        if kind == "whole":
            r = await c.post(url, json=body, headers={**arm.proxy.headers, **headers})
            arm.outcomes[f"whole_{r.status_code}"] += 1
            arm.served[r.headers.get("x-litellm-model-id", "-")] += r.status_code == 200
            return
        async with c.stream("POST", url, json=body, headers={**arm.proxy.headers, **headers}) as r:
            chunks = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    chunks += 1
                    if kind == "cancel" and chunks >= 2:
                        break  # leaving the block closes the connection: the client went away
            arm.outcomes[f"{kind}_{r.status_code}"] += 1
            arm.served[r.headers.get("x-litellm-model-id", "-")] += r.status_code == 200
    except httpx.HTTPError as exc:
        arm.outcomes[f"{kind}_{type(exc).__name__}"] += 1


async def inject_faults(c: httpx.AsyncClient, arms: list[Arm], period_s: float, rng: random.Random) -> None:
    """Every ``period_s``: the same fault (500s, 429s or a cut stream) on the same replica of every arm's fleet."""
    while True:
        await asyncio.sleep(period_s)
        fault, index = rng.choice(FAULTS), rng.randrange(len(arms[0].bases))
        for arm in arms:
            admin = arm.bases[index].removesuffix("/v1") + "/admin/fault"
            with contextlib.suppress(httpx.HTTPError):
                await c.post(admin, json=fault)


def take_sample(arm: Arm, at: float) -> None:
    """One RSS sample of the arm's proxy tree; a proxy that has exited is recorded once (when, its exit code)
    and sampled no more: a dead process is not 0 MB of memory."""
    process = arm.proxy.process
    if process is None or arm.exited is not None:
        return
    code = process.poll()
    if code is not None:
        arm.exited = (at, code)
        return
    each = tree_rss_by_process(process.pid)
    arm.samples.append((at, round(sum(each.values()), 2)))
    arm.processes.append((at, {k: round(v, 2) for k, v in each.items()}))


async def sample(arms: list[Arm], start: float, period_s: float) -> None:
    while True:
        for arm in arms:
            take_sample(arm, round(time.monotonic() - start, 1))
        await asyncio.sleep(period_s)


async def drive(arms: list[Arm], args: argparse.Namespace) -> int:
    """Send the mix to every arm at ``args.rate`` requests/s each for ``args.minutes``; the requests sent per arm."""
    rng, fault_rng = random.Random(args.seed), random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=60, trust_env=False, limits=limits) as c:
        start = time.monotonic()
        background = [asyncio.create_task(sample(arms, start, args.sample_s)),
                      asyncio.create_task(inject_faults(c, arms, args.fault_every_s, fault_rng))]
        inflight: set[asyncio.Task] = set()
        i = 0
        while time.monotonic() - start < args.minutes * 60:
            body, headers, kind = request(i, rng)
            for arm in arms:
                task = asyncio.create_task(send(c, arm, json.loads(json.dumps(body)), headers, kind))
                inflight.add(task)
                task.add_done_callback(inflight.discard)
            i += 1
            await asyncio.sleep(rng.expovariate(args.rate))
        if inflight:
            await asyncio.wait(inflight, timeout=60)
        for arm in arms:  # a last sample after the tail drained
            take_sample(arm, round(time.monotonic() - start, 1))
        for task in background:
            task.cancel()
        return i


def summary(arm: Arm, warmup_s: float) -> dict[str, Any]:
    """RSS at the end of warm-up and at the end, and the slope after warm-up."""
    after = [s for s in arm.samples if s[0] >= warmup_s] or arm.samples[-1:]
    return {"rss_start_mb": arm.samples[0][1] if arm.samples else None,
            "rss_warmup_mb": after[0][1] if after else None, "rss_end_mb": after[-1][1] if after else None,
            "rss_max_mb": max((m for _, m in arm.samples), default=None),
            "slope_mb_per_10min": _round(slope_mb_per_10min(after)), "outcomes": dict(sorted(arm.outcomes.items())),
            "processes": per_process(arm.processes, warmup_s), "served_by": dict(sorted(arm.served.items())),
            "exited": {"at_s": arm.exited[0], "code": arm.exited[1]} if arm.exited else None}


def per_process(samples: list[tuple[float, dict[str, float]]], warmup_s: float) -> dict[str, dict[str, Any]]:
    """Each process of the proxy's tree: its RSS at the end of warm-up and at the end, and its slope after warm-up
    (which process of a tree grows: a proxy worker, the ledger's drainer)."""
    names = sorted({name for _, each in samples for name in each})
    out: dict[str, dict[str, Any]] = {}
    for name in names:
        series = [(at, each[name]) for at, each in samples if at >= warmup_s and name in each]
        if series:
            out[name] = {"rss_warmup_mb": series[0][1], "rss_end_mb": series[-1][1],
                         "slope_mb_per_10min": _round(slope_mb_per_10min(series))}
    return out


def _round(value: float | None) -> float | None:
    return round(value, 2) if value is not None else None


def verdict(arms: dict[str, dict[str, Any]]) -> str:
    """``died`` when a proxy exited under load; else ``flat`` / ``growing`` from kvroute's post-warm-up slope
    against plain's (or against 0 without plain)."""
    dead = [name for name, row in arms.items() if row.get("exited")]
    if dead:
        return "died: " + ", ".join(f"{n} at {arms[n]['exited']['at_s']:g} s (exit {arms[n]['exited']['code']})"
                                    for n in dead)
    slope = arms["kvroute"]["slope_mb_per_10min"]
    if slope is None:
        return "too short"
    base = arms["plain"]["slope_mb_per_10min"] if "plain" in arms else 0.0
    return "flat" if slope - max(base or 0.0, 0.0) <= TOLERANCE_MB_PER_10MIN else "growing"


def proxy_for(name: str, llama: Fleet, hosted: Fleet, data: Path, trace: Path | None) -> ProxyProcess:
    groups = [ModelGroup("llama", llama.api_bases, kv_capacity_tokens=REPLICA.capacity_tokens),
              ModelGroup("hosted", hosted.api_bases, engine=None, prices=HOSTED_PRICES)]
    kvroute = name == "kvroute"
    settings: dict[str, Any] = {"callbacks": ["kvroute.plugin.kvroute_callback"] if kvroute else []}
    env = {"LITELLM_LOG": "ERROR", "PYTHONFAULTHANDLER": "1"}  # a crash leaves every thread's stack in the log
    if kvroute:
        env["KVROUTE_DATA_DIR"] = str(data)
    if trace is not None:
        settings["callbacks"].append("soak_trace.trace_callback")
        env.update(PYTHONPATH=str(HERE), SOAK_TRACE=str(trace / f"trace-{name}.txt"))
    config = build_proxy_config(groups, kvroute=kvroute, fallbacks={"llama": ["hosted"]}, litellm_settings=settings)
    return ProxyProcess(config, kvroute_settings={"groups": {"llama": {"policy": "cache_aware"}}} if kvroute else None,
                        env=env, inherit_kvroute_env=False)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    names = ["kvroute"] + ([] if args.no_plain else ["plain"])
    trace = Path(tempfile.mkdtemp(prefix="kvroute-soak-trace-")) if args.trace else None
    with contextlib.ExitStack() as stack:
        arms = []
        for name in names:
            llama = stack.enter_context(Fleet(args.replicas, engine="fake", options=REPLICA, name_prefix=f"{name}-r"))
            hosted = stack.enter_context(Fleet(1, engine="fake", options=REPLICA, name_prefix=f"{name}-h"))
            data = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-soak-")))
            proxy = stack.enter_context(proxy_for(name, llama, hosted, data, trace))
            arms.append(Arm(name, proxy, llama.api_bases + hosted.api_bases))
        sent = await drive(arms, args)
        rows = {a.name: summary(a, args.warmup_minutes * 60) for a in arms}
        for arm in arms:  # a dead proxy's last words (its log goes with its work directory)
            if arm.exited:
                rows[arm.name]["log_tail"] = arm.proxy.log_text()[-LOG_TAIL_CHARS:]
    result = {"minutes": args.minutes, "warmup_minutes": args.warmup_minutes, "rate_per_s": args.rate,
              "requests_per_arm": sent, "replicas": args.replicas, "sample_s": args.sample_s,
              "tolerance_mb_per_10min": TOLERANCE_MB_PER_10MIN, "arms": rows, "verdict": verdict(rows),
              "samples": {a.name: a.samples for a in arms}, "process_samples": {a.name: a.processes for a in arms}}
    if trace is not None:  # the last report of each proxy's census (and tracemalloc's, with SOAK_TRACEMALLOC=1)
        result["trace"] = {p.stem.removeprefix("trace-"): json.loads(p.read_text()) for p in trace.glob("trace-*.txt")}
        result["trace_dir"] = str(trace)
    return result


def render(result: dict[str, Any]) -> str:
    lines = [f"{result['minutes']:g} min at {result['rate_per_s']:g} req/s per arm ({result['requests_per_arm']} "
             f"requests each), warm-up {result['warmup_minutes']:g} min",
             "| proxy | RSS start MB | RSS after warm-up MB | RSS end MB | slope MB/10 min | outcomes |",
             "|---|---|---|---|---|---|"]
    for name, r in result["arms"].items():
        outcomes = ", ".join(f"{k} {v}" for k, v in r["outcomes"].items())
        lines.append(f"| {name} | {r['rss_start_mb']} | {r['rss_warmup_mb']} | {r['rss_end_mb']} | "
                     f"{r['slope_mb_per_10min']} | {outcomes} |")
    for name, r in result["arms"].items():
        if r.get("served_by"):
            lines.append(f"- {name} answers by deployment: " + ", ".join(f"{k} {v}" for k, v in r["served_by"].items()))
        for process, f in r.get("processes", {}).items():
            lines.append(f"- {name} process {process}: {f['rss_warmup_mb']} → {f['rss_end_mb']} MB, "
                         f"{f['slope_mb_per_10min']} MB/10 min after warm-up")
    for name, r in result["arms"].items():
        if r.get("log_tail"):
            lines += [f"- {name}'s proxy exited; the end of its log:", r["log_tail"]]
    lines.append(f"verdict: {result['verdict']} (flat: kvroute's slope after warm-up at most "
                 f"{result['tolerance_mb_per_10min']:g} MB/10 min above plain's)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0)
    p.add_argument("--warmup-minutes", type=float, default=2.0)
    p.add_argument("--rate", type=float, default=4.0, help="requests per second to each proxy (Poisson)")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--fault-every-s", type=float, default=5.0, help="seconds between injected faults")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-plain", action="store_true", help="only the kvroute proxy")
    p.add_argument("--trace", action="store_true", help="tracemalloc's top growth per proxy (bench/soak_trace.py)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--save", action="store_true", help="write bench/results/soak-<time>.json")
    p.add_argument("--out", type=Path, help="write the JSON result to this file")
    args = p.parse_args(argv)
    result = asyncio.run(run(args))
    print(json.dumps(result, indent=1) if args.json else render(result))
    paths = [args.out] if args.out else []
    if args.save:
        RESULTS.mkdir(exist_ok=True)
        paths.append(RESULTS / f"soak-{datetime.now(UTC):%Y-%m-%dT%H%M}.json")
    for path in paths:
        path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
