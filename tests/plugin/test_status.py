"""``kvroute status``: the routes the plugin mounts on an app, and the command reading them over HTTP."""

from __future__ import annotations

import json
import socket
import threading
import time

import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from starlette.applications import Starlette
from starlette.routing import Route
from typer.testing import CliRunner

from kvroute.plugin.adapter.litellm_hooks import KvrouteCallback
from kvroute.plugin.adapter.metrics import Metrics
from kvroute.plugin.cli.cli import app as cli_app
from kvroute.plugin.cli.status import mount_routes
from kvroute.plugin.settings import KvrouteSettings


@pytest.fixture
def served():
    cb = KvrouteCallback(KvrouteSettings(breaker={"consecutive_failures": 1}), metrics=Metrics(CollectorRegistry()),
                         mount=False)
    deps = [{"model_name": "llama", "litellm_params": {"model": "openai/m", "api_base": f"http://h{i}/v1"},
             "model_info": {"id": f"r{i}", "engine": "vllm"}} for i in range(2)]
    cb.filter("llama", deps, [{"role": "user", "content": "hello " * 200}], {"metadata": {}})
    cb.health.record("r1", "provider_failure", cb.clock())

    async def catch_all(_request):
        from starlette.responses import PlainTextResponse

        return PlainTextResponse("proxy route", status_code=404)

    app = Starlette(routes=[Route("/{path:path}", catch_all)])
    assert mount_routes(app, cb, auth="open") == ["/kvroute/status", "/kvroute/metrics"]
    assert mount_routes(app, cb, auth="open") == []  # idempotent
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    for _ in range(100):
        if server.started:
            break
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def test_status_json_over_http(served):
    result = CliRunner().invoke(cli_app, ["status", "--proxy", served, "--json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["backends"]["r0"]["breaker"] == "closed"
    assert data["backends"]["r1"]["breaker"] == "open"
    assert data["backends"]["r0"]["kind"] == "self_hosted"
    assert data["groups"]["llama"]["policy"] == "cache_aware"
    assert data["pending"] == 1


def test_status_table_and_metrics_route(served):
    import httpx

    result = CliRunner().invoke(cli_app, ["status", "--proxy", served])
    assert result.exit_code == 0 and "r1" in result.output and "open" in result.output
    text = httpx.get(served + "/kvroute/metrics", trust_env=False).text
    assert "kvroute_breaker_state" in text


def test_unreachable_proxy_exits_2():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = CliRunner().invoke(cli_app, ["status", "--proxy", f"http://127.0.0.1:{port}"])
    assert result.exit_code == 2 and "cannot reach" in result.output


def test_status_hides_api_base_unless_asked(served):
    import httpx

    plain = httpx.get(served + "/kvroute/status", trust_env=False).json()
    assert all("api_base" not in b for b in plain["backends"].values())
    asked = httpx.get(served + "/kvroute/status?show=api_base", trust_env=False).json()
    assert asked["backends"]["r0"]["api_base"] == "http://h0/v1"
    assert plain["hash_key"] == {"keyed": True, "source": "file"} and plain["workers"] == 1


@pytest.mark.parametrize(("auth", "role", "code"), [
    ("admin", "internal_user", 403), ("admin", "proxy_admin", 200), ("admin", "proxy_admin_viewer", 200),
    ("key", "internal_user", 200), ("key", "proxy_admin", 200),
])
def test_endpoint_auth_modes_on_a_fastapi_app(auth, role, code):
    """The guarded routes run LiteLLM's ``user_api_key_auth`` (overridden here with the key it would return)."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from litellm.proxy._types import UserAPIKeyAuth
    from litellm.proxy.auth.user_api_key_auth import user_api_key_auth

    cb = KvrouteCallback(KvrouteSettings(), metrics=Metrics(CollectorRegistry()), mount=False)
    app = FastAPI()
    assert mount_routes(app, cb, auth=auth) == ["/kvroute/status", "/kvroute/metrics"]
    app.dependency_overrides[user_api_key_auth] = lambda: UserAPIKeyAuth(api_key="sk-x", user_role=role)
    with TestClient(app) as client:
        assert client.get("/kvroute/status").status_code == code
        assert client.get("/kvroute/metrics").status_code == code


def test_metrics_port_binds_loopback_by_default():
    m = Metrics(CollectorRegistry())
    m.serve(0)
    try:
        assert m._server[0].server_address[0] == "127.0.0.1"
    finally:
        m.close()
