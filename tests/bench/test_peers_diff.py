"""The per-decision diff's parts: replica relays, what the fleet held of each prompt, causes, and the decision log
read back through a real LiteLLM proxy with kvroute."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from peers_diff import cause, diff_runs, placements  # noqa: E402
from peers_waste import Served, holdings  # noqa: E402
from replica_relay import ReplicaRelays, Timing, _Clock, _Rewriter, prompt_key, replica_of  # noqa: E402

from kvroute.plugin.dev.fake_engine import render_chat  # noqa: E402


def test_the_rewriter_replaces_a_fingerprint_cut_anywhere_and_holds_back_nothing_else():
    data = b'data: {"system_fingerprint":"b1234-abc","x":1}\n\ndata: {"system_fingerprint": "fp"}\n\ndata: [DONE]\n\n'
    want = data.replace(b"b1234-abc", b"peers-0__").replace(b'"fp"', b'"pe"')
    for cut in range(1, len(data)):
        r = _Rewriter("peers-0")
        first = r.feed(data[:cut])
        assert len(first) + len(r.carry) == cut and b"\n\n" not in r.carry  # only an unfinished field waits
        out = first + r.feed(data[cut:])
        assert out == want, cut  # the stream's end is never held back
    assert replica_of("peers-0__") == "peers-0" and replica_of(None) is None


def test_the_relay_clock_times_chat_requests_cut_anywhere_and_skips_health_checks():
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    body = json.dumps({"model": "m", "messages": messages, "stream": True}).encode()
    health = b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n"
    chat = b"POST /v1/chat/completions HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % len(body) + body
    for cut in (1, 7, len(health) + 3, len(health) + len(chat) - 2):
        sink: list[Timing] = []
        clock = _Clock(sink)
        data = health + chat
        clock.feed_out(b'HTTP/1.1 200 OK\r\n\r\n{"status":"ok"}')  # the health check's answer: no text
        clock.feed_in(data[:cut])
        clock.feed_in(data[cut:])
        assert [t.key for t in sink] == [prompt_key(render_chat(messages))], cut
        clock.feed_out(b'data: {"choices":[{"delta":{"role":"assistant","content":null}}]}\n\n')
        assert sink[0].first_s is None  # the role chunk is not answer text
        clock.feed_out(b'data: {"choices":[{"delta":{"content":"Hel')
        assert sink[0].first_s is not None and sink[0].first_s >= sink[0].arrived_s


def test_router_hops_split_the_clients_ttft_into_the_way_in_and_the_way_out():
    from peers import router_hops
    from peers_workloads import Outcome, RunResult

    a = Outcome(True, ttft_s=0.5, prompt="p-a", start_s=1.0)
    b = Outcome(True, ttft_s=0.2, prompt="p-b", start_s=2.0)
    failed = Outcome(False, prompt="p-c", start_s=3.0)
    run = RunResult([a, b, failed], t0=100.0)
    timings = [Timing(prompt_key("p-a"), 101.03, 101.49), Timing(prompt_key("p-b"), 102.01, None),
               Timing(prompt_key("p-b"), 102.05, 102.18), Timing(None, 103.0, 103.1)]
    hops = router_hops(run, timings)
    assert set(hops) == {id(a), id(b)}  # the retry of b that answered; the failed request has none
    assert [round(v, 6) for v in hops[id(a)]] == [30.0, 10.0]
    assert [round(v, 6) for v in hops[id(b)]] == [50.0, 20.0]


def _served(prompt: str, replica: str, cached: int, start: float, end: float) -> Served:
    return Served(prompt, "", replica, len(prompt) // 4, cached, start, end)


def test_holdings_tell_finished_in_flight_and_own_replica_apart():
    system = "s" * 640
    a = _served(system + "a" * 64, "r0", 0, 0.0, 1.0)
    b_in_flight = _served(system + "b" * 64, "r1", 0, 0.5, 2.0)  # sent while a was in flight, elsewhere
    c_after = _served(system + "c" * 64, "r1", 0, 3.0, 4.0)  # after a finished: r0 held the system prompt
    d_home = _served(system + "d" * 64, "r0", 160, 5.0, 6.0)
    h = holdings([a, b_in_flight, c_after, d_home], block_bytes=64)
    assert h[0].other_finished == h[0].other_sent == h[0].own_sent == 0
    assert h[1].other_finished == 0 and h[1].other_sent == 160  # held only by a request in flight
    assert h[2].other_finished == 160 and h[2].own_sent == 160  # r0 finished it; r1 had b too
    assert h[3].own_sent == 160


def _req(flow: str, turn: int, replica: str, prompt: int, cached: int, **held) -> dict:
    return {"flow": flow, "turn": turn, "replica": replica, "prompt_tokens": prompt, "cached_tokens": cached,
            "ttft_s": 0.1, "start_s": float(turn), "ok": True, "call_id": f"{flow}-{turn}", **held}


def test_causes_put_every_shortfall_in_one_place():
    split = _req("f", 0, "r1", 1000, 0, other_finished=0, other_sent=900, own_sent=0)
    assert cause(split, None) == "first turns split"
    dropped = _req("g", 2, "r0", 1000, 100, other_finished=0, other_sent=0, own_sent=900)
    assert cause(dropped, None) == "engine dropped it"
    spilled = _req("h", 1, "r1", 1000, 0, other_finished=900, other_sent=900, own_sent=0)
    assert cause(spilled, None) == "elsewhere"
    knew = {"backend": "r1", "inputs": {"candidates": {"r0": {"matched": 896}, "r1": {"matched": 0}}}}
    missed = {"backend": "r1", "inputs": {"candidates": {"r0": {"matched": 0}, "r1": {"matched": 0}}}}
    assert cause(spilled, knew) == "spill on load" and cause(spilled, missed) == "index missed a holder"
    assert cause(_req("k", 1, "r0", 1000, 990, other_finished=900, own_sent=900), None) is None


def test_the_diff_sums_each_cause_and_counts_moved_sessions():
    kv = {"requests_log": [_req("a", 0, "r0", 1000, 0), _req("a", 1, "r1", 1100, 0, other_finished=1000)],
          "decisions": []}
    peer = {"requests_log": [_req("a", 0, "r0", 1000, 0), _req("a", 1, "r0", 1100, 1000, own_sent=1000)]}
    d = diff_runs(kv, peer)
    assert d["causes"]["kvroute"]["elsewhere"]["tokens"] == 1000
    assert d["causes"]["peer"]["elsewhere"]["requests"] == 0
    assert placements(kv["requests_log"])["sessions moved"] == 1
    assert placements(peer["requests_log"])["sessions moved"] == 0


@pytest.mark.timeout(30)
def test_a_connection_the_replica_closes_is_closed_at_the_client_not_left_half_open():
    """llama.cpp closes an idle keep-alive connection; through the relay the client's connection must close too. A
    half-open one still takes the client's next request, which then dies unanswered ("Server disconnected"):
    LiteLLM retried such requests on another replica in the peers runs, and no router in front of a replica
    directly saw it."""

    async def replica(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        await writer.drain()
        writer.close()  # its keep-alive time is over

    async def connections_left(relays: ReplicaRelays) -> int:
        async def count() -> int:
            return sum(1 for t in asyncio.all_tasks() if t is not asyncio.current_task())

        for _ in range(100):
            left = asyncio.run_coroutine_threadsafe(count(), relays._loop).result(timeout=5)
            if not left:
                break
            await asyncio.sleep(0.02)
        return left

    async def run_all() -> tuple[bytes, int]:
        server = await asyncio.start_server(replica, "127.0.0.1", 0, family=socket.AF_INET)
        async with server:
            port = server.sockets[0].getsockname()[1]
            with ReplicaRelays([port], ["relay-a"]) as relays:
                reader, writer = await asyncio.open_connection("127.0.0.1", int(relays.base_urls[0].rsplit(":", 1)[1]))
                writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
                answer = await asyncio.wait_for(reader.read(), 10)  # to the end: the replica closed
                left = await connections_left(relays)  # the client sent nothing more and holds its side open
                writer.close()
                return answer, left

    answer, left = asyncio.run(run_all())
    assert answer.endswith(b"ok") and left == 0


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_relays_name_replicas_through_a_kvroute_proxy_whose_decision_log_joins_by_call_id(tmp_path):
    """Two fake replicas behind relays that stamp their names, a real LiteLLM proxy with kvroute and
    ``KVROUTE_DECISION_LOG``: every answer names the replica that served it, every pick is one log line joined
    by the client's ``x-litellm-call-id``, naming the same replica, and no prompt text is in the log."""
    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
    from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

    log = tmp_path / "decisions.jsonl"
    secret = "the quick brown fox " * 40
    with Fleet(2, engine="fake", options=ReplicaOptions(capacity_tokens=8192)) as fleet, \
            ReplicaRelays([r.port for r in fleet.replicas], ["relay-a", "relay-b"]) as relays:
        group = ModelGroup("m", [u + "/v1" for u in relays.base_urls], model=fleet.model, engine="vllm",
                           id_prefix="rep", block_size=16)
        names = {f"rep-{i}": n for i, n in enumerate(["relay-a", "relay-b"])}
        with ProxyProcess(build_proxy_config([group], kvroute=True), env={"KVROUTE_DECISION_LOG": str(log)},
                          inherit_kvroute_env=False) as proxy:
            served, keys = {}, []
            for i in range(4):
                body = {"model": "m", "max_tokens": 4,
                        "messages": [{"role": "system", "content": secret}, {"role": "user", "content": f"q{i}"}]}
                r = httpx.post(proxy.base_url + "/v1/chat/completions", json=body, timeout=60, trust_env=False,
                               headers={**proxy.headers, "x-litellm-call-id": f"call-{i}"})
                assert r.status_code == 200, r.text
                served[f"call-{i}"] = replica_of(r.json().get("system_fingerprint"))
                keys.append(prompt_key(render_chat(body["messages"])))
            timed = [t for t in relays.take_timings() if t.key in keys]
    assert sorted(t.key for t in timed) == sorted(keys)  # every request through LiteLLM clocked and keyed
    assert all(t.first_s is not None and t.first_s >= t.arrived_s for t in timed)
    assert set(served.values()) <= {"relay-a", "relay-b"} and None not in served.values()
    text = log.read_text()
    assert "quick brown fox" not in text
    lines = [json.loads(line) for line in text.splitlines()]
    picks = {d["call_id"]: d for d in lines if d["call_id"] in served}
    assert set(picks) == set(served)
    for call_id, d in picks.items():
        assert names[d["backend"]] == served[call_id]
        assert set(d["inputs"]["candidates"]) == set(names)


def test_an_attempt_that_ended_with_no_answer_is_listed_with_its_cause():
    from peers_diff import ending_rows

    run = {"endings": [{"event": "ended", "how": "failed", "call_id": "c-1", "backend": "tiny-2",
                        "verdict": "connect_error", "http_status": None,
                        "error": ["litellm.exceptions.InternalServerError", "httpx.ReadError"]}]}
    assert ending_rows([{}, run]) == ["- kvroute repeat 2: c-1 ended failed on tiny-2, connect_error (HTTP None): "
                                      "litellm.exceptions.InternalServerError <- httpx.ReadError"]
