"""kvroute side by side with the real peers: SMG 1.13, vllm-router 0.1.17, sglang-router 0.3.2 and LiteLLM's own
strategies, on the same fleet.

Starts N replicas (fake engines or llama.cpp, through ``plugin/dev/fleet.py``), then every rival in front of them
(``bench/peers_rivals.py``): each Rust router's ``cache_aware`` directly and behind LiteLLM, its session-sticky mode
directly, LiteLLM's strategies and affinity checks, LiteLLM + kvroute. Each workload (``bench/peers_workloads.py``:
demo, apps, agent, shared) is replayed once per rival per repeat, rivals interleaved (A B C … A B C …); every
replica is emptied before each run and every rival of a repeat replays the same prompts (``--no-fresh-fleet``: one
fleet throughout, each run its own prompt salt). Per rival: cached-token share (the engines' own counters), TTFT
p50/p90, req/s, failures, wasted prefill (``bench/peers_waste.py``), spread over replicas (max/mean prompt tokens
served), routing CPU per request (every process of the rival's chain: LiteLLM and the router, summed), and
same-repeat ratios against kvroute and LiteLLM simple-shuffle (medians over repeats). ``--fleet fake --engine-model
llamacpp`` runs fake engines that model the llama.cpp replicas (one slot, the host prompt cache, the tiny model's
speed and tokens, the host's cores shared: ``plugin/dev/fake_llamacpp.py``) with the llama.cpp fleet's sizes, and
kvroute's deployments say ``engine: llamacpp``. Per workload the result also records the host's CPU: cores busy on
average, of which the replicas' (``host_cpu``); ``--hop`` also measures each rival's own round trip on the idle
fleet (``hop_ms``). Usage::

    LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/python bench/peers.py [--fleet fake|llamacpp]
        [--engine-model vllm|llamacpp] [--workload demo --workload shared ...] [--repeats 3]
        [--rival kvroute --rival smg-ca ...] [--quick] [--hop] [--no-fresh-fleet] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_job import busy_cores
from peer_routers import KINDS, ensure_venv
from peers_rivals import PEERS, RIVALS, SHUFFLE, FleetView, Rival, start_rivals
from peers_waste import Served, holdings, wasted_prefill
from peers_workloads import (
    DEFAULT_WORKLOADS,
    WORKLOADS,
    Conversation,
    RunResult,
    Size,
    Workload,
    build,
    replay,
    replica_capacity_tokens,
    stream_one,
)
from replica_relay import ReplicaRelays, Timing, prompt_key

from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

PRECISE_NOTE = ("not run: precise mode needs KV-cache events, which neither the fake engine nor llama.cpp emits "
                "(vLLM/SGLang do; see bench/vllm_precise_e2e.py)")


# ---------------------------------------------------------------------------------------------- measurements
def cpu_seconds(pids: list[int]) -> float:
    """CPU seconds ``pids`` and their direct children have run, summed over their live threads (Linux
    ``/proc/*/task/*/schedstat``, nanoseconds; 0 elsewhere). Threads that ended meanwhile are not counted."""
    wanted = set(pids)
    procs = set(wanted)
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) in wanted:
                procs.add(int(stat.parent.name))
        except (OSError, ValueError, IndexError):
            continue
    total_ns = 0
    for pid in procs:
        for task in Path(f"/proc/{pid}/task").glob("*/schedstat"):
            try:
                total_ns += int(task.read_text().split()[0])
            except (OSError, ValueError, IndexError):
                continue
    return total_ns / 1e9


def host_busy_seconds() -> float:
    """CPU seconds every core of this host has been busy since boot (Linux ``/proc/stat``; 0 elsewhere)."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    except (OSError, ValueError):
        return 0.0
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / (os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100)


