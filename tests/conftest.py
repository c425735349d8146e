"""Shared fixtures: the real pynvml over the simulator's fake libnvidia-ml, a poller, the real HTTP server.

Nothing of gpuwarden is mocked: the only stand-in is the C library beneath pynvml (no GPU here).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.collect.poller import Poller
from gpuwarden.nvml import library
from gpuwarden.sim import install_simulator
from gpuwarden.sim.fakelib import FakeNvmlLibrary
from gpuwarden.sim.scenario import Scenario, load_scenario
from tests.helpers.common import LiveServer, scenario_from, settings
from tests.helpers.kubelet import FakeKubelet

pytest_plugins = ["tests.helpers.require_all"]


@pytest.fixture
def sim() -> Iterator[Callable[..., FakeNvmlLibrary]]:
    """Install a fake NVML for a scenario (name, dict or Scenario); always restores pynvml afterwards."""
    installed: list[FakeNvmlLibrary] = []

    def install(
        scenario: str | dict[str, Any] | Scenario = "healthy", clock: Callable[[], float] | None = None
    ) -> FakeNvmlLibrary:
        if isinstance(scenario, dict):
            scenario = scenario_from(scenario)
        elif isinstance(scenario, str):
            scenario = load_scenario(scenario)
        fake = install_simulator(scenario, clock=clock)
        installed.append(fake)
        return fake

    yield install
    for fake in installed:
        fake.close()
    library.install(None)


@pytest.fixture
def make_poller() -> Iterator[Callable[..., Poller]]:
    pollers: list[Poller] = []

    def make(**sections: dict[str, Any]) -> Poller:
        poller = Poller(settings(**sections))
        pollers.append(poller)
        return poller

    yield make
    for poller in pollers:
        poller.stop(timeout=0.5)


@pytest.fixture
def live_server(
    sim: Callable[..., FakeNvmlLibrary], make_poller: Callable[..., Poller]
) -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def start(scenario: str | dict[str, Any] = "healthy", **sections: dict[str, Any]) -> LiveServer:
        sim(scenario)
        sections.setdefault("poll", {"fast_interval": 0.2, "slow_interval": 1.0, "call_deadline": 1.0})
        server = LiveServer(make_poller(**sections)).__enter__()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.__exit__()


@pytest.fixture
def kubelet() -> Iterator[FakeKubelet]:
    """A fake kubelet pod-resources server on a unix socket (paths are limited to ~107 bytes: a short folder)."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="kubelet-") as short:
        fake = FakeKubelet(Path(short) / "kubelet.sock").start()
        yield fake
        fake.stop()
