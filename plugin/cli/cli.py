"""The ``kvroute`` command: one entry point; each concern mounts its own sub-commands here.

Command modules import heavy dependencies (LiteLLM, SQLAlchemy, ZMQ) inside their functions, so
``kvroute --help`` and light commands start fast. ``main`` turns every error a user can cause into one line on
stderr (a missing extra, an unreachable database, a bad config naming its key, a missing file) and exits 2;
``--debug`` or ``KVROUTE_DEBUG=1`` shows the traceback instead.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

import typer

from kvroute.plugin.cli.exit_codes import USAGE_ERROR
from kvroute.plugin.extras import MissingExtra, extra_for_module, require
from kvroute.policies.errors import KvrouteError

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="kvroute: KV-cache-aware routing, failover and usage billing for LiteLLM.")


@dataclass(frozen=True)
class Need:
    """``kvroute <command>`` (with ``option`` given, without ``unless``) cannot run without ``extra``."""

    command: str
    extra: str
    option: str | None = None
    unless: str | None = None


NEEDS = (
    Need("demo", "proxy"),
    Need("demo", "engines", option="--engine=llamacpp"),
    Need("billing", "billing"),
    Need("report", "billing"),
    Need("events", "events"),
    Need("simulate", "sim", option="--plots"),
    Need("bench decision", "litellm", unless="--no-litellm"),
)


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show the full traceback of an error "
                                     "(also KVROUTE_DEBUG=1).")) -> None:
    """kvroute: KV-cache-aware routing, failover and usage billing for LiteLLM."""


def _has(args: Sequence[str], option: str) -> bool:
    name, _, value = option.partition("=")
    for i, arg in enumerate(args):
        if arg == option or (not value and arg == name):
            return True
        if value and arg == name and i + 1 < len(args) and args[i + 1] == value:
            return True
    return False


def check_needs(command: str, args: Sequence[str]) -> None:
    """Raise ``MissingExtra`` for the first extra ``kvroute <command> <args>`` needs and lacks."""
    if "--help" in args or "-h" in args:
        return
    for need in NEEDS:
        if f"{command} ".startswith(f"{need.command} ") and (need.option is None or _has(args, need.option)) \
                and not (need.unless and _has(args, need.unless)):
            require(need.extra, need.command if need.option is None else f"{need.command} {need.option}")


def _mount() -> None:
    from kvroute.plugin.cli.bench_cli import bench_app

    app.add_typer(bench_app, name="bench", help="Benchmarks of the routing core.")

    from kvroute.sim.cli import lint_command, simulate_command

    app.command("simulate", help="What-if simulation: would cache-aware routing help this traffic?")(simulate_command)
    app.command("lint", help="Find what breaks prefix reuse in a request log, and how to fix it.")(lint_command)
    from kvroute.plugin.cli.status import status

    app.command("status", help="Breaker and routing state of a running proxy.")(status)
    from kvroute.plugin.cli.check_cli import check_command

    app.command("check", help="Validate a LiteLLM proxy config for kvroute (offline; --live reaches the services).")(
        check_command)
    from kvroute.plugin.cli.wait import wait_command

    app.command("wait", help="Wait until URLs (or a proxy config's deployments) answer, e.g. a proxy just started.")(
        wait_command)
    from kvroute.plugin.cli.events_cli import events_app

    app.add_typer(events_app, name="events", help="Engine KV-cache event streams (precise mode).")
    from kvroute.plugin.dev.demo import demo_command

    app.command("demo", help="Local replicas behind a real LiteLLM proxy: kvroute vs round robin.")(demo_command)
    from kvroute.billing.cli import billing_app, report_app

    app.add_typer(billing_app, name="billing", help="Usage ledger: ingest events, load price books, close periods.")
    app.add_typer(report_app, name="report", help="Usage, margin, payouts, statements and a page, per app.")


_mount()


def command_name(args: Sequence[str]) -> str:
    """The (sub-)command the arguments name, e.g. ``billing ingest`` (``kvroute`` itself when none)."""
    group = typer.main.get_command(app)
    words: list[str] = []
    for arg in args:
        if arg.startswith("-"):
            continue
        sub = (getattr(group, "commands", None) or {}).get(arg)
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
    from kvroute.plugin.settings import CliSettings

    debug = "--debug" in args or CliSettings().debug
    args = [a for a in args if a != "--debug"]
    command = command_name(args)
    try:
        check_needs(command, args)
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
