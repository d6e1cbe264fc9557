"""Loopback relays that make anonymous replicas name themselves: one port per replica, bytes forwarded both ways,
and every response's ``system_fingerprint`` replaced by that replica's name.

llama.cpp stamps its build into ``system_fingerprint``, the same on every replica, so a client behind a router
(SMG, vllm-router, LiteLLM, kvroute) cannot tell which replica answered. Each value keeps its length, so
``Content-Length`` and chunk sizes stay valid. Put a ``ReplicaRelays`` between the
routers and the replicas and each streamed chunk carries the replica's name instead, through every router that
passes ``system_fingerprint`` on (all of those ``bench/peers.py`` runs do). ``retarget(i, port)`` points relay
``i`` at a restarted replica while the routers keep the relay's address. Every relay runs on one event loop in a
daemon thread; closing stops it.

Each relay also clocks every chat request it passes (``take_timings``): when its first bytes reached the relay and
when the first answer text came back from the replica, keyed by ``prompt_key`` of its messages. The replay, in the
same process and on the same clock (``time.perf_counter``), splits its own TTFT into the router's way in, the
engine's part and the router's way out: the router's round trip under the run's own load.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.plugin.dev.fake_engine import render_chat

HOST = "127.0.0.1"
_CHUNK = 65536


def replica_of(fingerprint: str | None) -> str | None:
    """The replica name in a stamped fingerprint (the padding removed)."""
    return fingerprint.rstrip("_") or None if fingerprint else None


_KEY = b'"system_fingerprint"'
_FIELD = re.compile(rb'"system_fingerprint"\s*:\s*"([^"]*)"')


class _Rewriter:
    """Stamps ``name`` over every ``"system_fingerprint": "..."`` value of a byte stream cut anywhere, keeping
    each value's length (padded with ``_`` or cut): a chunk's tail that could start such a field waits for the
    next chunk, nothing else is held back."""

    def __init__(self, name: str) -> None:
        self.name = name.encode("ascii")
        self.carry = b""

    def _stamp(self, m: re.Match[bytes]) -> bytes:
        value = m.group(1)
        return m.group(0)[: m.start(1) - m.start(0)] + self.name.ljust(len(value), b"_")[: len(value)] + b'"'

    def feed(self, data: bytes) -> bytes:
        buf = _FIELD.sub(self._stamp, self.carry + data)
        keep = len(buf)
        at = buf.rfind(_KEY)
        if at >= 0 and not _FIELD.match(buf, at):
            keep = at  # the field's value has not ended yet
        else:
            for n in range(min(len(_KEY) - 1, len(buf)), 0, -1):
                if _KEY.startswith(buf[-n:]):
                    keep = len(buf) - n
                    break
        self.carry = buf[keep:]
        return buf[:keep]

    def flush(self) -> bytes:
        out, self.carry = self.carry, b""
        return out


def prompt_key(prompt: str) -> str:
    """The key a request's timing is filed under: a digest of its rendered prompt (``render_chat``)."""
    return hashlib.blake2b(prompt.encode("utf-8"), digest_size=12).hexdigest()


@dataclass
class Timing:
    """One request as a relay saw it: its prompt's key, its first bytes in and the replica's first answer text out
    (``time.perf_counter``; ``first_s`` None: no text came back)."""

    key: str | None
    arrived_s: float
    first_s: float | None = None


_CONTENT = re.compile(rb'"content"\s*:\s*"(?!")')
_HEAD_END = b"\r\n\r\n"


