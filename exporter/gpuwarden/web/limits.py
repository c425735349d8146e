"""What a client can hold of the server: the per-connection limits web/protocol.py enforces, and their counters.

An idle or slowloris connection, a 100 MB header or a flood of requests must never take the probes or an
authorised scrape down with it. The limits: a deadline for each request to arrive; a header size limit counted as
bytes arrive (431, then close, before the bytes pile up); admission (at the connection limit one closing with its
answer unread is closed, else the oldest one that has sent nothing, so a new connection — a probe, a scrape — gets
in); shedding (past the request limit new requests get 503, except the probes); one counter per reason instead of a
log line per rejected request (`gpuwarden_http_rejected_total`).
"""

from __future__ import annotations

import asyncio
import asyncio.constants
import asyncio.sslproto
import logging
import resource
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.web.peers import PeerShares

log = logging.getLogger(__name__)

PROBES = frozenset({"/healthz", "/readyz"})
MAX_HEADER_BYTES = 16 * 1024  # a request's line and headers, counted as they arrive
REJECT_REASONS = (
    "header_timeout",
    "header_too_large",
    "evicted",
    "shed",
    "auth_failed",
    "auth_shed",
    "write_timeout",
    "body_too_large",
    "pipeline",
    "bad_request",
    "handshake_limit",
)


@dataclass
class ConnectionGuard:
    """Limits and counters shared by every connection of one server (the protocol reads them on the event loop)."""

    header_timeout_s: float = 5.0
    max_header_bytes: int = MAX_HEADER_BYTES
    max_connections: int = 1000
    max_requests: int = 256
    rejected: Counter[str] = field(default_factory=Counter)
    parked: int = 0  # requests waiting out a refusal delay: they cost nothing and must not cause shedding
    waiting: dict[Any, float] = field(default_factory=dict)  # connections awaiting a request → since (ordered)
    aborting: int = 0  # connections aborted and not yet reported lost: still in the server's set, holding nothing
    max_handshakes: int = 256  # TLS connections accepted and still in their handshake (web/handshakes.py)
    # how long a handshake may wait on its client before its slot goes to a waiting one: ClientHello still
    # incomplete, or the server's answer unfinished (web/handshakes.py; tests that starve their own clients lengthen
    # them)
    handshake_grace_s: tuple[float, float] = (0.15, 0.5)
    # paths never shed past max_requests: the probes, and the scrape (served from the render cache, so cheap), which
    # a flood of API requests must not cost Prometheus its samples (the service adds its telemetry path)
    unshed_paths: frozenset[str] = PROBES
    # a share per peer address (web/peers.py; the probe listener's): None, no share
    peers: PeerShares | None = None
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
    """Bound what a TLS connection costs before it sends a byte of HTTP (asyncio's TLS layer).

    CPython's asyncio gives every TLS connection a 256 KiB receive buffer at accept (`SSLProtocol.max_size`) and
    waits 60 s for a handshake (`constants.SSL_HANDSHAKE_TIMEOUT`): 1,500 idle TLS
    connections took RSS up by 473 MiB (bench/hostile_clients.py --tls). A TLS record is at most 16 KiB, so a 16 KiB
    buffer loses nothing; the handshake gets the header deadline. Both are process-wide asyncio settings, set once
    at start (the exporter serves one listener); tests/test_hostile_clients.py fails if a Python release drops them.
    """
    asyncio.sslproto.SSLProtocol.max_size = buffer_bytes
    asyncio.constants.SSL_HANDSHAKE_TIMEOUT = handshake_timeout_s
