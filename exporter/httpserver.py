"""The HTTP/1.1 server both services run (the exporter and `gpuwarden fleet`): asyncio with httptools' C parser,
serving an ASGI app, with the limits of exporter/serving.py enforced as bytes arrive.

Why not uvicorn: on every GPU node the exporter must be at most as heavy and as slow to start as the lightest peer
(docs/benchmarks.md, Footprint); uvicorn with click and its config cost ~100 ms and ~2-4 MiB at start, and it has
no request deadline, no header size limit and no admission of its own, which exporter/serving.py had to add from
inside its protocol class anyway. This server does only what the two apps use: HTTP/1.1 with keep-alive and
pipelining (answered in order), bodies up to MAX_BODY_BYTES, chunked responses, TLS through asyncio, no upgrades.

Per connection:
- a deadline for each request to arrive whole (armed at connect, when a request begins and while a kept-alive
  connection idles), then close: idle, slowloris and slow-body clients are bounded alike;
- the request line and headers counted as the parser hands them over: past the limit 431 and close;
- admission: at the connection limit the oldest connection still waiting for a request is closed;
- shedding: past the request limit new requests get 503, except the probes;
- a response the client does not read is abandoned and the connection dropped: a streamed one after
  WRITE_TIMEOUT_S without progress, a whole one when the idle deadline finds it still unread.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import socket
import ssl
import threading
import time
from collections import deque
from typing import Any
from urllib.parse import unquote

import httptools

from exporter.serving import PROBES, ConnectionGuard

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024  # the APIs take GET requests; a body is refused past this
FEED_SLICE = 4096  # bytes handed to the parser at a time (the header limit is checked between slices)
MAX_PIPELINE = 16  # requests parsed ahead of the one being answered; reading pauses beyond
WRITE_TIMEOUT_S = 30.0
_REASONS = {
    200: "OK",
    204: "No Content",
    301: "Moved Permanently",
    302: "Found",
    304: "Not Modified",
    307: "Temporary Redirect",
    400: "Bad Request",
    401: "Unauthorized",
    403: "Forbidden",
    404: "Not Found",
    405: "Method Not Allowed",
    413: "Content Too Large",
    422: "Unprocessable Content",
    429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}


def _problem(status: int, message: str, close: bool = True) -> bytes:
    body = json.dumps({"error": message}).encode()
    head = f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
    head += f"content-length: {len(body)}\r\n" + ("connection: close\r\n" if close else "") + "\r\n"
    return head.encode() + body


class Cycle:
    """One request and its response: the ASGI receive and send callables."""

    def __init__(self, conn: HttpConnection, scope: dict[str, Any], keep_alive: bool) -> None:
        self.conn, self.scope, self.keep_alive = conn, scope, keep_alive
        self.body = bytearray()
        self.body_sent = False
        self.started = self.complete = self.chunked = False
        self._pending = b""  # the response's head, until its first body part
        self.head = scope["method"] == "HEAD"
        self.gone = asyncio.Event()  # the client disconnected, or the response is complete

    def request_line(self) -> tuple[str, str]:
        return self.scope["method"], self.scope["path"]

    async def receive(self) -> dict[str, Any]:
        if not self.body_sent:
            self.body_sent = True
            return {"type": "http.request", "body": bytes(self.body), "more_body": False}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        conn = self.conn
        if conn.transport.is_closing():
            return  # the client left: the app's remaining output goes nowhere, as ASGI allows
        kind = message["type"]
        if not self.started:
            if kind != "http.response.start":
                raise RuntimeError(f"expected http.response.start, got {kind}")
            self.started = True
            self._pending = self._head(message["status"], message.get("headers", []))  # sent with the first body
            return
        if self.complete or kind != "http.response.body":
            raise RuntimeError(f"unexpected ASGI message {kind} (response complete: {self.complete})")
        body, more = message.get("body", b""), message.get("more_body", False)
        out, self._pending = [self._pending], b""
        if not self.head:
            if self.chunked:
                if body:
                    out.append(b"%x\r\n%s\r\n" % (len(body), body))
                if not more:
                    out.append(b"0\r\n\r\n")
            elif body:
                out.append(body)
        conn.transport.write(b"".join(out) if len(out) > 1 else out[0])
        if more:
            await conn.drained()  # a streaming app waits while the client is not reading
        elif not self.complete:
            # The last part is left to the transport: a client that does not read it is cut off by the idle
            # deadline (counted as write_timeout), so an unread response is held for seconds, never for good.
            self.complete = True
            self.gone.set()
            conn.response_done(self)

    def _head(self, status: int, headers: list[tuple[bytes, bytes]]) -> bytes:
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, 'Status')}\r\n".encode()]
        has_length = False
        for name, value in headers:
            lower = name.lower()
            if lower == b"content-length":
                has_length = True
            elif lower == b"connection" and value.lower() == b"close":
                self.keep_alive = False
            elif lower == b"transfer-encoding":
                continue  # framing is this server's business
            lines.append(b"%s: %s\r\n" % (name, value))
        if not has_length and not self.head and status not in (204, 304) and status >= 200:
            self.chunked = True
            lines.append(b"transfer-encoding: chunked\r\n")
        if not self.keep_alive:
            lines.append(b"connection: close\r\n")
        lines.append(b"\r\n")
        return b"".join(lines)

    async def fail(self) -> None:
        """The app raised or returned without a whole response: 500 if nothing was sent (a head not yet written
        is replaced), else cut the connection."""
        nothing_sent = not self.started or (self._pending and not self.complete)
        if nothing_sent and not self.conn.transport.is_closing():
            self.keep_alive = False
            self.started = self.complete = True
            self._pending = b""
            self.gone.set()
            self.conn.transport.write(_problem(500, "internal server error"))
            self.conn.response_done(self)
        elif not self.complete:
            self.conn.close()


class HttpConnection(asyncio.Protocol):
    """One client connection: parse, bound, hand whole requests to the app in order."""

    def __init__(self, server: HttpServer) -> None:
        self.server, self.guard = server, server.guard
        self.parser = httptools.HttpRequestParser(self)
        self.transport: Any = None
        self.scheme = "http"
        self.server_address: tuple[Any, ...] | None = None  # the scope's "server" and "client", read once
        self.client_address: tuple[Any, ...] | None = None
        self.current: Cycle | None = None
        self.pipeline: deque[Cycle] = deque()
        self._url = bytearray()
        self._headers: list[tuple[bytes, bytes]] = []
        self._in_head = False
        self._head_bytes = 0
        self._building: Cycle | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._writable = asyncio.Event()
        self._writable.set()
        self._paused = False

    # -- connection --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        self.scheme = "https" if transport.get_extra_info("sslcontext") is not None else "http"
        sockname, peername = transport.get_extra_info("sockname"), transport.get_extra_info("peername")
        self.server_address = tuple(sockname[:2]) if isinstance(sockname, tuple) else None
        self.client_address = tuple(peername[:2]) if isinstance(peername, tuple) else None
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            # a response is written as it is ready: Nagle would hold a short one for the client's delayed ACK (40 ms)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.server.connections.add(self)
        if len(self.server.connections) > self.guard.max_connections:
            self._admit()
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._disarm()
        self._writable.set()
        for cycle in (self.current, self._building, *self.pipeline):
            if cycle is not None:
                cycle.gone.set()
        self.pipeline.clear()

    def close(self) -> None:
        """Close after what is buffered is written, or drop it if the client has not read it in time."""
        self._disarm()
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.close()
            if transport.get_write_buffer_size():
                self.server.loop.call_later(self.server.write_timeout_s, transport.abort)

    def drop(self) -> None:
        """Drop a connection that has nothing owed to it (idle past its deadline, evicted): no graceful TLS
        shutdown, which would keep the connection and its TLS state for the peer's close_notify, and an idle or
        slowloris peer never sends one (1,500 of them held +214 MiB that way, bench/hostile_clients.py --tls)."""
        self._disarm()
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    def _admit(self) -> None:
        """At the connection limit, make room by closing the connection that has waited longest for a request."""
        for oldest in self.guard.waiting:
            if oldest is not self:
                self.guard.reject("evicted")
                oldest.drop()
                return
        self.guard.reject("evicted")  # every other connection is busy with a request: this one goes
        self.drop()

    # -- the request deadline ------------------------------------------------------------------------------------

    def _arm(self) -> None:
        if self._timer is not None or self.transport.is_closing():
            return
        self.guard.waiting[self] = time.monotonic()
        self._timer = self.server.loop.call_later(self.guard.header_timeout_s, self._timed_out)

    def _disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.guard.waiting.pop(self, None)

    def _timed_out(self) -> None:
        self._timer = None
        self.guard.waiting.pop(self, None)
        if self.transport.get_write_buffer_size():  # idle because it is not reading what it was sent
            self.guard.reject("write_timeout")
            self.transport.abort()
            return
        self.guard.reject("header_timeout")
        self.drop()

    # -- bytes in ------------------------------------------------------------------------------------------------

    def data_received(self, data: bytes) -> None:
        """Feed the parser in slices, counting the bytes of a request's line and headers as they arrive.

        httptools keeps a header value whole in its own buffer until the value ends, so the count is taken here,
        a slice at a time (it resets when a request begins and when its headers end): a request's head is refused
        within FEED_SLICE bytes of the limit, before the bytes pile up."""
        for start in range(0, len(data), FEED_SLICE):
            if self.transport.is_closing():
                return
            piece = data[start : start + FEED_SLICE]
            self._head_bytes += len(piece)
            try:
                self.parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                self._refuse(400, "protocol upgrades are not supported")
                return
            except httptools.HttpParserError as exc:
                if not self.transport.is_closing():
                    self._refuse(400, f"malformed request: {str(exc) or type(exc).__name__}")
                return
            if self._in_head and self._head_bytes > self.guard.max_header_bytes:
                self.guard.reject("header_too_large")
                self._refuse(431, f"request headers exceed {self.guard.max_header_bytes} bytes")
                return

    def _refuse(self, status: int, message: str) -> None:
        self._disarm()
        if not self.transport.is_closing():
            self.transport.write(_problem(status, message))
        self.close()

    # httptools callbacks

    def on_message_begin(self) -> None:
        self._url, self._headers = bytearray(), []
        self._in_head, self._head_bytes = True, 0
        self._disarm()
        self._arm()  # from its first byte a request has the whole deadline, pipelined or after an idle spell

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        self._in_head, self._head_bytes = False, 0
        try:
            parsed = httptools.parse_url(bytes(self._url))
        except httptools.HttpParserInvalidURLError:
            self._refuse(400, "malformed request target")
            raise httptools.HttpParserError("bad url") from None
        raw_path = parsed.path or b"/"
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": self.parser.get_http_version(),
            "server": self.server_address,
            "client": self.client_address,
            "scheme": self.scheme,
            "method": self.parser.get_method().decode("ascii"),
            "root_path": "",
            "path": unquote(raw_path.decode("ascii", "replace")),
            "raw_path": raw_path,
            "query_string": parsed.query or b"",
            "headers": self._headers,
            "state": {},
        }
        self._building = Cycle(self, scope, self.parser.should_keep_alive())

    def on_body(self, body: bytes) -> None:
        cycle = self._building
        if cycle is None:
            return
        if len(cycle.body) + len(body) > MAX_BODY_BYTES:
            self._refuse(413, f"request body exceeds {MAX_BODY_BYTES} bytes")
            raise httptools.HttpParserError("body too large")
        cycle.body += body

    def on_message_complete(self) -> None:
        cycle, self._building = self._building, None
        if cycle is None:
            return
        self._disarm()
        if self.current is None:
            self._start(cycle)
        else:
            self.pipeline.append(cycle)
            if len(self.pipeline) >= MAX_PIPELINE and not self._paused:
                self._paused = True
                self.transport.pause_reading()

    # -- answering -------------------------------------------------------------------------------------------------

    def _start(self, cycle: Cycle) -> None:
        self.current = cycle
        server, guard = self.server, self.guard
        if len(server.tasks) - guard.parked >= guard.max_requests and cycle.scope["path"] not in PROBES:
            guard.reject("shed")
            cycle.keep_alive = False
            cycle.started = cycle.complete = True
            self.transport.write(_problem(503, "the server is overloaded; retry"))
            self.response_done(cycle)
            return
        task = server.loop.create_task(self._run(cycle))
        server.tasks.add(task)
        task.add_done_callback(server.tasks.discard)

    async def _run(self, cycle: Cycle) -> None:
        try:
            await self.server.app(cycle.scope, cycle.receive, cycle.send)
        except Exception:
            log.exception("request %s %s failed", *cycle.request_line())
            await cycle.fail()
            return
        if not cycle.complete:
            if cycle.started:
                log.error("%s %s: the app returned before its response was complete", *cycle.request_line())
            await cycle.fail()

    def response_done(self, cycle: Cycle) -> None:
        """The response is written: next pipelined request, or wait for one (deadline armed), or close."""
        if cycle is not self.current:
            return
        self.current = None
        if not cycle.keep_alive or self.transport.is_closing():
            self.close()
            return
        if self.pipeline:
            self._start(self.pipeline.popleft())
            if self._paused and len(self.pipeline) < MAX_PIPELINE // 2:
                self._paused = False
                self.transport.resume_reading()
        elif self._building is None:
            self._arm()

    # -- flow control of responses ------------------------------------------------------------------------------

    def pause_writing(self) -> None:
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    async def drained(self) -> None:
        """Wait while the client is not reading; give up on it after the server's write timeout."""
        if self._writable.is_set():
            return
        timer = self.server.loop.call_later(self.server.write_timeout_s, self._write_timed_out)
        try:
            await self._writable.wait()  # set again by resume_writing, or by connection_lost after an abort
        finally:
            timer.cancel()

    def _write_timed_out(self) -> None:
        self.guard.reject("write_timeout")
        if self.transport is not None:
            self.transport.abort()


