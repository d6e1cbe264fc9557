"""The bench's CPU-heavy job: the spinning processes exist while it is open and are gone after, however it ends."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from cpu_job import busy_cores


def _spinners() -> set[int]:
    """This process's live children that spin (read from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and cmd.endswith(b"while True: pass\0"):
            found.add(int(stat.parent.name))
    return found


def test_busy_cores_spin_while_open_and_are_killed_even_on_an_error():
    with pytest.raises(RuntimeError), busy_cores(2) as n:
        assert n == 2 and len(_spinners()) == 2
        raise RuntimeError("the bench failed")
    assert _spinners() == set()
    with busy_cores(0):
        assert _spinners() == set()
    with pytest.raises(ValueError), busy_cores(-1):
        pass
