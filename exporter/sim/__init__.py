"""The simulator: a fake libnvidia-ml beneath the real pynvml, driven by scenario files."""

from __future__ import annotations

from collections.abc import Callable

from exporter.nvml import library
from exporter.sim.fakelib import FakeNvmlLibrary
from exporter.sim.scenario import Scenario, load_scenario

DEFAULT_SCENARIO = "training"


def install_simulator(
    scenario: str | Scenario | None = None, clock: Callable[[], float] | None = None
) -> FakeNvmlLibrary:
    """Load the scenario (name, path or model) and put its fake library beneath pynvml."""
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(scenario or DEFAULT_SCENARIO)
    fake = FakeNvmlLibrary(scenario, clock=clock)
    library.install(fake.library, clock=fake.now)
    return fake
