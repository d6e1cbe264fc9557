"""``kvroute simulate`` and ``kvroute lint`` (mounted by ``kvroute.plugin.cli.cli``)."""

from __future__ import annotations

import dataclasses
import math
import sys
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

import typer

from kvroute.policies.errors import KvrouteError


def _value(raw: str) -> Any:
    low = raw.lower()
    if low in ("inf", "infinity"):
        return math.inf
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


def _price(raw: str) -> Decimal:
    from kvroute.policies.errors import ConfigError

    try:
        value = Decimal(raw)
    except InvalidOperation:
        raise ConfigError("usd_per_gpu_hour", f"not a number: {raw!r}") from None
    if not value.is_finite() or value < 0:
        raise ConfigError("usd_per_gpu_hour", "must be a non-negative number")
    return value


def parse_params(params: list[str]) -> dict[str, Any]:
    """``key=value`` pairs (numbers, ``inf``, booleans, strings) for a workload generator."""
    from kvroute.policies.errors import ConfigError

    out: dict[str, Any] = {}
    for p in params:
        if "=" not in p:
            raise ConfigError("param", f"expected key=value, got {p!r}")
        k, v = p.split("=", 1)
        out[k.strip().replace("-", "_")] = _value(v.strip())
    return out


def build_workload(spec: str, block_tokens: int, params: dict[str, Any], *, speedup: float = 1.0,
                   limit: int | None = None) -> Any:
    """A generator name (``gsp``, ``llmd-ladder``, ...) or ``mooncake:|kvct:|azure:|log:PATH``."""
    from kvroute.policies.errors import ConfigError
    from kvroute.sim import traces
    from kvroute.sim.workloads import GENERATORS

    kind, _, path = spec.partition(":")
    if path:
        if kind == "mooncake":
            return traces.load_mooncake(path, speedup=speedup, limit=limit)
        if kind == "kvct":
            arr = traces.SessionArrivals(gap_s=float(params.pop("session_gap_s", 30.0)), speedup=speedup,
                                         seed=int(params.pop("seed", 0)))
            return traces.load_kvct(path, arrivals=arr, max_sessions=params.pop("max_sessions", 20),
                                    shared_prefix=bool(params.pop("shared_prefix", False)), limit=limit)
        if kind == "azure":
            return traces.load_azure(path, speedup=speedup, prefix_groups=int(params.pop("prefix_groups", 0)),
                                     prefix_tokens=int(params.pop("prefix_tokens", 0)), limit=limit)
        if kind == "log":
            return traces.load_request_log(path, rate=float(params.pop("rate", 5.0)), limit=limit)
        raise ConfigError("workload", f"unknown trace kind {kind!r}; use mooncake:, kvct:, azure: or log:")
    gen = GENERATORS.get(spec)
    if gen is None:
        raise ConfigError("workload", f"unknown workload {spec!r}; known: {', '.join(GENERATORS)} or "
                                      "mooncake:PATH, kvct:PATH, azure:PATH, log:PATH")
    try:
        return gen(block_tokens, **params)
    except TypeError as exc:
        raise ConfigError("param", f"{spec}: {exc}") from None


