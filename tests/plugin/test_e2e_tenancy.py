"""End to end through real ``litellm`` proxies: tenant isolation with real keys, protected endpoints, several
workers speaking as one, and a bad kvroute setting stopping startup.

Keys come from ``general_settings.custom_auth`` (LiteLLM's DB-less auth; virtual keys need Postgres + prisma):
the module below maps each key to a team, key metadata and a role, exactly what LiteLLM then writes into the
request metadata (``user_api_key_team_id``, ``user_api_key_hash``, ``user_api_key_metadata``).
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvroute.plugin.dev.child_processes import ChildStartError
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(420)]

MASTER = "sk-kvroute-master"
AUTH_MODULE = '''
from fastapi import HTTPException
from litellm.proxy._types import LitellmUserRoles, UserAPIKeyAuth

KEYS = {
    "sk-tenant-a": dict(team_id="team-a", key_alias="a", metadata={"kvroute_app": "app-a"}),
    "sk-tenant-b": dict(team_id="team-b", key_alias="b", metadata={"kvroute_app": "app-b"}),
    "sk-tenant-d": dict(team_id="team-d", key_alias="d"),
    "sk-tenant-e": dict(team_id="team-e", key_alias="e"),
    "sk-salted": dict(team_id="team-c", key_alias="c", metadata={"kvroute_cache_salt": True}),
    "sk-ops": dict(key_alias="ops", user_role=LitellmUserRoles.PROXY_ADMIN),
}


async def auth(request, api_key):
    key = (api_key or "").removeprefix("Bearer ").strip()
    if key == "MASTER_KEY":
        return UserAPIKeyAuth(api_key=key, user_role=LitellmUserRoles.PROXY_ADMIN)
    if key in KEYS:
        fields = {"user_role": LitellmUserRoles.INTERNAL_USER, **KEYS[key]}
        return UserAPIKeyAuth(api_key=key, **fields)
    raise HTTPException(status_code=401, detail="unknown key")
'''.replace("MASTER_KEY", MASTER)
DOC = "Draft acquisition terms for the board: price, schedule, escrow and covenants. " * 50


def proxy_with_keys(groups, kvroute_settings, workdir: Path, **kw) -> ProxyProcess:
    (workdir / "tenancy_auth.py").write_text(AUTH_MODULE)
    cfg = build_proxy_config(groups, master_key=MASTER)
    cfg["general_settings"]["custom_auth"] = "tenancy_auth.auth"
    return ProxyProcess(cfg, kvroute_settings=kvroute_settings, workdir=workdir, inherit_kvroute_env=False, **kw)


async def chat(c: httpx.AsyncClient, base: str, key: str, model: str, question: str, **extra) -> int:
    resp = await c.post(base + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                        json={"model": model, "max_tokens": 4, "messages": [
                            {"role": "system", "content": DOC}, {"role": "user", "content": question}], **extra})
    assert resp.status_code == 200, resp.text[:300]
    return (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0


def predicted(metrics_text: str, group: str) -> float:
    for fam in text_string_to_metric_families(metrics_text):
        for s in fam.samples:
            if s.name == "kvroute_predicted_cached_tokens_total" and s.labels.get("group") == group:
                return s.value
    return 0.0


@pytest.fixture(scope="module")
def tenancy_stack():
    """One fake vLLM replica (so tenants share one engine: the worst case) behind a proxy with two groups on
    it: ``iso`` (isolation: team) and ``open`` (no isolation, the control)."""
    opts = ReplicaOptions(capacity_tokens=20000, prefill_tokens_per_s=400000, decode_ms=0.0, slots=8)
    with contextlib.ExitStack() as stack:
        replicas = stack.enter_context(Fleet(1, engine="fake", options=opts, name_prefix="ten"))
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvroute-tenancy-")))
        groups = [ModelGroup("iso", replicas.api_bases, engine="vllm", id_prefix="iso"),
                  ModelGroup("open", replicas.api_bases, engine="vllm", id_prefix="open")]
        settings = {"groups": {"iso": {"isolation": "team"}, "open": {"isolation": "none"}},
                    "data_dir": str(workdir / "data")}
        proxy = stack.enter_context(proxy_with_keys(groups, settings, workdir))
        yield proxy, replicas, workdir


async def test_isolated_tenant_b_gets_no_prefix_match_and_no_cached_tokens(tenancy_stack):
    proxy, _, _ = tenancy_stack
    admin = {"Authorization": f"Bearer {MASTER}"}
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        async def router_predicted(group: str) -> float:
            return predicted((await c.get(proxy.base_url + "/kvroute/metrics", headers=admin)).text, group)

        # control: without isolation B reuses what A sent (the side channel the setting closes)
        await chat(c, proxy.base_url, "sk-tenant-a", "open", "first")
        before = await router_predicted("open")
        open_b = await chat(c, proxy.base_url, "sk-tenant-b", "open", "second")
        open_pred = await router_predicted("open") - before
        # isolation on: A reuses its own prefix, B's first request for the same prompt matches nothing
        await chat(c, proxy.base_url, "sk-tenant-a", "iso", "first")
        a_again = await chat(c, proxy.base_url, "sk-tenant-a", "iso", "again")
        before = await router_predicted("iso")
        iso_b = await chat(c, proxy.base_url, "sk-tenant-b", "iso", "second")
        iso_pred = await router_predicted("iso") - before
        # D naming a cache_salt (its key may not set one) is stripped: still nothing of A's
        salted_b = await chat(c, proxy.base_url, "sk-tenant-d", "iso", "third", cache_salt="team-a")
        # E claiming A's team in its metadata changes nothing either (LiteLLM strips user_api_key_*)
        forged_b = await chat(c, proxy.base_url, "sk-tenant-e", "iso", "fourth",
                              metadata={"user_api_key_team_id": "team-a", "kvroute_app": "app-a"})
    print(f"\nopen group: B cached {open_b}, router predicted {open_pred:.0f}; isolated: A again {a_again}, "
          f"B cached {iso_b}, predicted {iso_pred:.0f}; D with A's salt {salted_b}, E forging A's team {forged_b}")
    assert open_b > 500 and open_pred > 500
    assert a_again > 500
    assert iso_b == 0 and iso_pred == 0
    assert salted_b == 0 and forged_b == 0


async def test_a_key_allowed_to_salt_keeps_its_own_salted_space(tenancy_stack):
    proxy, replicas, _ = tenancy_stack
    async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
        first = await chat(c, proxy.base_url, "sk-salted", "open", "x", cache_salt="project-1")
        same = await chat(c, proxy.base_url, "sk-salted", "open", "y", cache_salt="project-1")
        other = await chat(c, proxy.base_url, "sk-salted", "open", "z", cache_salt="project-2")
        stats = (await c.get(replicas.base_urls[0] + "/admin/stats")).json()
    assert same > 500 and other == 0 and first == 0
    assert "cache_salt" in stats["last_request"]["body_keys"]


async def test_endpoints_need_the_master_key_or_an_admin_role(tenancy_stack):
    proxy, _, _ = tenancy_stack
    async with httpx.AsyncClient(trust_env=False, timeout=30) as c:
        async def get(path: str, key: str | None) -> httpx.Response:
            return await c.get(proxy.base_url + path, headers={"Authorization": f"Bearer {key}"} if key else {})

        for path in ("/kvroute/status", "/kvroute/metrics"):
            assert (await get(path, None)).status_code == 401
            assert (await get(path, "sk-nobody")).status_code == 401
            assert (await get(path, "sk-tenant-a")).status_code == 403
            assert (await get(path, "sk-ops")).status_code == 200
            assert (await get(path, MASTER)).status_code == 200
        status = (await get("/kvroute/status", MASTER)).json()
        shown = (await get("/kvroute/status?show=api_base", MASTER)).json()
        metrics = (await get("/kvroute/metrics", MASTER)).text
    assert status["backends"] and all("api_base" not in b for b in status["backends"].values())
    assert all(b["api_base"].startswith("http://127.0.0.1:") for b in shown["backends"].values())
    assert status["hash_key"] == {"keyed": True, "source": "file"}
    assert "kvroute_decisions_total" in metrics
    assert "litellm_" not in metrics and "hashed_api_key" not in metrics and "api_key_alias" not in metrics


async def test_the_proxy_created_its_secret_file_private(tenancy_stack):
    """Without a configured secret or Redis the proxy generated one in its data dir, mode 0600."""
    _, _, workdir = tenancy_stack
    secret = workdir / "data" / "hash_secret"
    assert secret.stat().st_mode & 0o777 == 0o600 and len(secret.read_bytes()) == 32


# --- several workers -----------------------------------------------------------------------------------------
async def test_four_workers_metrics_and_status_speak_for_the_whole_proxy(redis_url, tmp_path):
    opts = ReplicaOptions(capacity_tokens=20000, prefill_tokens_per_s=400000, decode_ms=0.0, slots=16)
    multiproc = tmp_path / "prom"
    multiproc.mkdir()
    metrics_port = free_port()
    with Fleet(2, engine="fake", options=opts, name_prefix="mw") as replicas:
        cfg = build_proxy_config([ModelGroup("llama", replicas.api_bases, engine="vllm")], master_key=MASTER)
        env = {"PROMETHEUS_MULTIPROC_DIR": str(multiproc), "KVROUTE_REDIS_URL": redis_url,
               "KVROUTE_REDIS_NAMESPACE": f"kvtest-mw-{tmp_path.name}", "KVROUTE_METRICS_PORT": str(metrics_port),
               "KVROUTE_HASH_SECRET": "four-workers-secret-0123456789"}
        with ProxyProcess(cfg, kvroute_settings={"data_dir": str(tmp_path / "data")}, env=env,
                          inherit_kvroute_env=False, extra_args=["--num_workers", "4"], start_timeout_s=300) as proxy:
            admin = {"Authorization": f"Bearer {MASTER}"}
            fresh = httpx.Limits(max_keepalive_connections=0)  # a new connection per request: any worker answers
            async with httpx.AsyncClient(trust_env=False, timeout=60, limits=fresh) as c:
                async def one(i: int) -> None:
                    r = await c.post(proxy.base_url + "/v1/chat/completions", headers=admin, json={
                        "model": "llama", "max_tokens": 2,
                        "messages": [{"role": "user", "content": f"conversation {i % 6} " + "words " * 200}]})
                    assert r.status_code == 200, r.text[:200]

                for start in range(0, 48, 8):
                    await asyncio.gather(*(one(i) for i in range(start, start + 8)))
                await asyncio.sleep(2.0)  # every worker's heartbeat has published its counters
                totals, workers, secrets_seen = [], [], set()
                for _ in range(8):
                    text = (await c.get(proxy.base_url + "/kvroute/metrics", headers=admin)).text
                    totals.append(decisions(text))
                    status = (await c.get(proxy.base_url + "/kvroute/status", headers=admin)).json()
                    workers.append(status["workers"])
                    secrets_seen.add(status["hash_key"]["source"])
                port_total = decisions((await c.get(f"http://127.0.0.1:{metrics_port}/metrics")).text)
            log = proxy.log_text()
    print(f"\n4 workers: decisions per scrape {totals}, workers per status {workers}, metrics port {port_total}")
    assert log.count("kvroute: cannot serve metrics") <= 3
    assert totals == [48] * 8, totals
    assert workers == [4] * 8, workers
    assert port_total == 48
    assert secrets_seen == {"settings"}


def decisions(text: str) -> float:
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "kvroute_decisions_total")


# --- strict config through a real proxy -----------------------------------------------------------------------
@pytest.mark.parametrize(("settings", "env", "line"), [
    ({"groups": {"llama": {"knobs": {"min_prefix_tokens": 64}}}}, {},
     "kvroute: configuration error: kvroute.groups.llama.knobs: knobs given without a policy"),
    ({}, {"KVROUTE_METRICS_PROT": "9100"}, "kvroute: configuration error: KVROUTE_METRICS_PROT: unknown kvroute "
     "setting (did you mean KVROUTE_METRICS_PORT?)"),
    ({"default_polcy": "least_load"}, {},
     "kvroute: configuration error: kvroute.default_polcy: unknown key (did you mean default_policy?)"),
])
def test_a_bad_setting_stops_proxy_startup_with_one_line_naming_it(settings, env, line, tmp_path):
    """The proxy exits 2 on the one line, with no server traceback under it."""
    cfg = build_proxy_config([ModelGroup("llama", ["http://127.0.0.1:9/v1"])], master_key=MASTER)
    proxy = ProxyProcess(cfg, kvroute_settings={**settings, "data_dir": str(tmp_path)}, env=env,
                         inherit_kvroute_env=False, workdir=tmp_path / "proxy")
    with pytest.raises(ChildStartError):
        proxy.start()
    try:
        log = proxy.log_text()
        exit_code = proxy.process.wait(timeout=30)
    finally:
        proxy.stop()
    lines = [ln for ln in log.splitlines() if ln.startswith("kvroute: configuration error")]
    assert len(lines) == 1 and lines[0].startswith(line), lines
    assert "Traceback" not in log and log.rstrip().endswith(lines[0]), log[-2000:]
    assert exit_code == 2
