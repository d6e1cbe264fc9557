"""The fake engine's llama.cpp model: one slot, a host cache of whole prompts, cached tokens as llama.cpp reports."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from kvroute.plugin.dev.fake_engine import FakeEngineConfig, FakeEngineServer, render_chat
from kvroute.plugin.dev.fake_llamacpp import HostCores, LlamaCppModel
from kvroute.plugin.dev.llamacpp import xllamacpp_available
from kvroute.policies.errors import ConfigError
from kvroute.sim.prompt_cache import common_prefix

A = "".join(f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(40))
B = "".join(f"row {i}: pack my box with five dozen liquor jugs\n" for i in range(40))
TOKENS_PER_BYTE = 0.45  # the preset's, without a tokenizer


def messages(system: str, user: str) -> list[dict]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]


async def ask(client: httpx.AsyncClient, system: str, user: str) -> dict:
    r = await client.post("/v1/chat/completions", json={"model": "m", "messages": messages(system, user),
                                                         "max_tokens": 4})
    assert r.status_code == 200
    return r.json()


def shared_tokens(a: list[dict], b: list[dict]) -> int:
    """Tokens of ``b``'s prompt a slot holding ``a``'s prompt reuses (never its last token)."""
    pa, pb = render_chat(a).encode(), render_chat(b).encode()
    return min(int(common_prefix(pa, pb) * TOKENS_PER_BYTE), -int(-len(pb) * TOKENS_PER_BYTE // 1) - 1)


@pytest.fixture
async def llama():
    config = FakeEngineConfig(name="l0", engine_model="llamacpp", cache_ram_mib=9.0)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url, timeout=10) as client:
        yield server, client


async def test_cached_tokens_are_token_granular_and_reported_twice_as_llamacpp_does(llama):
    _, client = llama
    first = await ask(client, A, "one")
    second = await ask(client, A, "two")
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == shared_tokens(messages(A, "one"), messages(A, "two"))
    assert second["timings"]["cache_n"] == cached
    assert second["timings"]["prompt_n"] == second["usage"]["prompt_tokens"] - cached


async def test_the_same_prompt_again_reuses_all_but_its_last_token(llama):
    _, client = llama
    first = await ask(client, A, "one")
    assert first["choices"][0]["message"]["content"] == LlamaCppModel.answer(4) == "ok ok ok ok"  # a word a token
    again = await ask(client, A, "one")
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == again["usage"]["prompt_tokens"] - 1


async def test_a_prompt_the_slot_moved_on_from_comes_back_from_the_host_cache(llama):
    server, client = llama
    await ask(client, A, "one")
    await ask(client, B, "one")  # the slot now holds B; A went to the host cache
    back = await ask(client, A, "two")
    assert back["usage"]["prompt_tokens_details"]["cached_tokens"] == shared_tokens(messages(A, "one"),
                                                                                    messages(A, "two"))
    assert server.engine.llama is not None and server.engine.llama.cache.restored == 1


async def test_one_slot_whatever_slots_says_and_llamacpp_metrics():
    config = FakeEngineConfig(engine_model="llamacpp", slots=4)
    async with FakeEngineServer(config) as server, httpx.AsyncClient(base_url=server.base_url) as client:
        tasks = [asyncio.create_task(ask(client, A, str(i))) for i in range(3)]
        peak = 0
        while not all(t.done() for t in tasks):
            assert server.engine.running <= 1
            peak = max(peak, server.engine.waiting)
            await asyncio.sleep(0.001)
        await asyncio.gather(*tasks)
        text = (await client.get("/metrics")).text
    assert peak >= 1
    assert "llamacpp:prompt_tokens_cached_total" in text and "llamacpp:requests_deferred" in text


def test_a_tiny_host_cache_keeps_no_prompt_bigger_than_itself():
    model = LlamaCppModel(cache_ram_mib=0.001)
    a = model.encode(A)
    model.take(a)
    model.keep(a, "ok ok ok", 4)
    b = model.encode(B)
    assert model.take(b) == 0 and model.cache.entries == []  # A's state (over 1 KiB) was never saved
    model.keep(b, "ok ok ok", 4)
    assert model.take(model.encode(A)) == 0  # the slot holds B now, and nothing else holds A


def test_cores_and_engine_model_are_validated(tmp_path):
    with pytest.raises(ConfigError, match="engine_model"):
        FakeEngineConfig(engine_model="sglang")
    with pytest.raises(ConfigError, match="host_cores"):
        FakeEngineConfig(host_cores=2.0, cores_dir=str(tmp_path))  # a vLLM-style engine shares no cores
    with pytest.raises(ValueError):
        HostCores(tmp_path, 0.0, "r0")


def test_a_slower_host_makes_every_compute_time_of_the_fake_replica_that_many_times_longer(tmp_path):
    from kvroute.plugin.dev.fake_engine import FakeEngine

    base = FakeEngine(FakeEngineConfig(engine_model="llamacpp")).llama
    slow = FakeEngine(FakeEngineConfig(engine_model="llamacpp", engine_cost=1.5)).llama
    assert base is not None and slow is not None
    for new, cached in ((1, 0), (900, 0), (400, 1200)):
        assert slow.prefill_s(new, cached) == pytest.approx(1.5 * base.prefill_s(new, cached))
    assert slow.decode_s(3000) == pytest.approx(1.5 * base.decode_s(3000))
    with pytest.raises(ConfigError, match="engine_cost"):
        FakeEngineConfig(engine_model="llamacpp", engine_cost=0.0)


async def test_host_cores_share_compute_between_replicas(tmp_path):
    one = HostCores(tmp_path, 1.0, "r0")
    two = HostCores(tmp_path, 1.0, "r1")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await one.run(0.05)
    alone = loop.time() - t0
    t0 = loop.time()
    await asyncio.gather(one.run(0.05), two.run(0.05))
    together = loop.time() - t0
    assert together > 1.6 * alone  # two replicas on one core take about twice as long
    assert one.computing() == 0  # the markers are gone once done


# ---------------------------------------------------------------------------------------------- against llama.cpp
@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.skipif(not xllamacpp_available(),
                    reason="needs the engines extra: pip install 'kvroute[engines]' (xllamacpp, gguf, ...)")
def test_the_model_reports_the_cached_tokens_a_real_llamacpp_replica_reports(tmp_path_factory):
    """Conversations interleaved on one replica, the last one about as big as the host cache: the slot, the host
    cache's save, restore and eviction all decide what llama.cpp reuses, and the model must agree."""
    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
    from kvroute.plugin.dev.tiny_model import PRESETS, ensure_tiny_model

    cache_dir = tmp_path_factory.mktemp("kvroute-cache")
    tiny = ensure_tiny_model(PRESETS["small"], cache_dir)
    systems = [f"[{c}] You are app {c}. " + text for c, text in enumerate((A[:700], B[:1200], A[:900], A + B))]
    order = [0, 0, 1, 0, 2, 1, 2, 0, 3, 1, 0, 2]  # conversation of each request; 3 pushes the others out
    model = LlamaCppModel(cache_ram_mib=9.0, tokenizer=str(tiny.tokenizer_json))
    talks: list[list[dict]] = [[{"role": "system", "content": s}] for s in systems]
    real, modelled = [], []
    opts = ReplicaOptions(cache_dir=str(cache_dir), cache_ram_mib=9, threads=1, parallel=1, ctx=8192)
    with Fleet(1, engine="llamacpp", options=opts) as fleet, httpx.Client(timeout=60, trust_env=False) as client:
        for n, c in enumerate(order):
            talks[c].append({"role": "user", "content": f"Turn {n}: what next?"})
            r = client.post(fleet.api_bases[0] + "/chat/completions",
                            json={"model": "tiny", "max_tokens": 8, "temperature": 0, "messages": talks[c]})
            assert r.status_code == 200, r.text
            body = r.json()
            real.append(body["usage"]["prompt_tokens_details"]["cached_tokens"])
            seq = model.encode(render_chat(talks[c]))
            assert len(seq) == body["usage"]["prompt_tokens"]  # the model counts the prompt as llama.cpp does
            modelled.append(model.take(seq))
            answer = body["choices"][0]["message"]["content"]
            model.keep(seq, answer, 8)
            talks[c].append({"role": "assistant", "content": answer})
    # llama.cpp's slot keeps the token ids it generated; the next prompt holds the answer's text, which the tiny
    # random model's tokens need not re-tokenize to, so a follow-up may reuse up to the answer's tokens fewer
    # than the model, which keeps the answer as the next prompt tokenizes it (the fake engine's answers are alike)
    assert all(r <= m <= r + 8 for m, r in zip(modelled, real, strict=True)), (modelled, real)
    assert all(m == r for m, r in zip(modelled, real, strict=True) if m < 100), (modelled, real)  # template only
    assert model.cache.restored >= 3 and model.cache.evicted >= 1  # the sequence exercised restore and eviction


