"""KV-event feed: ZMQ subscribers for engine sources, applying batches to a ``PreciseIndex`` in a thread.

Frames are ``[topic, seq (uint64 BE), msgpack batch]``. Per stream (socket + topic) the feed checks the
sequence: a gap asks the engine's ROUTER replay socket for the missing batches (``[b"", start]`` →
``[b"", topic, seq, payload]``… then ``[b"", b"", 2^64-1, b""]`` in vLLM 0.32; older builds omit the topic
frame), a starting feed or a first message mid-stream asks for a full replay, a restart (seq back to 0) or
a reconnect drops the source's state and rebuilds it. Garbage is counted and skipped. All sockets live in
one background thread; the request path only reads the index.

Endpoint modes follow vLLM's rule: vLLM *binds* endpoints with ``*``, ``::``, ``ipc://`` or ``inproc://``
(we connect) and *connects* to host-specific ones (we bind). ``EventSource.bind`` overrides.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvroute.plugin.feeds import precise_metrics as pm
from kvroute.plugin.feeds.kvevents_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    EventDecodeError,
    decode_batch,
)
from kvroute.policies.fingerprint import chain_seed
from kvroute.policies.precise_index import PreciseIndex
from kvroute.policies.tiers import GPU, tier_of

log = logging.getLogger(__name__)
END_OF_REPLAY = (1 << 64) - 1


def resolve_mode(endpoint: str, bind: bool | None = None) -> tuple[bool, str]:
    """(we bind?, address to use) for an endpoint as configured on the engine."""
    wildcard = "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))
    we_bind = (not wildcard) if bind is None else bind
    address = endpoint
    if not we_bind:
        address = endpoint.replace("://*:", "://127.0.0.1:").replace("://[::]:", "://127.0.0.1:")
    return we_bind, address


@dataclass(frozen=True, slots=True)
class EventSource:
    """One engine publisher (or a central bound socket several engines connect to, split by topic)."""

    endpoint: str
    backend: str | None = None
    topic: str = ""
    replay_endpoint: str | None = None
    bind: bool | None = None
    model: str = ""
    topic_backends: Mapping[str, str] = field(default_factory=dict)

    def name_for(self, topic: str) -> str:
        return topic or self.topic or self.endpoint

    def backend_for(self, topic: str) -> str:
        return self.topic_backends.get(topic) or self.backend or self.name_for(topic)


@dataclass(slots=True)
class SourceStats:
    """Per-source counters, as ``kvroute events inspect`` prints them."""

    batches: int = 0
    blocks_stored: int = 0
    blocks_removed: int = 0
    clears: int = 0
    gaps: int = 0
    replays: int = 0
    decode_errors: int = 0
    duplicates: int = 0
    resets: int = 0
    replay_failures: int = 0
    last_seq: int | None = None

    def public(self) -> dict[str, int]:
        return {k: getattr(self, k) for k in ("batches", "blocks_stored", "blocks_removed", "clears", "gaps",
                                              "replays", "decode_errors")}


@dataclass(slots=True)
class _Stream:
    name: str
    source: EventSource
    backend: str
    expected: int | None = None
    needs_reset: bool = False
    dealer: Any = None
    last_live: int | None = None


class KvEventFeed:
    """Subscribes to ``sources`` and keeps ``index`` in step with the engines; ``start``/``stop`` it."""

    def __init__(self, index: PreciseIndex, sources: list[EventSource], *, replay_timeout_s: float = 2.0,
                 reorder_window: int = 1024, poll_ms: int = 50, replay_on_start: bool = True,
                 on_block_size: Callable[[str, int], None] | None = None,
                 tap: Callable[[str, int, bytes], None] | None = None) -> None:
        self.index = index
        self.sources = list(sources)
        self.replay_timeout_s = replay_timeout_s
        self.reorder_window = reorder_window
        self.poll_ms = poll_ms
        self.replay_on_start = replay_on_start
        self.on_block_size = on_block_size
        self.tap = tap  # sees every (source, seq, payload) before it is applied (capture, debugging)
        self.stats: dict[str, SourceStats] = {}
        self.block_sizes: dict[str, int] = {}
        self.bound: dict[str, str] = {}  # configured endpoint -> resolved address (bind mode, port 0)
        self._streams: dict[tuple[int, bytes], _Stream] = {}
        self._seeds: dict[tuple[str, str | None], int] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None
        for src in self.sources:
            names = list(src.topic_backends) or [src.topic]
            for topic in names:
                self.index.attach((src.name_for(topic), 0), src.backend_for(topic))

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self, timeout_s: float = 5.0) -> KvEventFeed:
        """Open the sockets in a daemon thread; returns once they are bound/connected (or failed)."""
        if self._thread is not None:
            return self
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="kvroute-kv-events", daemon=True)
        self._thread.start()
        self._ready.wait(timeout_s)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None

    def __enter__(self) -> KvEventFeed:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stat(self, name: str) -> SourceStats:
        s = self.stats.get(name)
        if s is None:
            s = self.stats[name] = SourceStats()
        return s

    # --- the thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        ctx = zmq.Context.instance()
        subs: list[Any] = []
        monitors: dict[Any, int] = {}
        poller = zmq.Poller()
        try:
            for i, src in enumerate(self.sources):
                sock = ctx.socket(zmq.SUB)
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.RCVHWM, 100_000)
                topics = list(src.topic_backends) or [src.topic]
                for t in topics:
                    sock.setsockopt(zmq.SUBSCRIBE, t.encode())
                mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED)
                we_bind, address = resolve_mode(src.endpoint, src.bind)
                if we_bind:
                    sock.bind(address)
                    self.bound[src.endpoint] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
                else:
                    sock.connect(address)
                subs.append(sock)
                poller.register(sock, zmq.POLLIN)
                monitors[mon] = i
                poller.register(mon, zmq.POLLIN)
        except Exception as exc:  # a bad endpoint must not take the router down
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("kv-event feed could not open its sockets: %s", self.error)
            for src in self.sources:  # no events will come: these backends go back to approximate mode
                for topic in list(src.topic_backends) or [src.topic]:
                    self.index.detach((src.name_for(topic), 0))
            self._ready.set()
            self._close(subs, monitors)
            return
        self._ready.set()
        try:
            if self.replay_on_start:
                self._replay_history()
            while not self._stop.is_set():
                ready = dict(poller.poll(self.poll_ms))
                for mon, i in monitors.items():
                    if mon in ready:
                        self._on_monitor(mon, i)
                for i, sock in enumerate(subs):
                    if sock not in ready:
                        continue
                    for _ in range(1000):  # drain, but let other sockets and stop() have a turn
                        try:
                            frames = sock.recv_multipart(zmq.NOBLOCK, copy=True)
                        except zmq.Again:
                            break
                        self._on_message(i, frames)
        except Exception as exc:  # pragma: no cover - last resort; the index stays usable
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("kv-event feed stopped")
        finally:
            self._close(subs, monitors)
            for stream in self._streams.values():
                if stream.dealer is not None:
                    stream.dealer.close(0)
                    stream.dealer = None

    @staticmethod
    def _close(subs: list[Any], monitors: Mapping[Any, int]) -> None:
        for sock in subs:
            with contextlib.suppress(Exception):
                sock.disable_monitor()
            sock.close(0)
        for mon in monitors:
            mon.close(0)

    def _on_monitor(self, mon: Any, i: int) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                msg = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            except Exception:
                return
            if msg.get("event") == zmq.EVENT_DISCONNECTED:
                for (si, _topic), stream in self._streams.items():
                    if si == i:
                        stream.needs_reset = True

    def _replay_history(self) -> None:
        """A (re)started router rebuilds what the engines retain before the first live batch arrives."""
        for i, src in enumerate(self.sources):
            if src.replay_endpoint and not src.topic_backends:
                stream = self._stream(i, src.topic.encode())
                if stream.expected is None:
                    self._replay(stream, 0, 0, count_empty=False)

    # --- messages -------------------------------------------------------------------------------
    def _stream(self, i: int, topic: bytes) -> _Stream:
        key = (i, topic)
        stream = self._streams.get(key)
        if stream is None:
            src = self.sources[i]
            t = topic.decode("utf-8", "replace")
            stream = self._streams[key] = _Stream(src.name_for(t), src, src.backend_for(t))
            self.index.attach((stream.name, 0), stream.backend)
        return stream

    def _on_message(self, i: int, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            src = self.sources[i]
            name = src.name_for(frames[0].decode("utf-8", "replace") if frames else "")
            self.stat(name).decode_errors += 1
            pm.KV_EVENT_DECODE_ERRORS.labels(name).inc()
            return
        topic, seq_raw, payload = frames
        stream = self._stream(i, topic)
        seq = int.from_bytes(seq_raw, "big")
        if self.tap is not None:
            self.tap(stream.name, seq, payload)
        self.ingest(stream, seq, payload, live=True)

    def ingest(self, stream: _Stream, seq: int, payload: bytes, *, live: bool) -> None:
        """Sequence bookkeeping for one batch, then apply it (replays recurse with ``live=False``)."""
        stats = self.stat(stream.name)
        if stream.needs_reset:
            stream.needs_reset = False
            self._reset(stream, "reconnect")
            stream.expected = None
            stream.last_live = None
        expected = stream.expected
        if live:
            if expected is None:
                if seq > 0 and stream.source.replay_endpoint:
                    self._replay(stream, 0, seq)  # joined mid-stream: rebuild from what the engine retains
            elif seq > expected:
                stats.gaps += 1
                pm.KV_EVENT_GAPS.labels(stream.name).inc()
                self._replay(stream, expected, seq)
            elif seq < expected:
                # A live 0 after live traffic is a restarted publisher; a replayed overlap is a duplicate.
                if (seq == 0 and stream.last_live is not None) or expected - seq > self.reorder_window:
                    stats.resets += 1
                    self._reset(stream, "sequence_reset")
                    stream.expected = None
                    stream.last_live = None
                    if seq > 0 and stream.source.replay_endpoint:
                        self._replay(stream, 0, seq)
                else:
                    stats.duplicates += 1
                    pm.KV_EVENT_DUPLICATES.labels(stream.name).inc()
                    stream.last_live = max(seq, stream.last_live or 0)
                    return
            stream.last_live = seq
        if stream.expected is not None and seq < stream.expected:
            stats.duplicates += 1  # already applied through a replay
            pm.KV_EVENT_DUPLICATES.labels(stream.name).inc()
            return
        stream.expected = seq + 1
        stats.last_seq = seq
        try:
            batch = decode_batch(payload)
        except EventDecodeError:
            stats.decode_errors += 1
            pm.KV_EVENT_DECODE_ERRORS.labels(stream.name).inc()
            return
        self.apply(stream, batch)

    def _reset(self, stream: _Stream, reason: str) -> None:
        stats = self.stat(stream.name)
        stats.clears += 1
        pm.KV_EVENT_CLEARS.labels(stream.name, reason).inc()
        for source in self.index.sources():
            if isinstance(source, tuple) and source and source[0] == stream.name:
                self.index.cleared(source)

    def apply(self, stream: _Stream, batch: EventBatch) -> None:
        """Apply a decoded batch to the index and count it."""
        stats = self.stat(stream.name)
        stats.batches += 1
        if batch.bad_events:
            stats.decode_errors += batch.bad_events
            pm.KV_EVENT_DECODE_ERRORS.labels(stream.name).inc(batch.bad_events)
        key = (stream.name, batch.dp_rank)
        if batch.dp_rank and key not in self.index.sources():
            self.index.attach(key, stream.backend)
        index = self.index
        model = stream.source.model
        stored = removed = 0
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                seed_key = (ev.lora_name or model, ev.salt)
                seed = self._seeds.get(seed_key)
                if seed is None:
                    if len(self._seeds) > 4096:
                        self._seeds.clear()
                    seed = self._seeds[seed_key] = chain_seed(seed_key[0], seed_key[1], index.chain)
                # A copy is named by its tier, not the medium's spelling: an absent medium is the GPU's.
                tier = tier_of(ev.medium)
                copy = (tier, ev.group_idx, ev.locality, ev.ownership)
                index.stored(key, ev.hashes, ev.parent, ev.token_ids, ev.block_size, seed, copy, tier)
                stored += len(ev.hashes)
                # The engine's block size comes from its GPU cache (offload tiers may use larger chunks).
                if (tier == GPU and ev.token_ids and self.block_sizes.get(stream.backend) != ev.block_size
                        and (ev.group_idx or 0) == 0):
                    self.block_sizes[stream.backend] = ev.block_size
                    if self.on_block_size is not None:
                        self.on_block_size(stream.backend, ev.block_size)
            elif isinstance(ev, BlockRemoved):
                index.removed(key, ev.hashes, (tier_of(ev.medium), ev.group_idx, ev.locality, ev.ownership))
                removed += len(ev.hashes)
            elif isinstance(ev, AllBlocksCleared):
                index.cleared(key)
                stats.clears += 1
                pm.KV_EVENT_CLEARS.labels(stream.name, "all_blocks_cleared").inc()
        stats.blocks_stored += stored
        stats.blocks_removed += removed
        pm.KV_EVENT_BATCHES.labels(stream.name).inc()
        if stored:
            pm.KV_EVENT_BLOCKS_STORED.labels(stream.name).inc(stored)
        if removed:
            pm.KV_EVENT_BLOCKS_REMOVED.labels(stream.name).inc(removed)
        pm.KV_EVENT_INDEX_BLOCKS.labels(stream.name).set(index.source_blocks(key))
        pm.KV_EVENT_LAG.labels(stream.name).set(max(0.0, time.time() - batch.ts))

    def _replay(self, stream: _Stream, start: int, live_seq: int, count_empty: bool = True) -> bool:
        """Ask the replay socket for batches ``start..``; apply them in order. True if the gap closed."""
        endpoint = stream.source.replay_endpoint
        stats = self.stat(stream.name)
        if not endpoint:
            stats.replay_failures += 1
            pm.KV_EVENT_REPLAYS.labels(stream.name, "unavailable").inc()
            return False
        import zmq

        if stream.dealer is None:
            dealer = zmq.Context.instance().socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(resolve_mode(endpoint, False)[1])
            stream.dealer = dealer
        dealer = stream.dealer
        closed = False
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            deadline = time.monotonic() + self.replay_timeout_s
            first = None
            while True:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0 or not dealer.poll(left_ms, zmq.POLLIN):
                    raise TimeoutError("replay timed out")
                frames = dealer.recv_multipart()
                # vLLM ≥ 0.2x: [b"", topic, seq, payload]; older: [b"", seq, payload]. End: seq = 2^64-1.
                if len(frames) == 4 and len(frames[2]) == 8:
                    seq_raw, payload = frames[2], frames[3]
                elif len(frames) == 3 and len(frames[1]) == 8:
                    seq_raw, payload = frames[1], frames[2]
                else:
                    stats.decode_errors += 1
                    pm.KV_EVENT_DECODE_ERRORS.labels(stream.name).inc()
                    continue
                seq = int.from_bytes(seq_raw, "big")
                if seq == END_OF_REPLAY:
                    break
                if first is None:
                    first = seq
                if stream.expected is None or seq >= stream.expected:
                    self.ingest(stream, seq, payload, live=False)
            closed = first is not None and first <= start and (stream.expected or 0) >= live_seq
            if first is not None or count_empty:
                stats.replays += 1
                pm.KV_EVENT_REPLAYS.labels(stream.name, "closed" if closed else "partial").inc()
        except Exception:
            stats.replay_failures += 1
            pm.KV_EVENT_REPLAYS.labels(stream.name, "failed").inc()
            # A late answer must not be read as the next replay's: start a fresh DEALER next time.
            stream.dealer.close(0)
            stream.dealer = None
        return closed
