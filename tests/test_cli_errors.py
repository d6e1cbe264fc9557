"""Every ``kvroute`` command fails with one line and exit 2: a missing extra, an unreachable database, a bad
config naming its key, a missing file; ``--debug`` / ``KVROUTE_DEBUG=1`` show the traceback instead.

The missing-extra cases run the built wheel from a fresh venv that cannot see the extra's packages
(``KVROUTE_BARE_PYTHON``: CI's venv with the bare wheel; otherwise this environment minus those packages).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from wheel_helpers import bare_env, build_wheel, filtered_site, install_wheel

from kvroute.plugin.cli.cli import one_line_error
from kvroute.plugin.extras import EXTRAS, MissingExtra, extra_for_module

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
ALL_EXTRA_MODULES = sorted({m for mods in EXTRAS.values() for m in mods} | {"uvloop", "nacl", "hiredis"})
KVROUTE = [sys.executable, "-m", "kvroute.plugin.cli.cli"]


@pytest.fixture(scope="module")
def farm_python(tmp_path_factory) -> Path:
    """The python of a fresh venv holding only the built wheel (dependencies: this environment, filtered)."""
    tmp = tmp_path_factory.mktemp("bare")
    return install_wheel(build_wheel(tmp), tmp / "venv")


@pytest.fixture(scope="module")
def wheel_python(request) -> Path | None:
    """None when CI gives a venv with the bare wheel (``KVROUTE_BARE_PYTHON``), else ``farm_python``."""
    if os.environ.get("KVROUTE_BARE_PYTHON"):
        return None
    return request.getfixturevalue("farm_python")


def run_without(wheel_python: Path | None, blocked: list[str], args: list[str], tmp: Path,
                **env: str) -> subprocess.CompletedProcess:
    """``kvroute ARGS`` from the wheel's venv with the ``blocked`` modules absent."""
    if wheel_python is None:
        py, environ = Path(os.environ["KVROUTE_BARE_PYTHON"]), bare_env(Path(os.environ["KVROUTE_BARE_PYTHON"]), None)
    else:
        py, environ = wheel_python, bare_env(wheel_python, filtered_site(tmp / "site", blocked))
    return subprocess.run([str(py), "-m", "kvroute.plugin.cli.cli", *args], capture_output=True, text=True, cwd=tmp,
                          env={**environ, **env}, timeout=120)


def one_line(out: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in out.stderr.splitlines() if ln.strip()]
    assert "Traceback" not in out.stderr and len(lines) == 1, out.stderr
    return lines[0]