class HostCpu:
    """The host's CPU over a stretch of time: cores busy on average, of which ``pids``' (e.g. the replicas)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.t0, self.busy0, self.own0 = time.monotonic(), host_busy_seconds(), cpu_seconds(pids)

    def figures(self) -> dict:
        wall = max(1e-9, time.monotonic() - self.t0)
        busy = (host_busy_seconds() - self.busy0) / wall
        own = (cpu_seconds(self.pids) - self.own0) / wall
        return {"wall_s": round(wall, 1), "busy_cores": round(busy, 3), "replica_cores": round(own, 3),
                "background_cores": round(max(0.0, busy - own), 3)}


def engine_counters(kind: str, base_urls: list[str]) -> list[tuple[float, float]]:
    """(prompt tokens served, of which cached) per replica, as each engine counts them."""
    out = []
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        for url in base_urls:
            if kind == "fake":
                stats = client.get(url + "/admin/stats").json()
                out.append((float(stats["prompt_tokens"]), float(stats["cached_tokens"])))
                continue
            values = {}
            for line in client.get(url + "/metrics").text.splitlines():
                if line.startswith("llamacpp:prompt_tokens"):
                    name, _, value = line.partition(" ")
                    values[name] = float(value)
            processed = values.get("llamacpp:prompt_tokens_total", 0.0)
            cached = values.get("llamacpp:prompt_tokens_cached_total", 0.0)
            out.append((processed + cached, cached))  # llama.cpp counts processed and cached tokens apart
    return out


def quantile(values: list[float], q: float) -> float | None:
    """Nearest-rank quantile (None when empty)."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


def _served(result: RunResult) -> list[Served] | None:
    """The answered requests as ``peers_waste`` needs them (None when an engine reported no usage)."""
    ok = [o for o in result.outcomes if o.ok]
    if any(o.prompt_tokens is None or o.cached_tokens is None for o in ok):
        return None
    return [Served(o.prompt, o.answer, o.replica, o.prompt_tokens, o.cached_tokens, o.start_s, o.end_s) for o in ok]


def run_figures(result: RunResult, before: list[tuple[float, float]], after: list[tuple[float, float]],
                cpu_s: float, block_bytes: int = 64) -> dict:
    """The figures of one run of one rival."""
    prompt = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    cached = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    ok = [o for o in result.outcomes if o.ok]
    ttfts = [o.ttft_s for o in ok if o.ttft_s is not None]
    mean_prompt = sum(prompt) / len(prompt) if prompt else 0.0
    p50, p90 = quantile(ttfts, 0.5), quantile(ttfts, 0.9)
    served = _served(result)
    waste = wasted_prefill(served, block_bytes) if served is not None else None
    in_flight = wasted_prefill(served, block_bytes, in_flight=True) if served is not None else None
    return {"wasted_share": None if waste is None else waste.share,
            "wasted_in_flight_share": None if in_flight is None else in_flight.share,
            "wasted_exact": None if waste is None else waste.exact,
            "replicas_seen": len({o.replica for o in ok if o.replica}),
            "requests": len(result.outcomes), "failed": len(result.outcomes) - len(ok),
            "cached_share": round(cached / sum(prompt), 4) if sum(prompt) > 0 else 0.0,
            "ttft_p50_ms": None if p50 is None else round(p50 * 1000, 1),
            "ttft_p90_ms": None if p90 is None else round(p90 * 1000, 1),
            "req_per_s": round(len(ok) / result.wall_s, 3) if result.wall_s > 0 else 0.0,
            "spread": round(max(prompt) / mean_prompt, 3) if mean_prompt > 0 else None,
            "router_cpu_ms_per_req": round(cpu_s * 1000 / len(result.outcomes), 3) if result.outcomes else None}


METRICS = ("cached_share", "ttft_p50_ms", "ttft_p90_ms", "req_per_s", "wasted_share", "spread",
           "router_cpu_ms_per_req")
EXTRA_METRICS = ("wasted_in_flight_share", "hop_ms")  # medians too, where the run recorded them
RATIO_METRICS = ("cached_share", "ttft_p90_ms", "req_per_s", "router_cpu_ms_per_req")
KVROUTE = "kvroute"


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 4) if present else None


