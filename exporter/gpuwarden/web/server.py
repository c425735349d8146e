"""gpuwarden's HTTP server: uvicorn (httptools), with a narrow protocol subclass for the limits uvicorn lacks.

uvicorn serves the ASGI apps (the exporter's and the fleet service's): HTTP/1.1 conformance, keep-alive, HTTP/1.0,
`Expect: 100-continue`, `Date`, pipelining order, lifespan and graceful shutdown are its. Where uvicorn has a
setting it is used (`timeout_keep_alive`, `timeout_graceful_shutdown`, `server_header`). `GuardedHttpProtocol` adds
what it lacks, per connection, with the limits of gpuwarden.web.limits.ConnectionGuard:
- a deadline for a whole request, body included, from the moment the connection waits for one;
- request bytes counted as they arrive, trailers included: 431 while the headers are incomplete, 413 after;
- at most `MAX_PIPELINE` queued pipelined requests, and a write timeout for a response the client does not read;
- a connection closed with its response still unsent (`Connection: close`, HTTP/1.0, a refusal) that the client
  does not read is aborted after the header timeout (`_abort_closed_connections`): asyncio's close waits to flush
  for ever, and 1,032 such connections held for good refused 121 of 134 probes (TLS: an OOM kill at 256 MiB);
- admission: at the connection limit a connection closing with its response unsent is aborted, else the oldest
  one waiting for a request with nothing in its socket (one whose request has arrived unread may be a probe), and
  up to `PROBE_RESERVE` connections past the limit get in, so a probe is not the one refused; where the guard
  gives each peer address a share (the probe listener, web/peers.py: past it a connection is refused at accept
  unless it asks for a probe), a probe past its peer's share makes room among that peer's own connections;
- shedding: past the request limit new requests get 503, except the probes and the scrape (`unshed_paths`);
- TCP_NODELAY on every accepted socket (asyncio sets it only where the listener was made with IPPROTO_TCP);
- one counter per refusal (`gpuwarden_http_rejected_total`), never a log line per malformed request.

The protocol and its response cycles write through `_PacedWrites` (the protocol's `transport` attribute is replaced):
an answer is handed to the transport a chunk at a time while the client reads, so a client that does not read holds
at most the transport's limits (`WRITE_HIGH_WATER_BYTES`, set on both layers of a TLS connection) and a view of the
answer, and a response's head and body leave in one send(). The uvicorn internals this touches are listed in
`UVICORN_INTERNALS`, asyncio's in `ASYNCIO_TLS_INTERNALS`; tests/test_webserver.py fails, rather than a node, when an
upgrade drops one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import itertools
import json
import logging
import socket
import ssl
import struct
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpuwarden.web.limits import ConnectionGuard

MAX_PIPELINE = 16  # requests queued behind the one being answered
WRITE_HIGH_WATER_BYTES = 16 * 1024  # unsent bytes at which a connection's writer is paused (TLS: each layer's)
PACE_CHUNK_BYTES = 16 * 1024  # handed to the transport at a time (_PacedWrites) once the socket left some unsent
PACE_CHUNK_MAX_BYTES = 64 * 1024  # ... and while the socket takes each chunk whole (plain HTTP only)
MAX_BODY_BYTES = 64 * 1024  # gpuwarden's endpoints take no body: anything larger is refused (413)
PROBE_RESERVE = 32  # connections let in past the limit when none can be evicted
EVICTION_SCAN = 64  # waiting connections looked at for one with nothing sent, oldest first, per newcomer at the limit
QUIET_MESSAGES = ("Invalid HTTP request received.", "Unsupported upgrade request.")

# Attributes and methods of uvicorn's HttpToolsProtocol that GuardedHttpProtocol reads or overrides.
UVICORN_INTERNALS = (
    "transport",
    "client",
    "cycle",
    "pipeline",
    "tasks",
    "connections",
    "flow",
    "url",
    "app",
    "loop",
    "logger",
    "data_received",
    "on_message_begin",
    "on_headers_complete",
    "on_body",
    "on_message_complete",
    "on_response_complete",
    "send_400_response",
    "pause_writing",
    "resume_writing",
    "connection_made",
    "connection_lost",
)
SERVER_INTERNALS = ("startup", "handle_exit", "_captured_signals", "should_exit", "server_state")
# server_state.connections: the set of open protocols that uvicorn keeps (the close sweep reads it)
# asyncio accepts each connection in a task running this coroutine; a TLS handshake happens inside it.
ACCEPT_COROUTINE = "BaseSelectorEventLoop._accept_connection2"
# asyncio's TLS transport keeps its TLS protocol, which keeps the socket transport beneath: its buffer is limited too
ASYNCIO_TLS_INTERNALS = ("_ssl_protocol", "_transport")


class _Quiet(logging.Filter):
    """uvicorn logs a warning per malformed request or unsupported upgrade: one client could fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in QUIET_MESSAGES


