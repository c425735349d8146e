"""The simulator: a fake libnvidia-ml beneath the real pynvml, driven by scenario files."""

from __future__ import annotations

from collections.abc import Callable

from gpuwarden.nvml import library
from gpuwarden.sim.fake_host_proc import SimulatedHostProc
from gpuwarden.sim.fake_kernel_log import SimulatedKernelLog, nvswitch_addresses
from gpuwarden.sim.fakelib import FakeNvmlLibrary
from gpuwarden.sim.scenario import SIM_UPTIME_S, Scenario, load_scenario

DEFAULT_SCENARIO = "training"


def install_simulator(
    scenario: str | Scenario | None = None, clock: Callable[[], float] | None = None, start: float | None = None
) -> FakeNvmlLibrary:
    """Load the scenario (name, path or model) and put its fake library beneath pynvml.

    `start`: the scenario's time zero on the host's monotonic clock (a GPM child process joins its parent's
    timeline). A scenario loaded by name or path on the host's clock can be reproduced in a child process."""
    name = None if isinstance(scenario, Scenario) else (scenario or DEFAULT_SCENARIO)
    if not isinstance(scenario, Scenario):
        scenario = load_scenario(name)
    fake = FakeNvmlLibrary(scenario, clock=clock, start=start)
    spec = (
        None
        if name is None or clock is not None
        else {"module": "gpuwarden.sim.gpm_child", "scenario": name, "start": fake.start}
    )
    # the host's uptime at the scenario's time zero: on the host's clock it is the host's own (a kernel log handed
    # over as a file is stamped on it), on a clock a test moves the host booted SIM_UPTIME_S before
    booted_before = fake.start if clock is None else SIM_UPTIME_S
    kernel_log = SimulatedKernelLog(scenario, fake.bus_id, booted_before)
    library.install(
        fake.library,
        clock=fake.now,
        child_spec=spec,
        driver=fake.driver_gpus,
        uptime=lambda: booted_before + fake.now(),
        kernel_log=kernel_log.path,
        nvswitches=lambda: nvswitch_addresses(scenario),
        host_proc=SimulatedHostProc(scenario).path,
    )
    return fake
