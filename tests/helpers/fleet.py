"""The fleet service's app on a real uvicorn server on a loopback port, and its settings for tests."""

from __future__ import annotations

import threading
from typing import Any

import httpx
import uvicorn

from exporter.fleet.app import create_app
from exporter.fleet.settings import FleetSettings
from tests.helpers.common import free_port
from tests.helpers.stack import wait_ready


class FleetServer:
    def __init__(self, settings: FleetSettings) -> None:
        self.port = int(settings.listen_address.rpartition(":")[2])
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(create_app(settings), host="127.0.0.1", port=self.port, log_config=None, access_log=False)
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> FleetServer:
        self.thread.start()
        wait_ready(self.url + "/healthz")
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(5)

    def get(self, path: str, **params: Any) -> httpx.Response:
        return httpx.get(self.url + path, params=params, timeout=30)


def fleet_settings(prometheus: str, **extra: Any) -> FleetSettings:
    return FleetSettings(
        **{"prometheus_url": prometheus, "listen_address": f"127.0.0.1:{free_port()}", "cache_ttl": 0, **extra}
    )
