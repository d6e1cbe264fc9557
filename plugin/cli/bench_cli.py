"""``kvroute bench ...``: benchmarks that print ratios against a baseline measured in the same run."""

from __future__ import annotations

import json

import typer

bench_app = typer.Typer(no_args_is_help=True)


@bench_app.command("decision")
def decision(
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON (same as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table | json | csv (one row per case)"),
    tokens: str = typer.Option("1000,8000,32000,128000", help="Prompt sizes in tokens, comma-separated."),
    backends: str = typer.Option("4,16,64", help="Backend counts, comma-separated."),
    repeats: int = typer.Option(300, min=10, help="Timed picks per case."),
    litellm_baseline: bool = typer.Option(True, "--litellm/--no-litellm",
                                          help="Also time LiteLLM's Router.acompletion (a mock response)."),
) -> None:
    """Fingerprint + pick latency for chat prompts on a warm index, against one xxh3 pass."""
    from kvroute.plugin.cli.output import resolve_format, write_csv
    from kvroute.plugin.dev.decision_bench import render_table, run_decision_bench

    fmt = resolve_format(fmt, json_out)
    result = run_decision_bench(
        [int(t) for t in tokens.split(",")], [int(b) for b in backends.split(",")], repeats, litellm_baseline
    )
    if fmt == "json":
        typer.echo(json.dumps(result, indent=2))
    elif fmt == "csv":
        cases = [{**c, "litellm_acompletion_p50_us": result["litellm_acompletion_p50_us"]} for c in result["cases"]]
        write_csv(cases, [*result["cases"][0].keys(), "litellm_acompletion_p50_us"] if cases else [])
    else:
        render_table(result)