class HttpServer:
    """Serve one ASGI app on a bound socket until SIGTERM/SIGINT or stop(); in-flight requests get `graceful_s`."""

    def __init__(
        self,
        app: Any,
        guard: ConnectionGuard,
        ssl_context: ssl.SSLContext | None = None,
        graceful_s: float = 5.0,
        write_timeout_s: float = WRITE_TIMEOUT_S,
    ) -> None:
        self.app, self.guard, self.ssl_context, self.graceful_s = app, guard, ssl_context, graceful_s
        self.write_timeout_s = write_timeout_s
        self.connections: set[HttpConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.started = threading.Event()
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]  # set when serving starts
        self._stop: asyncio.Event | None = None
        self._stop_requested = False

    def run(self, sock: socket.socket) -> None:
        asyncio.run(self.serve(sock))

    def stop(self) -> None:
        """Ask the server to shut down (from any thread)."""
        self._stop_requested = True
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)

    async def serve(self, sock: socket.socket) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._stop_requested:
            return
        lifespan = Lifespan(self.app)
        await lifespan.startup()
        try:
            await self._serve(sock)
        finally:
            await lifespan.shutdown()

    async def _serve(self, sock: socket.socket) -> None:
        assert self._stop is not None
        server = await self.loop.create_server(
            lambda: HttpConnection(self),
            sock=sock,
            ssl=self.ssl_context,
            ssl_handshake_timeout=self.guard.header_timeout_s if self.ssl_context else None,
            # a TLS close waits this long for the peer's close_notify (asyncio's default is 30 s)
            ssl_shutdown_timeout=self.guard.header_timeout_s if self.ssl_context else None,
            backlog=2048,
        )
        handled = []
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self.loop.add_signal_handler(sig, self._stop.set)
                handled.append(sig)
        self.started.set()
        try:
            await self._stop.wait()
        finally:
            for sig in handled:
                self.loop.remove_signal_handler(sig)
            await self._shutdown(server)

    async def _shutdown(self, server: asyncio.Server) -> None:
        server.close()
        for conn in list(self.connections):
            if conn.current is None:
                conn.close()
            else:
                conn.current.keep_alive = False  # answer the request in flight, then close
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=self.graceful_s)
        for task in list(self.tasks):
            task.cancel()
        for conn in list(self.connections):
            if conn.transport is not None:
                conn.transport.abort()


class Lifespan:
    """The app's ASGI lifespan: startup before the first connection, shutdown after the last (the fleet service
    closes its Prometheus client there). An app that does not speak the protocol (it raises on the scope) is served
    without it, as uvicorn's "auto" mode does."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self._inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._answers: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    async def startup(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
        self._task = asyncio.get_running_loop().create_task(self._run(scope))
        await self._step("startup")

    async def shutdown(self) -> None:
        if self._task is not None and not self._task.done():
            await self._step("shutdown")

    async def _run(self, scope: dict[str, Any]) -> None:
        try:
            await self.app(scope, self._inbox.get, self._answers.put)
        except Exception:  # noqa: BLE001 - an app without lifespan support raises on the scope
            log.debug("the app does not handle ASGI lifespan; serving without it", exc_info=True)
        await self._answers.put({"type": "lifespan.unsupported"})

    async def _step(self, phase: str) -> None:
        await self._inbox.put({"type": f"lifespan.{phase}"})
        answer = await self._answers.get()
        if answer["type"] == f"lifespan.{phase}.failed":
            raise RuntimeError(f"the app's lifespan {phase} failed: {answer.get('message', '')}")
