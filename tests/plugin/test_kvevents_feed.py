"""The KV-event feed over real ZMQ sockets on 127.0.0.1: gaps, replay, reorder, duplicates, garbage, resets."""

from __future__ import annotations

import json
import threading
import time

import msgspec
import pytest
import zmq
from typer.testing import CliRunner

from kvroute.plugin.cli.cli import app
from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed, resolve_mode
from kvroute.policies.fingerprint import chain_seed, token_keys
from kvroute.policies.precise_index import PreciseIndex

BS = 16
MODEL = "m"


def stored(hashes, parent, tokens):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": tokens,
            "block_size": BS, "medium": "GPU"}


def removed(hashes):
    return ["BlockRemoved", hashes, "GPU"]  # the positional encoding, mixed in on purpose


def block(i):
    return list(range(i * BS, (i + 1) * BS))


def keys(n, start=0):
    return token_keys([t for i in range(start, start + n) for t in block(i)], BS, chain_seed(MODEL), 1 << 20)


class Publisher:
    """An engine stand-in: XPUB (so it knows when the subscriber is there) + ROUTER replay of retained batches."""

    def __init__(self, topic=b"kv", *, bind=True, connect_to=None, replay=True, replay_topic_frame=True,
                 replay_junk=False):
        self.replay_topic_frame = replay_topic_frame  # vLLM 0.32 sends it; older builds did not
        self.replay_junk = replay_junk
        self.ctx = zmq.Context.instance()
        self.topic = topic
        self.pub = self.ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if connect_to:
            self.pub.connect(connect_to)
            self.endpoint = connect_to
        else:
            self.pub.bind("tcp://127.0.0.1:0")
            self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.retained: dict[int, bytes] = {}
        self.replay_requests: list[int] = []
        self.replay_endpoint = None
        self._stop = threading.Event()
        self._ready = threading.Event()
        if replay:
            self._thread = threading.Thread(target=self._serve_replay, daemon=True)
            self._thread.start()
            self._ready.wait(5)

    def _serve_replay(self):
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind("tcp://127.0.0.1:0")
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not router.poll(20):
                    continue
                ident, _empty, start_raw = router.recv_multipart()
                start = int.from_bytes(start_raw, "big")
                self.replay_requests.append(start)
                head = [ident, b"", self.topic] if self.replay_topic_frame else [ident, b""]
                end = [ident, b"", b""] if self.replay_topic_frame else [ident, b""]
                if self.replay_junk:
                    router.send_multipart([ident, b"", b"junk"])  # garbage on the replay socket is skipped
                for seq in sorted(s for s in self.retained if s >= start):
                    router.send_multipart([*head, seq.to_bytes(8, "big"), self.retained[seq]])
                router.send_multipart([*end, (2**64 - 1).to_bytes(8, "big"), b""])
        finally:
            router.close(0)

    def wait_subscribed(self, timeout=5.0):
        assert self.pub.poll(int(timeout * 1000)), "subscriber never subscribed"
        self.pub.recv()

    def payload(self, events, ts=None, rank=None):
        batch = [ts if ts is not None else time.time(), events] + ([rank] if rank is not None else [])
        return msgspec.msgpack.encode(batch)

    def retain(self, seq, events, **kw):
        self.retained[seq] = self.payload(events, **kw)
        return self.retained[seq]

    def send(self, seq, events=None, *, raw=None, topic=None, retain=True, **kw):
        payload = raw if raw is not None else (self.retain(seq, events, **kw) if retain else self.payload(events, **kw))
        self.pub.send_multipart([topic if topic is not None else self.topic, seq.to_bytes(8, "big"), payload])

    def close(self):
        self._stop.set()
        if getattr(self, "_thread", None):
            self._thread.join(2)
        self.pub.close(0)


def wait_for(pred, timeout=5.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.01)
    return pred()


@pytest.fixture
def pub():
    p = Publisher()
    yield p
    p.close()


def feed_for(pub, index=None, replay_timeout_s=2.0, **src):
    index = index or PreciseIndex()
    source = EventSource(pub.endpoint, backend="A", topic="kv", replay_endpoint=pub.replay_endpoint, model=MODEL,
                         **src)
    feed = KvEventFeed(index, [source], replay_timeout_s=replay_timeout_s)
    feed.start()
    pub.wait_subscribed()
    if pub.replay_endpoint:  # a starting feed first asks for the engine's retained history
        assert wait_for(lambda: pub.replay_requests == [0])
    return feed, index


