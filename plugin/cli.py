"""The ``kvroute`` command: one entry point; each concern mounts its own sub-commands here.

Command modules import heavy dependencies (LiteLLM, SQLAlchemy, ZMQ) inside their functions, so
``kvroute --help`` and light commands start fast. ``main`` turns every error a user can cause into one line on
stderr (a missing extra, an unreachable database, a bad config naming its key, a missing file) and exits 2;
``--debug`` or ``KVROUTE_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

import click
import typer

from kvroute.plugin.extras import MissingExtra, extra_for_module, require
from kvroute.policies.errors import KvrouteError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kvroute: KV-cache-aware routing, failover and usage billing for LiteLLM.")

# Top-level commands that cannot run at all without an extra (finer needs are checked inside the commands).
COMMAND_EXTRAS = {"demo": "proxy", "billing": "billing", "report": "billing", "events": "events"}
USAGE_ERROR = 2
_args: list[str] = []  # the arguments main() runs with (the root callback cannot see the sub-command's own)


@app.callback()
def _root(ctx: typer.Context,
          debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error "
                                     "(also KVROUTE_DEBUG=1).")) -> None:
    extra = COMMAND_EXTRAS.get(ctx.invoked_subcommand or "")
    if extra and not _asks_for_help(_args or sys.argv[1:]):
        require(extra, ctx.invoked_subcommand or "")


def _mount() -> None:
    from kvroute.plugin.bench_cli import bench_app

    app.add_typer(bench_app, name="bench", help="Benchmarks of the routing core.")

    from kvroute.sim.cli import lint_command, simulate_command

    app.command("simulate", help="What-if simulation: would cache-aware routing help this traffic?")(simulate_command)
    app.command("lint", help="Find what breaks prefix reuse in a request log, and how to fix it.")(lint_command)
    from kvroute.plugin.status import status

    app.command("status", help="Breaker and routing state of a running proxy.")(status)
    from kvroute.plugin.check_cli import check_command

    app.command("check", help="Validate a LiteLLM proxy config for kvroute (offline; --live reaches the services).")(
        check_command)
    from kvroute.plugin.events_cli import events_app

    app.add_typer(events_app, name="events", help="Engine KV-cache event streams (precise mode).")
    from kvroute.plugin.demo import demo_command

    app.command("demo", help="Local replicas behind a real LiteLLM proxy: kvroute vs round robin.")(demo_command)
    from kvroute.billing.cli import billing_app, report_app

    app.add_typer(billing_app, name="billing", help="Usage ledger: ingest events, load price books, close periods.")
    app.add_typer(report_app, name="report", help="Monthly usage, margin and payout reports.")


_mount()


def _asks_for_help(args: Sequence[str]) -> bool:
    return "--help" in args or "-h" in args


def command_name(args: Sequence[str]) -> str:
    """The (sub-)command the arguments name, e.g. ``billing ingest`` (``kvroute`` itself when none)."""
    group: click.Command = typer.main.get_command(app)
    words: list[str] = []
    for arg in args:
        if arg.startswith("-"):
            continue
        sub = group.commands.get(arg) if isinstance(group, click.Group) else None
        if sub is None:
            break
        words.append(arg)
        group = sub
    return " ".join(words) or "kvroute"


def _first_line(text: str) -> str:
    lines = [line.strip() for line in str(text).strip().splitlines() if line.strip()]
    return lines[0] if lines else ""


def one_line_error(exc: BaseException, command: str) -> str:
    """The one line a user sees for ``exc`` raised by ``kvroute <command>``."""
    if isinstance(exc, MissingExtra):
        return str(exc)
    if isinstance(exc, ModuleNotFoundError):
        extra = extra_for_module(exc.name)
        if extra:
            return str(MissingExtra(command, extra, exc.name))
        return f"error: kvroute {command} cannot import {exc.name}: {exc}"
    if isinstance(exc, KvrouteError):
        return f"error: {exc}"
    module = type(exc).__module__ or ""
    if module.startswith("sqlalchemy") and type(exc).__name__ in ("OperationalError", "InterfaceError"):
        orig = getattr(exc, "orig", None) or exc
        return f"error: cannot reach the database: {_first_line(str(orig))}"
    if module.startswith("pydantic") and type(exc).__name__ == "ValidationError":
        err = exc.errors()[0]  # type: ignore[attr-defined]
        key = ".".join(str(p) for p in err.get("loc", ())) or "settings"
        return f"error: {key}: {err.get('msg', 'invalid')}"
    if isinstance(exc, FileNotFoundError):
        return f"error: no such file: {exc.filename or exc}"
    if isinstance(exc, OSError):
        where = f": {exc.filename}" if exc.filename else ""
        return f"error: {exc.strerror or exc}{where}"
    return f"error: kvroute {command} failed: {type(exc).__name__}: {_first_line(str(exc))} (--debug shows more)"


def main(argv: Sequence[str] | None = None) -> None:
    """Run the CLI; errors become one line on stderr and exit 2 (1 for unexpected ones) unless debugging."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in args or os.environ.get("KVROUTE_DEBUG", "").lower() in ("1", "true", "yes")
    args = [a for a in args if a != "--debug"]
    command = command_name(args)
    _args[:] = args
    try:
        app(args=args, prog_name="kvroute")
    except SystemExit:
        raise
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        raise SystemExit(130) from None
    except Exception as exc:
        if debug:
            raise
        expected = isinstance(exc, KvrouteError | ModuleNotFoundError | OSError) or \
            type(exc).__module__.startswith(("sqlalchemy", "pydantic"))
        sys.stderr.write(one_line_error(exc, command) + "\n")
        raise SystemExit(USAGE_ERROR if expected else 1) from None


if __name__ == "__main__":
    main()
