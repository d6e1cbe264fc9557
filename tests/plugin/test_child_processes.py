"""child_processes.start_with_port_retry: a child whose port was taken is launched again on another; any other
start failure is raised at once. Real child processes binding real loopback sockets."""

from __future__ import annotations

import socket
import sys

import pytest

from kvroute.plugin.dev.child_processes import (
    ChildStartError,
    spawn,
    start_with_port_retry,
    terminate,
    wait_until_ready,
)
from kvroute.plugin.dev.proxy_process import free_port

CHILD = """
import socket, sys, time
s = socket.socket()
try:
    s.bind(("127.0.0.1", int(sys.argv[1])))
except OSError as exc:
    print("bind failed:", exc, flush=True)  # Linux: [Errno 98] Address already in use
    sys.exit(1)
if sys.argv[2] == "crash":
    print("boom", flush=True)
    sys.exit(3)
s.listen()
open(sys.argv[3], "w").write("ready")
time.sleep(60)
"""


def _starter(tmp_path, ports: list[int], mode: str = "serve"):
    """``launch``/``wait`` for a child that binds the next of ``ports``; ``launched`` lists the ports tried."""
    log, ready = tmp_path / "child.log", tmp_path / "ready"
    launched: list[int] = []
    procs: list = []

    def launch():
        launched.append(ports[len(launched)])
        procs.append(spawn([sys.executable, "-c", CHILD, str(launched[-1]), mode, str(ready)], log))
        return procs[-1]

    def wait():
        wait_until_ready(procs[-1], log, ready.exists, what="child", timeout_s=10)

    return launch, wait, log, launched


def test_a_taken_port_is_retried_on_another(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        launch, wait, log, launched = _starter(tmp_path, [busy, busy, free_port()])
        proc = start_with_port_retry(launch, wait, log)
        try:
            assert launched[-1] != busy and len(launched) == 3 and proc.poll() is None
        finally:
            terminate(proc)


def test_the_last_clash_and_other_failures_raise(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        launch, wait, log, launched = _starter(tmp_path / "a", [busy, busy])
        with pytest.raises(ChildStartError, match="already in use"):
            start_with_port_retry(launch, wait, log, attempts=2)
        assert len(launched) == 2
    launch, wait, log, launched = _starter(tmp_path / "b", [free_port(), free_port()], mode="crash")
    with pytest.raises(ChildStartError, match="boom"):
        start_with_port_retry(launch, wait, log)
    assert len(launched) == 1  # not a port clash: no second launch