def simulate_command(
    workload: str = typer.Option(..., "--workload", "-w", metavar="NAME",
                                 help="gsp, one-shared-prefix, llmd-ladder, prefix-repetition, prefix-ratio, chat, "
                                 "rag, agent, unique; or a trace: mooncake:PATH, kvct:PATH, azure:PATH, log:PATH"),
    replicas: int = typer.Option(8, "--replicas", "-r", min=1, metavar="N"),
    policies: str = typer.Option("", "--policies", metavar="A,B",
                                 help="Comma-separated; default: kvroute's default + baselines."),
    preset: str = typer.Option("qwen3-32b-h100-tp2", "--preset", metavar="NAME"),
    kv_tokens: int | None = typer.Option(None, "--kv-tokens", min=1, metavar="N",
                                         help="KV capacity per replica (tokens)."),
    gpu_hour: str | None = typer.Option(None, "--usd-per-gpu-hour", metavar="USD",
                                        help="Price per GPU-hour (default: preset's)."),
    param: list[str] = typer.Option([], "--param", "-p", metavar="K=V",
                                    help="Generator parameter key=value (repeatable)."),
    speedup: float = typer.Option(1.0, "--speedup", metavar="X", help="Divide trace timestamps by this."),
    limit: int | None = typer.Option(None, "--limit", min=1, metavar="N",
                                     help="Read at most this many trace requests."),
    max_concurrency: int | None = typer.Option(None, "--max-concurrency", min=1, metavar="N",
                                               help="Client-side cap on in-flight requests."),
    no_metrics: bool = typer.Option(False, "--no-metrics", help="Do not feed scraped engine metrics to routers."),
    json_out: bool = typer.Option(False, "--json", help="Print the JSON summary instead of the table "
                                  "(same as --format json)."),
    fmt: str = typer.Option("table", "--format", metavar="FMT", help="table | json | csv (printed on stdout)"),
    csv_path: Path | None = typer.Option(None, "--csv", metavar="FILE", help="Write all figures as CSV."),
    html_path: Path | None = typer.Option(None, "--html", metavar="FILE", help="Write a self-contained HTML report."),
    plots_dir: Path | None = typer.Option(None, "--plots", metavar="DIR", help="Write PNG plots into this folder."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    hosted: Path | None = typer.Option(None, "--hosted", metavar="FILE", help="YAML of hosted routes (price, TTFT, "
                                       "rate limits, outages) and a ttft_target_s: compare the overflow strategies "
                                       "instead."),
    strategies: str = typer.Option("", "--strategies", metavar="A,B", help="With --hosted: a subset of self_hosted, "
                                   "fallback_on_error, always_hosted, hybrid (default: all)."),
    spike: str | None = typer.Option(None, "--spike-window", metavar="START:END", help="With --hosted: seconds "
                                     "counted as the spike (default: the busiest 10 minutes, or third of the run)."),
    hedge: str | None = typer.Option(None, "--hedge", metavar="BUDGET", help="With --hosted: replay the streams "
                                     "on the hosted routes without and with hedging at this budget (\"5%\"; the "
                                     "file's hedge: block gives the rest) instead of the strategies."),
) -> None:
    """Replay a workload on a simulated fleet under several routing policies and compare them."""
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from kvroute.policies.errors import ConfigError
    from kvroute.sim.engine import FleetConfig
    from kvroute.sim.lineup import BLOCK_REPLICAS_ONLY, DEFAULT_LINEUP
    from kvroute.sim.presets import get_preset
    from kvroute.sim.report import dumps_json, print_table, to_csv, to_html
    from kvroute.sim.runner import compare

    err = Console(stderr=True)
    if fmt not in ("table", "json", "csv"):
        typer.echo(f"error: --format: must be one of table, json, csv, not {fmt!r}", err=True)
        raise typer.Exit(2)
    fmt = "json" if json_out else fmt
    try:
        pr = get_preset(preset)
        if gpu_hour is not None:
            pr = dataclasses.replace(pr, usd_per_gpu_hour=_price(gpu_hour))
        wl = build_workload(workload, pr.block_tokens, parse_params(param), speedup=speedup, limit=limit)
        if max_concurrency is not None:
            wl.max_concurrency = max_concurrency
        fleet = FleetConfig(replicas, pr, kv_tokens=kv_tokens, metrics_interval_s=None if no_metrics else 0.05)
        if hosted is not None:
            if policies:
                raise ConfigError("--policies", "does not apply with --hosted (use --strategies)")
            if hedge is not None:
                _simulate_hedge(wl, hosted, hedge, fmt)
                return
            _simulate_hosted(wl, fleet, hosted, strategies, spike, fmt, csv_path)
            return
        if strategies or spike or hedge is not None:
            raise ConfigError("--strategies" if strategies else "--spike-window" if spike else "--hedge",
                              "needs --hosted FILE")
        names = [p.strip() for p in policies.split(",") if p.strip()] or \
            [n for n in DEFAULT_LINEUP if pr.engine == "vllm" or n not in BLOCK_REPLICAS_ONLY]
        if pr.engine != "vllm" and BLOCK_REPLICAS_ONLY & set(names):
            raise ConfigError("--policies", f"{', '.join(sorted(BLOCK_REPLICAS_ONLY & set(names)))} read block "
                                            f"replicas; preset {pr.name} runs {pr.engine} replicas")
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=err, disable=quiet, transient=True) as bar:
            tasks = {n: bar.add_task(n, total=len(wl.requests)) for n in names}
            comp = compare(wl, fleet, names, lambda n, done, total: bar.update(tasks[n], completed=done))
    except KvrouteError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if fmt == "json":
        sys.stdout.write(dumps_json(comp) + "\n")
    elif fmt == "csv":
        sys.stdout.write(to_csv(comp))
    else:
        print_table(comp)
    if csv_path is not None:
        csv_path.write_text(to_csv(comp), encoding="utf-8")
    images: dict[str, bytes] = {}
    if plots_dir is not None or html_path is not None:
        from kvroute.sim import plots

        try:
            images = plots.render(comp)
        except KvrouteError as exc:
            if plots_dir is not None:
                typer.echo(f"error: {exc}", err=True)
                raise typer.Exit(2) from None
            typer.echo(f"note: HTML report without plots ({exc})", err=True)
        if plots_dir is not None:
            plots.write(images, plots_dir, wl.name.replace(":", "-").replace("/", "-"))
    if html_path is not None:
        html_path.write_text(to_html(comp, images), encoding="utf-8")