def test_endpoint_modes_follow_vllm():
    assert resolve_mode("tcp://127.0.0.1:5557") == (True, "tcp://127.0.0.1:5557")
    assert resolve_mode("tcp://*:5557") == (False, "tcp://127.0.0.1:5557")
    assert resolve_mode("ipc:///tmp/kv.sock") == (False, "ipc:///tmp/kv.sock")
    assert resolve_mode("tcp://127.0.0.1:5557", bind=False) == (False, "tcp://127.0.0.1:5557")


def test_connect_mode_store_remove_clear(pub):
    feed, index = feed_for(pub, bind=False)
    try:
        pub.send(0, [stored([101, 102, 103], None, block(0) + block(1) + block(2))])
        pub.send(1, [stored([104], 103, block(3)), removed([103])])
        assert wait_for(lambda: feed.stat("kv").batches == 2)
        assert index.match(keys(4), ["A"], 0.0) == {"A": 2}
        pub.send(2, [{"type": "AllBlocksCleared"}])
        assert wait_for(lambda: index.blocks("A") == 0)
        s = feed.stat("kv").public()
        assert s == {"batches": 3, "blocks_stored": 4, "blocks_removed": 1, "clears": 1, "gaps": 0, "replays": 0,
                     "decode_errors": 0}
    finally:
        feed.stop()


def test_gap_is_filled_by_replay_and_late_duplicates_are_skipped(pub):
    feed, index = feed_for(pub, bind=False)
    try:
        pub.send(0, [stored([1], None, block(0))])
        pub.retain(1, [stored([2], 1, block(1))])  # lost on the wire, retained by the engine
        pub.send(2, [stored([3], 2, block(2))])
        assert wait_for(lambda: index.match(keys(3), ["A"], 0.0) == {"A": 3})
        assert pub.replay_requests == [0, 1]
        pub.send(1, [stored([2], 1, block(1))])  # reordered copy of batch 1 arrives late
        pub.send(2, [stored([3], 2, block(2))])  # duplicate
        pub.send(3, [removed([3])])
        assert wait_for(lambda: feed.stat("kv").last_seq == 3)
        s = feed.stat("kv")
        # the live batch 2 (already replayed), the late 1 and the repeated 2
        assert (s.gaps, s.replays, s.duplicates, s.batches) == (1, 1, 3, 4)
        assert index.match(keys(3), ["A"], 0.0) == {"A": 2}
    finally:
        feed.stop()


def test_replay_in_the_older_three_frame_shape():
    p = Publisher(replay_topic_frame=False, replay_junk=True)
    try:
        p.retain(0, [stored([1], None, block(0))])
        feed, index = feed_for(p, bind=False)
        try:
            assert wait_for(lambda: index.blocks("A") == 1)
            assert feed.stat("kv").replays == 1 and feed.stat("kv").decode_errors == 1
        finally:
            feed.stop()
    finally:
        p.close()


def test_gap_without_replay_socket_keeps_going():
    p = Publisher(replay=False)
    feed, index = feed_for(p, bind=False)
    try:
        p.send(0, [stored([1], None, block(0))])
        p.send(5, [stored([9], None, block(7))])
        assert wait_for(lambda: feed.stat("kv").batches == 2)
        s = feed.stat("kv")
        assert s.gaps == 1 and s.replays == 0 and s.replay_failures == 1
        assert index.blocks("A") == 2
    finally:
        feed.stop()
        p.close()


def test_mid_stream_join_replays_from_the_start(pub):
    for seq in range(3):
        pub.retain(seq, [stored([seq + 1], seq or None, block(seq))])
    feed, index = feed_for(pub, bind=False)
    try:
        pub.send(3, [stored([4], 3, block(3))])
        assert wait_for(lambda: index.match(keys(4), ["A"], 0.0) == {"A": 4})
        assert pub.replay_requests == [0]
        assert feed.stat("kv").gaps == 0
    finally:
        feed.stop()


def test_garbage_is_counted_and_skipped(pub):
    feed, index = feed_for(pub, bind=False)
    try:
        pub.send(0, [stored([1], None, block(0))])
        pub.pub.send_multipart([b"kv", b"\x00\x01"])                       # two frames
        pub.pub.send_multipart([b"kv", b"\x00" * 3, b"x"])                 # bad sequence frame
        pub.send(1, raw=b"\xc1\xc1 not msgpack")                           # bad payload
        pub.send(2, raw=msgspec.msgpack.encode({"no": "batch"}))           # wrong shape
        pub.send(3, [stored("bad", None, []), stored([2], 1, block(1))])   # one bad event, one good
        assert wait_for(lambda: feed.stat("kv").last_seq == 3)
        s = feed.stat("kv")
        assert s.decode_errors == 5 and s.gaps == 0
        assert index.match(keys(2), ["A"], 0.0) == {"A": 2}
    finally:
        feed.stop()


