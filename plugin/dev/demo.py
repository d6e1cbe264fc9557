"""``kvroute demo``: local replicas + a real LiteLLM proxy with kvroute; the same workload under kvroute's
cache-aware routing and under round robin, side by side. Every process it starts is stopped on exit or Ctrl-C.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass

import typer

from kvroute.plugin.dev.demo_workload import PolicyReport, replay, warm_up
from kvroute.plugin.dev.workloads import WorkloadSpec, build_sessions
from kvroute.plugin.extras import MissingExtra, require
from kvroute.policies.errors import KvrouteError

POLICIES = (("kvroute", "demo-kvroute", "cache_aware"), ("round_robin", "demo-round-robin", "round_robin"))
ENGINE_LABEL = {"llamacpp": "llama.cpp", "fake": "fake"}


@dataclass(frozen=True)
class DemoOptions:
    """What ``kvroute demo`` runs: replicas per policy, requests per policy, engine choice, workload shape."""

    replicas: int = 3
    requests: int = 48
    engine: str = "auto"
    workload: WorkloadSpec | None = None
    cache_dir: str | None = None

    def spec(self) -> WorkloadSpec:
        base = self.workload or WorkloadSpec()
        return WorkloadSpec(requests=self.requests, turns=base.turns, prefixes=base.prefixes,
                            prefix_tokens=base.prefix_tokens, max_tokens=base.max_tokens,
                            concurrency=base.concurrency, seed=base.seed)


def replica_capacity_tokens(spec: WorkloadSpec, replicas: int) -> int:
    """Cache room per replica: its share of the shared prefixes plus one, with their conversations.

    Affinity routing fits; spraying every prefix over every replica does not, which is what the demo shows.
    """
    per_replica = math.ceil(spec.shared_prefixes / replicas) + 1
    return per_replica * (spec.prefix_tokens + 64 * spec.turns + 64)


def _replica_options(kind: str, spec: WorkloadSpec, replicas: int, cache_dir: str | None):
    from kvroute.plugin.dev.fleet import ReplicaOptions
    from kvroute.plugin.dev.tiny_model import PRESETS

    capacity = replica_capacity_tokens(spec, replicas)
    if kind == "llamacpp":
        mib = PRESETS["small"].cache_ram_mib(capacity)
        return ReplicaOptions(cache_ram_mib=mib, threads=1, parallel=1, cache_dir=cache_dir), capacity
    return ReplicaOptions(capacity_tokens=capacity, block_tokens=16, prefill_tokens_per_s=8000.0, decode_ms=2.0,
                          slots=2), capacity


def run_demo(options: DemoOptions, status=None, progress=None) -> dict:
    """Start everything, replay the workload per policy, stop everything; return the demo's JSON dict.

    ``status(msg)`` receives progress messages; ``progress(phase, done, total)`` each finished request.
    """
    from kvroute.plugin.dev.fleet import Fleet, resolve_engine
    from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

    say = status or (lambda _msg: None)
    require("proxy", "demo")
    spec = options.spec()
    kind = resolve_engine(options.engine)
    replica_options, capacity = _replica_options(kind, spec, options.replicas, options.cache_dir)
    sessions = build_sessions(spec)
    reports: dict[str, PolicyReport] = {}
    say(f"starting {options.replicas} {ENGINE_LABEL[kind]} replicas per policy, {len(POLICIES) * options.replicas} "
        f"in all (cache room ≈ {capacity} tokens each)")
    with Fleet(options.replicas, kind, replica_options, name_prefix="kvroute") as kv_fleet, \
            Fleet(options.replicas, kind, replica_options, name_prefix="round-robin") as rr_fleet:
        fleets = {"kvroute": kv_fleet, "round_robin": rr_fleet}
        engine = "llamacpp" if kind == "llamacpp" else "vllm"
        groups = [ModelGroup(group, fleets[key].api_bases, model=kv_fleet.model, engine=engine, id_prefix=group,
                             kv_capacity_tokens=capacity, block_size=16 if kind == "fake" else None)
                  for key, group, _ in POLICIES]
        config = build_proxy_config(groups, kvroute=True)
        kvroute_settings = {"groups": {group: {"policy": policy} for _, group, policy in POLICIES}}
        say("starting the LiteLLM proxy with kvroute (10–30 s on 2 cores)")
        with ProxyProcess(config, kvroute_settings=kvroute_settings, inherit_kvroute_env=False) as proxy:
            for key, group, _policy in POLICIES:
                asyncio.run(warm_up(proxy.base_url, proxy.master_key or "", group))
                done = 0

                def on_result(_result, key=key) -> None:
                    nonlocal done
                    done += 1
                    if progress is not None:
                        progress(key, done, spec.requests)

                say(f"replaying {spec.requests} requests with {key.replace('_', ' ')}")
                reports[key] = asyncio.run(replay(proxy.base_url, proxy.master_key or "", group, sessions,
                                                  spec.concurrency, spec.max_tokens, on_result))
            wasted = {key: wasted_prefill(proxy.base_url, proxy.headers, group) for key, group, _ in POLICIES}
    return {"engine": ENGINE_LABEL[kind], "replicas": options.replicas, "requests": spec.requests,
            "policies": {key: {**reports[key].as_dict(), "wasted_prefill_tokens": wasted[key]}
                         for key, _, _ in POLICIES}}


def wasted_prefill(base_url: str, headers: dict[str, str], group: str) -> int | None:
    """The proxy's ``kvroute_wasted_prefill_tokens_total`` for ``group`` (prompt tokens prefilled on a replica while
    another held them, from kvroute's index at each pick); None when the metrics cannot be read."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(base_url + "/kvroute/metrics", headers=headers, trust_env=False, timeout=30).text
        for family in text_string_to_metric_families(text):
            if family.name == "kvroute_wasted_prefill_tokens":
                return int(sum(s.value for s in family.samples
                               if s.name.endswith("_total") and s.labels.get("group") == group))
    except Exception:
        return None
    return 0