_QUIET_LOGGER = logging.getLogger("gpuwarden.http")
_QUIET_LOGGER.addFilter(_Quiet())


class _PacedWrites:
    """The connection's transport as the protocol and its response cycles see it: writes leave in the order made, a
    chunk at a time, and only while the client reads.

    asyncio's transports take whatever is written and keep what the socket does not: an answer of 100 KB to a client
    that does not read stayed as a copy in the socket transport's buffer and, over TLS, as ciphertext as well
    (~210 KiB a connection: 1,100 such clients OOM-killed a 256 MiB exporter). Here a write is kept as the caller's
    bytes (the exposition and the GPUs' JSON are shared by every request) and handed to the transport a chunk at a
    time until the transport pauses the writer (`paused`); the rest goes when it resumes (`flush`, from the
    protocol's resume_writing).

    What a transport copies is the part of a chunk the socket did not take. A chunk is `max_chunk` while the socket
    takes each one whole (a new connection's send buffer holds ~64 KiB even for a client that never reads, so a
    scrape of that size leaves in one send()), and `PACE_CHUNK_BYTES` after one it did not, until it takes one
    whole again. In 16 KiB pieces only, a 39 KB scrape took three send() calls and 30 % fewer requests a second;
    asking the kernel how full the socket is (TIOCOUTQ) cost 7 %. Over TLS `max_chunk` is `PACE_CHUNK_BYTES`:
    OpenSSL's memory BIO, into which asyncio encrypts, keeps the largest size it held (64 KiB chunks took 1,100
    never-reading TLS clients from 186 to 232 MiB).

    Writes smaller than a chunk are joined to what follows, so a response's status line and headers leave in the
    same send() as its body; a lone small write (`100 Continue`) leaves at the end of the loop iteration. close()
    closes the transport once everything is handed over, and stops reading meanwhile, as asyncio's close does."""

    def __init__(
        self,
        transport: asyncio.Transport,
        loop: asyncio.AbstractEventLoop,
        paused: Callable[[], bool],
        buffered: Callable[[], int] | None = None,
        max_chunk: int = PACE_CHUNK_MAX_BYTES,
    ) -> None:
        self._transport, self._loop, self._paused = transport, loop, paused
        self._buffered = buffered or transport.get_write_buffer_size
        self._max_chunk = max_chunk
        self._keeping_up = True  # the socket took the last chunk whole (a new connection's takes ~64 KiB)
        self._pending: collections.deque[bytes | memoryview] = collections.deque()
        self._pending_bytes = 0
        self._flush_scheduled = False
        self._close_requested = False
        self.aborted = False  # nothing more is written (abort(): the pipeline limit, a timeout, an eviction)

    def write(self, data: bytes | memoryview) -> None:
        if self.aborted or self._close_requested or not data:
            # asyncio's TLS transport raises AttributeError on a write after abort(): a traceback per connection
            return
        self._pending.append(data)
        self._pending_bytes += len(data)
        if self._pending_bytes >= PACE_CHUNK_BYTES:
            # at once, so that a large answer pauses the writer before uvicorn completes the response (the next
            # pipelined request then waits for the reader: GuardedHttpProtocol.on_response_complete)
            self.flush()
        elif not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self._scheduled_flush)

    def _scheduled_flush(self) -> None:
        self._flush_scheduled = False
        self.flush()

    def flush(self) -> None:
        """Hand the transport chunks until it pauses the writer or nothing is left; close it if asked and done."""
        transport = self._transport
        if self.aborted or transport.is_closing():
            self.discard()
            return
        while self._pending and not self._paused():
            transport.write(self._take(self._max_chunk if self._keeping_up else PACE_CHUNK_BYTES))
            if transport.is_closing():  # the write failed (a reset): asyncio closed the transport
                self.discard()
                return
            self._keeping_up = self._buffered() == 0  # the socket took it whole
        if self._close_requested and not self._pending:
            transport.close()

    def _take(self, limit: int) -> bytes | memoryview:
        """Up to `limit` bytes from the front: what was written, a slice of it, or small writes joined."""
        pending = self._pending
        first = pending[0]
        if len(first) >= limit or len(pending) == 1:
            if len(first) > limit:
                view = memoryview(first)
                first, pending[0] = view[:limit], view[limit:]
            else:
                pending.popleft()
            self._pending_bytes -= len(first)
            return first
        parts, size = [], 0
        while pending and size < limit:
            part = pending.popleft()
            if size + len(part) > limit:
                view = memoryview(part)
                part = view[: limit - size]
                pending.appendleft(view[limit - size :])
            parts.append(part)
            size += len(part)
        self._pending_bytes -= size
        return b"".join(parts)

    def discard(self) -> None:
        """Forget what is held (the connection is lost)."""
        self._pending.clear()
        self._pending_bytes = 0

    def close(self) -> None:
        if self._close_requested or self.aborted:
            return
        self._close_requested = True
        if self._pending and not self._transport.is_closing():
            self._transport.pause_reading()
        self.flush()

    def abort(self) -> None:
        self.aborted = True
        self.discard()
        self._transport.abort()

    def is_closing(self) -> bool:
        return self._close_requested or self.aborted or self._transport.is_closing()

    def get_write_buffer_size(self) -> int:
        """What the client has yet to be sent: held here and in the transport's buffer."""
        return self._pending_bytes + self._transport.get_write_buffer_size()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def _socket_transport_beneath(transport: asyncio.BaseTransport) -> asyncio.WriteTransport | None:
    """The socket transport under asyncio's TLS transport (`_SSLProtocolTransport._ssl_protocol._transport`, the
    names `ASYNCIO_TLS_INTERNALS` lists and tests/test_webserver.py checks); None for a plain connection."""
    protocol = getattr(transport, ASYNCIO_TLS_INTERNALS[0], None)
    return getattr(protocol, ASYNCIO_TLS_INTERNALS[1], None) if protocol is not None else None