def _window(raw: str | None, workload: Any) -> Any:
    from kvroute.policies.errors import ConfigError
    from kvroute.sim.spike import SpikeWindow, busiest_window

    if raw is None:
        times = [r.arrival for r in workload.requests if r.follows is None]
        span = (max(times) - min(times)) if times else 0.0
        return busiest_window(workload, min(600.0, span / 3) if span > 0 else 600.0)
    try:
        start, end = (float(x) for x in raw.split(":", 1))
    except ValueError:
        raise ConfigError("--spike-window", f"expected START:END in seconds, got {raw!r}") from None
    if not 0 <= start < end < math.inf:
        raise ConfigError("--spike-window", f"need 0 <= START < END, got {raw!r}")
    return SpikeWindow(start, end)


def _simulate_hedge(wl: Any, path: Path, budget: str, fmt: str) -> None:
    """``--hosted FILE --hedge BUDGET``: the hosted routes' streams without and with hedging, side by side."""
    import json

    from rich.console import Console
    from rich.table import Table

    from kvroute.policies.hedging import HedgeConfig
    from kvroute.sim.hedge_replay import replay_hedged
    from kvroute.sim.hosted import load_hosted

    plan = load_hosted(path)
    config = HedgeConfig.parse({**(plan.hedge or {}), "budget": budget}, "--hedge")
    rows = [replay_hedged(wl, plan.routes, None).row(), replay_hedged(wl, plan.routes, config).row()]
    if fmt == "json":
        sys.stdout.write(json.dumps({"workload": wl.name, "routes": [s.name for s in plan.routes], "rows": rows})
                         + "\n")
        return
    if fmt == "csv":
        sys.stdout.write(",".join(rows[0]) + "\n" + "".join(",".join(str(v) for v in r.values()) + "\n"
                                                           for r in rows))
        return
    table = Table(title=f"{wl.name} on hosted routes {', '.join(s.name for s in plan.routes)}: hedging at "
                        f"{config.budget:.0%} of requests, p{config.quantile * 100:g} of each route's TTFT")
    for column in ("setting", "TTFT p50 ms", "p90 ms", "p99 ms", "p99.9 ms", "extra requests", "extra cost", "wins"):
        table.add_column(column, justify="left" if column == "setting" else "right")
    for r in rows:
        table.add_row(r["setting"], str(r["ttft_p50_ms"]), str(r["ttft_p90_ms"]), str(r["ttft_p99_ms"]),
                      str(r["ttft_p999_ms"]), f"{r['extra_requests_pct']} %", f"{r['extra_cost_pct']} %",
                      str(r["hedge_wins"]))
    Console(width=160).print(table)


