"""The ``kvroute`` command: one entry point; each concern mounts its own sub-commands here.

Command modules import heavy dependencies (LiteLLM, SQLAlchemy, ZMQ) inside their functions, so
``kvroute --help`` and light commands start fast.
"""

from __future__ import annotations

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kvroute: KV-cache-aware routing, failover and usage billing for LiteLLM.")


def _mount() -> None:
    from kvroute.plugin.bench_cli import bench_app

    app.add_typer(bench_app, name="bench", help="Benchmarks of the routing core.")

    from kvroute.sim.cli import lint_command, simulate_command

    app.command("simulate", help="What-if simulation: would cache-aware routing help this traffic?")(simulate_command)
    app.command("lint", help="Find what breaks prefix reuse in a request log, and how to fix it.")(lint_command)
    from kvroute.plugin.status import status

    app.command("status", help="Breaker and routing state of a running proxy.")(status)
    from kvroute.plugin.events_cli import events_app

    app.add_typer(events_app, name="events", help="Engine KV-cache event streams (precise mode).")
    from kvroute.plugin.demo import demo_command

    app.command("demo", help="Local replicas behind a real LiteLLM proxy: kvroute vs round robin.")(demo_command)
    from kvroute.billing.cli import billing_app, report_app

    app.add_typer(billing_app, name="billing", help="Usage ledger: ingest events, load price books, close periods.")
    app.add_typer(report_app, name="report", help="Monthly usage, margin and payout reports.")


_mount()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