def _bytes_unread(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in the connection's socket the loop has not read yet (FIONREAD); a closed socket counts as none."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.fileno() < 0:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def _closing_unsent(connection: Any) -> bool:
    """A connection the server has closed whose response its client has not read (and not aborted yet)."""
    transport = connection.transport
    return (
        transport is not None
        and transport.is_closing()
        and not connection._writes.aborted
        and transport.get_write_buffer_size() > 0
    )


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits in the module docstring."""

    guard: ConnectionGuard  # set by protocol_for()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.logger = _QUIET_LOGGER
        self._request_bytes = 0
        self._headers_complete = False
        self._deadline: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None
        self._parked_writer = False  # counted in guard.parked: its answer waits for the client to read
        self._next_waits_for_reader = False  # a pipelined request not started while the client does not read
        self._past_limit = False  # let in past the probe reserve: its request is answered only if a probe's

    # -- connection --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # asyncio's TLS transport lets the app write until 512 KiB per connection is encrypted and unsent
        # (constants.FLOW_CONTROL_HIGH_WATER_SSL_WRITE) before it pauses it, and its socket transport beneath buffers
        # 64 KiB of ciphertext before it pauses the TLS layer: both get the plain limit, so a writer is paused with
        # at most ~2 x WRITE_HIGH_WATER_BYTES unsent per connection (300 TLS clients that stopped reading held
        # ~0.8 MiB each before).
        transport.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        beneath = _socket_transport_beneath(transport)
        if beneath is not None:
            beneath.set_write_buffer_limits(high=WRITE_HIGH_WATER_BYTES)
        if beneath is None:
            self._writes = _PacedWrites(transport, self.loop, lambda: self.flow.write_paused)
        else:  # TLS: chunks of one record (the memory BIO keeps the largest it held), both layers' buffers counted
            self._writes = _PacedWrites(
                transport,
                self.loop,
                lambda: self.flow.write_paused,
                lambda: transport.get_write_buffer_size() + beneath.get_write_buffer_size(),
                max_chunk=PACE_CHUNK_BYTES,
            )
        self.transport = self._writes  # type: ignore[assignment]  # every write and close goes through it, in order
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.guard.peers is not None:  # a probe past its peer's share (web/peers.py) makes room among its own
            victim = self.guard.peers.make_room(self, self.guard.waiting, lambda c: _bytes_unread(c.transport) == 0)
            if victim is not None:
                self.guard.reject("evicted")
                victim._abort()
        self._admit()
        self._await_request()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.guard.peers is not None:
            self.guard.peers.remove(self.peer)
        self._cancel_deadline()
        self._writes.discard()
        if self._writes.aborted:
            self.guard.aborting -= 1
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().connection_lost(exc)
        self._park_writer(False)

    @property
    def peer(self) -> str:
        """The client's address ("" for a Unix socket)."""
        return self.client[0] if self.client else ""

    def _admit(self) -> None:
        """Make room by aborting a connection closing with its response unsent (worth least: the server is done
        with it), else the oldest one waiting for a request with nothing in its socket. Past the probe reserve
        a newcomer that has sent nothing is refused, and one whose request has arrived is read and answered 503
        unless it asks for a probe. A connection whose request has arrived but is not read yet (accepted in the
        same burst: the loop reads it next turn; in a flood that was a kubelet probe) is never the victim, nor one
        already aborted (still in `connections` until asyncio reports it lost). At most the open connections and
        `EVICTION_SCAN` waiting ones are looked at, and only at the limit."""
        if len(self.connections) - self.guard.aborting <= self.guard.max_connections:
            return
        for other in self.connections:
            if other is not self and _closing_unsent(other):
                self.guard.reject("evicted")
                other._abort()
                return
        for oldest in itertools.islice(self.guard.waiting, EVICTION_SCAN):
            if oldest is not self and _bytes_unread(oldest.transport) == 0:
                self.guard.reject("evicted")
                oldest._abort()
                return
        if len(self.connections) - self.guard.aborting <= self.guard.max_connections + PROBE_RESERVE:
            return
        # past the reserve with no one to evict: every connection is busy or its request is on its way. One that
        # has sent nothing is refused; one whose request has arrived may be a probe, which cannot be told before
        # the request is read: it is read (next turn), and refused then unless it is a probe's (on_headers_complete)
        if _bytes_unread(self.transport) == 0:
            self.guard.reject("evicted")
            self._abort()
        else:
            self._past_limit = True

    def _abort(self) -> None:
        self._cancel_deadline()
        if not self._writes.aborted:
            self.guard.aborting += 1  # until connection_lost
        # no graceful TLS close: an attacker never sends its close_notify; and a transport already closing (uvicorn
        # closed it after a Connection: close response) is aborted too, or it waits to flush for ever
        self._writes.abort()

    # -- a request's deadline and size -----------------------------------------------------------------------------

    def _await_request(self) -> None:
        if self._deadline is not None or self.transport.is_closing():
            return
        self._request_bytes, self._headers_complete = 0, False
        self.guard.waiting[self] = self.loop.time()
        self._deadline = self.loop.call_later(self.guard.header_timeout_s, self._request_timeout)

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self.guard.waiting.pop(self, None)

    def _request_timeout(self) -> None:
        self._deadline = None
        self.guard.reject("header_timeout")
        self._abort()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if self._deadline is None and not self.pipeline and (self.cycle is None or self.cycle.response_complete):
            self._await_request()
        if self._request_bytes > self._allowed():  # this request was over its limit before this read
            self._refuse_size()
            return
        self._request_bytes += len(data)
        # One read (at most 256 KiB) is parsed before it is judged: it may hold many small pipelined requests,
        # each of which resets the count when it completes.
        super().data_received(data)
        if not self.transport.is_closing() and self._request_bytes > self._allowed():
            self._refuse_size()

    def _allowed(self) -> int:
        """Bytes the request in progress may have sent: its headers, then its body and trailers too."""
        limit = self.guard.max_header_bytes
        return limit + MAX_BODY_BYTES if self._headers_complete else limit

    def _refuse_size(self) -> None:
        if self._headers_complete:
            self._refuse(413, "Content Too Large", "body_too_large", f"request body exceeds {MAX_BODY_BYTES} bytes")
        else:
            limit = self.guard.max_header_bytes
            message = f"request headers exceed {limit} bytes"
            self._refuse(431, "Request Header Fields Too Large", "header_too_large", message)

    def _refuse(self, status: int, reason: str, counter: str, message: str) -> None:
        self.guard.reject(counter)
        self._cancel_deadline()
        body = json.dumps({"error": message}).encode()
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, reason.encode(), len(body), body)
        )
        self.transport.close()

    def send_400_response(self, msg: str) -> None:
        self.guard.reject("bad_request")
        self._cancel_deadline()
        super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        if self._deadline is None:  # a pipelined request parsed from the same bytes: it gets its own deadline
            self._await_request()

    def on_headers_complete(self) -> None:
        if self.transport.is_closing():
            return  # a request parsed from the same read as one that was refused
        if self._request_bytes > self.guard.max_header_bytes:  # a read larger than the limit: were the headers?
            size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
            if size > self.guard.max_header_bytes:  # headers that arrived whole in one read
                self._refuse_size()
                return
        self._headers_complete = True
        length = next((value for name, value in self.headers if name == b"content-length"), b"0")
        if length.isdigit() and int(length) > MAX_BODY_BYTES:
            self._refuse(413, "Content Too Large", "body_too_large", f"request body exceeds {MAX_BODY_BYTES} bytes")
            return
        if len(self.pipeline) >= MAX_PIPELINE:
            self.guard.reject("pipeline")
            self._abort()
            return
        if self._past_limit and not self._unshed():
            self.guard.reject("evicted")
            self._past_limit = False
            self._serve_unavailable()
            return
        if len(self.tasks) - self.guard.parked >= self.guard.max_requests and not self._unshed():
            self.guard.reject("shed")
            self._serve_unavailable()
            return
        super().on_headers_complete()
        self._park_writer()

    def _serve_unavailable(self) -> None:
        """503 and close, through uvicorn's own response for it."""
        app, self.app = self.app, service_unavailable
        try:
            super().on_headers_complete()
        finally:
            self.app = app

    def _unshed(self) -> bool:
        return self.url.split(b"?", 1)[0].decode("latin-1") in self.guard.unshed_paths

    def on_body(self, body: bytes) -> None:
        if self.transport.is_closing():
            return  # refused (413) or aborted: the rest of this read is dropped, not handed to a missing cycle
        super().on_body(body)

    def on_message_complete(self) -> None:
        if self.transport.is_closing():
            return
        self._cancel_deadline()
        self._request_bytes, self._headers_complete = 0, False  # the next pipelined request counts from here
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self.flow.write_paused and self.pipeline and not self.transport.is_closing():
            # The client has not read this answer: its next pipelined request starts once it does (resume_writing),
            # not now. uvicorn would make the next answer at once and hold it in send() until the transport drained:
            # one more answer per connection in memory, and over TLS the transport's buffers grow with each. 300
            # slow readers of 16 pipelined GET /api/v1/gpus (118 KB) took a TLS exporter to 340 MiB.
            self._next_waits_for_reader = True
            self._park_writer()
            return
        self._complete_response()

    def _complete_response(self) -> None:
        super().on_response_complete()  # starts the next pipelined request, if any
        self._park_writer()
        if not self.transport.is_closing() and not self.pipeline:
            self._await_request()

    # -- a response the client does not read -------------------------------------------------------------------------

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.guard.header_timeout_s, self._write_timeout)
        self._park_writer()

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()
        self._writes.flush()  # may pause the writer again: the answer is longer than the buffer
        self._park_writer()
        if self._next_waits_for_reader and not self.flow.write_paused and not self.transport.is_closing():
            self._next_waits_for_reader = False
            self._complete_response()

    def _park_writer(self, parked: bool | None = None) -> None:
        """Count this connection's running request as parked (not load) while its client does not read.

        uvicorn runs a connection's pipelined requests one at a time, and a request whose client has stopped
        reading waits in `send()` for the transport to drain: it holds a task, and so a place under
        `max_requests`, until the write timeout, while costing no CPU. 300 clients pipelining `GET /api/v1/gpus`
        every 0.5 s without reading held them all: 49 of 69 scrapes were shed with 503. A connection has at most
        one running request, and it has one exactly when its newest request's answer is incomplete."""
        if parked is None:
            cycle = self.cycle
            # `cycle` is the newest request's: a pipelined one not started yet (held back by on_response_complete)
            # runs no task, so it must not be counted, or each such connection would free a place under max_requests
            parked = (
                self.flow.write_paused
                and cycle is not None
                and not cycle.response_complete
                and not self._next_waits_for_reader
            )
        if parked != self._parked_writer:
            self._parked_writer = parked
            self.guard.parked += 1 if parked else -1

    def _write_timeout(self) -> None:
        self._write_timer = None
        self.guard.reject("write_timeout")
        self._abort()


