"""A PagerDuty Events-v2 endpoint and a ticket webhook on one loopback port, for Alertmanager in end-to-end tests."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import yaml

SHIPPED_ALERTMANAGER = Path(__file__).resolve().parents[2] / "deploy" / "alertmanager" / "alertmanager.yml"


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

    def alertmanager_config(self, folder: Path, routing_key: str) -> dict[str, Any]:
        """The shipped Alertmanager config with its PagerDuty and ticket receivers pointed here (the routing key in a
        file under `folder`) and its group waits shortened (1 s, 2 s): nothing else changed."""
        am = yaml.safe_load(SHIPPED_ALERTMANAGER.read_text())
        (folder / "routing-key").write_text(routing_key)
        for receiver_config in am["receivers"]:
            for pd in receiver_config.get("pagerduty_configs", []):
                pd["url"] = f"http://127.0.0.1:{self.port}/v2/enqueue"
                pd["routing_key_file"] = str(folder / "routing-key")
            for hook in receiver_config.get("webhook_configs", []):
                hook["url"] = f"http://127.0.0.1:{self.port}/tickets"
        for route in [am["route"], *am["route"]["routes"]]:
            route.update(group_wait="1s", group_interval="2s")
        return am