class _Clock:
    """One connection's requests, in order (HTTP/1.1 without pipelining): ``feed_in`` parses the request bytes
    (head, ``Content-Length`` body) to time and key each request, ``feed_out`` marks the oldest request still waiting
    for answer text when some arrives. A body it cannot read (chunked, not JSON) is timed without a key."""

    def __init__(self, sink: list[Timing]) -> None:
        self.sink = sink
        self.buf = b""
        self.need: int | None = None  # body bytes still to read for the current request
        self.body = b""
        self.current: Timing | None = None
        self.waiting: list[Timing] = []
        self.tail = b""

    def feed_in(self, data: bytes) -> None:
        self.buf += data
        while self.buf:
            if self.need is None:
                end = self.buf.find(_HEAD_END)
                if self.current is None:
                    self.current = Timing(None, time.perf_counter())
                    self.sink.append(self.current)
                    self.waiting.append(self.current)
                if end < 0:
                    return
                head, self.buf = self.buf[:end].lower(), self.buf[end + 4:]
                if not head.startswith(b"post") or b"/chat/completions" not in head.split(b"\r\n", 1)[0]:
                    self._forget(self.current)  # a health check, a model list: not a request to time
                    self.current = None
                m = re.search(rb"content-length:\s*(\d+)", head)
                self.need = int(m.group(1)) if m else 0
                self.body = b""
            take = self.buf[: self.need]
            self.body += take
            self.buf = self.buf[len(take):]
            self.need -= len(take)
            if self.need:
                return
            if self.current is not None:
                self.current.key = _key_of(self.body)
            self.need, self.current = None, None

    def _forget(self, timing: Timing | None) -> None:
        for where in (self.sink, self.waiting):
            if timing in where:
                where.remove(timing)

    def feed_out(self, data: bytes) -> None:
        if self.waiting and _CONTENT.search(self.tail + data):
            self.waiting.pop(0).first_s = time.perf_counter()
            self.tail = b""
        else:
            self.tail = data[-32:]


def _key_of(body: bytes) -> str | None:
    try:
        messages = json.loads(body).get("messages")
        return prompt_key(render_chat(messages))
    except Exception:  # not a chat request, or not JSON: timed, not keyed
        return None


class ReplicaRelays:
    """``len(targets)`` relays on free loopback ports; ``ports[i]`` forwards to ``targets[i]`` and stamps
    ``names[i]`` over every ``system_fingerprint`` in what comes back."""

    def __init__(self, targets: Sequence[int], names: Sequence[str]) -> None:
        if len(targets) != len(names):
            raise ValueError("one name per target")
        self.targets = list(targets)
        self.names = list(names)
        self.ports: list[int] = []
        self._loop = asyncio.new_event_loop()
        self._servers: list[asyncio.base_events.Server] = []
        self._thread = threading.Thread(target=self._loop.run_forever, name="replica-relays", daemon=True)
        self._timings: list[Timing] = []

    def __enter__(self) -> ReplicaRelays:
        self._thread.start()
        self.ports = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def base_urls(self) -> list[str]:
        return [f"http://{HOST}:{p}" for p in self.ports]

    def retarget(self, index: int, port: int) -> None:
        """Send relay ``index``'s new connections to ``port`` (a restarted replica)."""
        self.targets[index] = port

    async def _start(self) -> list[int]:
        ports = []
        for i in range(len(self.targets)):
            server = await asyncio.start_server(lambda r, w, i=i: self._serve(i, r, w), HOST, 0)
            self._servers.append(server)
            ports.append(server.sockets[0].getsockname()[1])
        return ports

    async def _serve(self, index: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(HOST, self.targets[index])
        except OSError:
            client_w.close()
            return
        rewriter = _Rewriter(self.names[index])
        clock = _Clock(self._timings)
        requests = asyncio.ensure_future(self._pipe(client_r, up_w, None, clock.feed_in))
        try:
            # the replica's side ending ends the connection, as when the client talks to the replica itself: an idle
            # keep-alive connection llama.cpp closes must close at the client too, not stay half open (a client
            # that sends its next request into a half-open relay gets "Server disconnected")
            await self._pipe(up_r, client_w, rewriter, clock.feed_out)
        except asyncio.CancelledError:  # closing: the connection goes with the relay
            pass
        finally:
            requests.cancel()
            up_w.close()
            client_w.close()

    def take_timings(self) -> list[Timing]:
        """Every request timed since the last call, in arrival order (then forgotten)."""

        async def take() -> list[Timing]:
            out = sorted(self._timings, key=lambda t: t.arrived_s)
            self._timings.clear()
            return out

        return asyncio.run_coroutine_threadsafe(take(), self._loop).result(timeout=10)

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rewriter: _Rewriter | None,
                    watch) -> None:
        """Copy ``reader`` to ``writer`` until its end; the other side then sees that end (an EOF)."""
        try:
            while data := await reader.read(_CHUNK):
                watch(data)
                writer.write(rewriter.feed(data) if rewriter else data)
                await writer.drain()
            if rewriter:
                writer.write(rewriter.flush())
                await writer.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            try:
                if writer.can_write_eof():
                    writer.write_eof()
            except (ConnectionError, OSError, RuntimeError):
                writer.close()

    def close(self) -> None:
        if not self._thread.is_alive():
            return

        async def stop() -> None:
            for server in self._servers:
                server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