# The grace a handshake's client has (ConnectionGuard.handshake_grace_s, 0.15 s and 0.5 s by default): a started
# handshake whose ClientHello is still incomplete after the first has stalled; one the server answered that the
# client has not finished after the second has stalled.
GRACE_CHECKS = 3  # ... and after this many admission checks: each is a turn of the loop, in which the handshake read
ADMISSION_CHECK_S = 0.05  # how often waiting handshakes are looked at while every slot is taken


class HandshakeLimiter:
    """At most `guard.max_handshakes` TLS handshakes in progress; the rest wait, newest first, before any TLS state.

    asyncio makes the protocol at accept but calls connection_made only after the TLS handshake, so a client that
    never finishes one costs memory (~100 KiB each) that the connection limit never sees: 4,500 of them took RSS up
    by 438 MiB. The handshake runs inside asyncio's accept task (`ACCEPT_COROUTINE`), which this task factory sees
    (`loop.set_task_factory`, public API) and runs behind an admission gate: a waiting connection is an accepted
    socket and a coroutine not yet started (no TLS state, a few KiB).

    A slot is taken from a handshake only when it has stalled: its ClientHello still incomplete the first of
    `ConnectionGuard.handshake_grace_s` after it started, or the server's answer unfinished by the client the
    second after it was sent, and in
    both cases `GRACE_CHECKS` admission checks later: the checks run on the loop, so a loop that lags under load
    (700 ms a turn under `wrk -c1000` on 2 cores) does not count its own lag against a client. Closing
    the oldest regardless let a probe through a flood of stalled handshakes, but 1,000 real clients connecting at
    once (`wrk -c1000`) then completed 0 requests: every handshake was closed before it could finish, and each client
    came back to be closed again. Waiting connections start newest first, so a probe starts as soon as a slot
    frees even behind a thousand waiting connections; one that waits past the header timeout, or past
    `4 × max_handshakes` waiting, is closed, oldest first. Whether the server has answered is the handshake's
    SSLObject having chosen a cipher (`SSLObject.cipher()`), seen by wrapping the context's `wrap_bio` (`watch`),
    which asyncio calls inside the accept task.
    """

    def __init__(self, guard: ConnectionGuard, clock: Callable[[], float] | None = None) -> None:
        self.guard = guard
        self.clock = clock
        self.running: dict[asyncio.Task[Any], _Handshake] = {}  # handshakes in progress, oldest first
        self.waiting: collections.deque[_Handshake] = collections.deque()  # accepted, not started, oldest first
        self._check: asyncio.TimerHandle | None = None
        self.checks = 0  # admission checks run by the timer: one per turn of the loop at most

    @property
    def max_waiting(self) -> int:
        return 4 * self.guard.max_handshakes

    def watch(self, context: ssl.SSLContext) -> None:
        """See each handshake's SSLObject: `context.wrap_bio` is wrapped on this one context object."""
        wrap_bio = context.wrap_bio

        def wrap_and_note(*args: Any, **kwargs: Any) -> ssl.SSLObject:
            sslobj = wrap_bio(*args, **kwargs)
            try:
                handshake = self.running.get(asyncio.current_task())  # type: ignore[arg-type]
            except RuntimeError:  # no running loop: not one of the server's handshakes
                handshake = None
            if handshake is not None:
                handshake.sslobj = sslobj
            return sslobj

        context.wrap_bio = wrap_and_note  # type: ignore[method-assign]

    def __call__(self, loop: asyncio.AbstractEventLoop, coro: Any, **kwargs: Any) -> asyncio.Task[Any]:
        if getattr(coro, "__qualname__", "") != ACCEPT_COROUTINE:
            return asyncio.Task(coro, loop=loop, **kwargs)
        handshake = _Handshake(self._now(loop), coro)
        handshake.task = asyncio.Task(self._admitted(handshake, loop), loop=loop, **kwargs)
        return handshake.task

    def _now(self, loop: asyncio.AbstractEventLoop) -> float:
        return self.clock() if self.clock is not None else loop.time()

    async def _admitted(self, handshake: _Handshake, loop: asyncio.AbstractEventLoop) -> None:
        """Wait for a slot, then run asyncio's accept (the handshake) in it."""
        task = handshake.task
        try:
            if self.waiting or len(self.running) >= self.guard.max_handshakes:
                handshake.gate = loop.create_future()
                self.waiting.append(handshake)
                self._admit(loop)
                await handshake.gate
            else:
                self._start(handshake, loop)
        except asyncio.CancelledError:
            handshake.discard()  # closed before it started: asyncio's coroutine never ran to close its socket
            with contextlib.suppress(ValueError):  # cancelled from elsewhere (shutdown): no gate to open later
                self.waiting.remove(handshake)
            raise
        try:
            await handshake.coro
        finally:
            if self.running.pop(task, None) is not None and self.waiting:  # type: ignore[arg-type]
                self._admit(loop)

    def _start(self, handshake: _Handshake, loop: asyncio.AbstractEventLoop) -> None:
        handshake.started = self._now(loop)
        handshake.started_check = self.checks
        self.running[handshake.task] = handshake  # type: ignore[index]

    def _admit(self, loop: asyncio.AbstractEventLoop) -> None:
        """Close what waited too long or stalled, and start the newest waiting handshakes in the slots free."""
        now = self._now(loop)
        while self.waiting and (
            len(self.waiting) > self.max_waiting or now - self.waiting[0].accepted > self.guard.header_timeout_s
        ):
            self._close(self.waiting.popleft().task)
        if self.waiting and len(self.running) >= self.guard.max_handshakes:
            grace = self.guard.handshake_grace_s
            stalled = [task for task, shake in self.running.items() if shake.stalled(now, self.checks, grace)]
            for task in stalled[: len(self.waiting)]:
                del self.running[task]
                self._close(task)
        while self.waiting and len(self.running) < self.guard.max_handshakes:
            handshake = self.waiting.pop()
            self._start(handshake, loop)
            handshake.gate.set_result(None)  # type: ignore[union-attr]
        if self.waiting and self._check is None:
            self._check = loop.call_later(ADMISSION_CHECK_S, self._recheck, loop)

    def _recheck(self, loop: asyncio.AbstractEventLoop) -> None:
        self._check = None
        self.checks += 1
        self._admit(loop)

    def _close(self, task: asyncio.Task[Any] | None) -> None:
        self.guard.reject("handshake_limit")
        if task is not None:
            task.cancel()


