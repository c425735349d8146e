"""gpuwarden's HTTP server: an ASGI app on uvicorn (httptools) over a listener already bound, with its limits.

uvicorn serves the ASGI apps (the exporter's and the fleet service's); lifespan and graceful shutdown are its. Where
uvicorn has a setting it is used (`timeout_keep_alive`, `timeout_graceful_shutdown`, `server_header`). What it lacks
is in the modules beside this one, each a mechanism over uvicorn or asyncio internals (listed in web/internals.py):
- web/protocol.py: `GuardedHttpProtocol`, the per-connection limits (deadlines, sizes, admission, shedding), and
  the sweep that aborts connections closed with their response unread;
- web/pacing.py: answers handed to the transport a chunk at a time while the client reads;
- web/handshakes.py: at most `max_handshakes` TLS handshakes in progress, the rest waiting before any TLS state.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
import threading
import time
from typing import Any

import uvicorn

from gpuwarden.web.handshakes import HandshakeLimiter
from gpuwarden.web.limits import ConnectionGuard
from gpuwarden.web.protocol import abort_closed_connections, protocol_for

HEARTBEAT_S = 1.0  # how often the loop notes that it turns (HttpServer.last_turn)


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
            abort_closed_connections(self.server_state.connections, self._guard)
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