class _Answer:
    """An exchange that keeps the answer (the engine's socket side is not under test here)."""

    status: int | None = None
    aborted = False

    async def send_json(self, status: int, value: object, headers: dict | None = None) -> None:
        self.status, self.body = status, value


async def test_the_fakes_own_handling_is_taken_out_of_the_models_time_not_added_to_it(monkeypatch):
    """What the fake spends reading and tokenizing a request comes out of llama.cpp's pre-slot time, and the slot's
    cache update out of the prefill: a request waits the model's times in all (on a clock the test moves)."""
    import json

    from kvroute.plugin.dev.fake_engine import FakeEngine
    from kvroute.plugin.dev.fake_http import Request

    engine = FakeEngine(FakeEngineConfig(name="l0", engine_model="llamacpp", cache_ram_mib=9.0))
    loop = asyncio.get_running_loop()
    now = [1000.0]
    monkeypatch.setattr(loop, "time", lambda: now[0])
    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def sleep(seconds: float, *args: object) -> None:
        slept.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(asyncio, "sleep", sleep)
    prefills: list[float] = []

    async def prefill(seconds: float) -> None:
        prefills.append(seconds)

    monkeypatch.setattr(engine, "_prefill", prefill)
    take = engine.llama.take

    def slow_take(prompt):  # the slot's cache update takes 50 ms of this process
        now[0] += 0.050
        return take(prompt)

    monkeypatch.setattr(engine.llama, "take", slow_take)
    response_s = engine.llama.spec.response_s
    for i, (read_ago, pre_slot) in enumerate(((0.0, response_s), (response_s / 3, response_s * 2 / 3), (1.0, 0.0))):
        slept.clear(), prefills.clear()
        body = json.dumps({"model": "m", "messages": messages(f"{i} {A}", "one"), "max_tokens": 1}).encode()
        ex = _Answer()
        await engine.handle(Request("POST", "/v1/chat/completions", "", {}, body, received=now[0] - read_ago), ex)
        assert ex.status == 200
        usage = ex.body["usage"]
        model = engine.llama.prefill_s(usage["prompt_tokens"] - usage["prompt_tokens_details"]["cached_tokens"],
                                       usage["prompt_tokens_details"]["cached_tokens"])
        assert slept[0] == pytest.approx(pre_slot)
        assert prefills == [pytest.approx(model - 0.050)]
        assert ex.body["timings"]["prompt_ms"] == round(model * 1000, 3)  # llama.cpp's own report: the model's


