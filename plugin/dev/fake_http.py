"""A minimal HTTP/1.1 server on asyncio + h11 for the fake engine, with the control real faults need.

Unlike an ASGI server it can drop a connection before any byte of the response, or cut a chunked body midway,
exactly as a crashing engine would. Handlers receive a ``Request`` and answer through an ``Exchange``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from http import HTTPStatus

import h11

log = logging.getLogger("kvroute.fake_engine")

MAX_BODY = 64 * 1024 * 1024


@dataclass(frozen=True)
class Request:
    """One parsed request: method, path (no query), query string, lower-cased headers, raw body, and when its
    head arrived (the event loop's clock; 0.0 when not read from a socket)."""

    method: str
    path: str
    query: str
    headers: dict[str, str]
    body: bytes
    received: float = 0.0

    def json(self) -> object:
        return json.loads(self.body or b"null")


class ConnectionDropped(Exception):
    """The peer went away while we were answering."""


class Exchange:
    """Writes one response: ``send`` a whole body, or ``start`` + ``chunk``... + ``end``; ``abort`` kills the socket."""

    def __init__(self, conn: h11.Connection, writer: asyncio.StreamWriter,
                 reader: asyncio.StreamReader | None = None) -> None:
        self._conn = conn
        self._writer = writer
        self._reader = reader
        self.status: int | None = None
        self.aborted = False

    async def _write(self, event: h11.Event) -> None:
        data = self._conn.send(event)
        if data:
            if self._writer.is_closing():
                raise ConnectionDropped()
            self._writer.write(data)
            try:
                await self._writer.drain()
            except (ConnectionError, OSError) as exc:
                raise ConnectionDropped() from exc

    async def start(self, status: int, headers: dict[str, str] | None = None, length: int | None = None) -> None:
        self.status = status
        items = [(k.encode(), str(v).encode()) for k, v in (headers or {}).items()]
        if length is not None:
            items.append((b"content-length", str(length).encode()))
        try:
            reason = HTTPStatus(status).phrase.encode()
        except ValueError:
            reason = b""
        await self._write(h11.Response(status_code=status, headers=items, reason=reason))

    async def chunk(self, data: bytes) -> None:
        await self._write(h11.Data(data=data))

    async def end(self) -> None:
        await self._write(h11.EndOfMessage())

    async def send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        await self.start(status, headers, length=len(body))
        await self.chunk(body)
        await self.end()

    async def send_json(self, status: int, value: object, headers: dict[str, str] | None = None) -> None:
        await self.send(status, json.dumps(value).encode(), {"content-type": "application/json", **(headers or {})})

    def peer_gone(self) -> bool:
        """Whether the client closed its side (its request was read whole, so end of input means it left)."""
        return self._writer.is_closing() or (self._reader is not None and self._reader.at_eof())

    def abort(self) -> None:
        """Reset the connection at once (RST), whatever was sent so far."""
        self.aborted = True
        transport = self._writer.transport
        with contextlib.suppress(Exception):
            transport.abort()


Handler = Callable[[Request, Exchange], Awaitable[None]]


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> h11.Event | type:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        data = await reader.read(65536)
        conn.receive_data(data)


async def _read_request(conn: h11.Connection, reader: asyncio.StreamReader) -> Request | None:
    event = await _next_event(conn, reader)
    if not isinstance(event, h11.Request):
        return None
    received = asyncio.get_running_loop().time()
    body = bytearray()
    while True:
        part = await _next_event(conn, reader)
        if isinstance(part, h11.Data):
            body += part.data
            if len(body) > MAX_BODY:
                raise h11.RemoteProtocolError("request body too large", error_status_hint=413)
        elif isinstance(part, h11.EndOfMessage):
            break
        else:
            return None
    target = event.target.decode("latin-1")
    path, _, query = target.partition("?")
    headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in event.headers}
    return Request(event.method.decode("ascii"), path, query, headers, bytes(body), received)


async def serve_connection(handler: Handler, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve requests on one keep-alive connection until either side closes it."""
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            try:
                request = await _read_request(conn, reader)
            except h11.RemoteProtocolError as exc:
                with contextlib.suppress(Exception):
                    ex = Exchange(conn, writer)
                    await ex.send_json(exc.error_status_hint, {"error": {"message": str(exc)}},
                                       {"connection": "close"})
                return
            if request is None:
                return
            exchange = Exchange(conn, writer, reader)
            try:
                await handler(request, exchange)
            except ConnectionDropped:
                return
            except Exception:
                log.exception("handler failed for %s %s", request.method, request.path)
                if exchange.status is None and not exchange.aborted:
                    with contextlib.suppress(Exception):
                        await exchange.send_json(500, {"error": {"message": "internal error"}})
                else:
                    exchange.abort()
            if exchange.aborted or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                return
            conn.start_next_cycle()
    except (ConnectionError, OSError, h11.ProtocolError):
        return
    finally:
        with contextlib.suppress(Exception):
            writer.close()


async def start_server(handler: Handler, host: str = "127.0.0.1", port: int = 0) -> asyncio.Server:
    """Listen on ``host:port`` (0 = a free port chosen by the OS) and serve ``handler``."""

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await serve_connection(handler, reader, writer)

    return await asyncio.start_server(on_connect, host, port, reuse_address=True)
