"""The fleet service's app on gpuwarden's real HTTP server on a loopback port, and its settings for tests."""

from __future__ import annotations

from typing import Any

import httpx

from gpuwarden.config.typed import build
from gpuwarden.fleet.app import create_app
from gpuwarden.fleet.settings import FleetSettings
from tests.helpers.common import ServedApp, free_port, plain_client
from tests.helpers.stack import wait_ready


class FleetServer:
    def __init__(self, settings: FleetSettings) -> None:
        self.port = int(settings.listen_address.rpartition(":")[2])
        self.url = f"http://127.0.0.1:{self.port}"
        self.served = ServedApp(create_app(settings), port=self.port)
        self.client = plain_client(timeout=30)

    def __enter__(self) -> FleetServer:
        self.served.start()
        wait_ready(self.url + "/healthz")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.close()
        self.served.stop()

    def get(self, path: str, **params: Any) -> httpx.Response:
        return self.client.get(self.url + path, params=params)


def fleet_settings(prometheus: str, **extra: Any) -> FleetSettings:
    """Settings checked as `gpuwarden fleet` checks its flags (config/typed.py), on a free loopback port."""
    values = {"prometheus_url": prometheus, "listen_address": f"127.0.0.1:{free_port()}", "cache_ttl": 0, **extra}
    return build(FleetSettings, values)
