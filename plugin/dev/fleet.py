"""Start N local replicas (fake engines or llama.cpp) on free 127.0.0.1 ports, wait until healthy, stop them all.

``with Fleet(3, engine="auto") as fleet: fleet.api_bases`` gives ``http://127.0.0.1:PORT/v1`` per replica. Every
process is stopped on exit, on SIGTERM/SIGHUP (inside the ``with``), at interpreter exit, and when this process
dies (the children get SIGTERM from the kernel), so no replica is left behind.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from subprocess import Popen
from typing import Literal

import httpx

from kvroute.plugin.dev.child_processes import (
    ChildOwner,
    ChildStartError,
    kill,
    log_tail,
    read_ready_file,
    spawn,
    terminate,
    terminate_many,
)
from kvroute.policies.errors import ConfigError

EngineKind = Literal["fake", "llamacpp"]
ENGINE_CHOICES = ("auto", "fake", "llamacpp")


def resolve_engine(engine: str) -> EngineKind:
    """``auto`` → llama.cpp when ``xllamacpp`` is installed, else the fake engine; others are checked."""
    from kvroute.plugin.dev.llamacpp import xllamacpp_available

    if engine not in ENGINE_CHOICES:
        raise ConfigError("engine", f"unknown engine {engine!r}; expected one of {', '.join(ENGINE_CHOICES)}")
    if engine == "auto":
        return "llamacpp" if xllamacpp_available() else "fake"
    if engine == "llamacpp" and not xllamacpp_available():
        raise ConfigError("engine", "llamacpp needs the xllamacpp package: pip install 'kvroute[engines]'")
    return engine  # type: ignore[return-value]


@dataclass(frozen=True)
class ReplicaOptions:
    """Per-replica settings; ``capacity_tokens`` sizes a fake engine's cache, ``cache_ram_mib`` llama.cpp's.

    ``engine_model="llamacpp"`` makes fake engines model the llama.cpp replica (``fake_llamacpp``: one slot,
    ``cache_ram_mib`` of host prompt cache, ``tokenizer`` to count tokens with, and with ``host_cores`` the host's
    cores shared by the fleet's replicas)."""

    model: str | None = None  # served model name; default "fake-model" / "tiny"
    capacity_tokens: int = 16384
    block_tokens: int = 16
    prefill_tokens_per_s: float = 20000.0
    decode_ms: float = 2.0
    slots: int = 4
    metrics_style: str = "vllm"
    cache_ram_mib: int = 64
    threads: int = 1
    ctx: int = 8192
    parallel: int = 1
    engine_model: str = "vllm"
    tokenizer: str | None = None
    host_cores: float = 0.0
    background_cores: float = 0.0
    engine_cost: float = 1.0  # fake llamacpp: the host's slowness against the preset's
    time_jitter: tuple[float, ...] = ()  # fake llamacpp: relative deviations of a request's time, one drawn each
    model_path: str | None = None  # llama.cpp GGUF; default: the generated tiny model
    cache_dir: str | None = None  # where the tiny model is cached
    extra_args: tuple[str, ...] = ()

    def served_model(self, kind: EngineKind) -> str:
        return self.model or ("tiny" if kind == "llamacpp" else "fake-model")


@dataclass
class Replica:
    """One running replica process."""

    name: str
    kind: EngineKind
    model: str
    process: Popen
    log_path: Path
    ready_path: Path
    port: int = 0
    stopped: bool = field(default=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_base(self) -> str:
        return self.base_url + "/v1"

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None


class Fleet(ChildOwner):
    """N replicas of one engine kind; a context manager that always stops what it started."""

    def __init__(self, replicas: int = 3, engine: str = "auto", options: ReplicaOptions | None = None,
                 workdir: str | Path | None = None, start_timeout_s: float = 60.0,
                 name_prefix: str = "replica") -> None:
        if replicas <= 0:
            raise ConfigError("replicas", "must be a positive integer")
        self.kind: EngineKind = resolve_engine(engine)
        self.options = options or ReplicaOptions()
        self.count = replicas
        self.start_timeout_s = start_timeout_s
        self.name_prefix = name_prefix
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kvroute-fleet-"))
        self.replicas: list[Replica] = []
        self._model_path: str | None = None

    # ------------------------------------------------------------------ views
    @property
    def model(self) -> str:
        return self.options.served_model(self.kind)

    @property
    def base_urls(self) -> list[str]:
        return [r.base_url for r in self.replicas]

    @property
    def api_bases(self) -> list[str]:
        return [r.api_base for r in self.replicas]

    def pids(self) -> list[int]:
        return [r.pid for r in self.replicas]

    # ------------------------------------------------------------------ lifecycle
    def _command(self, name: str, ready: Path) -> list[str]:
        o = self.options
        if self.kind == "fake" and o.engine_model == "llamacpp":
            llama = ["--engine-model", "llamacpp", "--cache-ram-mib", str(o.cache_ram_mib)]
            if o.tokenizer:
                llama += ["--tokenizer", o.tokenizer]
            if o.engine_cost != 1.0:
                llama += ["--engine-cost", str(o.engine_cost)]
            if o.time_jitter:
                llama += ["--time-jitter=" + ",".join(f"{d:.5g}" for d in o.time_jitter)]  # may start with "-"
            if o.host_cores > 0:
                llama += ["--host-cores", str(o.host_cores), "--background-cores", str(o.background_cores),
                          "--cores-dir", str(self.workdir / "cores")]
            return [sys.executable, "-m", "kvroute.plugin.dev.fake_engine", "--port", "0", "--name", name,
                    "--model", self.model, "--ready-file", str(ready), *llama, *o.extra_args]
        if self.kind == "fake":
            return [sys.executable, "-m", "kvroute.plugin.dev.fake_engine", "--port", "0", "--name", name,
                    "--model", self.model, "--capacity-tokens", str(o.capacity_tokens),
                    "--block-tokens", str(o.block_tokens), "--prefill-tps", str(o.prefill_tokens_per_s),
                    "--decode-ms", str(o.decode_ms), "--slots", str(o.slots), "--metrics-style", o.metrics_style,
                    "--ready-file", str(ready), *o.extra_args]
        return [sys.executable, "-m", "kvroute.plugin.dev.llamacpp", "--model", str(self._model_path),
                "--alias", self.model, "--port", "0", "--threads", str(o.threads), "--ctx", str(o.ctx),
                "--parallel", str(o.parallel), "--cache-ram-mib", str(o.cache_ram_mib),
                "--ready-file", str(ready), *o.extra_args]

    def start(self) -> Fleet:
        """Spawn every replica, then wait until each has published its port and answers ``/health``."""
        if self.kind == "llamacpp":
            from kvroute.plugin.dev.tiny_model import ensure_tiny_model

            self._model_path = self.options.model_path or str(ensure_tiny_model(cache_dir=self.options.cache_dir).gguf)
        try:
            for i in range(self.count):
                self.replicas.append(self._spawn(f"{self.name_prefix}-{i}"))
            deadline = time.monotonic() + self.start_timeout_s
            for replica in self.replicas:
                self._wait_ready(replica, deadline)
        except BaseException:
            self.stop()
            raise
        return self

    def _spawn(self, name: str) -> Replica:
        ready = self.workdir / f"{name}.ready.json"
        ready.unlink(missing_ok=True)
        log = self.workdir / f"{name}.log"
        proc = spawn(self._command(name, ready), log)
        return Replica(name=name, kind=self.kind, model=self.model, process=proc, log_path=log, ready_path=ready)

    def _wait_ready(self, replica: Replica, deadline: float) -> None:
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                if not replica.alive():
                    raise ChildStartError(f"{replica.name} ({replica.kind}) exited with code "
                                          f"{replica.process.returncode} before it was ready:\n"
                                          f"{log_tail(replica.log_path)}")
                if time.monotonic() > deadline:
                    raise ChildStartError(f"{replica.name} ({replica.kind}) not healthy after "
                                          f"{self.start_timeout_s:g}s:\n{log_tail(replica.log_path)}")
                record = read_ready_file(replica.ready_path)
                if record is not None:
                    replica.port = int(record["port"])
                    try:
                        if client.get(replica.base_url + "/health").status_code == 200:
                            return
                    except httpx.HTTPError:
                        pass
                time.sleep(0.05)

    def kill(self, index: int) -> Replica:
        """Crash replica ``index`` (SIGKILL), e.g. to test failover; it stays in the list, marked stopped."""
        replica = self.replicas[index]
        kill(replica.process)
        replica.stopped = True
        return replica

    def restart(self, index: int) -> Replica:
        """Stop replica ``index`` and start a fresh one (empty cache, new port) in its place."""
        old = self.replicas[index]
        terminate(old.process)
        new = self._spawn(old.name)
        self.replicas[index] = new
        try:
            self._wait_ready(new, time.monotonic() + self.start_timeout_s)
        except BaseException:
            terminate(new.process)
            raise
        return new

    def stop(self) -> None:
        """Stop every replica (SIGTERM, then SIGKILL) and remove the work directory this fleet created."""
        terminate_many([r.process for r in self.replicas])
        for replica in self.replicas:
            replica.stopped = True
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)
        self._model_path = None
