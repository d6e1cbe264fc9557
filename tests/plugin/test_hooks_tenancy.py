"""Tenant isolation and salts in the hooks (SDK path, in-process fake vLLM replicas that honour cache_salt).

The proxy path, with two real keys, is in ``test_e2e_tenancy.py``; here the tenant fields LiteLLM's proxy auth
writes into the request metadata (``user_api_key_team_id`` ...) are set by the test.
"""

from __future__ import annotations

import litellm
import pytest
from test_hooks_sdk import fleet, installed, litellm_flush, model_list, sample

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.adapter.tenancy import set_engine_salt as _set_engine_salt
from kvroute.plugin.settings import KvrouteSettings, load_settings

pytestmark = pytest.mark.timeout(120)
DOC = "Confidential merger memo for the board, section one. " * 60
SECRET = "tenancy-test-secret-0123456789"


def callback(isolation: str) -> KvrouteCallback:
    from prometheus_client import CollectorRegistry

    settings = load_settings(groups={"llama": {"isolation": isolation}}, hash_secret=SECRET)
    return KvrouteCallback(settings, metrics=Metrics(CollectorRegistry()), mount=False)


async def ask(router, team: str, question: str, **extra) -> int:
    resp = await router.acompletion(model="llama", max_tokens=4, metadata={"user_api_key_team_id": team,
                                                                            "user_api_key_hash": "h-" + team,
                                                                            **extra.pop("key_meta", {})},
                                    messages=[{"role": "system", "content": DOC},
                                              {"role": "user", "content": question}], **extra)
    details = resp.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details else 0


async def run_pair(isolation: str, **b_extra) -> tuple[int, int, float]:
    """Tenant A sends the memo twice; tenant B then sends it once. Returns A's 2nd cached, B's cached, B's
    predicted (router) cached tokens."""
    async with fleet(1) as servers:
        cb = callback(isolation)
        with installed(cb):
            router = litellm.Router(model_list=model_list(servers), num_retries=0)
            await ask(router, "team-a", "q1")
            a_again = await ask(router, "team-a", "q2")
            await litellm_flush(cb)
            before = sample(cb.metrics, "kvroute_predicted_cached_tokens_total", group="llama")
            b_first = await ask(router, "team-b", "q3", **b_extra)
            await litellm_flush(cb)
            predicted = sample(cb.metrics, "kvroute_predicted_cached_tokens_total", group="llama") - before
            body_keys = (await _stats(servers[0]))["last_request"]["body_keys"]
    assert ("cache_salt" in body_keys) == (isolation != "none" or "key_meta" in str(b_extra)), body_keys
    return a_again, b_first, predicted


async def _stats(server) -> dict:
    import httpx

    async with httpx.AsyncClient() as c:
        return (await c.get(server.base_url + "/admin/stats")).json()


async def test_without_isolation_tenant_b_reuses_tenant_a_prefix():
    a_again, b_first, predicted = await run_pair("none")
    assert a_again > 500 and b_first > 500 and predicted > 500  # the side channel isolation closes


@pytest.mark.parametrize("isolation", ["team", "key"])
async def test_with_isolation_tenant_b_gets_no_match_and_no_cached_tokens(isolation):
    a_again, b_first, predicted = await run_pair(isolation)
    assert a_again > 500  # within a tenant the prefix is still reused
    assert b_first == 0 and predicted == 0


async def test_a_client_cache_salt_is_ignored_unless_the_key_may_set_one():
    # B names a salt; without the key flag it is stripped: B still lands in its own tenant space
    _, b_first, predicted = await run_pair("team", cache_salt="anything")
    assert b_first == 0 and predicted == 0


def test_tenant_comes_from_key_data_and_salt_is_a_keyed_digest():
    cb = callback("app")
    gs = cb.settings.group("llama")
    cb._setup()
    meta = {"user_api_key_hash": "h1", "user_api_key_metadata": {"kvroute_app": "acme"}}
    tenant, salt = cb.tenant_salt(gs, meta, {})
    assert tenant == "app:acme" and salt.startswith("kvr-") and "acme" not in salt
    assert cb.tenant_salt(gs, {"user_api_key_hash": "h2", "user_api_key_metadata": {"kvroute_app": "acme"}},
                          {}) == (tenant, salt)  # two keys of one app share
    assert cb.tenant_salt(gs, {"user_api_key_hash": "h3"}, {})[0] == "key:h3"  # no app: the key itself
    assert cb.tenant_salt(gs, {}, {})[0] == "anonymous"
    # a client salt counts only with the key flag, and never reaches another tenant's space
    plain = cb.tenant_salt(gs, meta, {"cache_salt": "x"})
    flagged = cb.tenant_salt(gs, {**meta, "user_api_key_metadata": {"kvroute_app": "acme", "kvroute_cache_salt": True}},
                             {"cache_salt": "x"})
    assert plain == (tenant, salt) and flagged[1] != salt
    other = callback("app")
    other.parts.settings = load_settings(groups={"llama": {"isolation": "app"}},
                                         hash_secret="another-secret-0123456789")
    other.chain = None
    other._ready = False
    other._setup()
    assert other.tenant_salt(gs, meta, {})[1] != salt  # the salt is keyed with the deployment's secret
    assert cb.tenant_salt(KvrouteSettings().group("llama"), meta, {}) == (None, None)


def test_engine_salt_replaces_or_strips_the_client_value():
    assert _set_engine_salt({"model": "m"}, None) is None
    assert _set_engine_salt({"cache_salt": "theirs"}, None) == {}
    assert _set_engine_salt({"extra_body": {"cache_salt": "theirs", "x": 1}}, "kvr-1") == {
        "extra_body": {"cache_salt": "kvr-1", "x": 1}}


def test_forwarded_prompt_cache_key_is_keyed_and_matches_no_unkeyed_recomputation():
    """What a hosted provider sees (``prompt_cache_key``) cannot be recomputed from the prompt without the
    secret: neither the unkeyed prefix key nor the unkeyed session digest equals it; another worker with the
    same secret forwards the same key."""
    from kvroute.policies import Fingerprinter

    deps = [{"model_name": "hosted", "litellm_params": {"model": "openai/gpt-4o-mini", "api_base": "http://h/v1",
                                                        "input_cost_per_token": 1e-6, "output_cost_per_token": 2e-6},
             "model_info": {"id": "h0"}}]
    messages = [{"role": "system", "content": DOC}, {"role": "user", "content": "q"}]

    def forwarded(cb: KvrouteCallback, extra: dict) -> str:
        request_kwargs = {"metadata": {}, **extra, "messages": messages, "model": "hosted"}
        cb.filter("hosted", deps, messages, request_kwargs)
        return (cb.pre_call({**request_kwargs, "model_info": {"id": "h0"}}) or {}).get("prompt_cache_key")

    for extra in ({}, {"user": "alice"}):
        key = forwarded(callback("none"), extra)
        assert key and key.startswith("kvr-")
        public = Fingerprinter().from_kwargs({"model": "hosted", "messages": messages, **extra})
        assert key not in {f"kvr-{public.session_key}", f"kvr-{format(public.prefix_key(1024) or 0, 'x')}"}
        assert forwarded(callback("none"), extra) == key