class _Handshake:
    """One accepted TLS connection: asyncio's accept coroutine, when it was accepted and started, its SSLObject,
    and when the server was first seen to have answered its ClientHello."""

    __slots__ = ("coro", "task", "gate", "accepted", "started", "started_check", "sslobj", "answered", "answered_check")

    def __init__(self, accepted: float, coro: Any) -> None:
        self.coro = coro
        self.task: asyncio.Task[Any] | None = None
        self.gate: asyncio.Future[None] | None = None
        self.accepted = accepted
        self.started = accepted
        self.started_check = 0
        self.sslobj: ssl.SSLObject | None = None
        self.answered: float | None = None
        self.answered_check = 0

    def stalled(self, now: float, checks: int, grace: tuple[float, float]) -> bool:
        """Whether the client, not the server, has kept this handshake from going on for its grace (unanswered,
        answered)."""
        if self.answered is None and self.sslobj is not None and self.sslobj.cipher() is not None:
            self.answered, self.answered_check = now, checks
        if self.answered is None:
            return now - self.started > grace[0] and checks - self.started_check >= GRACE_CHECKS
        return now - self.answered > grace[1] and checks - self.answered_check >= GRACE_CHECKS

    def discard(self) -> None:
        """Close the socket of an accept coroutine that never started (its own cleanup runs only once started)."""
        if self.coro.cr_frame is not None:
            conn = self.coro.cr_frame.f_locals.get("conn")
            if isinstance(conn, socket.socket):
                conn.close()
        self.coro.close()


