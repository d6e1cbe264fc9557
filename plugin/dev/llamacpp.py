"""Serve a GGUF model with llama.cpp's native HTTP server through ``xllamacpp``: one replica per process.

``python -m kvroute.plugin.dev.llamacpp --preset small --port 0 --cache-ram-mib 64 --ready-file F`` generates
(or reuses) the tiny random Llama, listens on 127.0.0.1, writes ``{"port", "pid", "name"}`` to ``F`` once healthy
and ends on SIGTERM/SIGINT. ``--cache-ram-mib`` bounds llama.cpp's host prompt cache, i.e. how many prefixes a replica
keeps (whole prompts: a prefix shared by several entries is stored once per entry); ``--slot-prompt-similarity`` is 0
by default here so the cache is used for every request (see ``LlamaCppOptions``).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from kvroute.plugin.dev.tiny_model import PRESETS, ensure_tiny_model
from kvroute.policies.errors import ConfigError

log = logging.getLogger("kvroute.llamacpp")


ENGINE_PACKAGES = ("xllamacpp", "gguf", "tokenizers", "numpy", "safetensors")


def xllamacpp_available() -> bool:
    """True when llama.cpp's server (``xllamacpp``) and the tiny-model generator's packages can be imported."""
    return all(importlib.util.find_spec(name) is not None for name in ENGINE_PACKAGES)


@dataclass(frozen=True)
class LlamaCppOptions:
    """Server settings of one llama.cpp replica."""

    model_path: str
    alias: str = "tiny"
    host: str = "127.0.0.1"
    port: int = 0
    threads: int = 1
    ctx: int = 8192
    parallel: int = 1
    cache_ram_mib: int = 64
    # 0 (kvroute's preset; llama.cpp's default is 0.1): every request saves the slot's prompt to the host cache
    # and restores its own best entry. With 0.1 an idle slot sharing > 10 % of the new prompt is reused in
    # place, and when that shared part (a fleet-wide system/tools prefix) is >= half of the slot's last prompt,
    # the old prompt is dropped unsaved and the cache not consulted: a replica keeps one context per slot.
    slot_prompt_similarity: float = 0.0
    verbosity: int = 1

    def __post_init__(self) -> None:
        if not Path(self.model_path).is_file():
            raise ConfigError("model_path", f"no GGUF file at {self.model_path}")
        for key in ("threads", "ctx", "parallel"):
            if getattr(self, key) <= 0:
                raise ConfigError(key, "must be a positive integer")
        if self.cache_ram_mib < 0:
            raise ConfigError("cache_ram_mib", "must be >= 0 (0 turns the host prompt cache off)")
        if not 0.0 <= self.slot_prompt_similarity <= 1.0:
            raise ConfigError("slot_prompt_similarity", "must be in 0..1")
        if not 0 <= self.port < 65536:
            raise ConfigError("port", "must be in 0..65535")


def build_params(options: LlamaCppOptions):
    """The ``xllamacpp.CommonParams`` for ``options`` (prompt cache, metrics and slots endpoints on)."""
    import xllamacpp as xlc

    p = xlc.CommonParams()
    p.model.path = options.model_path
    p.model_alias = {options.alias}  # a set: a plain string would be split into characters
    p.hostnames = [options.host]
    p.port = options.port
    p.n_ctx = options.ctx
    p.n_parallel = options.parallel
    p.cpuparams.n_threads = options.threads
    p.cpuparams_batch.n_threads = options.threads
    p.cache_prompt = True
    p.cache_ram_mib = options.cache_ram_mib
    p.slot_prompt_similarity = options.slot_prompt_similarity
    p.endpoint_metrics = True
    p.endpoint_slots = True
    p.verbosity = options.verbosity
    return p


def serve(options: LlamaCppOptions, ready_file: str | None = None, stop: threading.Event | None = None) -> None:
    """Run the server until ``stop`` is set (or SIGTERM/SIGINT when called from the main thread)."""
    import xllamacpp as xlc

    from kvroute.plugin.dev.child_processes import write_ready_file

    stop = stop or threading.Event()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        signal.signal(signal.SIGINT, lambda *_: stop.set())
    server = xlc.Server(build_params(options))
    address = server.listening_address  # "http://127.0.0.1:PORT"
    port = int(address.rsplit(":", 1)[1].rstrip("/"))
    log.info("llama.cpp replica %s listening on %s", options.alias, address)
    print(f"listening on {address}", flush=True)
    if ready_file:
        write_ready_file(ready_file, port, options.alias)
    stop.wait()
    del server


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m kvroute.plugin.dev.llamacpp", description=__doc__.splitlines()[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="path to a GGUF file")
    src.add_argument("--preset", choices=sorted(PRESETS), default="small", help="generate/reuse the tiny model")
    p.add_argument("--cache-dir", default=None, help="where generated models are cached (default ~/.cache/kvroute)")
    p.add_argument("--alias", default="tiny", help="model name served on /v1/models")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 = a free port (see --ready-file)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--ctx", type=int, default=8192)
    p.add_argument("--parallel", type=int, default=1, help="slots (continuous batching); ctx is split across them")
    p.add_argument("--cache-ram-mib", type=int, default=64, help="host prompt-cache size; 0 = off")
    p.add_argument("--slot-prompt-similarity", type=float, default=0.0,
                   help="0 (default here) = save the slot's prompt to the host cache and restore the request's best "
                        "entry every time; llama.cpp's own default 0.1 reuses a slot sharing that fraction in place")
    p.add_argument("--verbosity", type=int, default=1)
    p.add_argument("--ready-file", default=None, help="write {port, pid, name} here once listening")
    args = p.parse_args(argv)
    logging.basicConfig(level="INFO", format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if not xllamacpp_available():
        p.error("xllamacpp is not installed: pip install 'kvroute[engines]'")
    try:
        model_path = args.model or str(ensure_tiny_model(PRESETS[args.preset], args.cache_dir).gguf)
        options = LlamaCppOptions(model_path=model_path, alias=args.alias, host=args.host, port=args.port,
                                  threads=args.threads, ctx=args.ctx, parallel=args.parallel,
                                  cache_ram_mib=args.cache_ram_mib,
                                  slot_prompt_similarity=args.slot_prompt_similarity, verbosity=args.verbosity)
    except ConfigError as exc:
        p.error(str(exc))
    serve(options, args.ready_file)
    os._exit(0)  # llama.cpp's worker threads need no orderly teardown; exit promptly


if __name__ == "__main__":
    main()
