"""The Rust routers ``bench/peers.py`` runs, each from PyPI in a venv of its own, and one running router process.

Three projects, pinned: SGLang's router ``sglang-router==0.3.2`` (kept for continuity), its successor SMG
``smg==1.13.0`` (the Shepherd Model Gateway) and vLLM's fork ``vllm-router==0.1.17``. ``ensure_venv(kind)``
creates ``.kvroute/<project>-<version>`` once (``python -m venv`` + ``pip install --require-hashes -r
requirements/bench/<project>.txt``: the pin and its dependencies, every file's sha256 checked) and reuses it while
its marker file names that pin. ``PeerRouter(kind, binary, worker_urls, policy, extra_args)`` launches the router on
free 127.0.0.1 ports (HTTP and Prometheus) with the policy's CLI defaults, waits until ``GET /workers`` lists
every worker healthy (all three answer that route alike), and always stops it.

Flags against plain OpenAI-compatible workers (the fake engines, llama.cpp): none of the three needs one to route.
``--prometheus-port`` is set only so parallel routers do not collide on a default port (29000). SMG registers an
HTTP worker after probing SGLang's ``/server_info`` and ``/model_info`` (404 on these workers: it logs a warning
and falls back); it loads no tokenizer for HTTP workers (its ``cache_aware`` keeps a character tree).
vllm-router 0.1.17's ``cache_aware`` asks a worker for ``POST /v1/chat/completions/render`` (then ``/tokenize``)
before every request and routes on the token ids; when both fail (llama.cpp answers neither in vLLM's shape) it
logs ``render_unavailable`` and has no prefix to match, and no flag turns that off.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from kvroute.plugin.dev.child_processes import (
    ChildOwner,
    ChildStartError,
    spawn,
    start_with_port_retry,
    terminate,
    wait_until_ready,
)
from kvroute.plugin.dev.proxy_process import free_port

VENVS = Path(__file__).resolve().parent.parent / ".kvroute"
LOCKS = Path(__file__).resolve().parent.parent / "requirements" / "bench"  # bash requirements/compile.sh


@dataclass(frozen=True)
class RouterKind:
    """One router project: its PyPI pin, its executable and how that is launched."""

    key: str
    pin: str
    executable: str
    subcommand: tuple[str, ...] = ()
    log_level: str = "warn"

    @property
    def default_venv(self) -> Path:
        return VENVS / self.pin.replace("==", "-")

    @property
    def requirements(self) -> Path:
        """The hashed requirements file that pins this router and its dependencies."""
        return LOCKS / f"{self.key}.txt"


SGLANG_ROUTER = RouterKind("sglang-router", "sglang-router==0.3.2", "sglang-router", ("launch",))
SMG = RouterKind("smg", "smg==1.13.0", "smg", ("launch",))
VLLM_ROUTER = RouterKind("vllm-router", "vllm-router==0.1.17", "vllm-router", (), "warning")
KINDS = {k.key: k for k in (SGLANG_ROUTER, SMG, VLLM_ROUTER)}


def ensure_venv(kind: RouterKind, path: Path | None = None, python: str | None = None) -> Path:
    """The executable of ``kind`` in the venv at ``path`` (default ``kind.default_venv``), creating it if needed."""
    path = path or kind.default_venv
    binary = path / "bin" / kind.executable
    marker = path / ".kvroute-pin"
    if binary.exists() and marker.exists() and marker.read_text().strip() == kind.pin:
        return binary
    if path.exists():
        shutil.rmtree(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    steps = ([python or sys.executable, "-m", "venv", str(path)],
             [str(path / "bin" / "python"), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
              "--require-hashes", "-r", str(kind.requirements)])
    for cmd in steps:
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise ChildStartError(f"could not set up {kind.pin} in {path}: {' '.join(cmd[:3])} ... exited "
                                  f"{done.returncode}:\n{(done.stderr or done.stdout)[-2000:]}")
    if not binary.exists():
        raise ChildStartError(f"{kind.pin} installed no {kind.executable} executable in {path / 'bin'}")
    marker.write_text(kind.pin + "\n")
    return binary


class PeerRouter(ChildOwner):
    """``<router> [launch] --policy POLICY [extra_args] --worker-urls ...`` on 127.0.0.1; ``base_url`` once started."""

    def __init__(self, kind: RouterKind, binary: Path, worker_urls: Sequence[str], policy: str = "cache_aware",
                 extra_args: Sequence[str] = (), start_timeout_s: float = 60.0) -> None:
        self.kind = kind
        self.binary = binary
        self.worker_urls = list(worker_urls)
        self.policy = policy
        self.extra_args = list(extra_args)
        self.start_timeout_s = start_timeout_s
        self.workdir = Path(tempfile.mkdtemp(prefix=f"kvroute-{kind.key}-{policy}-"))
        self.log_path = self.workdir / "router.log"
        self.port = 0
        self.process = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The command line (``self.port`` already chosen)."""
        return [str(self.binary), *self.kind.subcommand, "--host", "127.0.0.1", "--port", str(self.port),
                "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                "--policy", self.policy, "--log-level", self.kind.log_level, *self.extra_args,
                "--worker-urls", *self.worker_urls]

    def start(self) -> PeerRouter:
        def launch() -> subprocess.Popen:
            self.port = free_port()
            self.process = spawn(self.command(), self.log_path)
            return self.process

        start_with_port_retry(launch, self._wait_ready, self.log_path)
        return self

    def _wait_ready(self) -> None:
        def registered() -> bool:
            workers = client.get(self.base_url + "/workers").json().get("workers") or []
            return len(workers) == len(self.worker_urls) and all(w.get("is_healthy") for w in workers)

        with httpx.Client(timeout=2.0, trust_env=False) as client:
            wait_until_ready(self.process, self.log_path, registered, what=f"{self.kind.key} ({self.policy})",
                             timeout_s=self.start_timeout_s,
                             not_ready=f"had not registered all {len(self.worker_urls)} workers", poll_s=0.2, tail=30)

    def stop(self) -> None:
        if self.process is not None:
            terminate(self.process)
        shutil.rmtree(self.workdir, ignore_errors=True)
