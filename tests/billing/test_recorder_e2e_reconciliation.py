"""Reconciliation through a real LiteLLM proxy: what clients saw against what the ledger holds.

Fake self-hosted replicas (group ``llama``) fall back to priced hosted fakes (group ``hosted``). Several hundred
requests with retries, fallbacks, injected 500/429 faults, concurrent requests sharing a trace id and an
``x-session-id`` header, client-written ``kvroute_*`` metadata of every type, the proxy SIGTERMed and ``kill -9``ed
mid-run and restarted on the same data directory, and (PostgreSQL) the database stopped and started mid-run.
Join key: every request sends its own ``user``, which the ledger stores as ``end_user``.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import signal
from collections import Counter
from datetime import UTC, datetime
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from kvroute.billing.events import period_of
from kvroute.billing.ledger import Ledger
from kvroute.billing.recorder import UsageRecorder
from kvroute.plugin.dev.fake_faults import clear_fault, engine_stats, inject_fault
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

JUNK = ["x", {"a": 1}, [1, 2], 10**30, None, ""]
CUTS, CUT_AFTER = 6, 3  # hosted cut faults (both replicas), chunks sent first (the role chunk, then 2 tokens)
PRICE_IN, PRICE_OUT = Decimal("0.000001"), Decimal("0.000002")  # the hosted group's prices (per token)


def _pg_server_class():
    spec = importlib.util.spec_from_file_location("billing_conftest", Path(__file__).with_name("conftest.py"))
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module._PgServer


class Run:
    """The client side: every request's user and what came back (status code, or the transport error)."""

    def __init__(self, proxy: ProxyProcess) -> None:
        self.proxy = proxy
        self.results: dict[str, int | str] = {}
        self.phase_of: dict[str, str] = {}
        self.n = 0

    async def one(self, client: httpx.AsyncClient, phase: str, *, stream: bool = False) -> None:
        self.n += 1
        i = self.n
        user = f"u{i:05d}"
        self.phase_of[user] = phase
        meta: dict = {"trace_id": "shared-trace"} if i % 3 == 0 else {}
        if i % 5 == 0:
            meta.update(kvroute_attempt=JUNK[i % len(JUNK)], kvroute_request="evil", kvroute_rid=JUNK[(i + 1) % 6],
                        kvroute_sig="0" * 24)
        headers = {**self.proxy.headers, **({"x-session-id": "shared-session"} if i % 2 == 0 else {})}
        body = {"model": "llama", "messages": [{"role": "user", "content": f"request {i} " + "word " * (i % 7)}],
                "max_tokens": 3, "user": user, "metadata": meta}
        if i % 4 == 0:
            body["litellm_trace_id"] = "shared-litellm-trace"
        if stream:
            body["stream"] = True
        try:
            if stream:
                async with client.stream("POST", self.proxy.base_url + "/v1/chat/completions", json=body,
                                         headers=headers) as r:
                    text = "".join([chunk async for chunk in r.aiter_text()])
                    # a stream cut upstream after output went out ends in an in-band error event (then [DONE])
                    complete = "[DONE]" in text and 'data: {"error"' not in text
                    self.results[user] = r.status_code if complete or r.status_code != 200 else "cut"
            else:
                r = await client.post(self.proxy.base_url + "/v1/chat/completions", json=body, headers=headers)
                self.results[user] = r.status_code
        except httpx.HTTPError as exc:
            self.results[user] = type(exc).__name__

    async def batch(self, phase: str, n: int, concurrency: int = 6, stream_every: int = 0) -> None:
        sem = asyncio.Semaphore(concurrency)
        async with httpx.AsyncClient(trust_env=False, timeout=60) as client:
            async def go(k: int) -> None:
                async with sem:
                    await self.one(client, phase, stream=bool(stream_every and k % stream_every == 0))
            await asyncio.gather(*(go(k) for k in range(n)))

    async def batch_with_kill(self, phase: str, n: int, sig: int) -> None:
        """``n`` requests; once a third have answered, the proxy gets ``sig`` while the rest are in flight."""
        async def killer() -> None:
            while sum(1 for u, p in self.phase_of.items() if p == phase and u in self.results) < n // 3:
                await asyncio.sleep(0.01)
            os.killpg(self.proxy.process.pid, sig)  # the proxy and (with --num_workers) all its workers
        await asyncio.gather(self.batch(phase, n, concurrency=8), killer())