def test_sequence_reset_drops_the_sources_state(pub):
    feed, index = feed_for(pub, bind=False)
    try:
        pub.send(0, [stored([1, 2], None, block(0) + block(1))])
        pub.send(1, [stored([3], 2, block(2))])
        assert wait_for(lambda: index.blocks("A") == 3)
        pub.retained.clear()
        pub.send(0, [stored([50], None, block(5))])  # engine restarted: sequence back at 0
        assert wait_for(lambda: feed.stat("kv").resets == 1)
        assert wait_for(lambda: index.blocks("A") == 1)
        assert index.match(keys(1, start=5), ["A"], 0.0) == {"A": 1}
        assert index.match(keys(3), ["A"], 0.0) == {}
    finally:
        feed.stop()


def test_reconnect_drops_state_and_rebuilds_from_replay():
    p1 = Publisher()
    port_endpoint = p1.endpoint
    feed, index = feed_for(p1, bind=False, replay_timeout_s=0.3)
    p2 = None
    try:
        p1.send(0, [stored([1, 2], None, block(0) + block(1))])
        assert wait_for(lambda: index.blocks("A") == 2)
        p1.close()  # the engine goes away (replay socket too); a new one comes up on the same address
        time.sleep(0.3)
        p2 = Publisher(replay=False)
        p2.pub.close(0)
        p2.pub = p2.ctx.socket(zmq.XPUB)
        p2.pub.setsockopt(zmq.LINGER, 0)
        p2.pub.bind(port_endpoint)
        p2.wait_subscribed()
        p2.send(7, [stored([9], None, block(4))])
        assert wait_for(lambda: feed.stat("kv").clears >= 1 and index.blocks("A") >= 1)
        assert index.match(keys(2), ["A"], 0.0) == {}
        assert index.match(keys(1, start=4), ["A"], 0.0) == {"A": 1}
        assert feed.stat("kv").replay_failures == 1  # the old replay socket is gone; the live batch still applies
    finally:
        feed.stop()
        if p2 is not None:
            p2.close()


def test_bind_mode_with_several_engines_split_by_topic():
    index = PreciseIndex()
    src = EventSource("tcp://127.0.0.1:0", topic_backends={"kv@a": "A", "kv@b": "B"}, model=MODEL)
    feed = KvEventFeed(index, [src])
    feed.start()
    bound = feed.bound["tcp://127.0.0.1:0"]
    pa = Publisher(b"kv@a", connect_to=bound, replay=False)
    pb = Publisher(b"kv@b", connect_to=bound, replay=False)
    try:
        pa.wait_subscribed()
        pb.wait_subscribed()
        pa.send(0, [stored([1, 2], None, block(0) + block(1))])
        pb.send(0, [stored([7], None, block(0))], rank=1)
        pb.send(1, [stored([8], 7, block(1))], rank=1)
        assert wait_for(lambda: index.blocks("A") == 2 and index.blocks("B") == 2)
        assert index.match(keys(2), ["A", "B"], 0.0) == {"A": 2, "B": 2}
        assert set(feed.stats) == {"kv@a", "kv@b"}
    finally:
        feed.stop()
        pa.close()
        pb.close()


def test_bad_endpoint_reports_an_error_instead_of_crashing():
    index = PreciseIndex()
    feed = KvEventFeed(index, [EventSource("nonsense://x", backend="A", bind=True)])
    assert index.covers("A")
    feed.start()
    try:
        assert feed.error
        assert not index.covers("A")  # routed approximately instead of by events that never come
    finally:
        feed.stop()


def test_events_inspect_cli_prints_the_documented_json(pub):
    pub.retain(0, [stored([1, 2], None, block(0) + block(1))])  # history the engine retains
    pub.retain(1, [removed([2])])
    pub.retain(2, [stored([3], 1, block(1))])

    def publish():
        pub.wait_subscribed()
        assert wait_for(lambda: pub.replay_requests == [0])  # the CLI rebuilt the history first
        pub.send(3, raw=b"garbage", retain=False)
        pub.retain(4, [removed([3])])  # lost on the wire
        pub.send(5, [stored([4], 1, block(1))])

    t = threading.Thread(target=publish)
    t.start()
    result = CliRunner().invoke(app, ["events", "inspect", "--endpoint", pub.endpoint, "--replay",
                                      pub.replay_endpoint, "--topic", "kv", "--duration", "1.5", "--json"])
    t.join()
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data == {"sources": {"kv": {"batches": 5, "blocks_stored": 4, "blocks_removed": 2, "clears": 0,
                                       "gaps": 1, "replays": 2, "decode_errors": 1}},
                    "index_blocks": 2}
    assert pub.replay_requests == [0, 4]
