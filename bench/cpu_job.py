"""A CPU-heavy job beside a benchmark: ``busy_cores(n)`` keeps ``n`` processes spinning for as long as it is open.

What "beside another job on the machine" means in the bench, made repeatable: each process is a Python loop that
never sleeps, so on a machine of ``c`` cores the engines and routers get about ``c - n`` of them.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def busy_cores(n: int) -> Iterator[int]:
    """Spin ``n`` busy processes while the block runs (0: nothing); they are killed when it ends, however it ends."""
    if n < 0:
        raise ValueError("busy cores must be 0 or more")
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield n
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()
