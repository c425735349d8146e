"""Shared fixtures: the real pynvml over the simulator's fake libnvidia-ml, a pipeline, the real HTTP server.

Nothing of gpuwarden is mocked: the only stand-in is the C library beneath pynvml (no GPU here).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwarden.nvml import library
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim import install_simulator
from gpuwarden.sim.fakelib import FakeNvmlLibrary
from gpuwarden.sim.scenario import Scenario, load_scenario
from tests.helpers.common import LiveServer, scenario_from, settings, wait_for_every_gpu_read, wait_for_slow_cycles
from tests.helpers.kubelet import FakeKubelet

pytest_plugins = ["tests.helpers.require_all"]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--phase",
        choices=("all", "parallel", "serial"),
        default="all",
        help="parallel: the tests not marked serial (-n 4); serial: those (-n 2 --dist loadfile); .ci/test runs both",
    )


# Modules whose tests take longest (wall seconds on the 2-core build machine, 2026-11-28), longest first. pytest-xdist
# hands work out in collection order, and the alphabetical order put the longest files last: the phase waited on one
# worker at the end (the serial phase: 351 s for 630 s of tests on 2 workers). Longest first keeps the tail short.
LONGEST_FIRST = (
    "test_fleet_backends.py",  # one 70 s group (parallel phase)
    "test_fleet_jobs.py",  # one 80 s test
    "test_hostile_clients.py",  # 147 s (serial phase)
    "test_pages_across_restarts.py",  # 85 s
    "test_restart_verdicts.py",  # 80-100 s (serial phase)
    "test_fleet.py",  # 73 s
    "test_packaging.py",
    "test_alert_rules.py",
    "test_demo.py",
    "test_gpm_containment.py",  # 56 s
    "test_dashboards.py",  # 50 s
    "test_slurm_healthcheck.py",  # 50 s
    "test_jobs.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each module keeps its own order
    phase = config.getoption("--phase")
    if phase == "all":
        return
    keep = [item for item in items if (item.get_closest_marker("serial") is not None) == (phase == "serial")]
    config.hook.pytest_deselected(items=[item for item in items if item not in keep])
    items[:] = keep


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
def make_pipeline() -> Iterator[Callable[..., Pipeline]]:
    pipelines: list[Pipeline] = []

    def make(**sections: dict[str, Any]) -> Pipeline:
        pipeline = Pipeline(settings(**sections))
        pipelines.append(pipeline)
        return pipeline

    yield make
    for pipeline in pipelines:
        pipeline.stop(timeout=0.5)


@pytest.fixture
def live_server(
    sim: Callable[..., FakeNvmlLibrary], make_pipeline: Callable[..., Pipeline]
) -> Iterator[Callable[..., LiveServer]]:
    servers: list[LiveServer] = []

    def start(scenario: str | dict[str, Any] = "healthy", **sections: dict[str, Any]) -> LiveServer:
        sim(scenario)
        sections.setdefault("poll", {"fast_interval": 0.2, "slow_interval": 1.0, "call_deadline": 1.0})
        server = LiveServer(make_pipeline(**sections)).__enter__()
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


# sustain windows at zero, so that faults whose verdict waits minutes (NVLink down 5 min, 91 °C for 2 min) are
# judged within the test; the defaults are the alert rules' (exporter/gpuwarden/health/thresholds.toml)
IMPATIENT = {"nvlink_down_for_s": 0, "temperature_critical_for_s": 0, "thermal_slowdown_for_s": 0, "gpu_lost_for_s": 0}


@pytest.fixture
def scenario_exporter(make_pipeline, tmp_path_factory):  # noqa: ANN001, ANN201 - the fixtures; a starter
    """The exporter over a scenario whose timed faults (t=5 s, t=8 s) have already happened. One at a time: the
    simulator is process-wide, so a second start replaces what the first one reads."""
    started: list[LiveServer] = []

    def start(name: str, impatient: bool = False) -> LiveServer:
        for server in started:
            server.__exit__()
        started.clear()
        install_simulator(load_scenario(name), start=time.monotonic() - 30)
        # the default fast interval: its publish wait (0.5 s) holds on a loaded machine, where 0.2 s polling of
        # eight GPUs marked readings stale and turned a verdict into "unknown"; a call deadline of 5 s, not 1 s: with
        # four busy processes beside the suite a read of the simulator took over 1 s, the GPU went stale and the
        # verdict a test asserted read "unknown" (what these tests check is the verdict, not the deadline's effect:
        # tests/test_stuck_gpu.py does that)
        sections: dict = {"poll": {"fast_interval": 1.0, "slow_interval": 1.0, "call_deadline": 5.0}}
        if impatient:
            path = tmp_path_factory.mktemp("thresholds") / "thresholds.yaml"
            path.write_text(yaml.safe_dump(IMPATIENT))
            sections["health"] = {"thresholds_file": str(path)}
        server = LiveServer(make_pipeline(**sections))
        started.append(server.__enter__())
        wait_for_slow_cycles(server.pipeline, 2)  # health verdicts from the faults' slow-tier readings
        wait_for_every_gpu_read(server.pipeline)  # of every GPU, none stale (starved: a read can miss both cycles)
        return server

    yield start
    for server in started:
        server.__exit__()
    from gpuwarden.nvml import library

    library.install(None)
