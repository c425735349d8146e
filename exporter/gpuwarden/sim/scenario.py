"""Scenario files: node shape, value trajectories over time, and faults at given times.

A scenario is YAML validated here; a bad file gets one line naming the file, the key and the fix.
Time `t` is seconds since the simulator started. See docs/simulator.md for the format.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from gpuwarden.config.errors import describe_error
from gpuwarden.config.settings import ConfigError, read_yaml
from gpuwarden.sim.faults import Fault
from gpuwarden.sim.host_spec import HostProcessSpec
from gpuwarden.sim.models import MODELS
from gpuwarden.sim.trajectory import StrictModel, Trajectory

VALUE_KEYS = (
    "utilization",
    "memory_utilization",
    "encoder_utilization",
    "decoder_utilization",
    "memory_used_ratio",
    "temperature",
    "memory_temperature",
    "power_watts",
    "sm_clock_mhz",
    "memory_clock_mhz",
    "pstate",
    "clock_event_reasons",
    "processes",
    "persistence_mode",
    "power_limit_watts",
    "pcie_gen",
    "pcie_width",
    "pcie_tx_bytes_per_second",
    "pcie_rx_bytes_per_second",
    "fan_percent",
    "recovery_action",
    # GPM (percent over the window, or bytes/s); when a scenario leaves them out they follow `utilization`
    "graphics_active",
    "sm_active",
    "sm_occupancy",
    "tensor_active",
    "fp64_active",
    "fp32_active",
    "fp16_active",
    "dram_active",
    "nvlink_rx_bytes_per_second",
    "nvlink_tx_bytes_per_second",
)


class Node(StrictModel):
    model: str = "h100-sxm-80gb"
    identity: str | None = Field(
        None,
        min_length=1,
        max_length=128,
        description="What the GPUs' UUIDs (and the fabric's and MIG instances') are derived from; default: the "
        "scenario's name. Keep it when copying a scenario under a new name, and the copy's GPUs are the same GPUs "
        "across a restart",
    )
    count: int = Field(8, ge=1, le=16)
    nvlink: Literal["nvswitch", "none"] = "nvswitch"
    numa_nodes: int = Field(2, ge=1, le=8)
    pcie_same_numa: Literal["PIX", "PXB", "PHB", "NODE"] = Field(
        "NODE", description="PCIe path between GPUs on the same NUMA node (different nodes: SYS)"
    )
    mig_instances: dict[int, int] = Field(
        default_factory=dict, description="GPU index → MIG instances on it (MIG mode on for those GPUs), 1-7"
    )

    mig_activity: dict[int, list[float]] = Field(
        default_factory=dict,
        description="GPU index → each MIG instance's GPM activity as a share of the GPU's scenario values, 0-1 "
        "(default 1 for every instance)",
    )

    @field_validator("mig_instances")
    @classmethod
    def _mig(cls, value: dict[int, int]) -> dict[int, int]:
        for gpu, instances in value.items():
            if gpu < 0 or not 1 <= instances <= 7:
                raise ValueError("maps a GPU index to 1-7 MIG instances, e.g. {0: 7}")
        return value

    @field_validator("mig_activity")
    @classmethod
    def _mig_activity(cls, value: dict[int, list[float]]) -> dict[int, list[float]]:
        for shares in value.values():
            if len(shares) > 7 or any(not 0.0 <= share <= 1.0 for share in shares):
                raise ValueError("maps a GPU index to up to 7 shares between 0 and 1, e.g. {0: [1.0, 0.2]}")
        return value

    @field_validator("model")
    @classmethod
    def _known_model(cls, value: str) -> str:
        if value not in MODELS:
            raise ValueError(f"unknown GPU model; choose one of {', '.join(MODELS)}")
        return value


class Driver(StrictModel):
    version: str = "580.159.04"
    nvml_version: str = "13.580.159.04"
    cuda_version: int = 13000
    missing_symbols: tuple[str, ...] = Field((), description="C symbols this driver lacks (FunctionNotFound)")
    lists_gpus: bool = Field(
        True, description="/proc/driver/nvidia/gpus is visible (false: a container that does not mount it)"
    )


SIM_UPTIME_S = 86_400.0  # the simulated host booted a day before its scenario began (records may go back that far)


class KernelRecord(StrictModel):
    """One GPU fault the simulated host's kernel logged before the simulator (and so the exporter) started: what
    NVML's event API never reported, read back from the kernel log (collect/kernel_log.py). Written as the driver
    writes it, a `trap` as the kernel reports a process's crash (which the exporter ignores: docs/simulator.md,
    Kernel log)."""

    kind: Literal["xid", "sxid", "fallen_off_bus", "trap"]
    at: float = Field(..., le=0, ge=-SIM_UPTIME_S, description="seconds before the simulator started (<= 0)")
    gpu: int | None = Field(None, ge=0, description="xid, fallen_off_bus: the GPU's index")
    xid: int | None = Field(None, ge=1, le=999, description="xid: the XID")
    switch: int | None = Field(None, ge=0, le=15, description="sxid: the NVSwitch's number")
    sxid: int | None = Field(None, ge=1, le=99_999, description="sxid: the SXid (the driver prints five digits)")
    library: Literal["libnvidia-ml", "libcuda"] = "libnvidia-ml"

    @model_validator(mode="after")
    def _kind_fields(self) -> KernelRecord:
        need = {"xid": ("gpu", "xid"), "fallen_off_bus": ("gpu",), "sxid": ("switch", "sxid"), "trap": ()}
        for name in need[self.kind]:
            if getattr(self, name) is None:
                raise ValueError(f"a '{self.kind}' record needs '{name}'")
        return self


class ProcessSpec(StrictModel):
    """A process holding a GPU: its memory and SM/memory-bandwidth utilization over time, while it lives."""

    gpu: int = Field(ge=0)
    pid: int = Field(ge=1, le=4_194_304)
    name: str = Field("python", min_length=1, max_length=64)
    kind: Literal["compute", "graphics"] = "compute"
    memory_gib: Trajectory = Field(description="GPU memory the process holds, GiB")
    sm: Trajectory = Field(Trajectory(constant=0), description="SM utilization, percent")
    memory_activity: Trajectory = Field(Trajectory(constant=0), description="memory-bandwidth utilization, percent")
    gpu_instance: int | None = Field(None, ge=0, description="MIG GPU instance ID the process runs in")
    at: float = Field(0.0, ge=0, description="seconds after start the process appears")
    until: float | None = Field(None, gt=0, description="seconds after start it exits (omitted: never)")
    respawn_every: float | None = Field(
        None, gt=0, description="start a new process (pid + 1, + 2, ...) this often, each living `until - at` seconds"
    )
    respawns: int = Field(0, ge=0, le=100_000, description="how many times it respawns")

    def alive(self, t: float) -> int | None:
        """The PID alive at time t, or None."""
        if self.respawn_every is None:
            if t >= self.at and (self.until is None or t < self.until):
                return self.pid
            return None
        lifetime = (self.until or self.at + self.respawn_every) - self.at
        if t < self.at:
            return None
        k = int((t - self.at) // self.respawn_every)
        if k > self.respawns or t - self.at - k * self.respawn_every >= lifetime:
            return None
        return self.pid + k


class Scenario(StrictModel):
    name: str
    description: str = ""
    node: Node = Node()
    driver: Driver = Driver()
    values: dict[str, Trajectory] = Field(default_factory=dict, description="every GPU")
    gpus: dict[int, dict[str, Trajectory]] = Field(default_factory=dict, description="per-GPU overrides")
    faults: tuple[Fault, ...] = ()
    processes: tuple[ProcessSpec, ...] = Field(
        (), description="processes holding GPUs; a GPU with any has its memory used = their sum"
    )
    kernel_log: tuple[KernelRecord, ...] = Field((), description="what the host's kernel logged before the start")
    host_processes: tuple[HostProcessSpec, ...] = Field(
        (), description="what the host's /proc shows: the ranks' launchers and environments (the job view)"
    )

    @model_validator(mode="after")
    def _check_keys(self) -> Scenario:
        """What one section cannot check alone: GPU indices within the node, known value keys, each pid once."""
        self._check_processes()
        self._check_values()
        pids = [process.pid for process in self.host_processes]
        if len(set(pids)) < len(pids) or 1 in pids:
            raise ValueError("host_processes: each pid once, and not 1 (the simulated host's init)")
        self._check_kernel_log()
        self._check_faults()
        return self

    def _gpus_of_node(self) -> str:
        return f"the node has GPUs 0-{self.node.count - 1}"

    def _check_processes(self) -> None:
        for number, process in enumerate(self.processes):
            if process.gpu >= self.node.count:
                raise ValueError(f"processes.{number}.gpu: {self._gpus_of_node()}")
            if process.until is not None and process.until <= process.at:
                raise ValueError(f"processes.{number}.until: must be later than `at` ({process.at})")

    def _check_values(self) -> None:
        for where, values in [("values", self.values), *((f"gpus.{i}", v) for i, v in self.gpus.items())]:
            unknown = sorted(set(values) - set(VALUE_KEYS))
            if unknown:
                raise ValueError(f"{where}: unknown value '{unknown[0]}'; known: {', '.join(VALUE_KEYS)}")
        for index in self.gpus:
            if not 0 <= index < self.node.count:
                raise ValueError(f"gpus.{index}: {self._gpus_of_node()}")

    def _check_kernel_log(self) -> None:
        for number, record in enumerate(self.kernel_log):
            if record.gpu is not None and record.gpu >= self.node.count:
                raise ValueError(f"kernel_log.{number}.gpu: {self._gpus_of_node()}")
            if record.kind == "sxid" and self.node.nvlink != "nvswitch":
                raise ValueError(f"kernel_log.{number}: an SXid needs an NVSwitch node (node.nvlink: nvswitch)")

    def _check_faults(self) -> None:
        links = MODELS[self.node.model].nvlinks
        for number, fault in enumerate(self.faults):
            if fault.gpu is not None and fault.gpu >= self.node.count:
                raise ValueError(f"faults.{number}.gpu: {self._gpus_of_node()}")
            if fault.link is not None and fault.link >= links:
                raise ValueError(f"faults.{number}.link: {self.node.model} has {links} NVLinks")

    def _resolved(self, gpu: int, key: str) -> tuple[Trajectory | None, str]:
        """The trajectory that sets `key` on `gpu` (its own, else every GPU's, else None) and its noise seed; looked
        up once: the simulator asks millions of times per test run, and the scenario is frozen."""
        found = self.lookups.get((gpu, key))
        if found is None:
            trajectory = self.gpus.get(gpu, {}).get(key) or self.values.get(key)
            found = self.lookups[(gpu, key)] = (trajectory, f"{self.name}:{gpu}:{key}")
        return found

    def explicit(self, gpu: int, key: str, t: float) -> float | None:
        """The scenario's own value for `key`, or None when it sets none (the caller derives one)."""
        trajectory, seed = self._resolved(gpu, key)
        return None if trajectory is None else trajectory.at(t, seed)

    def value(self, gpu: int, key: str, t: float) -> float:
        trajectory, seed = self._resolved(gpu, key)
        if trajectory is None:
            return MODELS[self.node.model].idle[key]
        return trajectory.at(t, seed)

    def sets(self, gpu: int, key: str) -> bool:
        """Whether the scenario sets `key` on `gpu` (else the caller derives or defaults it)."""
        return self._resolved(gpu, key)[0] is not None

    def steady_between(self, gpu: int, key: str, start: float, end: float) -> bool:
        """Whether `key` on `gpu` is the same at every instant of [start, end] (a noiseless constant, a ramp outside
        its change, or the model's idle value): a window's mean of it is then one reading."""
        trajectory, _ = self._resolved(gpu, key)
        return trajectory is None or trajectory.steady_between(start, end)

    @functools.cached_property
    def lookups(self) -> dict[tuple[int, str], tuple[Trajectory | None, str]]:
        """(GPU, key) → what `_resolved` found. A cached property, not a pydantic private attribute: those are read
        through `BaseModel.__getattr__`, which cost more than the lookup saved. Not a field: not dumped or compared."""
        return {}


SCENARIO_PACKAGE = "gpuwarden.sim.scenarios"


def shipped_scenarios() -> dict[str, Path]:
    """Name → path of every scenario shipped in the package."""
    folder = resources.files(SCENARIO_PACKAGE)
    return {Path(p.name).stem: Path(str(p)) for p in folder.iterdir() if p.name.endswith(".yaml")}


def load_scenario(name_or_path: str) -> Scenario:
    """Load a shipped scenario by name or a YAML file by path; ConfigError (one line) when invalid."""
    shipped = shipped_scenarios()
    path = shipped.get(name_or_path) or Path(name_or_path)
    if not path.is_file():
        raise ConfigError(
            f"scenario '{name_or_path}': no such file or shipped scenario; shipped: {', '.join(sorted(shipped))}"
        )
    data = read_yaml(path, "scenario", "--nvml.scenario")
    try:
        return Scenario.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(describe_error(exc, f"scenario {path}", Scenario)) from None
