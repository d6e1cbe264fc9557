"""End to end: a hybrid group whose replicas are all down fails over to its hosted route within the spend cap.

A real ``litellm`` proxy, a group of two replicas nobody listens on (their breakers open on the first failure)
plus one priced fake provider, a share cap of 10 % (failover ignores it: the replicas cannot serve) and a hosted
spend cap of about three requests per window (failover keeps it). Requests are served hosted until the cap is
spent, then refused with no deployment (never sent hosted past the cap); the ledger's hosted rows stay within it.
"""

from __future__ import annotations

import contextlib
import socket
import uuid
from decimal import Decimal
from pathlib import Path

import httpx
import pytest

from kvroute.billing.ledger import Ledger
from kvroute.billing.recorder import UsageRecorder
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]

HOSTED_PRICE = {"input_cost_per_token": 2e-6, "output_cost_per_token": 8e-6}
SELF_PRICE = {"input_cost_per_token": 2e-7, "output_cost_per_token": 8e-7}
SPEND_WINDOW_S = 600.0
BUDGET = Decimal("0.012")  # the window's hosted budget: two or three 1,800-token requests at the hosted price
REQUESTS = 12


def _dead_base() -> str:
    """An http base on a loopback port nobody listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/v1"


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    data = tmp_path_factory.mktemp("failover-data")
    fast = ReplicaOptions(capacity_tokens=400_000, prefill_tokens_per_s=1_000_000, decode_ms=1.0, slots=64,
                          extra_args=("--context-cost", "0"))
    with contextlib.ExitStack() as es:
        provider = es.enter_context(Fleet(1, engine="fake", options=fast, name_prefix="prov"))
        groups = [ModelGroup("down", [_dead_base(), _dead_base()], id_prefix="dself", prices=SELF_PRICE),
                  ModelGroup("down", provider.api_bases, engine=None, id_prefix="dhosted", prices=HOSTED_PRICE)]
        cfg = build_proxy_config(groups[:1], router_settings={"num_retries": 0})
        cfg["model_list"] = [d for g in groups for d in g.deployments()]
        per_hour = BUDGET * Decimal(3600) / Decimal(str(SPEND_WINDOW_S))
        kvroute = {"groups": {"down": {"hybrid": {"ttft_target_s": 2.0, "max_overflow_share": 0.1,
                                                  "share_min_requests": 1, "spend_window_s": SPEND_WINDOW_S,
                                                  "max_hosted_spend_per_hour": str(per_hour)}}},
                   "breaker": {"consecutive_failures": 1, "min_requests": 1, "base_cooldown_s": 600,
                               "max_cooldown_s": 600, "jitter": 0},
                   "endpoint_auth": "open"}
        proxy = es.enter_context(ProxyProcess(cfg, kvroute_settings=kvroute, inherit_kvroute_env=False,
                                              env={"KVROUTE_DATA_DIR": str(data)}))
        yield {"proxy": proxy, "data": data}


def _hosted_rows(data: Path) -> list:
    url = f"sqlite:///{data / 'billing.db'}"
    rec = UsageRecorder(url, data / "journal", dead_letter=data).start()
    assert rec.flush(60)
    rec.close()
    led = Ledger.open(url)
    try:
        from sqlalchemy import select

        from kvroute.billing.models import UsageEventRow as E
        with led.engine.connect() as conn:
            return list(conn.execute(select(E.backend_id, E.status, E.provider_cost, E.route_kind)
                                     .where(E.backend_id == "dhosted-0")))
    finally:
        led.close()


def test_no_replica_left_fails_over_hosted_until_the_spend_cap_then_refuses(stack):
    proxy: ProxyProcess = stack["proxy"]
    outcomes = []
    with httpx.Client(trust_env=False, timeout=60) as c:
        for _ in range(REQUESTS):
            body = {"model": "down", "max_tokens": 8,
                    "messages": [{"role": "user", "content": f"q {uuid.uuid4().hex} " + "tokens " * 1000}]}
            r = c.post(proxy.base_url + "/v1/chat/completions", json=body, headers=proxy.headers)
            outcomes.append((r.status_code, r.headers.get("x-litellm-model-id")))
    status = httpx.get(proxy.base_url + "/kvroute/status", trust_env=False, timeout=30).json()
    hy = status["groups"]["down"]["hybrid"]
    served = [b for code, b in outcomes if code == 200]
    print(f"outcomes {outcomes}; reasons {hy['reasons']}; hosted spend {hy['hosted_spend_window']} of {BUDGET}")
    assert served and set(served) == {"dhosted-0"}  # only the hosted route answered (the replicas are down)
    # two hosted of the group's first four decisions: a 10 % share cap would have refused the second
    assert hy["reasons"].get("self_hosted_unavailable", 0) == len(served) >= 2
    assert hy["reasons"].get("no_acceptable_provider:guard_spend", 0) > 0  # then the spend cap refused
    assert outcomes[-1][0] != 200  # refused: no deployment was sent hosted past the cap
    assert Decimal(hy["hosted_spend_window"]) <= BUDGET
    rows = _hosted_rows(stack["data"])
    booked = [r for r in rows if r.status == "success"]
    assert len(booked) == len(served) and all(r.route_kind == "direct" for r in booked)
    assert 0 < sum((r.provider_cost for r in booked), Decimal(0)) <= BUDGET
