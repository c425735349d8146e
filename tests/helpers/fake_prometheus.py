"""A fake Prometheus HTTP API on loopback, for the fleet service's tests and benches: a real HTTP server standing in
for an upstream that a real Prometheus cannot be made to be (broken, hostile, or answering at the fleet's caps).
/api/v1/query is answered by `answer(query, handler)`, /api/v1/rules by `rules(handler)`."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from contextlib import suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs

Answer = Callable[[str, BaseHTTPRequestHandler], None]


class FakePrometheus:
    """/api/v1/query answered by `answer(query, handler)`; every query received is recorded."""

    def __init__(self) -> None:
        self.answer: Answer = lambda query, handler: reply(handler, vector([]))
        self.rules: Callable[[BaseHTTPRequestHandler], None] = lambda handler: reply(handler, {"status": "success"})
        self.queries: list[str] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                form = parse_qs(self.rfile.read(int(self.headers.get("Content-Length", 0))).decode())
                query = form.get("query", [""])[0]
                fake.queries.append(query)
                with suppress(BrokenPipeError, ConnectionResetError):
                    fake.answer(query, self)

            def do_GET(self) -> None:  # noqa: N802 - http.server API: /api/v1/rules
                with suppress(BrokenPipeError, ConnectionResetError):
                    fake.rules(self)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()


def reply(handler: BaseHTTPRequestHandler, body: Any, status: int = 200) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def vector(items: list[dict[str, Any]]) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "vector", "result": items}}


def everyday_answer(query: str) -> dict[str, Any] | None:
    """What a real Prometheus answers to the fleet's own small queries, whatever the fake answers to the rest: the
    readiness probe's `vector(1)` and the latency calibration's `time()` (now: no latency offset)."""
    now = time.time()
    if query == "vector(1)":
        return vector([{"metric": {}, "value": [now, "1"]}])
    if query == "time()":
        return {"status": "success", "data": {"resultType": "scalar", "result": [now, f"{now:.3f}"]}}
    return None


def capped_answer(series: int, target_bytes: int | None = None) -> bytes:
    """An instant vector of `series` series, each a node's GPU, its node names padded so that the whole is about
    `target_bytes`: the largest answer the fleet's caps admit is max_answer_series of max_answer_bytes in all."""

    def body(pad: int) -> bytes:
        items = [
            {
                "metric": {"node": f"gpu-node-{i:05d}" + "x" * pad, "uuid": f"GPU-{i:08x}", "gpu": str(i % 8)},
                "value": [1.0, "2"],
            }
            for i in range(series)
        ]
        return json.dumps(vector(items)).encode()

    plain = body(0)
    if target_bytes is None or len(plain) >= target_bytes:
        return plain
    return body((target_bytes - len(plain)) // series)
