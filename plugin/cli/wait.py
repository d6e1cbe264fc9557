"""``kvroute wait TARGET... [--timeout S]``: block until every target answers, so scripts start in order.

A target is a URL (it answers when it returns any HTTP status below 500) or a proxy config file (every
deployment's ``api_base``/``models`` and ``metrics_url``, as ``kvroute check --live`` reaches them). Prints one
line when all answer; exits 2 naming what still did not answer when the time is up.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    import httpx

POLL_S = 0.25


def urls_of(target: str) -> list[str]:
    """The URLs one target stands for (a config's problems raise ``ConfigError`` with the first of them)."""
    if target.startswith(("http://", "https://")):
        return [target]
    from kvroute.plugin.cli.check import check_config
    from kvroute.policies.errors import ConfigError

    report = check_config(Path(target))
    if report.problems:
        raise ConfigError(target, report.problems[0])
    found = []
    for b in report.backends:
        if b.api_base:
            found.append(b.api_base.rstrip("/") + "/models")
        if b.metrics_url:
            found.append(b.metrics_url)
    return found


def answers(client: httpx.Client, url: str) -> bool:
    import httpx

    try:
        return client.get(url).status_code < 500
    except httpx.HTTPError:
        return False


def wait_command(
    targets: list[str] = typer.Argument(..., help="URLs, or proxy config files whose deployments to wait for."),
    timeout: float = typer.Option(60.0, "--timeout", min=0.1, help="Seconds to wait for all of them."),
) -> None:
    """Wait until every URL (or every deployment of a proxy config) answers HTTP; exit 2 if time runs out."""
    import httpx

    from kvroute.plugin.cli.exit_codes import USAGE_ERROR

    pending = list(dict.fromkeys(url for target in targets for url in urls_of(target)))
    total, start = len(pending), time.monotonic()
    with httpx.Client(timeout=min(2.0, timeout)) as client:
        while pending:
            pending = [url for url in pending if not answers(client, url)]
            if pending and time.monotonic() - start >= timeout:
                typer.echo(f"error: no answer within {timeout:g} s from {', '.join(pending)}", err=True)
                raise typer.Exit(USAGE_ERROR)
            if pending:
                time.sleep(POLL_S)
    typer.echo(f"ready: {total} URL(s) answer ({time.monotonic() - start:.1f} s)")