def protocol_for(guard: ConnectionGuard) -> type[GuardedHttpProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), bound to this guard."""
    return type("BoundGuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": guard})


HEARTBEAT_S = 1.0  # how often the loop notes that it turns (HttpServer.last_turn)
CLOSE_SWEEP_S = 1.0  # how often connections that were closed but not flushed are looked at


async def _abort_closed_connections(connections: set[Any], guard: ConnectionGuard) -> None:
    """Abort each connection that has been closing, its response unsent, for longer than the header timeout.

    Every close path (uvicorn after a Connection: close or HTTP/1.0 response, a 400, a refusal here) ends in
    asyncio's transport.close(), which waits for the buffer to flush: a client that never reads holds the
    connection, its buffer and (over TLS) its SSL state for ever, and no deadline of the protocol's is running any
    more. One sweep a second over the open connections covers them all."""
    loop = asyncio.get_running_loop()
    closing_since: dict[Any, float] = {}
    while True:
        await asyncio.sleep(CLOSE_SWEEP_S)
        now = loop.time()
        closing = {
            c
            for c in list(connections)
            if c.transport is not None and c.transport.is_closing() and not c._writes.aborted
        }
        closing_since = {c: closing_since.get(c, now) for c in closing}
        for connection, since in closing_since.items():
            if now - since >= guard.header_timeout_s:
                guard.reject("write_timeout")
                connection._abort()


class _Server(uvicorn.Server):
    """uvicorn's server, telling a thread when it listens."""

    def __init__(self, config: uvicorn.Config, started: threading.Event, guard: ConnectionGuard) -> None:
        super().__init__(config)
        self._started_event = started
        self._guard = guard
        self.last_turn = time.monotonic()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if self.config.ssl is not None:
            limiter = HandshakeLimiter(self._guard)
            limiter.watch(self.config.ssl)
            asyncio.get_running_loop().set_task_factory(limiter)
        await super().startup(sockets)
        self._sweeper = asyncio.get_running_loop().create_task(
            _abort_closed_connections(self.server_state.connections, self._guard)
        )
        self._heartbeat = asyncio.get_running_loop().create_task(self._beat())
        self._started_event.set()

    async def _beat(self) -> None:
        """Note each turn of the loop, once a second: the probe listener's /healthz reads it from its own thread."""
        while True:
            self.last_turn = time.monotonic()
            await asyncio.sleep(HEARTBEAT_S)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """SIGTERM and SIGINT stop the server gracefully and the process exits 0: uvicorn would raise the signal
        again once it has stopped, so the process would end on it (-15) instead of returning from main()."""
        super().handle_exit(sig, frame)
        self._captured_signals.clear()