def _ledger_rows(url: str) -> list:
    from sqlalchemy import select

    from kvroute.billing.models import UsageEventRow as E
    led = Ledger.open(url)
    try:
        with led.engine.connect() as conn:
            return list(conn.execute(select(E.end_user_id, E.status, E.is_final_attempt, E.backend_id, E.attempt_no,
                                            E.request_id, E.event_id, E.provider_cost, E.absorbed_cost,
                                            E.provider, E.billed_amount, E.input_uncached_tokens,
                                            E.cache_read_tokens, E.output_tokens, E.occurred_at)))
    finally:
        led.close()


def _period(at: datetime) -> str:
    return period_of(at if at.tzinfo else at.replace(tzinfo=UTC))


def _report_absorbed(url: str, periods: set[str]) -> Decimal:
    """The absorbed cost of ``kvroute billing report margin``, summed over its rows of ``periods``."""
    from kvroute.billing.reports import margin_report
    led = Ledger.open(url)
    try:
        with led.engine.connect() as conn:
            catalog = led.catalog()
            return sum((row["absorbed_cost"] for p in periods for row in margin_report(conn, catalog, p)),
                       Decimal(0))
    finally:
        led.close()


def _faults(fleet: Fleet) -> Counter:
    out: Counter = Counter()
    for i, base in enumerate(fleet.api_bases):
        for mode, count in engine_stats(base).get("faults", {}).items():
            out[(i, mode)] += count
    return out


def _start_proxy(cfg: dict, workdir: Path, env: dict) -> ProxyProcess:
    return ProxyProcess(cfg, env=env, workdir=workdir, inherit_kvroute_env=False).start()


