"""The guarded httptools protocol: uvicorn's, with the per-connection limits it lacks (`GuardedHttpProtocol`).

uvicorn serves the ASGI apps: HTTP/1.1 conformance, keep-alive, HTTP/1.0, `Expect: 100-continue`, `Date`,
pipelining order are its. `GuardedHttpProtocol` adds what it lacks, per connection, with the limits of
gpuwarden.web.limits.ConnectionGuard:
- a deadline for a whole request, body included, from the moment the connection waits for one;
- request bytes counted as they arrive, trailers included: 431 while the headers are incomplete, 413 after;
- at most `MAX_PIPELINE` queued pipelined requests, and a write timeout for a response the client does not read;
- a connection closed with its response still unsent (`Connection: close`, HTTP/1.0, a refusal) that the client
  does not read is aborted after the header timeout (`abort_closed_connections`): asyncio's close waits to flush
  for ever, and 1,032 such connections held for good refused 121 of 134 probes (TLS: an OOM kill at 256 MiB);
- admission: at the connection limit a connection closing with its response unsent is aborted, else the oldest
  one waiting for a request with nothing in its socket (one whose request has arrived unread may be a probe), and
  up to `PROBE_RESERVE` connections past the limit get in, so a probe is not the one refused; where the guard
  gives each peer address a share (the probe listener, web/peers.py: past it a connection is refused at accept
  unless it asks for a probe), a probe past its peer's share makes room among that peer's own connections;
- shedding: past the request limit new requests get 503, except the probes and the scrape (`unshed_paths`);
- TCP_NODELAY on every accepted socket (asyncio sets it only where the listener was made with IPPROTO_TCP);
- one counter per refusal (`gpuwarden_http_rejected_total`), never a log line per malformed request.

Its writes, and its response cycles', go through web/pacing.py. The uvicorn internals it reads and overrides are
listed in web/internals.py.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import json
import logging
import socket
import struct
import termios
from typing import Any

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from gpuwarden.web.limits import ConnectionGuard
from gpuwarden.web.pacing import paced_writes

MAX_PIPELINE = 16  # requests queued behind the one being answered
MAX_BODY_BYTES = 64 * 1024  # gpuwarden's endpoints take no body: anything larger is refused (413)
PROBE_RESERVE = 32  # connections let in past the limit when none can be evicted
EVICTION_SCAN = 64  # waiting connections looked at for one with nothing sent, oldest first, per newcomer at the limit
CLOSE_SWEEP_S = 1.0  # how often connections that were closed but not flushed are looked at
QUIET_MESSAGES = ("Invalid HTTP request received.", "Unsupported upgrade request.")


class _Quiet(logging.Filter):
    """uvicorn logs a warning per malformed request or unsupported upgrade: one client could fill the log."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() not in QUIET_MESSAGES


_QUIET_LOGGER = logging.getLogger("gpuwarden.http")
_QUIET_LOGGER.addFilter(_Quiet())


def _bytes_unread(transport: asyncio.BaseTransport | None) -> int:
    """Bytes in the connection's socket the loop has not read yet (FIONREAD); a closed socket counts as none."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None or sock.fileno() < 0:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def _closing_unsent(connection: GuardedHttpProtocol) -> bool:
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
        self._writes = paced_writes(transport, self.loop, lambda: self.flow.write_paused)
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


def protocol_for(guard: ConnectionGuard) -> type[GuardedHttpProtocol]:
    """The protocol class to give uvicorn (`Config(http=...)`), bound to this guard."""
    return type("BoundGuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": guard})


async def abort_closed_connections(connections: set[GuardedHttpProtocol], guard: ConnectionGuard) -> None:
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
        closing = {c for c in list(connections) if _closing(c)}
        closing_since = {c: closing_since.get(c, now) for c in closing}
        for connection, since in closing_since.items():
            if now - since >= guard.header_timeout_s:
                guard.reject("write_timeout")
                connection._abort()


def _closing(connection: GuardedHttpProtocol) -> bool:
    """A connection closing (its response unsent or not) that has not been aborted."""
    transport = connection.transport
    return transport is not None and transport.is_closing() and not connection._writes.aborted