def test_a_requests_deviation_is_drawn_by_its_tokens_whatever_the_order():
    from kvroute.plugin.dev.fake_llamacpp import drawn

    pool = (-0.2, -0.05, 0.0, 0.1, 0.3)
    seqs = [tuple(range(i, i + 50)) for i in range(40)] + [f"prompt {i}".encode() for i in range(40)]
    first = [drawn(pool, s) for s in seqs]
    assert [drawn(pool, s) for s in reversed(seqs)] == first[::-1]  # the same request, the same draw
    assert set(first) == set(pool)  # every value is drawn (80 requests over 5 values)
    salted = [drawn(pool, b"another repeat's salt " + s if isinstance(s, bytes) else (9, *s)) for s in seqs]
    assert salted != first  # a repeat salts its prompts: other draws
    assert drawn((), seqs[0]) == 0.0


@pytest.mark.parametrize("deviation", [0.25, -0.4, -0.99])
async def test_a_requests_time_is_its_models_times_one_plus_its_deviation_taken_or_given_at_the_prefill(
        monkeypatch, deviation):
    """llama.cpp's run-to-run variation on the fake: prefill and decode of a request times 1 + its drawn
    deviation, the difference on the prefill (never below nothing), and llama.cpp's report says so."""
    import json

    from kvroute.plugin.dev.fake_engine import FakeEngine
    from kvroute.plugin.dev.fake_http import Request

    plain = FakeEngine(FakeEngineConfig(name="l0", engine_model="llamacpp", cache_ram_mib=9.0))
    varied = FakeEngine(FakeEngineConfig(name="l0", engine_model="llamacpp", cache_ram_mib=9.0,
                                         time_jitter=(deviation,)))
    waits: dict[str, list[float]] = {"plain": [], "varied": []}
    for name, engine in (("plain", plain), ("varied", varied)):
        async def prefill(seconds: float, name: str = name) -> None:
            waits[name].append(seconds)

        monkeypatch.setattr(engine, "_prefill", prefill)
    loop_time = asyncio.get_running_loop().time
    reports = {}
    for name, engine in (("plain", plain), ("varied", varied)):
        body = json.dumps({"model": "m", "messages": messages(A, "one"), "max_tokens": 3}).encode()
        ex = _Answer()
        await engine.handle(Request("POST", "/v1/chat/completions", "", {}, body, received=loop_time()), ex)
        assert ex.status == 200
        reports[name] = ex.body
    prompt = reports["plain"]["usage"]["prompt_tokens"]
    model = plain.llama.prefill_s(prompt, 0)
    whole = model + 3 * plain.llama.decode_s(prompt)
    expected = max(0.0, model + deviation * whole)
    assert waits["plain"][0] == pytest.approx(model, abs=0.005)  # less the fake's own cache update
    assert waits["varied"][0] == pytest.approx(expected, abs=0.005)
    assert reports["varied"]["timings"]["prompt_ms"] == pytest.approx(expected * 1000, abs=0.01)
    assert reports["varied"]["usage"] == reports["plain"]["usage"]  # the work is the same; only its time varies


