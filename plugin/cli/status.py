"""``kvroute status``: breaker and routing state read from a running proxy, and the routes that serve it.

The plugin mounts ``GET /kvroute/status`` (JSON) and ``GET /kvroute/metrics`` (Prometheus text, kvroute's
own series only) on the LiteLLM proxy app behind the proxy's own auth; the command reads the first one.
"""

from __future__ import annotations

from typing import Any

import typer

ADMIN_ROLES = frozenset({"proxy_admin", "proxy_admin_viewer"})


def mount_routes(app: Any, callback: Any, path: str = "/kvroute/status", auth: str = "admin") -> list[str]:
    """Add the status and metrics routes to a FastAPI/Starlette app, ahead of catch-all routes.

    ``auth``: ``admin`` (the proxy's own auth must accept the key and give it an admin role; the master key
    does), ``key`` (any key the proxy's auth accepts), ``open`` (no check; for tests and private networks).
    Status hides ``api_base`` unless the query asks for it (``?show=api_base``; LiteLLM's auth rejects a
    parameter named ``api_base`` itself).
    """
    from starlette.responses import JSONResponse, Response

    async def status_view(request: Any) -> Any:
        try:
            show = "api_base" in str(request.query_params.get("show", "")).split(",")
            return JSONResponse(callback.status(show_api_base=show))
        except Exception as exc:
            return JSONResponse({"error": type(exc).__name__}, status_code=500)

    async def metrics_view(_request: Any) -> Any:
        body, content_type = callback.metrics.exposition()
        return Response(body, media_type=content_type)

    metrics_path = path.rsplit("/", 1)[0] + "/metrics" if path.count("/") > 1 else "/kvroute-metrics"
    existing = {getattr(r, "path", None) for r in app.router.routes}
    added = []
    for route_path, view in ((path, status_view), (metrics_path, metrics_view)):
        if route_path in existing:
            continue
        app.router.routes.insert(0, _route(app, route_path, view, auth))
        added.append(route_path)
    return added


def _route(app: Any, path: str, view: Any, auth: str) -> Any:
    """A GET route for ``view``; unless ``auth == "open"`` it first runs LiteLLM's ``user_api_key_auth``."""
    from starlette.routing import Route

    if auth == "open":
        return Route(path, view, methods=["GET"])
    from fastapi import Depends, Request
    from fastapi.routing import APIRoute
    from litellm.proxy.auth.user_api_key_auth import user_api_key_auth
    from starlette.responses import JSONResponse

    async def guarded(request: Request, key: Any = Depends(user_api_key_auth)) -> Any:
        role = getattr(getattr(key, "user_role", None), "value", getattr(key, "user_role", None))
        if auth == "admin" and str(role) not in ADMIN_ROLES:
            return JSONResponse({"error": "kvroute endpoints need the master key or an admin role"},
                                status_code=403)
        return await view(request)

    guarded.__annotations__["request"] = Request  # resolved here: the module uses postponed annotations
    return APIRoute(path, guarded, methods=["GET"], include_in_schema=False, dependency_overrides_provider=app)


def fetch_status(proxy: str, path: str = "/kvroute/status", api_key: str | None = None,
                 timeout: float = 5.0) -> dict[str, Any]:
    """GET the status JSON from a proxy base URL; raises ``RuntimeError`` with a readable message."""
    import httpx

    url = proxy.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(url, headers=headers, timeout=timeout)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"cannot reach {url}: {exc}") from exc
    if resp.status_code in (401, 403):
        hint = ("no key was sent: pass --api-key or set LITELLM_MASTER_KEY (the master key or an admin key)"
                if not api_key else "this key may not read it: use the master key or a proxy_admin key")
        raise RuntimeError(f"{url} answered {resp.status_code}: {hint}")
    if resp.status_code != 200:
        raise RuntimeError(f"{url} answered {resp.status_code}: {' '.join(resp.text[:200].split())}")
    try:
        return resp.json()
    except ValueError as exc:
        raise RuntimeError(f"{url} did not return JSON") from exc


STATUS_COLUMNS = ("backend", "group", "kind", "provider", "breaker", "inflight", "index_blocks")


def status_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per backend of the status JSON (``STATUS_COLUMNS``)."""
    return [{"backend": name, "group": b.get("group", ""), "kind": b.get("kind", ""),
             "provider": b.get("provider", ""), "breaker": b.get("breaker", "closed"),
             "inflight": b.get("inflight", 0), "index_blocks": b.get("index_blocks", 0)}
            for name, b in sorted(data.get("backends", {}).items())]


def render_table(data: dict[str, Any]) -> Any:
    from rich.table import Table
    from rich.text import Text

    from kvroute.plugin.cli.output import fold

    table = Table(title="kvroute backends")
    for col in ("backend", "group", "kind", "provider", "breaker", "in flight", "index blocks"):
        table.add_column(col)
    for row in status_rows(data):
        colour = {"closed": "green", "half_open": "yellow", "open": "red"}.get(str(row["breaker"]), "white")
        table.add_row(Text(str(row["backend"])), Text(str(row["group"])), Text(str(row["kind"])),
                      Text(str(row["provider"])), Text(str(row["breaker"]), style=colour), str(row["inflight"]),
                      str(row["index_blocks"]))
    return fold(table)


def status(
    proxy: str = typer.Option("http://127.0.0.1:4000", "--proxy", help="Base URL of the LiteLLM proxy."),
    as_json: bool = typer.Option(False, "--json", help="Print the raw JSON (same as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table | json | csv (one row per backend)"),
    api_key: str | None = typer.Option(None, "--api-key",
                                       help="Master key or an admin key of the proxy (default LITELLM_MASTER_KEY)."),
    path: str = typer.Option("/kvroute/status", "--path", help="Status route the plugin mounted."),
    show_api_base: bool = typer.Option(False, "--api-base", help="Also show each backend's api_base."),
) -> None:
    """Breaker state, in-flight requests and index size per backend, from the running proxy (needs the master
    key or an admin key: ``--api-key`` or ``LITELLM_MASTER_KEY``)."""
    from kvroute.plugin.cli.output import resolve_format, write_csv, write_json
    from kvroute.plugin.settings import CliSettings

    fmt = resolve_format(fmt, as_json)
    if api_key is None and (master := CliSettings().master_key) is not None:
        api_key = master.get_secret_value()
    try:
        data = fetch_status(proxy, path + ("?show=api_base" if show_api_base else ""), api_key)
    except RuntimeError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from exc
    if fmt == "json":
        write_json(data)
        return
    if fmt == "csv":
        write_csv(status_rows(data), STATUS_COLUMNS)
        return
    from rich.markup import escape

    from kvroute.plugin.cli.output import stdout_console

    console = stdout_console()
    console.print(render_table(data))
    groups = data.get("groups", {})
    for name, g in sorted(groups.items()):
        console.print(f"group [bold]{escape(str(name))}[/bold]: policy {escape(str(g.get('policy')))}, "
                      f"internal errors {g.get('errors', 0)}")
