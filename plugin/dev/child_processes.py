"""Child processes that never outlive their parent: spawn with logs to a file, stop by process group, clean up on
exit, SIGTERM/SIGHUP and parent death. Used by the engine fleet, the proxy runner and the demo.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

from kvroute.policies.errors import KvrouteError

_LIVE: set[subprocess.Popen] = set()
_LOCK = threading.Lock()


class ChildStartError(KvrouteError):
    """A child did not start or become ready; the message carries the tail of its log."""


def _die_with_parent() -> None:  # runs in the child between fork and exec
    if sys.platform.startswith("linux"):
        import ctypes

        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn(cmd: Sequence[str], log_path: Path, env: Mapping[str, str] | None = None,
          cwd: str | Path | None = None) -> subprocess.Popen:
    """Start ``cmd`` in its own session with stdout+stderr appended to ``log_path``; it gets SIGTERM if we die."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                env=dict(env) if env is not None else None, cwd=cwd, start_new_session=True,
                                preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None)
    with _LOCK:
        _LIVE.add(proc)
    return proc


def terminate(proc: subprocess.Popen, timeout: float = 5.0) -> int | None:
    """SIGTERM the child's process group, SIGKILL it after ``timeout`` s; return the exit code."""
    try:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                _signal_group(proc, signal.SIGKILL)
                proc.wait(5)
        _signal_group(proc, signal.SIGKILL)  # stragglers left in the group
        return proc.returncode
    finally:
        with _LOCK:
            _LIVE.discard(proc)


def kill(proc: subprocess.Popen) -> None:
    """SIGKILL the child's group at once (a crash, for failover tests) and reap it."""
    _signal_group(proc, signal.SIGKILL)
    with contextlib.suppress(Exception):
        proc.wait(5)
    with _LOCK:
        _LIVE.discard(proc)


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
    with contextlib.suppress(ProcessLookupError, PermissionError, OSError):
        if proc.poll() is None:
            proc.send_signal(sig)


def live_children() -> list[int]:
    """PIDs of the children started here and not yet stopped."""
    with _LOCK:
        return [p.pid for p in _LIVE if p.poll() is None]


def terminate_many(procs: list[subprocess.Popen], timeout: float = 5.0) -> None:
    """Stop several children in parallel: SIGTERM all, wait up to ``timeout`` s in total, SIGKILL the rest."""
    for proc in procs:
        if proc.poll() is None:
            _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for proc in procs:
        with contextlib.suppress(Exception):
            proc.wait(max(0.0, deadline - time.monotonic()))
        with contextlib.suppress(Exception):
            terminate(proc, 0.5)


def terminate_all(timeout: float = 5.0) -> None:
    """Stop every child still alive (atexit and signal handlers call this)."""
    with _LOCK:
        procs = list(_LIVE)
    terminate_many(procs, timeout)


atexit.register(terminate_all)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """Turn SIGTERM/SIGHUP into ``SystemExit`` while inside, so ``finally`` blocks stop the children.

    Only acts in the main thread and only where the default action (die without cleanup) is installed.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous: dict[int, object] = {}

    def handler(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGHUP):
        if signal.getsignal(sig) in (signal.SIG_DFL, None):
            previous[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            with contextlib.suppress(Exception):
                signal.signal(sig, old)


def wait_until_ready(proc: subprocess.Popen, log_path: Path, ready: Callable[[], bool], *, what: str,
                     timeout_s: float, not_ready: str = "not ready", poll_s: float = 0.25, tail: int = 40) -> None:
    """Poll ``ready()`` until it is true; raise ``ChildStartError`` with the log's tail when the process exits or
    ``timeout_s`` passes (``not_ready`` says what was missing). An exception from ``ready`` counts as not yet."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise ChildStartError(f"{what} exited with code {proc.returncode}:\n{log_tail(log_path, tail)}")
        if time.monotonic() > deadline:
            raise ChildStartError(f"{what} {not_ready} after {timeout_s:g}s:\n{log_tail(log_path, tail)}")
        try:
            if ready():
                return
        except Exception:
            pass
        time.sleep(poll_s)


def start_with_port_retry(launch: Callable[[], subprocess.Popen], wait: Callable[[], None], log_path: Path,
                          attempts: int = 3) -> subprocess.Popen:
    """``launch()`` a child (on a port it picks), then ``wait()`` until it is ready; a child that failed because
    another process took its port meanwhile ("address already in use" in its log) is stopped and launched again,
    ``attempts`` times in all. Any other failure, or the last clash, raises ``wait``'s ``ChildStartError``."""
    for attempt in range(attempts):
        proc = launch()
        try:
            wait()
            return proc
        except ChildStartError:
            terminate(proc)
            try:
                clash = "address already in use" in log_path.read_text(errors="replace").lower()
            except OSError:
                clash = False
            if not clash or attempt == attempts - 1:
                raise
    raise ValueError("attempts must be >= 1")


def write_ready_file(path: str | Path, port: int, name: str) -> None:
    """Atomically publish ``{"port", "pid", "name"}`` so a parent knows the server is listening."""
    target = Path(path)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps({"port": port, "pid": os.getpid(), "name": name}))
    tmp.replace(target)


def read_ready_file(path: Path) -> dict | None:
    """The ready record, or None while the child has not written it."""
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, ValueError):
        return None


def log_tail(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a child's log (for error messages)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log {path} unreadable: {exc.strerror or exc}; was its directory removed?)"


class ChildOwner:
    """Base of objects that own child processes: ``with`` starts them (SIGTERM/SIGHUP become ``SystemExit``
    meanwhile, so cleanup runs) and always stops them. Subclasses implement idempotent ``start``/``stop``."""

    _signals: contextlib.AbstractContextManager[None] | None = None

    def start(self) -> ChildOwner:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def _leave_signals(self) -> None:
        if self._signals is not None:
            self._signals.__exit__(None, None, None)
            self._signals = None

    def __enter__(self):
        self._signals = exit_on_signals()
        self._signals.__enter__()
        try:
            return self.start()
        except BaseException:
            try:
                self.stop()
            finally:
                self._leave_signals()
            raise

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop()
        finally:
            self._leave_signals()


def tree_rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and all its descendants in MiB (Linux ``/proc``; 0 once gone or elsewhere)."""
    return sum(tree_rss_by_process(pid).values())


def tree_rss_by_process(pid: int) -> dict[str, float]:
    """Resident memory in MiB of ``pid`` and each of its descendants, keyed ``"<pid> <what>"`` (what: the module
    a ``python -m`` runs, else the program's name); empty once gone or elsewhere."""
    found: dict[str, float] = {}
    todo, seen = [pid], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            status = Path(f"/proc/{p}/status").read_text()
            for task in os.listdir(f"/proc/{p}/task"):
                todo += [int(c) for c in Path(f"/proc/{p}/task/{task}/children").read_text().split()]
        except (OSError, ValueError):
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        rss = fields.get("VmRSS")
        if rss is not None:
            found[f"{p} {_program(p, fields.get('Name', '?').strip())}"] = int(rss.split()[0]) / 1024
    return found


def _program(pid: int, name: str) -> str:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return name
    if "-m" in argv[:-1]:
        return argv[argv.index("-m") + 1]
    script = argv[1] if len(argv) > 1 and Path(argv[0]).name.startswith("python") else ""
    return Path(script).name if script and not script.startswith("-") else name
