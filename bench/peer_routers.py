"""SGLang's router (PyPI ``sglang-router==0.3.2``) in a venv of its own, and one running router process.

``ensure_venv(path)`` creates the venv once (``python -m venv`` + ``pip install sglang-router==0.3.2``) and reuses it
while its marker file names that version. ``SglangRouter(binary, worker_urls, policy)`` runs
``sglang-router launch`` on free 127.0.0.1 ports (HTTP and Prometheus) with the policy's defaults, waits until
every worker is registered and healthy, and always stops it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import httpx

from kvroute.plugin.child_processes import (
    ChildOwner,
    ChildStartError,
    spawn,
    start_with_port_retry,
    terminate,
    wait_until_ready,
)
from kvroute.plugin.proxy_process import free_port

SGLANG_ROUTER_PIN = "sglang-router==0.3.2"
DEFAULT_VENV = Path(__file__).resolve().parent.parent / ".kvroute" / "sglang-router-0.3.2"


def ensure_venv(path: Path = DEFAULT_VENV, python: str | None = None) -> Path:
    """The ``sglang-router`` executable of the venv at ``path``, creating the venv first if needed."""
    binary = path / "bin" / "sglang-router"
    marker = path / ".kvroute-pin"
    if binary.exists() and marker.exists() and marker.read_text().strip() == SGLANG_ROUTER_PIN:
        return binary
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = ([python or sys.executable, "-m", "venv", str(path)],
             [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              SGLANG_ROUTER_PIN])
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ChildStartError(f"could not set up {SGLANG_ROUTER_PIN} in {path}: {' '.join(cmd[:3])} ... exited "
                                  f"{done.returncode}:\n{(done.stderr or done.stdout)[-2000:]}")
    if not binary.exists():
        raise ChildStartError(f"{SGLANG_ROUTER_PIN} installed no sglang-router executable in {path / 'bin'}")
    marker.write_text(SGLANG_ROUTER_PIN + "\n")
    return binary


class SglangRouter(ChildOwner):
    """``sglang-router launch --policy POLICY --worker-urls ...`` on 127.0.0.1; ``base_url`` once started."""

    def __init__(self, binary: Path, worker_urls: Sequence[str], policy: str = "cache_aware",
                 start_timeout_s: float = 60.0, log_level: str = "warn") -> None:
        self.binary = binary
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.start_timeout_s = start_timeout_s
        self.log_level = log_level
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvroute-sglang-{policy}-"))
        self.log_path = self.workdir / "router.log"
        self.port = 0
        self.process = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> SglangRouter:
        def launch() -> subprocess.Popen:
            self.port = free_port()
            self.process = spawn([str(self.binary), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                                  "--policy", self.policy, "--log-level", self.log_level,
                                  "--worker-urls", *self.worker_urls], self.log_path)
            return self.process

        start_with_port_retry(launch, self._wait_ready, self.log_path)
        return self

    def _wait_ready(self) -> None:
        def registered() -> bool:
            workers = client.get(self.base_url + "/workers").json().get("workers") or []
            return len(workers) == len(self.worker_urls) and all(w.get("is_healthy") for w in workers)

        with httpx.Client(timeout=2.0, trust_env=False) as client:
            wait_until_ready(self.process, self.log_path, registered, what=f"sglang-router ({self.policy})",
                             timeout_s=self.start_timeout_s,
                             not_ready=f"had not registered all {len(self.worker_urls)} workers", poll_s=0.2, tail=30)

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)