def test_time_jitter_is_refused_outside_the_llamacpp_model_or_at_minus_one():
    with pytest.raises(ConfigError):
        FakeEngineConfig(name="x", engine_model="llamacpp", time_jitter=(0.1, -1.0))
    with pytest.raises(ConfigError):
        FakeEngineConfig(name="x", time_jitter=(0.1,))
    from kvroute.plugin.dev.fake_engine import _deviations

    assert _deviations("0.1,-0.05, 0") == (0.1, -0.05, 0.0)
    with pytest.raises(Exception, match="comma-separated"):
        _deviations("0.1,fast")


def test_a_fleets_fake_llamacpp_replicas_are_started_with_its_time_jitter(tmp_path):
    from kvroute.plugin.dev import fake_engine
    from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions

    fleet = Fleet(1, engine="fake", workdir=tmp_path,
                  options=ReplicaOptions(engine_model="llamacpp", time_jitter=(-0.0625, 0.125)))
    command = fleet._command("r0", tmp_path / "ready")
    assert command[1:3] == ["-m", "kvroute.plugin.dev.fake_engine"]
    args = fake_engine.parser().parse_args(command[3:])  # as the replica's own parser reads them
    assert args.time_jitter == (-0.0625, 0.125)  # a first value below 0 is no option