@pytest.mark.parametrize(("db", "workers"), [("sqlite", 1), ("postgresql", 1), ("sqlite", 2)])
def test_every_200_billed_once_nothing_else_through_faults_kills_and_outages(db: str, workers: int, tmp_path: Path,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    if workers > 1:
        from kvroute.plugin.dev import proxy_process
        plain = proxy_process.litellm_command
        monkeypatch.setattr(proxy_process, "litellm_command", lambda: [*plain(), "--num_workers", str(workers)])
    pg = None
    if db == "postgresql":
        try:
            pg = _pg_server_class()()
            pg.start()
        except Exception as exc:  # no PostgreSQL binaries on this machine
            pytest.skip(f"PostgreSQL unavailable: {exc}")
        url = pg.url
    else:
        url = f"sqlite:///{tmp_path / 'ledger.db'}"
    data = tmp_path / "data"
    env = {"KVROUTE_DATA_DIR": str(data), "KVROUTE_BILLING_DB": url, "KVROUTE_BILLING_FSYNC_INTERVAL_S": "0.5"}
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0, slots=16)
    try:
        with Fleet(2, engine="fake", options=opts, name_prefix="rep") as reps, \
                Fleet(2, engine="fake", options=opts, name_prefix="host") as hosted:
            groups = [ModelGroup("llama", reps.api_bases),
                      ModelGroup("hosted", hosted.api_bases, engine=None,
                                 prices={"input_cost_per_token": float(PRICE_IN),
                                         "output_cost_per_token": float(PRICE_OUT)})]
            cfg = build_proxy_config(groups, fallbacks={"llama": ["hosted"]},
                                     router_settings={"num_retries": 1, "allowed_fails": 1, "cooldown_time": 1,
                                                      "retry_after": 0})
            workdir = tmp_path / "proxy"
            proxy = _start_proxy(cfg, workdir, env)
            run = Run(proxy)
            fault_phases: Counter = Counter()
            try:
                asyncio.run(run.batch("warm", 40, stream_every=5))
                before = _faults(reps) + _faults(hosted)
                inject_fault(reps.api_bases[0], "500", count=12)
                inject_fault(reps.api_bases[1], "429", count=6, retry_after=0)
                asyncio.run(run.batch("retries", 50))
                inject_fault(reps.api_bases[0], "500", count=30)
                inject_fault(reps.api_bases[1], "500", count=30)
                asyncio.run(run.batch("fallbacks", 50))
                inject_fault(hosted.api_bases[0], "500", count=5)
                asyncio.run(run.batch("hosted_fault", 30))
                # streams cut by a priced hosted provider after output went out: paid failed attempts
                for base in reps.api_bases:
                    inject_fault(base, "500", count=None)
                for base in hosted.api_bases:  # hosted-0 may still be cooling down from its 500s
                    inject_fault(base, "cut", count=CUTS // 2, cut_after_chunks=CUT_AFTER)
                asyncio.run(run.batch("stream_cut", 30, stream_every=1))
                for base in (*reps.api_bases, *hosted.api_bases):
                    clear_fault(base)
                fault_phases = (_faults(reps) + _faults(hosted)) - before
                if pg is not None:
                    pg.pg_ctl("stop")
                    asyncio.run(run.batch("db_down", 40))
                    pg.pg_ctl("start")
                asyncio.run(run.batch_with_kill("kill9", 45, signal.SIGKILL))
                proxy.process.wait(30)
                proxy = run.proxy = _start_proxy(cfg, workdir, env)
                asyncio.run(run.batch_with_kill("sigterm", 45, signal.SIGTERM))
                proxy.process.wait(60)
                proxy = run.proxy = _start_proxy(cfg, workdir, env)
                asyncio.run(run.batch("after", 40, stream_every=4))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proxy.process.pid, signal.SIGTERM)
                proxy.process.wait(60)
                proxy.stop()
        # the next start of the proxy replays whatever the last one left in its journal
        rec = UsageRecorder(url, data / "journal", dead_letter=data).start()
        assert rec.flush(60)
        rec.close()
        rows = _ledger_rows(url)
        absorbed_in_report = _report_absorbed(url, {_period(r.occurred_at) for r in rows})
    finally:
        if pg is not None:
            pg.stop()

    ok = {u for u, r in run.results.items() if r == 200}
    finals = Counter(r.end_user_id for r in rows if r.is_final_attempt and r.status == "success")
    billed = set(finals)
    dup = {u: n for u, n in finals.items() if n > 1}
    lost = ok - billed
    not_received = billed - ok
    in_flight_at_kill = {u for u, r in run.results.items() if not isinstance(r, int) and
                         run.phase_of[u] in ("kill9", "sigterm")}
    failed_attempts = [r for r in rows if not r.is_final_attempt and r.status != "no_route"]
    router_hops = [r for r in rows if r.status == "no_route"]
    paid_failed = [r for r in failed_attempts if r.output_tokens > 0]
    cuts_served = sum(n for (_, mode), n in fault_phases.items() if mode == "cut")
    absorbed_total = sum((r.absorbed_cost for r in rows), Decimal(0))
    by_phase = Counter(run.phase_of[u] for u in ok)
    lost_by_phase = Counter(run.phase_of[u] for u in lost)
    print(f"\n[{db}, {workers} worker(s)] requests {len(run.results)}, client 200s {len(ok)} {dict(by_phase)}; "
          f"billed finals {len(billed)}, duplicated {len(dup)}, lost {len(lost)} {dict(lost_by_phase)}, "
          f"billed but not received {len(not_received)} (all in flight at a kill: "
          f"{not_received <= in_flight_at_kill}); client errors {Counter(run.results.values())}; "
          f"failed attempt rows {len(failed_attempts)} vs injected faults served {sum(fault_phases.values())} "
          f"{dict(fault_phases)}; paid failed attempts {len(paid_failed)} vs stream cuts served {cuts_served}, "
          f"absorbed cost {absorbed_total} (margin report {absorbed_in_report}); "
          f"router-level rows {len(router_hops)}; ledger rows {len(rows)}")
    assert len(run.results) >= 300
    assert not dup, dup
    assert not lost, sorted(lost)[:10]
    assert not_received <= in_flight_at_kill, sorted(not_received - in_flight_at_kill)[:10]
    assert {r.request_id for r in rows}.isdisjoint({"evil", "shared-trace", "shared-litellm-trace"})
    assert len({r.event_id for r in rows}) == len(rows)
    # every failed upstream attempt is in the ledger, its cost absorbed (never billed)
    assert len(failed_attempts) >= sum(fault_phases.values()), (len(failed_attempts), fault_phases)
    assert all(r.absorbed_cost == r.provider_cost for r in failed_attempts)
    assert all(r.backend_id == "router" and r.provider == "litellm-router" for r in router_hops)
    # every stream cut after output went out is a paid failed attempt: the provider's cost for the prompt and the
    # output relayed so far, absorbed (the app is billed 0 for it); the margin report's absorbed cost is the sum
    assert cuts_served >= 1 and len(paid_failed) == cuts_served, (len(paid_failed), cuts_served)
    for r in paid_failed:
        assert r.output_tokens == CUT_AFTER - 1 and r.input_uncached_tokens + r.cache_read_tokens > 0, r
        expected = PRICE_IN * (r.input_uncached_tokens + r.cache_read_tokens) + PRICE_OUT * r.output_tokens
        assert r.provider_cost == r.absorbed_cost == expected and r.billed_amount == 0, (r, expected)
    assert absorbed_total == sum((r.absorbed_cost for r in paid_failed), Decimal(0)) > 0
    assert absorbed_in_report == absorbed_total, (absorbed_in_report, absorbed_total)
    assert not os.path.exists(data / "dead-letter.jsonl") or not (data / "dead-letter.jsonl").read_text()
