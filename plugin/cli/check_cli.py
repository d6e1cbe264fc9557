"""``kvroute check CONFIG [--live]``: every problem of a proxy config, one per line; exit 2 (a problem you can fix,
as every command) when there is one or a live probe fails."""

from __future__ import annotations

from pathlib import Path

import typer


def check_command(
    config: Path = typer.Argument(..., help="The LiteLLM proxy config.yaml (with its kvroute: block)."),
    live: bool = typer.Option(False, "--live", help="Also reach each replica's api_base and metrics_url, Redis "
                              "and the billing database, and say what answers."),
    timeout: float = typer.Option(3.0, "--timeout", min=0.1, help="Seconds per live probe."),
) -> None:
    """Validate the kvroute block, model_info, the callbacks line and KVROUTE_* overrides (offline)."""
    from kvroute.plugin.cli.check import check_config, probe
    from kvroute.plugin.cli.exit_codes import USAGE_ERROR as FIXABLE

    report = check_config(config)
    for note in report.notes:
        typer.echo(f"note: {note}")
    for problem in report.problems:
        typer.echo(f"{config}: {problem}")
    if not report.ok:
        typer.echo(f"{len(report.problems)} problem(s) in {config}", err=True)
        raise typer.Exit(FIXABLE)
    hosted = sum(1 for b in report.backends if not b.self_hosted)
    groups = sorted({b.group for b in report.backends})
    typer.echo(f"{config}: ok ({len(groups)} groups: {', '.join(groups)}; {len(report.backends) - hosted} "
               f"self-hosted, {hosted} hosted deployments)")
    if not live:
        return
    probes = probe(report, timeout)
    for p in probes:
        typer.echo(p.line())
    failed = sum(1 for p in probes if not p.ok)
    if failed:
        typer.echo(f"{failed} of {len(probes)} live checks failed", err=True)
        raise typer.Exit(FIXABLE)
