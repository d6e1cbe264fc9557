"""Sim-to-real calibration: do the fake engine and the simulator predict what llama.cpp does? Fails where they lie.

    LITELLM_LOCAL_MODEL_COST_MAP=True .venv/bin/python bench/calibrate.py [--workload demo ...] [--repeats 1]
        [--sim-repeats N] [--run real --run fake --run sim] [--from FILE] [--json] [--save] [--render FILE]

Per workload (demo, apps, agent at ``bench/peers.py``'s llama.cpp sizes) and router, three sources of the same
requests (the same flows of ``bench/peers_workloads.py``):

1. measured: ``bench/peers.py`` on 4 llama.cpp replicas (the tiny model, 1 thread, 1 slot, 9 MiB host prompt cache
   each) behind LiteLLM + kvroute, SMG 1.13 ``cache_aware`` and sglang-router round robin, rivals interleaved;
2. fake: the same run on 4 fake engines with ``--engine-model llamacpp`` (``plugin/dev/fake_llamacpp.py``);
3. sim: the simulator's ``llamacpp`` preset (``sim/replica_llamacpp.py``) on the flows tokenized with the tiny
   model's tokenizer (``bench/calibrate_sim.py``), with kvroute's ``cache_aware``, ``smg_2026`` (the closest baseline to
   SMG's ``cache_aware``) and ``round_robin``.

Both models run their replicas on this host's cores with the background load the real run measured (the host's busy
cores less the replicas' while that workload ran, per workload); the simulator also takes each router's round trip as
the real run measured it under that workload's own load (the median of the runs' ``hop_ms``: each request's way in
to the replica and way back out, clocked by ``bench/replica_relay.py``; a run without it falls back to the router's
TTFT on the idle fleet less a replica's own, which under load was a third of the measured hop), which the fake run
has by itself (the same routers in front of it). Each source runs repeats (``--repeats`` for the real and fake
runs, ``--sim-repeats`` for the simulator, by default as many as the real run had): where the real repeats spread,
one model timeline cannot match one real one, so the simulator's repeat ``n`` moves its requests by the arrival
jitter measured on the real repeats, drawn with seed ``n`` (``bench/calibrate_jitter.py``), the fake run's engines
time each request by the same steps' relative variation (one deviation a request, drawn by its prompt, which each
repeat salts anew) and hold each flow's first turn back by a start sample (``turn_delays``, seed ``n``), and every
figure is the median over a source's repeats. Per cell the table gives each source's cached share and TTFT p50/p90
(medians, the cached share and p90 with their min–max) and each model's error; the verdict
(``bench/calibrate_verdict.py``) wants the cached share within ±1.5 points and TTFT p90 within ±25 % of llama.cpp's
(median against median) for every model on every cell, and the command exits 1 (with a ``MISSED`` line per check)
otherwise. ``--from FILE`` takes the sources not in ``--run`` from a saved calibration (``--save`` writes
``bench/results/calibrate-<UTC time>.json``); ``--render FILE`` prints a saved one.

A fourth source, replay, is the simulator given each llama.cpp repeat's own arrivals (every request when it
reached the engines, open loop; ``calibrate_sim.replayed``): one simulated run per measured repeat, judged repeat
against repeat (``calibrate_verdict.paired``: the median size of the cached share's error within the same bound;
TTFT p90 shown, the closed-loop models' to meet). Where a router's share turns on which turn meets which prompt on
a one-slot replica (round robin), a few repeats' medians differ by more than the bounds between llama.cpp's own
runs; given the arrivals, what is left to judge is the engine model and the router's picks. Its verdict is
printed below the table and counts in the exit status; a real run redone without it drops a saved one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Mapping
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from calibrate_jitter import Jitter, jittered, measure, turn_delays
from calibrate_sim import Tokenize, replayed, sim_workload, simulate_cell, tiny_tokenizer
from calibrate_verdict import Bounds, Calibration, Figures, Paired, calibrate, paired
from peers_workloads import Size, build, replica_capacity_tokens

from kvroute.plugin.dev.tiny_model import PRESETS as TINY
from kvroute.sim.presets import Preset, get_preset

#: (bench/peers.py rival, simulator policy) per router of the table
ROUTERS = (("kvroute", "cache_aware"), ("smg-ca", "smg_2026"), ("sglang-rr", "round_robin"))
WORKLOADS = ("demo", "apps", "agent")
SOURCES = ("real", "fake", "sim", "replay")
MODELS = ("fake", "sim")
REPLICAS = 4


def run_fleet(fleet: str, workloads: list[str], repeats: int, cores: float, background: Mapping[str, float],
              say, jitter: Mapping[str, Jitter] | None = None, costs: Mapping[str, float] | None = None) -> dict:
    """``bench/peers.py`` with the table's routers (``fleet`` real: llama.cpp, each replica's prefill timed before
    each workload; fake: its fake-engine model), each workload on a fleet of its own when their ``background`` loads,
    engine ``costs`` or jitters differ (a fleet's replicas take one of each); ``jitter``: per workload, the variation
    measured on llama.cpp, replayed on the fake run: its steps' by the engines (``time_jitter``), its first starts'
    by the client (``turn_delays``)."""
    import peers

    costs = costs or {}
    jitter = jitter or {}

    def delays(name: str, repeat: int):
        return turn_delays(jitter[name], repeat) if name in jitter else None

    def one(names: list[str], load: float, cost: float, rel: tuple[float, ...]) -> dict:
        args = argparse.Namespace(fleet="llamacpp" if fleet == "real" else "fake", engine_model="llamacpp",
                                  workload=names, repeats=repeats, replicas=REPLICAS, rival=[r for r, _ in ROUTERS],
                                  quick=False, fresh_fleet=False, host_cores=cores, background_cores=load, hop=True,
                                  turn_delays=delays if jitter else None, probe=fleet == "real", engine_cost=cost,
                                  time_jitter=rel)
        return peers.run(args, say)

    def setting(name: str) -> tuple[float, float, tuple[float, ...]]:
        return background.get(name, 0.0), costs.get(name, 1.0), jitter[name].step_rel if name in jitter else ()

    if len({setting(name) for name in workloads}) <= 1:
        result = one(workloads, *(setting(workloads[0]) if workloads else (0.0, 1.0, ())))
    else:
        parts = [one([name], *setting(name)) for name in workloads]
        result = {**parts[0], "workloads": {k: v for p in parts for k, v in p["workloads"].items()},
                  "wall_s": round(sum(p["wall_s"] for p in parts), 1),
                  "load_average_end": parts[-1]["load_average_end"]}
    for w in result["workloads"].values():  # kvroute's decision logs stay out of the calibration's file; the
        # per-request log stays (its timings are what ``bench/calibrate_jitter.py`` measures the arrival jitter on)
        w["runs"] = {k: [{m: v for m, v in run.items() if m != "decisions"} for run in runs]
                     for k, runs in w["runs"].items()}
    return result


def _sources(result: Mapping) -> str:
    """What measured each workload's engine cost (a saved run from before ``engine_cost_source``: the probes)."""
    given = result.get("engine_cost_source")
    if not given:
        return "llama.cpp's prefill probes"
    return ", ".join(f"{name}: {src}" for name, src in given.items())


def cache_tokens() -> int:
    """The llama.cpp replicas' host cache in tokens: ``bench/peers.py``'s ``--cache-ram`` over the state per token."""
    size = Size.llamacpp()
    mib = TINY["small"].cache_ram_mib(replica_capacity_tokens(size, REPLICAS))
    spec = get_preset("llamacpp").llamacpp
    assert spec is not None
    return int(mib * 1024 * 1024 // spec.state_bytes_per_token)


SIM_METRICS = ("cached_share", "ttft_p50_ms", "ttft_p90_ms")


def probe_cost(sample: Mapping, preset: Preset | None = None) -> float | None:
    """One probe's host slowness: the prefill time llama.cpp reported over the ``llamacpp`` preset's for the same
    tokens (``CostModel.prefill_alone_s``); None for a probe that computed nothing."""
    cost = (preset or get_preset("llamacpp")).cost
    computed, cached = int(sample.get("prompt_n") or 0), int(sample.get("cache_n") or 0)
    if computed <= 0 or not sample.get("prompt_ms"):
        return None
    return float(sample["prompt_ms"]) / 1000.0 / cost.prefill_alone_s(cached, computed)


#: a workload's own requests that ran alone on the host needed before their figure replaces the probes'
MIN_SOLO = 20
SOLO_MIN_TOKENS = 100  # fewer computed tokens: the fixed response time outweighs the prefill


def solo_costs(workload: Mapping, preset: Preset | None = None) -> list[float]:
    """The host's slowness as the workload's own requests read it: per request that computed at least
    ``SOLO_MIN_TOKENS`` and ran alone on the host (no other request of its run between its start and its end, on
    any replica), its time to first token less llama.cpp's response time and the router's way in and out
    (measured by the relays), over the preset's prefill of the same tokens."""
    preset = preset or get_preset("llamacpp")
    response_s = preset.llamacpp.response_s if preset.llamacpp is not None else 0.0
    out = []
    for runs in (workload.get("runs") or {}).values():
        for run in runs:
            log = [q for q in run.get("requests_log") or () if q.get("ok") and q.get("ttft_s") is not None]
            for q in log:
                computed = int(q.get("prompt_tokens") or 0) - int(q.get("cached_tokens") or 0)
                if computed < SOLO_MIN_TOKENS:
                    continue
                start, end = q["start_s"], q["start_s"] + q["ttft_s"]
                if any(o is not q and o["start_s"] < end and o["end_s"] > start for o in log):
                    continue
                hop_s = ((q.get("router_in_ms") or 0.0) + (q.get("router_out_ms") or 0.0)) / 1000.0
                out.append((q["ttft_s"] - response_s - hop_s) / preset.cost.prefill_alone_s(
                    int(q.get("cached_tokens") or 0), computed))
    return out


def engine_cost_sources(real: dict | None) -> dict[str, tuple[float, str]]:
    """Per workload, how many times slower than the preset this host ran llama.cpp, and what said so: the median
    of its own requests that ran alone on the host (``solo_costs``) where at least ``MIN_SOLO`` did, else the
    median over the replicas' prefill probes taken just before it (``bench/peers.py``'s ``engine_probe``: idle
    replicas, one cold prompt each, which read a few per cent slower than the same host's steady work); none:
    neither was measured."""
    out = {}
    for name, w in (real or {}).get("workloads", {}).items():
        solo = solo_costs(w)
        if len(solo) >= MIN_SOLO:
            out[name] = (round(statistics.median(solo), 3), f"{len(solo)} requests alone on the host")
            continue
        ratios = [r for r in (probe_cost(x) for x in w.get("engine_probe") or ()) if r is not None]
        if ratios:
            out[name] = (round(statistics.median(ratios), 3), f"{len(ratios)} probe{'s' if len(ratios) != 1 else ''}")
    return out


def sim_cell(repeats: list[dict]) -> dict:
    """One simulated cell over its repeats: each figure's median (as ``bench/peers.py`` takes the measured ones),
    failures summed, and every repeat under ``runs``."""
    cell: dict = {}
    for metric in SIM_METRICS:
        values = [r[metric] for r in repeats if r.get(metric) is not None]
        cell[metric] = round(statistics.median(values), 4) if values else None
    cell["requests"] = repeats[0]["requests"] if repeats else 0
    cell["failed"] = sum(r["failed"] for r in repeats)
    cell["runs"] = repeats
    return cell


def run_sim(workloads: list[str], cores: float, background: Mapping[str, float] | float,
            hops_ms: Mapping[str, Mapping[str, float]], say,
            tokenize: Tokenize | None = None, repeats: int = 1, jitters: dict[str, Jitter] | None = None,
            costs: Mapping[str, float] | None = None) -> dict:
    """The simulator's figures per workload and router (``hops_ms``: per workload, each router's round trip as
    measured; a router missing: none):
    ``repeats`` runs per cell, repeat ``n`` with its requests moved by the workload's measured jitter drawn with
    seed ``n`` (``bench/calibrate_jitter.py``; no jitter: every repeat the same timeline), each workload's engines
    ``costs`` times slower than the preset (measured; none: 1), medians and the repeats."""
    size = Size.llamacpp()
    capacity = replica_capacity_tokens(size, REPLICAS)
    tokenize = tokenize or tiny_tokenizer()
    jitters = jitters or {}
    if not isinstance(background, Mapping):
        background = {name: float(background) for name in workloads}
    costs = costs or {}
    out: dict = {"cache_tokens": cache_tokens(), "cores": cores, "background_cores": background, "hop_ms": hops_ms,
                 "engine_cost": dict(costs), "repeats": repeats, "workloads": {}}
    for name in workloads:
        workload = build(name, size, capacity)
        jitter = jitters.get(name, Jitter())
        hops = hops_ms.get(name, {})
        cells = {}
        for rival, policy in ROUTERS:
            hop_s = float(hops.get(rival) or 0.0) / 1000.0
            base = sim_workload(workload, tokenize, hop_s=hop_s)
            cells[rival] = sim_cell([simulate_cell(jittered(base, jitter, seed), policy, REPLICAS,
                                                   out["cache_tokens"], cores, background.get(name, 0.0), hop_s,
                                                   costs.get(name, 1.0))
                                     for seed in range(repeats)])
        out["workloads"][name] = cells
        say(f"sim {name}: " + json.dumps({k: {m: c[m] for m in SIM_METRICS} for k, c in cells.items()}))
    return out


def run_replay(real: dict | None, background: Mapping[str, float], say, cores: float,
               tokenize: Tokenize | None = None, costs: Mapping[str, float] | None = None) -> dict:
    """The simulator given each llama.cpp repeat's own arrivals (``calibrate_sim.replayed``): per workload and
    router, one simulated run per measured repeat, in the same order, with that workload's background load and
    engine cost."""
    size = Size.llamacpp()
    capacity = replica_capacity_tokens(size, REPLICAS)
    tokenize = tokenize or tiny_tokenizer()
    costs = costs or {}
    out: dict = {"cache_tokens": cache_tokens(), "workloads": {}}
    for name, w in (real or {}).get("workloads", {}).items():
        workload = build(name, size, capacity)
        cells = {}
        for rival, policy in ROUTERS:
            runs = []
            for run in w.get("runs", {}).get(rival, []):
                replay, hops = replayed(workload, tokenize, run.get("requests_log") or [])
                runs.append(simulate_cell(replay, policy, REPLICAS, out["cache_tokens"], cores,
                                          background.get(name, 0.0), hops, costs.get(name, 1.0)))
            cells[rival] = {"runs": runs}
        out["workloads"][name] = cells
        say(f"replay {name}: " + json.dumps({k: [r["cached_share"] for r in c["runs"]] for k, c in cells.items()}))
    return out


def cell_runs(source: dict | None, name: str, rival: str) -> list[dict]:
    """A source's repeats of one cell: under ``runs`` by rival (a ``bench/peers.py`` result) or under the rival's
    ``runs`` (the simulator's and the replay's); none: empty."""
    w = (source or {}).get("workloads", {}).get(name, {})
    return w.get("runs", {}).get(rival) or (w.get(rival) or {}).get("runs") or []


def judge_replay(result: dict, bounds: Bounds = Bounds()) -> dict[tuple[str, str], Paired]:
    """Per measured cell, the replayed repeats against the measured ones (empty without a replay)."""
    replay = result.get("replay") or {}
    return {(name, rival): paired(cell_runs(result.get("real"), name, rival), cell_runs(replay, name, rival), bounds)
            for name in replay.get("workloads", {}) for rival, _ in ROUTERS}


def arrival_order(run: Mapping) -> tuple[tuple[str, int], ...]:
    """The order a run's requests were sent in (flow, turn), by their send times."""
    return tuple((q["flow"], int(q["turn"])) for q in sorted(run.get("requests_log") or (), key=lambda q: q["start_s"]))


def same_order(result: dict) -> dict[tuple[str, str], Paired]:
    """Per cell, every fake repeat that sent its requests in the order of a llama.cpp repeat, against that repeat
    (the fake engine cannot be given llama.cpp's arrivals; where the lottery drew the same order, it is judged as
    the replay is). Cells without such a pair are left out."""
    out = {}
    for name in (result.get("fake") or {}).get("workloads", {}):
        for rival, _ in ROUTERS:
            by_order = {arrival_order(m): m for m in cell_runs(result.get("real"), name, rival)
                        if m.get("requests_log")}
            pairs = [(by_order[o], f) for f in cell_runs(result.get("fake"), name, rival)
                     if f.get("requests_log") and (o := arrival_order(f)) in by_order]
            if pairs:
                out[(name, rival)] = paired([m for m, _ in pairs], [f for _, f in pairs])
    return out


def met(result: dict) -> bool:
    """Every model on every cell, and the replay on every cell where one ran."""
    bounds = Bounds(**result.get("bounds", {}))
    return judge(result, bounds).met and all(p.met for p in judge_replay(result, bounds).values())


def jitters(real: dict | None) -> dict[str, Jitter]:
    """Per workload, the arrival jitter measured on the real run's repeats (none logged: no jitter)."""
    size = Size.llamacpp()
    capacity = replica_capacity_tokens(size, REPLICAS)
    out = {}
    for name, w in (real or {}).get("workloads", {}).items():
        flows = build(name, size, capacity)
        gated = {f.conv_id for f in flows.flows[flows.concurrency:]} if flows.concurrency else set()
        out[name] = measure(w.get("runs", {}), frozenset(gated))
    return out


def hops_ms(real: dict | None) -> dict[str, dict[str, float]]:
    """Per workload, each router's round trip as the real run measured it: the median over its runs of the run's
    ``hop_ms`` (clocked under the run's own load), else its ``hop_ms`` on the idle fleet, else 0."""
    rivals = (real or {}).get("rivals", {})
    idle = {key: float(rivals.get(key, {}).get("hop_ms") or 0.0) for key, _ in ROUTERS}
    out = {}
    for name, w in (real or {}).get("workloads", {}).items():
        out[name] = {}
        for key, _ in ROUTERS:
            loaded = [r["hop_ms"] for r in w.get("runs", {}).get(key, []) if r.get("hop_ms") is not None]
            out[name][key] = round(statistics.median(loaded), 2) if loaded else idle[key]
    return out


def background_cores(real: dict | None) -> dict[str, float]:
    """The real run's background load per workload: the host's busy cores less the replicas' while that workload
    ran (the models run each workload with its own: one mean over workloads gave a short, proxy-heavy workload's
    load to a long one and the reverse)."""
    return {name: float(w["host_cpu"]["background_cores"])
            for name, w in (real or {}).get("workloads", {}).items() if w.get("host_cpu")}


def judge(result: dict, bounds: Bounds = Bounds()) -> Calibration:
    """Every measured cell against the fake and simulated ones."""
    def cells(source: dict | None, summary: bool) -> dict:
        out: dict = {}
        for name, w in (source or {}).get("workloads", {}).items():
            rows = w["summary"] if summary else w
            for rival, _ in ROUTERS:
                row = rows.get(rival)
                runs = w.get("runs", {}).get(rival) if summary else (row or {}).get("runs")
                out[(name, rival)] = Figures.of(row, runs)
        return out

    measured = cells(result.get("real"), True)
    if not measured:  # nothing measured: every predicted cell misses for want of a measurement
        measured = {k: None for k in {**cells(result.get("fake"), True), **cells(result.get("sim"), False)}}
    return calibrate(measured, {"fake": cells(result.get("fake"), True), "sim": cells(result.get("sim"), False)},
                     MODELS, bounds)


# ---------------------------------------------------------------------------------------------- output
def _share(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:,.0f}"


def _spread(fig: Figures | None, cached: bool) -> str:
    """A figure's min–max over its repeats ('' for one repeat)."""
    span = fig and (fig.cached_range if cached else fig.p90_range)
    if not fig or fig.repeats < 2 or not span:
        return ""
    return f" [{span[0]:.1%}–{span[1]:.1%}]" if cached else f" [{span[0]:,.0f}–{span[1]:,.0f}]"


def _shares(runs: list[dict]) -> str:
    """The repeats' median cached share with its [min–max] ('-' for none)."""
    shares = [r["cached_share"] for r in runs if r.get("cached_share") is not None]
    if not shares:
        return "-"
    spread = f" [{min(shares):.1%}–{max(shares):.1%}]" if len(shares) > 1 else ""
    return _share(statistics.median(shares)) + spread


def _loads(background: Mapping[str, float] | float | None) -> str:
    """The models' background cores: one figure, or one per workload."""
    if isinstance(background, Mapping):
        return ", ".join(f"{name} {load:g}" for name, load in background.items()) or "0"
    return f"{background}"


def replica_cpu_per_token(real: dict | None) -> dict[str, float]:
    """Per workload, the llama.cpp replicas' CPU milliseconds per prompt token they computed (not cached), over
    every run: how fast the host ran the engines. The background load does not show a host that is slower per
    unit of work (a neighbour on the hypervisor, shared caches); this does."""
    out = {}
    for name, w in (real or {}).get("workloads", {}).items():
        cpu = w.get("host_cpu") or {}
        computed = sum((q.get("prompt_tokens") or 0) - (q.get("cached_tokens") or 0)
                       for runs in w.get("runs", {}).values() for run in runs for q in run.get("requests_log", ()))
        if computed > 0 and cpu.get("replica_cores") is not None:
            out[name] = round(cpu["replica_cores"] * cpu["wall_s"] * 1000 / computed, 3)
    return out


def render(result: dict) -> str:
    """The calibration table (markdown; medians over repeats, each with its [min–max]), the verdict, what missed."""
    cal = judge(result, Bounds(**result.get("bounds", {})))
    real = result.get("real") or {}
    load = [(real.get(k) or ["-"])[0] for k in ("load_average_start", "load_average_end")]
    repeats = {s: (result.get(s) or {}).get("repeats", "-") for s in SOURCES}
    costs = result.get("engine_cost") or {}
    lines = [f"{REPLICAS} llama.cpp replicas (tiny model, 1 thread, 1 slot, {result.get('cache_tokens', '?')} "
             f"tokens of host prompt cache each) on {result.get('cores')} cores, background "
             f"{_loads(result.get('background_cores'))} cores; repeats: llama.cpp {repeats['real']}, "
             f"fake {repeats['fake']}, "
             f"sim {repeats['sim']} (medians, [min–max]); load average {load[0]} → {load[1]}; llama.cpp CPU per "
             f"computed token {_loads(replica_cpu_per_token(real)) if replica_cpu_per_token(real) else '-'} ms; "
             f"models' engines slower than the preset by {_loads(costs) if costs else '- (1)'} "
             f"({_sources(result)})", "",
             "| workload | router | cached: llama.cpp | fake (Δ pt) | sim (Δ pt) | TTFT p50 ms: llama.cpp | fake | sim "
             "| TTFT p90 ms: llama.cpp | fake (Δ) | sim (Δ) | verdict |", "|---|---|" + "---|" * 10]
    for cell in cal.cells:
        m = cell.measured or Figures(None, None, None)
        by = {c.model: c for c in cell.checks}
        parts = [cell.workload, cell.router, _share(m.cached_share) + _spread(m, True)]
        for model in MODELS:
            c = by[model]
            err = "-" if c.cached_err_pt is None else f"{c.cached_err_pt:+.1f}"
            parts.append(f"{_share(c.predicted and c.predicted.cached_share)}{_spread(c.predicted, True)} "
                         f"({err}{'' if c.cached_met else ' ✗'})")
        parts.append(_ms(m.ttft_p50_ms))
        parts += [_ms(by[model].predicted and by[model].predicted.ttft_p50_ms) for model in MODELS]
        parts.append(_ms(m.ttft_p90_ms) + _spread(m, False))
        for model in MODELS:
            c = by[model]
            err = "-" if c.p90_err is None else f"{c.p90_err:+.0%}"
            parts.append(f"{_ms(c.predicted and c.predicted.ttft_p90_ms)}{_spread(c.predicted, False)} "
                         f"({err}{'' if c.p90_met else ' ✗'})")
        parts.append("met" if cell.met else "MISSED")
        lines.append("| " + " | ".join(parts) + " |")
    b = cal.bounds
    lines.append("")
    lines.append(f"bounds on the medians: cached share ±{b.cached_pt:g} pt, TTFT p90 ±{b.p90_rel:.0%}, every model on "
                 "every cell: "
                 + ("MET" if cal.met else f"MISSED on {sum(not c.met for c in cal.cells)} of {len(cal.cells)} cells"))
    lines += [f"MISSED {m}" for m in cal.missed()]
    replay = judge_replay(result, b)
    if replay:
        lines += ["", "Given each llama.cpp repeat's own arrivals (the simulator, repeat against repeat):", "",
                  "| workload | router | repeats | cached: llama.cpp | replayed | Δ pt, median size (largest) "
                  "| TTFT p90 Δ, median size (largest; not judged) | verdict |", "|---|---|---|---|---|---|---|---|"]
        for (name, rival), pair in replay.items():
            worst_c = max(map(abs, pair.cached_err_pt), default=None)
            worst_p = max(map(abs, pair.p90_err), default=None)
            lines.append(
                f"| {name} | {rival} | {pair.repeats} | {_shares(cell_runs(real, name, rival))} "
                f"| {_shares(cell_runs(result['replay'], name, rival))} "
                f"| {'-' if pair.cached_pt is None else f'{pair.cached_pt:.1f}'}"
                f" ({'-' if worst_c is None else f'{worst_c:.1f}'}) "
                f"| {'-' if pair.p90_rel is None else f'{pair.p90_rel:.0%}'}"
                f" ({'-' if worst_p is None else f'{worst_p:.0%}'}) | {'met' if pair.met else 'MISSED'} |")
        lines.append("")
        lines.append(f"bound on the median size of the cached share's error: ±{b.cached_pt:g} pt: "
                     + ("MET" if all(p.met for p in replay.values())
                        else f"MISSED on {sum(not p.met for p in replay.values())} of {len(replay)} cells"))
        lines += [f"MISSED {name} {rival} replay" for (name, rival), p in replay.items() if not p.met]
    matched = same_order(result)
    if matched:
        lines += ["", "Fake repeats that sent their requests in the order of a llama.cpp repeat, against it (shown, "
                  "not judged): " + "; ".join(
                      f"{name} {rival} {p.repeats} (cached Δ {p.cached_pt:.1f} pt, p90 {p.p90_rel:.0%})"
                      for (name, rival), p in matched.items() if p.repeats)]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", action="append", choices=WORKLOADS, help="repeatable; default: demo, apps, agent")
    p.add_argument("--repeats", type=int, default=1, help="interleaved repeats of the real and fake runs")
    p.add_argument("--sim-repeats", type=int, default=None,
                   help="the simulator's repeats, each with its own draw of the measured jitter (default: the "
                        "real run's repeats)")
    p.add_argument("--run", action="append", choices=SOURCES, help="sources to run (default all; others --from)")
    p.add_argument("--from", dest="from_file", metavar="FILE", help="a saved calibration to take other sources from")
    p.add_argument("--cores", type=float, default=float(os.cpu_count() or 1), help="the host's cores (models)")
    p.add_argument("--background-cores", type=float, default=None,
                   help="background load for the models (default: what the real run measured, else 0)")
    p.add_argument("--engine-cost", type=float, default=None,
                   help="the models' engines this many times slower than the preset (default: measured by the real "
                        "run's prefill probes, per workload; 1 = the preset as measured)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--save", action="store_true", help="also write bench/results/calibrate-<UTC time>.json")
    p.add_argument("--render", metavar="FILE", help="print the table of a saved calibration, run nothing")
    args = p.parse_args(argv)
    if args.render:
        result = json.loads(Path(args.render).read_text())
        print(render(result))
        return 0 if met(result) else 1
    if args.repeats < 1 or (args.sim_repeats is not None and args.sim_repeats < 1):
        p.error("--repeats and --sim-repeats must be positive")
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    workloads = args.workload or list(WORKLOADS)
    runs = args.run or list(SOURCES)
    base = json.loads(Path(args.from_file).read_text()) if args.from_file else {}

    def say(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    started = time.time()
    result = {"workloads": workloads, "cores": args.cores, "cache_tokens": cache_tokens(),
              "bounds": {"cached_pt": Bounds().cached_pt, "p90_rel": Bounds().p90_rel},
              "real": base.get("real"), "fake": base.get("fake"), "sim": base.get("sim"),
              "replay": base.get("replay")}
    if "real" in runs:
        result["real"] = run_fleet("real", workloads, args.repeats, args.cores, {}, say)
        result["replay"] = None  # a saved replay replayed other repeats
    background = ({name: args.background_cores for name in workloads} if args.background_cores is not None
                  else background_cores(result["real"]))
    result["background_cores"] = background
    sources = engine_cost_sources(result["real"]) if args.engine_cost is None else {}
    costs = ({name: args.engine_cost for name in workloads} if args.engine_cost is not None
             else {name: cost for name, (cost, _) in sources.items()})
    result["engine_cost"] = costs
    result["engine_cost_source"] = ({name: src for name, (_, src) in sources.items()} if sources
                                    else {name: "--engine-cost" for name in costs})
    if "fake" in runs:
        result["fake"] = run_fleet("fake", workloads, args.repeats, args.cores, background, say,
                                   jitter=jitters(result["real"]), costs=costs)
        result["fake"]["jittered"] = True
    if "sim" in runs:
        measured = jitters(result["real"])
        result["jitter"] = {name: {**j.summary(), "samples": j.to_json()} for name, j in measured.items()}
        sim_repeats = args.sim_repeats or (result["real"] or {}).get("repeats") or args.repeats
        result["sim"] = run_sim(workloads, args.cores, background, hops_ms(result["real"]), say,
                                repeats=sim_repeats, jitters=measured, costs=costs)
    if "replay" in runs:
        result["replay"] = run_replay(result["real"], background, say, args.cores, costs=costs)
    result["wall_s"] = round(time.time() - started, 1)
    if args.save:
        stamp = time.strftime("%Y-%m-%dT%H%M", time.gmtime(started))
        path = Path(__file__).resolve().parent / "results" / f"calibrate-{stamp}.json"
        path.write_text(json.dumps(result) + "\n")
        say(f"saved {path}")
    print(json.dumps(result) if args.json else render(result))
    return 0 if met(result) else 1


if __name__ == "__main__":
    sys.exit(main())