def same_repeat_ratio(runs: dict[str, list[dict]], key: str, base: str, metric: str) -> float | None:
    """Median over repeats of ``key``'s ``metric`` divided by ``base``'s in the same repeat."""
    if key not in runs or base not in runs:
        return None
    return _median([r[metric] / b[metric] if r[metric] is not None and b[metric] else None
                    for r, b in zip(runs[key], runs[base], strict=False)])


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per rival: the median of each figure over repeats, failures summed, and same-repeat ratio medians
    against kvroute and LiteLLM simple-shuffle (kvroute's row also against every peer's LiteLLM chain)."""
    out: dict[str, dict] = {}
    for key, per_repeat in runs.items():
        row: dict = {m: _median([r[m] for r in per_repeat]) for m in METRICS}
        row.update({m: _median([r.get(m) for r in per_repeat]) for m in EXTRA_METRICS})
        row["failed"] = sum(r["failed"] for r in per_repeat)
        row["requests"] = sum(r["requests"] for r in per_repeat)
        row["wasted_exact"] = all(r.get("wasted_exact") for r in per_repeat)
        bases = [SHUFFLE, KVROUTE] + ([chain for _, chain in PEERS.values()] if key == KVROUTE else [])
        for base in bases:
            for m in RATIO_METRICS:
                ratio = same_repeat_ratio(runs, key, base, m)
                if ratio is not None:
                    row[f"{m}_vs_{base}"] = ratio
        out[key] = row
    return out


def targets(summary: dict[str, dict]) -> dict:
    """The issue's targets on one workload, per peer: kvroute's cached share ≥ the peer's ``cache_aware`` direct
    (and ≥ each other direct mode that ran: sticky sessions, round robin), kvroute's TTFT p90 ≤ LiteLLM → that
    peer's (same-repeat ratio), and once kvroute's routing CPU per request ≤ 1.03 × LiteLLM simple-shuffle's. A
    peer that did not run gets no verdict rather than a wrong one."""
    kv, shuffle = summary.get(KVROUTE), summary.get(SHUFFLE)
    out: dict = {}
    if not kv:
        return out
    for peer, (direct_key, chain_key) in PEERS.items():
        direct, chain = summary.get(direct_key), summary.get(chain_key)
        if direct and kv["cached_share"] is not None and direct["cached_share"] is not None:
            out[f"cached_share {peer}"] = {"kvroute": kv["cached_share"], direct_key: direct["cached_share"],
                                           "difference": round(kv["cached_share"] - direct["cached_share"], 4),
                                           "met": kv["cached_share"] >= direct["cached_share"]}
        ratio = kv.get(f"ttft_p90_ms_vs_{chain_key}")
        if chain and ratio is not None:
            out[f"ttft_p90 {peer}"] = {"kvroute_ms": kv["ttft_p90_ms"], f"{chain_key}_ms": chain["ttft_p90_ms"],
                                       "ratio": ratio, "met": ratio <= 1.0}
    for spec in RIVALS:  # every other direct peer mode that ran (sticky sessions, round robin): cached share too
        direct = summary.get(spec.key)
        if (spec.router and spec.litellm is None and spec.key not in {d for d, _ in PEERS.values()} and direct
                and kv["cached_share"] is not None and direct["cached_share"] is not None):
            out[f"cached_share {spec.key}"] = {"kvroute": kv["cached_share"], spec.key: direct["cached_share"],
                                               "difference": round(kv["cached_share"] - direct["cached_share"], 4),
                                               "met": kv["cached_share"] >= direct["cached_share"]}
    ratio = kv.get(f"router_cpu_ms_per_req_vs_{SHUFFLE}")
    if shuffle and ratio is not None:
        out["proxy_cpu"] = {"kvroute_ms": kv["router_cpu_ms_per_req"],
                            f"{SHUFFLE}_ms": shuffle["router_cpu_ms_per_req"], "ratio": ratio, "goal": 1.03,
                            "met": ratio <= 1.03}
    return out


# ---------------------------------------------------------------------------------------------- the run
def _replica_options(kind: str, capacity: int, quick: bool, engine_model: str = "vllm",
                     host_cores: float = 0.0, background_cores: float = 0.0,
                     engine_cost: float = 1.0, time_jitter: tuple[float, ...] = ()) -> ReplicaOptions:
    from kvroute.plugin.dev.tiny_model import PRESETS

    mib = PRESETS["small"].cache_ram_mib(capacity)
    if kind == "fake" and engine_model == "llamacpp":  # the llama.cpp replica's model, the tiny model's tokens
        return ReplicaOptions(engine_model="llamacpp", cache_ram_mib=mib, tokenizer=_tiny_tokenizer(),
                              host_cores=host_cores, background_cores=background_cores, engine_cost=engine_cost,
                              time_jitter=time_jitter)
    if kind == "fake":  # timing stays the fleet's default (the fake engine's own model of prefill and decode)
        return ReplicaOptions(capacity_tokens=capacity, block_tokens=16)
    return ReplicaOptions(cache_ram_mib=mib, threads=1, parallel=1, ctx=4096 if quick else 8192)


def _tiny_tokenizer() -> str | None:
    """The tiny model's ``tokenizer.json`` where its packages are installed (the fake engine then counts its tokens)."""
    from kvroute.plugin.dev.llamacpp import xllamacpp_available
    from kvroute.plugin.dev.tiny_model import ensure_tiny_model

    return str(ensure_tiny_model().tokenizer_json) if xllamacpp_available() else None


