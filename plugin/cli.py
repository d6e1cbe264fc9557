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


_mount()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
