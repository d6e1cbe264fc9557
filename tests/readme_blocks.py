"""The README's fenced blocks as a test reads them, and a runner that runs one as written.

``blocks()`` parses README.md with markdown-it-py and returns every fenced block with the heading it sits under,
so a test runs the page's own words: when the README changes, the test runs the new ones. ``with_ports``
substitutes port numbers (the only edit a test makes). ``BlockRun`` runs a block with bash (``-e``: the first
command that fails stops it) in a process group of its own, and kills that group, background jobs included,
when it exits.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


@dataclass(frozen=True)
class Block:
    """One fenced block: the heading above it, its info string (``sh``, ``yaml``), its text and first line."""

    heading: str
    info: str
    text: str
    line: int


def blocks(path: Path = README) -> list[Block]:
    """Every fenced block of a Markdown file, in order."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").parse(path.read_text())
    heading, found = "", []
    for i, tok in enumerate(tokens):
        if tok.type == "heading_open":
            heading = tokens[i + 1].content
        elif tok.type == "fence":
            found.append(Block(heading, tok.info.strip(), tok.content, (tok.map or [0])[0] + 1))
    return found


def section(heading: str, path: Path = README) -> list[Block]:
    """The blocks under ``heading`` (the page's top, before any heading: ``""``)."""
    found = [b for b in blocks(path) if b.heading == heading]
    assert found, f"{path.name} has no block under the heading {heading!r}"
    return found


def with_ports(text: str, ports: Mapping[int, int]) -> str:
    """``text`` with every whole number that is a key of ``ports`` replaced by its value."""
    return re.sub(r"(?<![\w.])(\d{2,5})(?![\w.])", lambda m: str(ports.get(int(m.group(1)), m.group(1))), text)


class BlockRun:
    """``bash -e -c BLOCK`` in ``cwd`` with ``env``; stdout and stderr kept in files beside each other."""

    def __init__(self, text: str, cwd: Path, env: Mapping[str, str], logs: Path) -> None:
        self.text = text
        self.cwd = cwd
        self.env = dict(env)
        self.stdout_path = logs / "stdout.txt"
        self.stderr_path = logs / "stderr.txt"
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> BlockRun:
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.process = subprocess.Popen(["bash", "-e", "-c", self.text], cwd=self.cwd, env=self.env,
                                            stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                            start_new_session=True)
        return self

    def wait(self, timeout: float) -> int:
        """The block's exit status once it ends (its background jobs may still run)."""
        assert self.process is not None
        return self.process.wait(timeout=timeout)

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> None:
        """Poll ``ready`` until it holds; fail with the block's output if the block ends or time runs out first."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while not ready():
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"block ended ({self.process.poll()}) or timed out before it was ready:\n"
                                     + self.output()[-3000:])
            time.sleep(0.25)

    @property
    def stdout(self) -> str:
        return self.stdout_path.read_text(errors="replace")

    def output(self) -> str:
        return self.stdout + self.stderr_path.read_text(errors="replace")

    def __exit__(self, *_exc: object) -> None:
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _group_alive(self.process.pid):
                self.process.poll()
                time.sleep(0.1)
        self.process.poll()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True