MISSING = [
    (["demo", "--engine", "fake"], "demo", "proxy"),
    (["report", "usage", "--period", "2026-10"], "report", "billing"),
    (["billing", "ingest", str(EXAMPLES / "usage.jsonl")], "billing", "billing"),
    (["billing", "load-prices", str(EXAMPLES / "prices.yaml")], "billing", "billing"),
    (["events", "inspect", "--endpoint", "tcp://127.0.0.1:5557", "--duration", "0"], "events", "events"),
    (["bench", "decision", "--repeats", "10"], "bench decision", "litellm"),
    (["simulate", "-w", "gsp", "-r", "2", "-q", "--plots", "plots"], "simulate --plots", "sim"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("args", "command", "extra"), MISSING, ids=[m[1] for m in MISSING])
def test_bare_wheel_names_the_missing_extra(wheel_python, tmp_path, args, command, extra):
    out = run_without(wheel_python, ALL_EXTRA_MODULES, args, tmp_path)
    assert out.returncode == 2, out.stderr
    assert one_line(out) == f"kvroute {command} needs the '{extra}' extra: pip install 'kvroute[{extra}]'"
    assert not (tmp_path / ".kvroute").exists()


@pytest.mark.slow  # builds and installs the wheel into a fresh venv (farm_python)
def test_demo_on_llamacpp_names_the_engines_extra(farm_python, tmp_path):
    out = run_without(farm_python, list(EXTRAS["engines"]), ["demo", "--engine", "llamacpp"], tmp_path)
    assert out.returncode == 2
    assert one_line(out) == ("kvroute demo --engine=llamacpp needs the 'engines' extra: "
                             "pip install 'kvroute[engines]'")


@pytest.mark.slow
def test_bare_wheel_runs_what_needs_no_extra(wheel_python, tmp_path):
    """The routing core's commands work with the core dependencies alone."""
    env = dict.fromkeys(["EXAMPLE_REPLICA_1_API_BASE", "EXAMPLE_REPLICA_2_API_BASE", "EXAMPLE_REPLICA_3_API_BASE",
                         "EXAMPLE_PROVIDER_A_API_BASE", "EXAMPLE_PROVIDER_B_API_BASE"], "http://127.0.0.1:9/v1")
    env |= dict.fromkeys(["EXAMPLE_REPLICA_1_METRICS_URL", "EXAMPLE_REPLICA_2_METRICS_URL",
                          "EXAMPLE_REPLICA_3_METRICS_URL"], "http://127.0.0.1:9/metrics")
    check = run_without(wheel_python, ALL_EXTRA_MODULES, ["check", str(EXAMPLES / "config.yaml")], tmp_path, **env)
    assert check.returncode == 0 and ": ok (2 groups" in check.stdout, check.stdout + check.stderr
    sim = run_without(wheel_python, ALL_EXTRA_MODULES, ["simulate", "-w", "gsp", "-r", "2", "-q", "--format", "csv",
                                                        "-p", "groups=4", "-p", "prompts_per_group=4"], tmp_path)
    assert sim.returncode == 0 and sim.stdout.startswith("policy,"), sim.stderr
    live = run_without(wheel_python, ALL_EXTRA_MODULES, ["check", str(EXAMPLES / "config.yaml"), "--live",
                                                         "--timeout", "0.5"], tmp_path,
                       KVROUTE_REDIS_URL="redis://127.0.0.1:9/0", **env)
    assert live.returncode == 2
    # a Redis URL without the redis package is a settings problem naming the key and the extra, in one line
    assert ("kvroute.redis_url: sharing state needs the redis package (pip install 'kvroute[redis]')"
            in live.stdout), live.stdout + live.stderr


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kvroute(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTE_")}
    return subprocess.run([*KVROUTE, *args], capture_output=True, text=True, cwd=cwd, env={**environ, **env},
                          timeout=120)


@pytest.mark.slow
def test_unreachable_database_is_one_line_and_debug_shows_the_traceback(tmp_path):
    db = f"postgresql+psycopg://kvroute@127.0.0.1:{closed_port()}/nowhere"
    for args in (["report", "margin", "--period", "2026-10"], ["billing", "ingest", str(EXAMPLES / "usage.jsonl")]):
        out = kvroute(args, tmp_path, KVROUTE_BILLING_DB=db)
        assert out.returncode == 2
        line = one_line(out)
        assert line.startswith("error: cannot reach the database:") and "Connection refused" in line, line
    debug = kvroute(["--debug", "report", "margin", "--period", "2026-10"], tmp_path, KVROUTE_BILLING_DB=db)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "OperationalError" in debug.stderr
    env_debug = kvroute(["report", "margin", "--period", "2026-10"], tmp_path, KVROUTE_BILLING_DB=db, KVROUTE_DEBUG="1")
    assert "Traceback" in env_debug.stderr


def test_report_on_a_missing_ledger_says_so_and_creates_nothing(tmp_path):
    out = kvroute(["report", "usage", "--period", "2026-10"], tmp_path)
    assert out.returncode == 2
    assert one_line(out) == (f"error: no usage ledger at {tmp_path / '.kvroute' / 'billing.db'} (set KVROUTE_DATA_DIR "
                             "or KVROUTE_BILLING_DB as the proxy has them, or pass --db)")
    assert not (tmp_path / ".kvroute").exists()


@pytest.mark.slow
def test_bad_settings_and_missing_files_are_one_line_naming_the_key_or_file(tmp_path):
    bad_env = kvroute(["billing", "close-period", "--period", "2026-10", "--db", str(tmp_path / "l.db")], tmp_path,
                      KVROUTE_BILLING_GRACE_HOURS="soon")
    assert bad_env.returncode == 2 and one_line(bad_env).startswith("error: grace_hours: ")
    bad_prices = tmp_path / "prices.yaml"
    bad_prices.write_text("currency: USD\nbackends: [{id: a, provider: p, rates: [{effective_from: 2026-01-01, "
                          "input_per_mtok: lots}]}]\n")
    out = kvroute(["billing", "load-prices", str(bad_prices), "--check"], tmp_path)
    assert out.returncode == 2 and "backends[a].rates[0].input_per_mtok" in one_line(out)
    for args in (["billing", "ingest", "nope.jsonl", "--db", str(tmp_path / "l.db")], ["lint", "nope.jsonl"],
                 ["simulate", "-w", "log:nope.jsonl", "-q"]):
        out = kvroute(args, tmp_path)
        assert out.returncode == 2 and "nope.jsonl" in one_line(out), (args, out.stderr)


def test_status_of_an_unreachable_proxy_is_one_line(tmp_path):
    out = kvroute(["status", "--proxy", f"http://127.0.0.1:{closed_port()}"], tmp_path)
    assert out.returncode == 2 and one_line(out).startswith("error: cannot reach http://127.0.0.1:")


def test_missing_extra_message_keeps_its_brackets_in_the_demo_console():
    """Rich would read ``[proxy]`` as markup; the demo escapes it (the message is printed verbatim)."""
    from rich.console import Console
    from rich.markup import escape

    console = Console(record=True, width=200)
    console.print(f"[red]demo failed:[/red] {escape(str(MissingExtra('demo', 'proxy')))}")
    assert "pip install 'kvroute[proxy]'" in console.export_text()


def test_a_failed_import_maps_to_the_extra_that_provides_it():
    assert extra_for_module("sqlalchemy.orm") == "billing"
    assert extra_for_module("zmq") == "events"
    assert extra_for_module("litellm") == "litellm"
    assert extra_for_module("fastapi") == "proxy"
    assert extra_for_module("matplotlib.pyplot") == "sim"
    assert extra_for_module("xllamacpp") == "engines"
    assert extra_for_module("json") is None
    exc = ModuleNotFoundError("No module named 'redis'", name="redis")
    assert one_line_error(exc, "check") == "kvroute check needs the 'redis' extra: pip install 'kvroute[redis]'"
