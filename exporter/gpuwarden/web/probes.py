"""The kubelet's probes on a listener of their own (`web.probe_listen_address`), served on their own thread.

On the main listener a probe is one more connection: it cannot be told from a scraper before its handshake and its
request are read, so under 1,000 TLS clients at once the loop that would answer it turns in 250-700 ms and most
probes missed their second (docs/reliability.md). Here the probes have a loop, a connection limit and a thread of
their own, plain HTTP with two small answers, and what they report is judged from outside the main loop:

- `/healthz` fails when the main server's loop has not turned for `LOOP_STALL_S` (its heartbeat,
  `HttpServer.last_turn`), so a loop that hangs still restarts the pod, as the probe on the main port would;
- `/readyz` is the front's readiness (the fast snapshot's age, NVML up, a GPU visible), and fails too while the
  main loop is stalled.

Any pod can reach the port (the kubelet probes from the node), so it must survive a flood. 1,000 idle connections,
each reopened as soon as the server closed it, made the server accept and close ~700 connections a second, and 15
of 60 probes failed in 10 minutes, 3 in a row: a restart (bench/probes_under_load.py idle). The kubelet sends its
request as soon as it has connected; a flood's idle connection sends nothing. So the listener has the kernel hold
a connection until its first bytes arrive (`accept_only_with_data`, Linux's TCP_DEFER_ACCEPT, for up to
`DEFER_ACCEPT_S`): idle connections wait in the kernel, costing the server nothing, and a probe is accepted and
answered past them. One still idle when the wait ends is accepted and meets the server's own limits (the header
deadline, and at `MAX_CONNECTIONS` the oldest connection that has sent nothing is closed). A flood that sends a byte
first is not held back by the kernel: each peer address gets a share of `MAX_PER_PEER` connections, enforced at accept
(web/peers.py), so a pod's flood is closed as it arrives and never takes the kubelet's connections.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.web.listener import accept_only_with_data
from gpuwarden.web.peers import PeerShares, SharedListener
from gpuwarden.web.readiness import Readiness, SnapshotSource, send_json, serve_lifespan

log = logging.getLogger(__name__)

LOOP_STALL_S = 10.0  # the liveness probe's period: a loop this late has stopped, not slowed under load
DEFER_ACCEPT_S = 30.0  # how long the kernel keeps a connection that has sent nothing from the server (31 s in fact)
MAX_CONNECTIONS = 64  # the kubelet holds at most three at once (startup, liveness and readiness probes)
MAX_PER_PEER = 8  # connections one address may hold (web/peers.py): the kubelet's three, and room to spare


class ProbeApp:
    """ASGI: /healthz and /readyz (GET, HEAD), 404 for anything else."""

    def __init__(
        self,
        snapshots: SnapshotSource,
        ready: Readiness,
        last_turn: Callable[[], float],
        stall_s: float = LOOP_STALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.snapshots, self.ready, self.last_turn = snapshots, ready, last_turn
        self.stall_s, self.clock = stall_s, clock

    def stalled(self) -> str | None:
        """Why the main loop is judged stopped, or None."""
        late = self.clock() - self.last_turn()
        if late > self.stall_s:
            return f"the main listener's event loop has not turned for {late:.0f} s"
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        path, head = scope["path"], scope["method"] == "HEAD"
        if scope["method"] not in ("GET", "HEAD") or path not in ("/healthz", "/readyz"):
            await send_json(send, 404, {"status": "not found", "error": "only /healthz and /readyz are here"}, head)
            return
        stalled = self.stalled()
        if stalled is not None:
            await send_json(send, 503, {"status": "stalled", "error": stalled}, head)
        elif path == "/healthz":
            await send_json(send, 200, {"status": "ok"}, head)
        elif (reason := self.ready(self.snapshots(), time.time())) is None:
            await send_json(send, 200, {"status": "ready"}, head)
        else:
            await send_json(send, 503, {"status": "not ready", "error": reason}, head)


class ProbeListener:
    """The probe app on gpuwarden's HTTP server (its own guard and loop) in a daemon thread."""

    def __init__(self, app: ProbeApp, header_timeout_s: float, defer_s: float = DEFER_ACCEPT_S) -> None:
        from gpuwarden.web.limits import ConnectionGuard
        from gpuwarden.web.server import HttpServer

        # a probe sends its request at once: the header deadline evicts whatever holds a connection without one
        self.guard = ConnectionGuard(
            header_timeout_s=header_timeout_s,
            max_connections=MAX_CONNECTIONS,
            max_requests=32,
            peers=PeerShares(MAX_PER_PEER),
        )
        self.server = HttpServer(app, self.guard, graceful_s=1.0)
        self.defer_s = defer_s
        self.thread: threading.Thread | None = None

    def start(self, listener: socket.socket) -> None:
        if not accept_only_with_data(listener, self.defer_s):
            log.info("the probe listener cannot have the kernel hold idle connections here (no TCP_DEFER_ACCEPT)")
        assert self.guard.peers is not None
        listener = SharedListener.around(listener, self.guard.peers, lambda: self.guard.reject("evicted"))
        self.thread = threading.Thread(target=self.server.run, args=(listener,), name="gpuwarden-probes", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.server.stop()
        if self.thread is not None:
            self.thread.join(5)
