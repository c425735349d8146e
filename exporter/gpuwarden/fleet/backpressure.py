"""The bytes of answers on their way to clients, bounded as a whole: ASGI middleware of the fleet service.

gpuwarden's server (web/pacing.py) hands an answer to the socket only as fast as its client reads, keeping the rest
as the app's own bytes; a client that never reads is cut off after the header timeout. What it cannot bound is how
many answers the app has made meanwhile: each request for a 730 KB view rendered its own copy, and 600 clients that
sent `Connection: close` and never read OOM-killed the fleet service at 384 MiB (issue 48). Here every answer's
body is counted from its first byte sent until its client has taken all but the last piece of it, shared bodies
once (a view's JSON is rendered once for all its readers: refresh.AnswerCache). Past `limit_bytes` a new request is
answered 503 with Retry-After before the app makes anything; the probes and /metrics are never refused.

The count is exact because the body goes down in pieces of `PIECE_BYTES`: uvicorn waits for a paused writer to
drain before it takes the next piece, so the last `send` returns only once the client has read the rest.
"""

from __future__ import annotations

import json
from typing import Any

from gpuwarden.web.limits import PROBES

PIECE_BYTES = 64 * 1024
RETRY_AFTER_S = 5
NEVER_REFUSED = PROBES | {"/metrics"}


class ResponseBudget:
    """ASGI middleware: at most `limit_bytes` of response bodies in flight (distinct objects counted once)."""

    def __init__(self, app: Any, limit_bytes: int) -> None:
        self.app = app
        self.limit_bytes = limit_bytes
        self.used = 0
        self.peak = 0
        self.refused = 0
        self._bodies: dict[int, list[Any]] = {}  # id(body) → [body, senders]: shared bodies counted once

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.used >= self.limit_bytes and scope["path"] not in NEVER_REFUSED:
            self.refused += 1
            await _busy(send, self.used)
            return

        async def paced(message: dict[str, Any]) -> None:
            if message["type"] != "http.response.body" or not message.get("body"):
                await send(message)
                return
            body = message["body"]
            self._count(body)
            try:
                view = memoryview(body)
                last = message.get("more_body", False)
                for start in range(0, len(view), PIECE_BYTES):
                    end = start + PIECE_BYTES
                    more = end < len(view) or last
                    await send({"type": "http.response.body", "body": view[start:end], "more_body": more})
            finally:
                self._uncount(body)

        await self.app(scope, receive, paced)

    def _count(self, body: Any) -> None:
        root = _root(body)
        held = self._bodies.get(id(root))
        if held is None:
            self._bodies[id(root)] = [root, 1]  # kept referenced: its id cannot be reused while counted
            self.used += len(root)
            self.peak = max(self.peak, self.used)
        else:
            held[1] += 1

    def _uncount(self, body: Any) -> None:
        root = _root(body)
        held = self._bodies[id(root)]
        held[1] -= 1
        if held[1] == 0:
            del self._bodies[id(root)]
            self.used -= len(root)


def _root(body: Any) -> Any:
    """The object a body's bytes live in: a memoryview's own (each reader's view of a shared answer is its own
    memoryview of the same bytes)."""
    while isinstance(body, memoryview) and isinstance(body.obj, (bytes, bytearray, memoryview)):
        body = body.obj
    return body


async def _busy(send: Any, used: int) -> None:
    detail = (
        f"{used // 2**20} MiB of answers are on their way to clients that have not read them; retry in "
        f"{RETRY_AFTER_S} s (--max-response-bytes)"
    )
    data = json.dumps({"error": "busy", "detail": detail}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(data)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": data})
