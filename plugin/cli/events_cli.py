"""``kvroute events ...``: look at an engine's KV-event stream without running the proxy."""

from __future__ import annotations

import json
import time

import typer

events_app = typer.Typer(no_args_is_help=True)


@events_app.command("inspect")
def inspect(
    endpoint: str = typer.Option(..., "--endpoint", help="Engine event endpoint, as configured on the engine."),
    bind: bool = typer.Option(False, "--bind", help="Bind instead of connect (engine uses a host-specific "
                                                  "endpoint, so it connects to us)."),
    replay: str | None = typer.Option(None, "--replay", help="Engine replay (ROUTER) endpoint for gap replay."),
    topic: str = typer.Option("", "--topic", help="Topic prefix to subscribe to (default: all)."),
    duration: float = typer.Option(10.0, "--duration", min=0.0, help="Seconds to listen."),
    model: str = typer.Option("", "--model", help="Model name used to seed the index keys."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON (same as --format json)."),
    fmt: str = typer.Option("table", "--format", help="table | json | csv (one row per source)"),
) -> None:
    """Listen for DURATION seconds; print per-source batches, blocks, clears, gaps, replays, decode errors."""
    from kvroute.plugin.cli.output import resolve_format, write_csv
    from kvroute.plugin.feeds.kvevents import EventSource, KvEventFeed
    from kvroute.policies.precise_index import PreciseIndex

    fmt = resolve_format(fmt, json_out)
    index = PreciseIndex()
    feed = KvEventFeed(index, [EventSource(endpoint, topic=topic, replay_endpoint=replay, bind=bind,
                                           model=model)])
    feed.start()
    try:
        if feed.error:
            typer.echo(f"error: cannot open {endpoint}: {feed.error}", err=True)
            raise typer.Exit(2)
        time.sleep(duration)
    finally:
        feed.stop()
    result = {"sources": {name: s.public() for name, s in feed.stats.items()}, "index_blocks": index.blocks()}
    if fmt == "json":
        typer.echo(json.dumps(result, indent=2, sort_keys=True))
        return
    if fmt == "csv":
        from kvroute.plugin.feeds.kvevents import SourceStats

        sources = result["sources"] or {topic or endpoint: SourceStats().public()}  # silent source: zeros
        rows = [{"source": name, **s, "index_blocks": result["index_blocks"]} for name, s in sources.items()]
        write_csv(rows, list(rows[0]))
        return
    for name, s in result["sources"].items():
        typer.echo(f"{name}: " + ", ".join(f"{k}={v}" for k, v in s.items()))
    typer.echo(f"index_blocks={result['index_blocks']}")
