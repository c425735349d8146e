"""What a client can hold of the server, bounded inside uvicorn's own HTTP protocol (httptools).

uvicorn has no deadline for receiving a request's headers and httptools no limit on their size, so an idle or
slowloris connection is held forever and a 100 MB header is buffered whole before any middleware can refuse it;
`limit_concurrency` then answers 503 to everyone, probes included. `GuardedHttpProtocol` adds, per connection:
- a deadline for a request's headers (armed at connect and when a keep-alive request begins), then close;
- a header size limit counted as bytes arrive, answered 431 and closed before the bytes pile up;
- admission: at the connection limit the oldest connection still waiting for its headers is closed, so a new
  connection (a probe, a scrape) always gets in;
- shedding: past the request limit new requests get 503, except the probes; one counter per reason instead of a
  log line per rejected request (`gpuwarden_http_rejected_total`).
"""

from __future__ import annotations

import asyncio
import asyncio.constants
import asyncio.sslproto
import json
import logging
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.flow_control import service_unavailable
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from exporter.asgi import MAX_HEADER_BYTES

log = logging.getLogger(__name__)

PROBES = frozenset({"/healthz", "/readyz"})
REJECT_REASONS = ("header_timeout", "header_too_large", "evicted", "shed", "auth_failed", "auth_shed")


@dataclass
class ConnectionGuard:
    """Limits and counters shared by every connection of one server (the protocol reads them on the event loop)."""

    header_timeout_s: float = 5.0
    max_header_bytes: int = MAX_HEADER_BYTES  # the same limit as the ASGI check of apps served without this guard
    max_connections: int = 1000
    max_requests: int = 256
    rejected: Counter[str] = field(default_factory=Counter)
    parked: int = 0  # requests waiting out a refusal delay: they cost nothing and must not cause shedding
    waiting: dict[GuardedHttpProtocol, float] = field(default_factory=dict)  # awaiting headers → since (ordered)
    _log_lock: threading.Lock = field(default_factory=threading.Lock)
    _logged_at: float = 0.0
    _unlogged: int = 0

    def reject(self, reason: str) -> None:
        """Count a rejection; log at most one line per 10 s saying how many there were."""
        self.rejected[reason] += 1
        now = time.monotonic()
        with self._log_lock:
            self._unlogged += 1
            if now - self._logged_at < 10.0:
                return
            count, self._unlogged, self._logged_at = self._unlogged, 0, now
        log.warning(
            "rejected %d connection(s) or request(s) since the last report (%s); see gpuwarden_http_rejected_total",
            count,
            ", ".join(f"{r} {n}" for r, n in sorted(self.rejected.items())),
        )

    def counts(self) -> dict[str, int]:
        return {reason: self.rejected.get(reason, 0) for reason in REJECT_REASONS}

    def protocol(self) -> type[GuardedHttpProtocol]:
        """The protocol class to give uvicorn (`Config(http=...)`), bound to this guard."""
        return type("BoundGuardedHttpProtocol", (GuardedHttpProtocol,), {"guard": self})

    async def refuse_later(self, seconds: float) -> None:
        """Wait out a refusal delay without counting as load (see `parked`)."""
        self.parked += 1
        try:
            await asyncio.sleep(seconds)
        finally:
            self.parked -= 1


def connection_limit(wanted: int = 1000, reserve: int = 64) -> int:
    """Raise the soft open-file limit to the hard one, and keep connections below it (listening sockets, NVML's
    device files and the log need descriptors too)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return wanted
    return max(16, min(wanted, soft - reserve))


def bound_tls_costs(handshake_timeout_s: float, buffer_bytes: int = 16 * 1024) -> None:
    """Bound what a TLS connection costs before it sends a byte of HTTP (asyncio's TLS layer, beneath uvicorn).

    CPython's asyncio gives every TLS connection a 256 KiB receive buffer at accept (`SSLProtocol.max_size`) and
    waits 60 s for a handshake (`constants.SSL_HANDSHAKE_TIMEOUT`), and uvicorn exposes neither: 1,500 idle TLS
    connections took RSS up by 473 MiB (bench/hostile_clients.py --tls). A TLS record is at most 16 KiB, so a 16 KiB
    buffer loses nothing; the handshake gets the header deadline. Both are process-wide asyncio settings, set once
    at start (the exporter serves one listener); tests/test_hostile_clients.py fails if a Python release drops them.
    """
    asyncio.sslproto.SSLProtocol.max_size = buffer_bytes
    asyncio.constants.SSL_HANDSHAKE_TIMEOUT = handshake_timeout_s


def _problem_bytes(status: int, reason: str, message: str) -> bytes:
    body = json.dumps({"error": message}).encode()
    return (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    ).encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with a header deadline, a header size limit, admission and shedding."""

    guard: ConnectionGuard  # set by ConnectionGuard.protocol()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_bytes = 0
        self._header_timer: asyncio.TimerHandle | None = None
        self._awaiting = False

    # -- connection --------------------------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        guard = self.guard
        if len(self.connections) > guard.max_connections:
            self._admit()
        self._await_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_done()
        super().connection_lost(exc)

    def _admit(self) -> None:
        """At the connection limit, make room by closing the connection that has waited longest for its headers."""
        guard = self.guard
        for oldest in guard.waiting:
            if oldest is not self:
                guard.reject("evicted")
                oldest._close()
                return
        guard.reject("evicted")  # every other connection is busy with a request: this one waits its turn elsewhere
        self._close()

    def _close(self) -> None:
        self._headers_done()
        if not self.transport.is_closing():
            self.transport.close()

    # -- a request's headers -------------------------------------------------------------------------------------

    def _await_headers(self) -> None:
        if self._awaiting or self.transport.is_closing():
            return
        self._awaiting, self._header_bytes = True, 0
        self.guard.waiting[self] = time.monotonic()
        self._header_timer = self.loop.call_later(self.guard.header_timeout_s, self._header_timeout)

    def _headers_done(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        self._awaiting = False
        self.guard.waiting.pop(self, None)

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self._awaiting:
            self.guard.reject("header_timeout")
            self._close()

    def data_received(self, data: bytes) -> None:
        if self.transport.is_closing():
            return
        if not self._awaiting and (self.cycle is None or self.cycle.response_complete):
            self._await_headers()  # the next request on a kept-alive connection: its headers get a deadline too
        if self._awaiting:
            self._header_bytes += len(data)
            if self._header_bytes > self.guard.max_header_bytes:
                self.guard.reject("header_too_large")
                self._headers_done()
                self.transport.write(
                    _problem_bytes(
                        431,
                        "Request Header Fields Too Large",
                        f"request headers exceed {self.guard.max_header_bytes} bytes",
                    )
                )
                self.transport.close()
                return
        super().data_received(data)

    def on_headers_complete(self) -> None:
        self._headers_done()
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        if len(self.tasks) - self.guard.parked >= self.guard.max_requests and path not in PROBES:
            self.guard.reject("shed")
            app, self.app = self.app, service_unavailable
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()
