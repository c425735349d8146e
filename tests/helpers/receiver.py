"""A PagerDuty Events-v2 endpoint and a ticket webhook on one loopback port, for Alertmanager in end-to-end tests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver:
    """PagerDuty Events API v2 and a ticket webhook on one loopback port, recording every POST."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server API
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with receiver.lock:
                    receiver.events.append((self.path, body))
                self.send_response(202)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status":"success","message":"Event processed"}')

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def pages(self) -> list[dict]:
        with self.lock:
            return [body for path, body in self.events if path == "/v2/enqueue"]

    def tickets(self) -> list[dict]:
        with self.lock:
            return [alert for path, body in self.events if path == "/tickets" for alert in body["alerts"]]
