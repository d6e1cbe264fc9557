"""Through a real proxy: kvroute's own metadata keys are written by kvroute only, and the app comes from the key.

A client sending ``metadata.kvroute_attempt`` as ``"x"``, a dict, a list or a huge int (and forged ``kvroute_rid``,
``kvroute_request``, ``kvroute_sig``) is routed like anyone else: no filter error, one decision per request, one
ledger request id per request, none of them the client's. A client's ``metadata.app`` under the master key (which
does not trust client apps) never shows up as an app label.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from kvroute.billing.ledger import Ledger
from kvroute.billing.recorder import UsageRecorder
from kvroute.plugin.dev.fleet import Fleet, ReplicaOptions
from kvroute.plugin.dev.proxy_process import ModelGroup, ProxyProcess, build_proxy_config

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

FORGED = [{"kvroute_attempt": "x"}, {"kvroute_attempt": {"a": 1}}, {"kvroute_attempt": [1, 2]},
          {"kvroute_attempt": 10**30}, {"kvroute_rid": "evil:1", "kvroute_attempt": 1},
          {"kvroute_request": "evil", "kvroute_sig": "0" * 24, "kvroute_rid": "evil:7"},
          {"kvroute_trace": {"x": []}}, {}]


def _sample(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_client_written_kvroute_keys_never_crash_or_skip_routing(tmp_path: Path) -> None:
    data = tmp_path / "data"
    url = f"sqlite:///{data / 'billing.db'}"
    opts = ReplicaOptions(capacity_tokens=12000, prefill_tokens_per_s=200000, decode_ms=0.0)
    with Fleet(2, engine="fake", options=opts, name_prefix="rep") as reps:
        cfg = build_proxy_config([ModelGroup("llama", reps.api_bases)])
        with ProxyProcess(cfg, env={"KVROUTE_DATA_DIR": str(data)}, inherit_kvroute_env=False) as proxy:
            assert "kvroute billing: recording to sqlite:///" in proxy.log_text()  # on by default, says where

            async def go() -> list[int]:
                async with httpx.AsyncClient(trust_env=False, timeout=60) as c:
                    async def one(i: int) -> int:
                        meta = {**FORGED[i % len(FORGED)], "app": "evil-app", "trace_id": "same"}
                        r = await c.post(proxy.base_url + "/v1/chat/completions", headers=proxy.headers,
                                         json={"model": "llama", "max_tokens": 2, "user": f"u{i}", "metadata": meta,
                                               "messages": [{"role": "user", "content": f"hello {i}"}]})
                        return r.status_code
                    return list(await asyncio.gather(*(one(i) for i in range(len(FORGED) * 3))))

            codes = asyncio.run(go())
            metrics = httpx.get(proxy.base_url + "/kvroute/metrics", headers=proxy.headers, trust_env=False).text
    n = len(FORGED) * 3
    assert codes == [200] * n
    assert _sample(metrics, "kvroute_plugin_errors_total", hook="filter") == 0
    assert _sample(metrics, "kvroute_decisions_total", group="llama") == n  # none skipped
    assert not re.search(r'app="evil-app"', metrics)
    assert _sample(metrics, "kvroute_billing_recorded_before_response_total") == n  # before the client had it
    assert _sample(metrics, "kvroute_billing_events_recorded_total") == n  # the later callback adds nothing
    assert _sample(metrics, "kvroute_billing_events_dead_lettered_total") == 0
    rec = UsageRecorder(url, data / "journal", dead_letter=data).start()  # replays what the proxy left
    assert rec.flush(30)
    rec.close()
    led = Ledger.open(url)
    try:
        from sqlalchemy import select

        from kvroute.billing.models import UsageEventRow as E
        with led.engine.connect() as conn:
            rows = list(conn.execute(select(E.request_id, E.attempt_no, E.end_user_id, E.app_id)))
    finally:
        led.close()
    assert len(rows) == n and len({r.request_id for r in rows}) == n
    assert all(re.fullmatch(r"[0-9a-f]{32}", r.request_id) and r.attempt_no == 1 for r in rows)
    assert all(r.app_id != "evil-app" for r in rows)
