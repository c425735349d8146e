"""The exporter's HTTP front: what a scrape and the probes need, in plain ASGI, with the JSON API loaded lazily.

`/metrics` (GET/HEAD) is served from the render cache, `/healthz` and `/readyz` (GET/HEAD) from the snapshot; these
never import FastAPI. Any other path builds the FastAPI app of exporter/gpuwarden/web/api.py on its first request (in a
worker thread, once) and hands it the request: FastAPI, Starlette and the API's models cost ~0.4 s and ~20 MiB that a
node whose only client is Prometheus never pays (docs/benchmarks.md, Footprint).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.exposition.render import Renderer, content_type
from gpuwarden.model.snapshot import Snapshot
from gpuwarden.web.health_document import HealthBodies
from gpuwarden.web.limits import ConnectionGuard
from gpuwarden.web.readiness import Readiness, SnapshotSource, send_json, serve_lifespan


def _quality(header: str, wanted: str) -> float:
    """The q-value the header gives `wanted` (0 when absent or refused)."""
    for part in header.split(","):
        media, *params = (piece.strip() for piece in part.split(";"))
        if media.lower() != wanted:
            continue
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    return max(0.0, min(float(value), 1.0))
                except ValueError:
                    return 0.0
        return 1.0
    return 0.0


@functools.lru_cache(maxsize=64)  # a scraper sends the same two headers every time: parse them once
def negotiate(accept: str, accept_encoding: str) -> tuple[bool, bool]:
    """(OpenMetrics?, gzip?) as the scraper asked, honouring quality values (q=0 means "not this")."""
    openmetrics = _quality(accept, "application/openmetrics-text")
    text = max(_quality(accept, "text/plain"), _quality(accept, "*/*"))
    return openmetrics > 0 and openmetrics >= text, _quality(accept_encoding, "gzip") > 0


def _wait_within(headers: dict[bytes, bytes], wait_s: float) -> float:
    """How long a start-up scrape may wait: `wait_s`, and no more than 80 % of the scrape timeout Prometheus sends
    (X-Prometheus-Scrape-Timeout-Seconds), so that the wait never turns the scrape into a failed one (up 0)."""
    try:
        timeout = float(headers.get(b"x-prometheus-scrape-timeout-seconds", b"inf"))
    except ValueError:
        return wait_s
    return min(wait_s, 0.8 * timeout) if timeout > 0 else wait_s


FIRST_SNAPSHOT_POLL_S = 0.001
FIRST_SNAPSHOT_WAIT_MAX_S = 5.0  # half of Prometheus' default scrape timeout: the scrape still gets an answer


class Front:
    """Scrapes and probes answered here; the rest by the lazily built API app."""

    def __init__(
        self,
        snapshots: SnapshotSource,
        ready: Readiness,
        renderer: Renderer,
        path: str,
        api: Callable[[], Any],
        first_snapshot_wait_s: float = 0.0,
        expected_gpus: Callable[[], int] = lambda: 0,
    ) -> None:
        self.snapshots, self.ready, self.renderer, self.path = snapshots, ready, renderer, path
        self.expected_gpus = expected_gpus
        self._health = HealthBodies()
        self.first_snapshot_wait_s = first_snapshot_wait_s
        self._first_watch: asyncio.Future[None] | None = None
        self._api_factory = api
        self._api: Any = None
        self._lock = threading.Lock()
        # Renders (one per snapshot and format) and the API's one-time build: two threads, however many scrapers
        # ask at once (the render lock serialises them anyway; more threads would only hold stacks and arenas).
        self._work = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="gpuwarden-render")

    def _build(self) -> Any:
        with self._lock:
            if self._api is None:
                self._api = self._api_factory()
            return self._api

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD"):
            head = scope["method"] == "HEAD"
            if scope["path"] == self.path:
                await self._metrics(scope, send, head)
                return
            if scope["path"] == "/healthz":
                await send_json(send, 200, {"status": "ok"}, head)
                return
            if scope["path"] == "/api/v1/health":  # node-problem-detector's, every 30 s: no framework loaded for it
                body = self._health.body(self.snapshots(), self.expected_gpus())
                headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
                await send({"type": "http.response.start", "status": 200, "headers": headers})
                await send({"type": "http.response.body", "body": b"" if head else body})
                return
            if scope["path"] == "/readyz":
                reason = self.ready(self.snapshots(), time.time())
                if reason is None:
                    await send_json(send, 200, {"status": "ready"}, head)
                else:
                    await send_json(send, 503, {"status": "not ready", "error": reason}, head)
                return
        if scope["type"] == "lifespan":
            await serve_lifespan(receive, send)
            return
        api = self._api or await asyncio.get_running_loop().run_in_executor(self._work, self._build)
        await api(scope, receive, send)

    async def _first_snapshot(self, wait_s: float) -> Snapshot:
        """A scrape that arrives before the poller's first snapshot waits for it (up to `wait_s`), so
        that the first sample Prometheus stores after a restart says what the GPUs are, not a body without them.
        However many scrapes wait, one task on the loop watches for the snapshot (every millisecond): start-up
        only, no thread held, and no per-request polling to take the GIL from the poller."""
        if self._first_watch is None or self._first_watch.done():
            self._first_watch = asyncio.ensure_future(self._watch_first_snapshot())
        await asyncio.wait((self._first_watch,), timeout=wait_s)
        return self.snapshots()

    async def _watch_first_snapshot(self) -> None:
        deadline = time.monotonic() + self.first_snapshot_wait_s
        while self.snapshots().id == 0 and time.monotonic() < deadline:
            await asyncio.sleep(FIRST_SNAPSHOT_POLL_S)

    async def _metrics(self, scope: dict[str, Any], send: Any, head: bool) -> None:
        headers = dict(scope["headers"])
        openmetrics, compress = negotiate(
            headers.get(b"accept", b"").decode("latin-1"), headers.get(b"accept-encoding", b"").decode("latin-1")
        )
        snapshot = self.snapshots()
        if snapshot.id == 0 and (wait_s := _wait_within(headers, self.first_snapshot_wait_s)) > 0:
            snapshot = await self._first_snapshot(wait_s)
        body = self.renderer.cached(snapshot, openmetrics, compress)
        if body is None:  # the first scrape of a snapshot renders, in a worker thread: the loop never blocks
            body = await asyncio.get_running_loop().run_in_executor(
                self._work, self.renderer.render, snapshot, openmetrics, compress
            )
        response = [(b"content-type", content_type(openmetrics).encode()), (b"content-length", str(len(body)).encode())]
        if compress:
            response += [(b"content-encoding", b"gzip"), (b"vary", b"Accept-Encoding")]
        await send({"type": "http.response.start", "status": 200, "headers": response})
        await send({"type": "http.response.body", "body": b"" if head else body})


def create_front(
    snapshots: SnapshotSource,
    ready: Readiness,
    renderer: Renderer,
    telemetry_path: str = "/metrics",
    basic_auth_users: dict[str, str] | None = None,
    guard: ConnectionGuard | None = None,
    first_snapshot_wait_s: float = 0.0,
    expected_gpus: Callable[[], int] = lambda: 0,
) -> Any:
    """The ASGI app the exporter serves: basic auth (probes exempt), then the front (the server has already
    bounded the request). Scrapes before the first snapshot wait for it up to `first_snapshot_wait_s`."""

    def api() -> Any:
        from gpuwarden.web.api import create_app

        return create_app(snapshots, ready, telemetry_path, expected_gpus)

    app: Any = Front(snapshots, ready, renderer, telemetry_path, api, first_snapshot_wait_s, expected_gpus)
    if basic_auth_users:
        from gpuwarden.web.basic_auth import BasicAuth

        app = BasicAuth(app, users=basic_auth_users, guard=guard)
    return app