class HttpServer:
    """An ASGI app on uvicorn over an already bound listener, with the guard's limits and an optional TLS context."""

    def __init__(
        self, app: Any, guard: ConnectionGuard, ssl_context: ssl.SSLContext | None = None, graceful_s: float = 5.0
    ) -> None:
        self.started = threading.Event()
        config = uvicorn.Config(
            app,
            http=protocol_for(guard),
            lifespan="auto",
            log_config=None,
            access_log=False,
            server_header=False,
            proxy_headers=False,  # the client address is the peer's: no X-Forwarded-For rewriting on every request
            timeout_keep_alive=max(1, int(guard.header_timeout_s)),
            timeout_graceful_shutdown=max(1, int(graceful_s)),
        )
        config.load()
        config.ssl = ssl_context  # our context (client certificates included): uvicorn builds one only from paths
        self.server = _Server(config, self.started, guard)

    def run(self, sock: socket.socket) -> None:
        """Serve until stop() or SIGINT/SIGTERM (handled by uvicorn in the main thread)."""
        sock.setblocking(False)
        asyncio.run(self.server.serve(sockets=[sock]))

    def last_turn(self) -> float:
        """When the server's loop last turned (time.monotonic(); at most HEARTBEAT_S old while it runs)."""
        return self.server.last_turn

    def stop(self) -> None:
        self.server.should_exit = True
