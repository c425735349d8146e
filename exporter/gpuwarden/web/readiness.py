"""What the probes answer, shared by the front, the JSON API and the probe listener: when the exporter is ready,
and the two small ASGI answers they give. Plain ASGI, no framework; imports only the snapshot model."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from gpuwarden.model.snapshot import Snapshot

READY_INTERVALS = 3  # /readyz fails when the fast snapshot is older than this many intervals
SnapshotSource = Callable[[], Snapshot]
Readiness = Callable[[Snapshot, float], "str | None"]


def readiness(snapshot: Snapshot, fast_interval: float, now: float) -> str | None:
    """None when ready, else the reason."""
    if not snapshot.nvml_up:
        return f"nvml is down: {snapshot.nvml_error or 'not initialised'}"
    if not any(gpu.up for gpu in snapshot.gpus):
        return "no GPU is visible"
    fast_at = snapshot.tier_finished.get("fast")
    limit = READY_INTERVALS * fast_interval
    if fast_at is None or now - fast_at > limit:
        return f"the fast snapshot is older than {limit:g} s"
    return None


def readiness_under(settings: Callable[[], Any]) -> Readiness:
    """Readiness judged by the fast interval in force now (a reload may change it), not the one at start."""
    return lambda snapshot, now: readiness(snapshot, settings().poll.fast_interval, now)


async def send_json(send: Any, status: int, body: dict[str, Any], head: bool) -> None:
    """A small JSON answer (HEAD: the same headers, no body)."""
    data = json.dumps(body, separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": b"" if head else data})


async def serve_lifespan(receive: Any, send: Any) -> None:
    """Start-up and shut-down need nothing here (the API app has no lifespan work either)."""
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