def render(result: dict, console) -> None:
    """The side-by-side table of the demo's figures."""
    from rich.table import Table

    from kvroute.plugin.cli.output import fold

    def secs(x: float | None) -> str:
        return "-" if x is None else f"{x * 1000:.0f} ms"

    def tokens(x: int | None) -> str:
        return "-" if x is None else f"{x:,}"

    kv, rr = result["policies"]["kvroute"], result["policies"]["round_robin"]
    table = Table(title=f"kvroute demo: {result['replicas']} {result['engine']} replicas and "
                        f"{result['requests']} requests per policy")
    table.add_column("metric")
    table.add_column("kvroute (cache_aware)", justify="right")
    table.add_column("round robin", justify="right")
    table.add_row("cached-token share", f"{kv['cached_token_share']:.1%}", f"{rr['cached_token_share']:.1%}")
    table.add_row("TTFT p50", secs(kv["ttft_p50_s"]), secs(rr["ttft_p50_s"]))
    table.add_row("TTFT p90", secs(kv["ttft_p90_s"]), secs(rr["ttft_p90_s"]))
    table.add_row("requests/s", f"{kv['requests_per_s']:.2f}", f"{rr['requests_per_s']:.2f}")
    table.add_row("wasted prefill (tokens held elsewhere)", tokens(kv.get("wasted_prefill_tokens")),
                  tokens(rr.get("wasted_prefill_tokens")))
    table.add_row("failed", str(kv["failed"]), str(rr["failed"]))
    console.print(fold(table))


def policy_rows(result: dict) -> list[dict]:
    """One row per policy of the demo's figures (for ``--format csv``)."""
    return [{"policy": key, "engine": result["engine"], "replicas": result["replicas"], **figures}
            for key, figures in result["policies"].items()]


def demo_command(
    replicas: int = typer.Option(3, min=2, max=8, help="Replicas per policy (3 or 4 recommended)."),
    requests: int = typer.Option(48, min=4, max=5000, help="Requests replayed per policy."),
    engine: str = typer.Option("auto", help="auto (llama.cpp when xllamacpp is installed), llamacpp or fake."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON only (same as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table | json | csv (one row per policy)"),
    cache_dir: str = typer.Option(None, help="Where the tiny llama.cpp model is cached (default "
                                              "KVROUTE_CACHE_DIR, else ~/.cache/kvroute)."),
) -> None:
    """Run local replicas behind a real LiteLLM proxy and compare kvroute with round robin."""
    from rich.console import Console
    from rich.markup import escape
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvroute.plugin.cli.output import resolve_format, stdout_console, write_csv
    from kvroute.plugin.settings import CliSettings

    fmt = resolve_format(fmt, json_out)
    err = Console(stderr=True)
    if cache_dir is None and (from_env := CliSettings().cache_dir) is not None:
        cache_dir = str(from_env)
    options = DemoOptions(replicas=replicas, requests=requests, engine=engine, cache_dir=cache_dir)
    started = time.perf_counter()
    try:
        if fmt == "json":
            result = run_demo(options)
        else:
            bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                           console=err, transient=False)
            tasks: dict[str, int] = {}

            def progress(phase: str, done: int, total: int) -> None:
                if phase not in tasks:
                    tasks[phase] = bar.add_task(phase.replace("_", " "), total=total)
                bar.update(tasks[phase], completed=done)

            with bar:
                result = run_demo(options, status=lambda m: bar.console.print(f"[dim]{escape(m)}[/dim]"),
                                  progress=progress)
    except KeyboardInterrupt:
        err.print("interrupted: every replica and the proxy were stopped")
        raise typer.Exit(130) from None
    except MissingExtra:
        raise
    except KvrouteError as exc:
        err.print(f"[red]demo failed:[/red] {escape(str(exc))}")
        raise typer.Exit(1) from None
    if fmt == "json":
        sys.stdout.write(json.dumps(result) + "\n")
        return
    if fmt == "csv":
        rows = policy_rows(result)
        write_csv(rows, list(rows[0]))
        return
    render(result, stdout_console())
    err.print(f"[dim]done in {time.perf_counter() - started:.0f} s; all processes stopped[/dim]")