def _simulate_hosted(wl: Any, fleet: Any, path: Path, strategies: str, spike: str | None, fmt: str,
                     csv_path: Path | None) -> None:
    """``--hosted``: the overflow strategies on this workload, the same table as ``bench/hybrid_spike.py``."""
    from kvroute.policies.errors import ConfigError
    from kvroute.sim.hosted import load_hosted
    from kvroute.sim.overflow_report import print_table, to_csv, to_json
    from kvroute.sim.spend import replica_rate_card
    from kvroute.sim.strategies import STRATEGIES, check_targets, run_strategies

    plan = load_hosted(path)
    names = [n.strip() for n in strategies.split(",") if n.strip()] or list(STRATEGIES)
    for n in names:
        if n not in STRATEGIES:
            raise ConfigError("--strategies", f"unknown strategy {n!r}; known: {', '.join(STRATEGIES)}")
    window = _window(spike, wl)
    card = replica_rate_card(fleet.preset)
    try:
        figs = run_strategies(wl, window, fleet, plan.routes, card, target_s=plan.ttft_target_s, names=names,
                              queue_limit=plan.queue_limit, hybrid_knobs=plan.hybrid)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, KvrouteError):
            raise
        raise ConfigError(f"{path}: hybrid", str(exc)) from None
    checks = check_targets({f.strategy: f for f in figs})
    meta = {"workload": wl.name, "replicas": fleet.replicas, "preset": fleet.preset.name,
            "target_s": plan.ttft_target_s, "spike_window_s": [window.start_s, window.end_s]}
    if fmt == "json":
        sys.stdout.write(to_json(figs, checks, meta) + "\n")
    elif fmt == "csv":
        sys.stdout.write(to_csv(figs))
    else:
        print_table(figs, checks, f"{wl.name} on {fleet.replicas} x {fleet.preset.name}, spike "
                    f"{window.start_s:.0f}-{window.end_s:.0f} s, target {plan.ttft_target_s:g} s", plan.ttft_target_s)
    if csv_path is not None:
        csv_path.write_text(to_csv(figs), encoding="utf-8")


def lint_command(
    log: Path = typer.Argument(..., help="JSONL request log (OpenAI-style bodies or LiteLLM spend logs)."),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output (same as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table | json | csv (one row per finding)"),
    excerpts: bool = typer.Option(False, "--excerpts", help="Show one short excerpt per finding, volatile value "
                                  "masked (off by default: no prompt text is printed)."),
    limit: int | None = typer.Option(None, "--limit", min=1),
) -> None:
    """Find what breaks prefix reuse in your prompts (volatile fields early, reordered tools) and how to fix it."""
    import json

    from kvroute.sim.lint import lint_log, print_report

    if fmt not in ("table", "json", "csv"):
        typer.echo(f"error: --format: must be one of table, json, csv, not {fmt!r}", err=True)
        raise typer.Exit(2)
    fmt = "json" if json_out else fmt
    try:
        report = lint_log(log, excerpts=excerpts, limit=limit)
    except KvrouteError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if fmt == "json":
        sys.stdout.write(json.dumps(report.as_dict(), indent=2) + "\n")
    elif fmt == "csv":
        import csv

        columns = ["app", "kind", "where", "position_tokens", "requests", "distinct_values", "tokens_lost", "fix"]
        writer = csv.DictWriter(sys.stdout, fieldnames=columns + (["excerpt"] if excerpts else []),
                                extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        for finding in report.findings:
            writer.writerow(finding.as_dict())
    else:
        print_report(report)