async def _warm_up(rival: Rival, model: str) -> None:
    """One short streamed request through the rival, as the workloads send them, then one to each of its LiteLLM
    deployments by id: a proxy in service has streamed through every deployment before, and LiteLLM's first
    stream and first call to a deployment cost it CPU (measured: 3–6 ms a deployment, serialised in a burst of
    cold first turns) that a fresh proxy would otherwise pay inside the run."""
    async with httpx.AsyncClient(base_url=rival.base_url, headers=rival.headers, timeout=60.0,
                                 trust_env=False) as client:
        for name in (model, *rival.deployments):
            body = {"model": name, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": "hi"}]}
            out = await stream_one(client, body, {})
            if not out.ok:
                raise httpx.HTTPError(f"warm-up of {name} failed: {out.error}")


async def _hop_ms(rival: Rival, direct_url: str, model: str, probes: int = 7) -> float:
    """The rival's own round trip: the median TTFT of a short streamed request through it less that of the same
    request sent straight to a replica (``probes`` of each, one at a time, on idle replicas; the prompt is cached
    after the first, so the engine's part is its fixed response time)."""
    body = {"model": model, "max_tokens": 2, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": "How long is the way through the router?"}]}

    async def median_ttft(base_url: str, headers: dict) -> float:
        async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=60.0, trust_env=False) as client:
            ttfts = []
            for _ in range(probes):
                out = await stream_one(client, body, {})
                if not out.ok or out.ttft_s is None:
                    raise httpx.HTTPError(f"hop probe failed: {out.error}")
                ttfts.append(out.ttft_s)
        return statistics.median(ttfts)

    through = await median_ttft(rival.base_url, dict(rival.headers))
    return round(max(0.0, through - await median_ttft(direct_url, {})) * 1000, 1)


def random_words(n: int) -> str:
    """``n`` random 8-character words: a prompt no cache holds any of (beyond the chat template)."""
    return " ".join(f"{int.from_bytes(os.urandom(4), 'big'):08x}" for _ in range(n))


async def engine_probe(base_urls: list[str], model: str, per_replica: int = 2, words: int = 200) -> list[dict]:
    """Each replica's own prefill time, timed by llama.cpp itself: ``per_replica`` requests straight to every replica,
    one at a time, each a fresh prompt of ``words`` random 8-character words and 1 token out; per request the
    engine's ``timings`` (``prompt_n`` computed after ``cache_n`` cached, in ``prompt_ms``). How fast this host runs
    the engines right now (``bench/calibrate.py`` gives the models the ratio to their preset's)."""
    out = []
    async with httpx.AsyncClient(timeout=120.0, trust_env=False) as client:
        for url in base_urls:
            for _ in range(per_replica):
                text = random_words(words)
                r = await client.post(url + "/v1/chat/completions", json={
                    "model": model, "max_tokens": 1, "temperature": 0,
                    "messages": [{"role": "user", "content": text}]})
                timings = r.json().get("timings") if r.status_code == 200 else None
                if isinstance(timings, dict) and isinstance(timings.get("prompt_ms"), int | float):
                    out.append({k: timings.get(k) for k in ("cache_n", "prompt_n", "prompt_ms")})
    return out


def _new_decisions(rival: Rival) -> list[dict]:
    """kvroute's decision-log lines written since the last call (the file grows run after run)."""
    path = rival.decision_log
    if path is None or not path.exists():
        return []
    with path.open() as f:
        f.seek(rival.decisions_read)
        lines = f.readlines()
        rival.decisions_read = f.tell()
    return [json.loads(line) for line in lines if line.strip()]


def router_hops(result: RunResult, timings: list[Timing]) -> dict[int, tuple[float, float]]:
    """Per answered request (by ``id`` of its outcome), the router's way in and way out in ms: the client's send to
    the relay's first byte, and the relay's first answer text to the client's (``replica_relay``'s clock). A prompt
    sent twice (a retry) is matched to its last timing that got text back."""
    by_key: dict[str, Timing] = {}
    for t in timings:
        if t.key is not None and t.first_s is not None:
            by_key[t.key] = t
    hops = {}
    for o in result.outcomes:
        t = by_key.get(prompt_key(o.prompt)) if o.ok and o.ttft_s is not None else None
        if t is None:
            continue
        sent = result.t0 + o.start_s
        hops[id(o)] = ((t.arrived_s - sent) * 1000, (sent + o.ttft_s - t.first_s) * 1000)
    return hops


def _one_run(rival: Rival, workload: Workload, model: str, kind: str, base_urls: list[str], salt: str,
             block_bytes: int, relays: ReplicaRelays | None = None,
             delays: Callable[[Conversation, int], float] | None = None) -> dict:
    """One replay of ``workload`` through ``rival``; ``block_bytes``: the engines' reuse granularity in prompt bytes
    (fake vLLM-style engines cache 16-token blocks of 4 bytes a token; llama.cpp reuses any token prefix). Behind
    ``relays``, each request also gets the router's way in and out (``router_in_ms``, ``router_out_ms``) and the run
    their median sum (``hop_ms``): the round trip under the run's own load."""
    if relays is not None:
        relays.take_timings()  # the warm-up's and earlier runs' requests are not this run's
    before = engine_counters(kind, base_urls)
    _new_decisions(rival)  # the warm-up's and earlier runs' picks are not this run's
    cpu0 = cpu_seconds(rival.pids)
    result = asyncio.run(replay(rival.base_url, rival.headers, model, workload, salt, delays=delays))
    cpu = cpu_seconds(rival.pids) - cpu0
    figures = run_figures(result, before, engine_counters(kind, base_urls), cpu, block_bytes)
    log = {id(o): o.record() for o in result.outcomes}
    served = _served(result)
    if served is not None:  # what the fleet held of each prompt when it was sent (bench/peers_diff.py reads it)
        ok = [o for o in result.outcomes if o.ok]
        for o, h in zip(ok, holdings(served, block_bytes), strict=True):
            log[id(o)].update(dataclasses.asdict(h))
    if relays is not None:
        hops = router_hops(result, relays.take_timings())
        for key, (way_in, way_out) in hops.items():
            log[key].update(router_in_ms=round(way_in, 2), router_out_ms=round(way_out, 2))
        figures["hop_ms"] = round(statistics.median(a + b for a, b in hops.values()), 2) if hops else None
    figures["requests_log"] = [log[id(o)] for o in sorted(result.outcomes, key=lambda o: o.start_s)]
    lines = _new_decisions(rival)
    decisions = [line for line in lines if line.get("event") != "ended"]
    endings = [line for line in lines if line.get("event") == "ended"]  # attempts that ended with no answer
    if decisions:
        figures["decisions"] = decisions
    if endings:
        figures["endings"] = endings
    return figures


def run(args: argparse.Namespace, say) -> dict:
    """Everything: fleet, rivals, interleaved runs; the JSON-ready result."""
    llama = args.fleet == "llamacpp" or getattr(args, "engine_model", "vllm") == "llamacpp"
    size = Size.quick() if args.quick else Size.llamacpp() if llama else Size()
    capacity = replica_capacity_tokens(size, args.replicas)
    specs = [s for s in RIVALS if not args.rival or s.key in args.rival]
    started_at = time.time()
    needed = sorted({s.router for s in specs if s.router})
    binaries: dict[str, Path] = {}
    for key in needed:  # a router that cannot be installed is reported by the rivals that need it
        try:
            binaries[key] = ensure_venv(KINDS[key])
            say(f"{KINDS[key].pin}: {binaries[key]}")
        except Exception as exc:
            say(f"{KINDS[key].pin}: NOT INSTALLED: {exc}")
    result: dict = {"fleet": args.fleet, "engine_model": "llamacpp" if llama else "vllm",
                    "replicas": args.replicas, "repeats": args.repeats, "quick": args.quick,
                    "fresh_fleet": args.fresh_fleet,
                    "size": dataclasses.asdict(size), "routers": {k: KINDS[k].pin for k in needed},
                    "capacity_tokens_per_replica": capacity,
                    "kvroute_precise": PRECISE_NOTE, "cpu_count": os.cpu_count(),
                    "busy_cores": getattr(args, "busy_cores", 0), "load_average_start": list(os.getloadavg())}
    with contextlib.ExitStack() as stack:
        stack.enter_context(busy_cores(result["busy_cores"]))
        options = _replica_options(args.fleet, capacity, args.quick, "llamacpp" if llama else "vllm",
                                   getattr(args, "host_cores", 0.0), getattr(args, "background_cores", 0.0),
                                   getattr(args, "engine_cost", 1.0), getattr(args, "time_jitter", ()))
        fleet = stack.enter_context(Fleet(args.replicas, engine=args.fleet, options=options, name_prefix="peers"))
        api_bases = fleet.api_bases
        relays, token_calls = None, {}
        # llama.cpp's replicas look alike: relays stamp each one's name on its answers; the calibration's fakes of
        # them sit behind the same relays, so both runs take one way (the relays share the client's process)
        if llama:
            relays = stack.enter_context(ReplicaRelays([r.port for r in fleet.replicas],
                                                       [r.name for r in fleet.replicas]))
            api_bases = [u + "/v1" for u in relays.base_urls]
        view = FleetView(api_bases, fleet.model, "llamacpp" if llama else "vllm", capacity, None if llama else 16)
        say(f"{args.replicas} {args.fleet} replicas up (cache ≈ {capacity} tokens each); starting {len(specs)} rivals")
        rivals = start_rivals(specs, view, binaries, stack)
        for rival in rivals:
            if rival.error is None:
                try:
                    asyncio.run(_warm_up(rival, fleet.model))
                except httpx.HTTPError as exc:
                    rival.error = f"warm-up request failed: {type(exc).__name__}: {exc}"
        live = [r for r in rivals if r.error is None]
        result["rivals"] = {r.spec.key: {"label": r.spec.label, "started": r.error is None, "error": r.error,
                                         "router_args": list(r.spec.router_args)} for r in rivals}
        if getattr(args, "hop", False):  # each rival's own round trip (bench/calibrate.py's simulator adds it)
            for rival in live:
                result["rivals"][rival.spec.key]["hop_ms"] = asyncio.run(_hop_ms(rival, fleet.base_urls[0],
                                                                                 fleet.model))
        say(f"started {len(live)}/{len(rivals)} rivals in {time.time() - started_at:.0f} s")
        result["workloads"] = {}
        # bench/calibrate.py's fake run: first turns' start jitter measured on llama.cpp, repeat n drawn with seed n
        turn_delays = getattr(args, "turn_delays", None)
        for name in args.workload:
            workload = build(name, size, capacity)
            runs: dict[str, list[dict]] = {r.spec.key: [] for r in live}
            probe = (asyncio.run(engine_probe(fleet.base_urls, fleet.model))
                     if getattr(args, "probe", False) and args.fleet == "llamacpp" else None)
            host = HostCpu(fleet.pids())
            for repeat in range(args.repeats):
                for rival in live:
                    # the same length for every rival: a longer salt shifts block boundaries and the cached share
                    # with them (rival keys of 6 to 18 characters moved it by up to 0.06 points). A fresh fleet
                    # per run lets every rival of a repeat replay the same prompts on the same (empty) replicas.
                    who = "" if args.fresh_fleet else rival.spec.key
                    salt = hashlib.sha256(f"{name}-{repeat}-{who}-{started_at}".encode()).hexdigest()[:16]
                    if args.fresh_fleet:
                        _restart(fleet, relays, token_calls)
                    runs[rival.spec.key].append(_one_run(rival, workload, fleet.model, args.fleet,
                                                         fleet.base_urls, salt, 4 if llama else 64, relays,
                                                         turn_delays(name, repeat) if turn_delays else None))
                    say(f"{name} repeat {repeat + 1}/{args.repeats} {rival.spec.key}: "
                        f"{json.dumps(runs[rival.spec.key][-1])}")
            summary = summarise(runs)
            result["workloads"][name] = {"requests_per_run": workload.requests, "flows": len(workload.flows),
                                         "summary": summary, "targets": targets(summary), "runs": runs,
                                         "host_cpu": host.figures()}
            if probe is not None:
                result["workloads"][name]["engine_probe"] = probe
        if args.fleet == "fake":  # which vLLM token endpoints the routers called (vllm-router's cache_aware does)
            with httpx.Client(timeout=10.0, trust_env=False) as client:
                for url in fleet.base_urls:
                    _add_token_calls(token_calls, client, url)
            result["engine_token_calls"] = token_calls
        for rival in rivals:
            if rival.spec.key in result["rivals"]:
                result["rivals"][rival.spec.key]["proxy_errors"] = rival.proxy_errors()
    result["load_average_end"] = list(os.getloadavg())
    result["wall_s"] = round(time.time() - started_at, 1)
    return result


def _restart(fleet: Fleet, relays: ReplicaRelays | None, token_calls: dict[str, int]) -> None:
    """Every replica empty again: llama.cpp's stopped and started (the relays follow them to their new ports), a
    fake engine's cache and counters cleared in place (``/admin/reset``; the routers keep its address), its
    tokenizer-endpoint calls so far added to ``token_calls`` first."""
    if fleet.kind == "fake":
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            for base in fleet.base_urls:
                _add_token_calls(token_calls, client, base)
                client.post(base + "/admin/reset").raise_for_status()
        return
    for i in range(len(fleet.replicas)):
        port = fleet.restart(i).port
        if relays is not None:
            relays.retarget(i, port)


def _add_token_calls(calls: dict[str, int], client: httpx.Client, base_url: str) -> None:
    for path, n in client.get(base_url + "/admin/stats").json().get("token_calls", {}).items():
        calls[path] = calls.get(path, 0) + n


# ---------------------------------------------------------------------------------------------- output
def _fmt(value: float | None, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "share":
        return f"{value:.1%}"
    if kind == "ms":
        return f"{value:,.0f} ms"
    if kind == "x":
        return f"{value:.2f}×"
    return f"{value:.2f}"


def render(result: dict) -> str:
    """A markdown table per workload, then the targets."""
    labels = {k: v["label"] for k, v in result["rivals"].items()}
    model = " (llama.cpp model)" if result["fleet"] == "fake" and result.get("engine_model") == "llamacpp" else ""
    busy = f" beside {result['busy_cores']} busy core(s)" if result.get("busy_cores") else ""
    lines = [f"{result['replicas']} {result['fleet']}{model} replicas, {result['repeats']} interleaved repeats, "
             "medians; "
             f"load average {result['load_average_start'][0]:.1f} → {result['load_average_end'][0]:.1f} on "
             f"{result['cpu_count']} CPUs{busy}; routers {', '.join(result.get('routers', {}).values())}"]
    for key, info in result["rivals"].items():
        if not info["started"]:
            lines.append(f"NOT STARTED {key}: {info['error']}")
        if info.get("proxy_errors"):
            lines.append(f"proxy errors {key}: {len(info['proxy_errors'])}, the first: {info['proxy_errors'][0]}")
    for name, w in result["workloads"].items():
        lines += ["", f"### {name} ({w['requests_per_run']} requests per run)", "",
                  "| router | cached share | TTFT p50 | TTFT p90 | req/s | failed | wasted prefill | CPU/req | "
                  "cached × kvroute | p90 × kvroute | CPU × kvroute | CPU × shuffle |", "|---|" + "---|" * 11]
        for key, row in w["summary"].items():
            wasted = _fmt(row.get("wasted_share"), "share") + ("" if row.get("wasted_exact") else " ≤")
            if row.get("wasted_in_flight_share") is not None:
                wasted += f" ({_fmt(row['wasted_in_flight_share'], 'share')})"
            lines.append(f"| {labels[key]} | {_fmt(row['cached_share'], 'share')} | {_fmt(row['ttft_p50_ms'], 'ms')} "
                         f"| {_fmt(row['ttft_p90_ms'], 'ms')} | {_fmt(row['req_per_s'], '')} | {row['failed']} "
                         f"| {wasted} | {_fmt(row['router_cpu_ms_per_req'], '')} ms "
                         f"| {_fmt(row.get(f'cached_share_vs_{KVROUTE}'), 'x')} "
                         f"| {_fmt(row.get(f'ttft_p90_ms_vs_{KVROUTE}'), 'x')} "
                         f"| {_fmt(row.get(f'router_cpu_ms_per_req_vs_{KVROUTE}'), 'x')} "
                         f"| {_fmt(row.get(f'router_cpu_ms_per_req_vs_{SHUFFLE}'), 'x')} |")
        for target, t in w["targets"].items():
            lines.append(f"- target {target}: {'met' if t['met'] else 'MISSED'} {json.dumps(t)}")
    lines.append("- wasted prefill: share of prompt tokens computed while another replica had been sent them "
                 "by a finished request (in brackets: by any request sent earlier, still in flight included; "
                 "bench/peers_waste.py); ≤: replicas not visible (llama.cpp), an upper bound")
    lines.append(f"- kvroute precise: {result['kvroute_precise']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fleet", choices=("fake", "llamacpp"), default="fake")
    p.add_argument("--engine-model", choices=("vllm", "llamacpp"), default="vllm",
                   help="--fleet fake only: llamacpp makes the fake engines model the llama.cpp replicas (and sizes "
                        "the workloads as for them)")
    p.add_argument("--hop", action="store_true",
                   help="also measure each rival's own round trip on the idle fleet (hop_ms: its TTFT less a "
                        "replica's own, medians of 7)")
    p.add_argument("--host-cores", type=float, default=float(os.cpu_count() or 1),
                   help="--engine-model llamacpp: the host cores the modelled replicas share (default: this host's)")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help="repeatable; default: demo, apps, agent, shared (apps-large is the scale cell: --replicas 8)")
    p.add_argument("--repeats", type=int, default=None, help="interleaved repeats (default 3, --quick 1)")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--rival", action="append", help="only these rivals (repeatable), e.g. kvroute")
    p.add_argument("--quick", action="store_true", help="tiny workloads, one repeat: a CI smoke run")
    p.add_argument("--fresh-fleet", action=argparse.BooleanOptionalAction, default=True,
                   help="restart every replica before each run, and give every rival of a repeat the same prompts: "
                        "identical request sequences from identical fleet states, so shares are compared on the same "
                        "tokens (what bench/peers_diff.py compares; the default). --no-fresh-fleet: one fleet for "
                        "the whole run, each rival its own prompts")
    p.add_argument("--probe", action="store_true",
                   help="llama.cpp: time every replica's prefill before each workload (the result's engine_probe)")
    p.add_argument("--busy-cores", type=int, default=0, metavar="N",
                   help="run beside a CPU-heavy job: N processes spinning for the whole run (bench/cpu_job.py)")
    p.add_argument("--json", action="store_true", help="print the result as JSON only")
    p.add_argument("--render", metavar="FILE", help="print the table of a result saved with --json, run nothing")
    p.add_argument("--save", action="store_true",
                   help="also write the result to bench/results/peers-<UTC date and time>-<fleet>.json")
    args = p.parse_args(argv)
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    args.workload = args.workload or list(DEFAULT_WORKLOADS)
    args.repeats = args.repeats or (1 if args.quick else 3)
    if args.repeats <= 0 or args.replicas <= 0:
        p.error("--repeats and --replicas must be positive")
    if args.busy_cores < 0:
        p.error("--busy-cores must be 0 or more")
    unknown = set(args.rival or ()) - {s.key for s in RIVALS}
    if unknown:
        p.error(f"unknown rival(s) {sorted(unknown)}; expected some of {[s.key for s in RIVALS]}")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    result = run(args, say)
    if args.save:
        stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime(time.time() - result["wall_s"]))
        path = Path(__file__).resolve().parent / "results" / f"peers-{stamp}-{args.fleet}.json"
        path.write_text(json.dumps(result) + "\n")
        say(f"saved {path}")
    print(json.dumps(result) if args.json else render(result))
    return 0 if all(r["started"] for r in result["rivals"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
