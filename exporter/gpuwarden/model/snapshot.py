"""The snapshot contract: what the poller publishes and everything downstream reads, frozen.

The snapshot contract: what the poller publishes and everything downstream (render, JSON, readiness, health,
fleet) reads. Every type here is frozen: a snapshot is never modified after publication, so HTTP handlers read
it without locks. This module imports nothing of NVML, the pod-resources client or HTTP.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.model.families import Family


class Tier(enum.Enum):
    STATIC = "static"
    FAST = "fast"
    SLOW = "slow"


@dataclass(frozen=True, slots=True)
class Sample:
    """One series of a GPU: the family name, its extra label values and the value."""

    name: str
    labels: tuple[str, ...]  # values for the family's labels beyond gpu/uuid, in contract order
    value: float


@dataclass(frozen=True, slots=True)
class NvlinkFacts:
    """What discovery learns about a GPU's NVLinks: the topology matrix is built from these, not from NVML."""

    links: int = 0  # links the GPU has (field 91)
    remote_bus_ids: tuple[tuple[int, str], ...] = ()  # (link, remote PCI bus id, upper case)
    nvswitch_links: int = 0  # links connected to NVSwitch (field 147); 0 on direct-NVLink boards


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A process holding the GPU, as NVML reports it (host PID namespace)."""

    pid: int
    kind: str  # compute, graphics, or compute+graphics
    used_memory_bytes: int | None  # None where the driver cannot tell (e.g. MIG without instance permission)
    sm_ratio: float | None = None  # SM utilization over the last window, 0-1 (None: no sample)
    memory_ratio: float | None = None  # memory-bandwidth utilization over the last window, 0-1
    gpu_instance: int | None = None  # MIG GPU instance the process runs in


@dataclass(frozen=True, slots=True)
class GpuInfo:
    """Static and slowly changing facts about one GPU (the `info` of the JSON API; never a Prometheus label set),
    and the processes the fast tier last saw on it (served attributed, through Snapshot.processes).

    A field a reader did not set is None and left out of the JSON.
    """

    name: str | None = None
    serial: str | None = None
    pci_bus_id: str | None = None
    vbios_version: str | None = None
    compute_capability: str | None = None
    memory_total_bytes: int | None = None
    memory_used_includes_reserved: bool | None = None  # True when memory v1 answered ("used" counts the reserve)
    compute_mode: str | None = None
    nvlink_links: int | None = None
    mig_uuids: tuple[str, ...] | None = None  # MIG instances of a MIG-enabled GPU
    fabric: dict[str, Any] | None = None  # NVSwitch fabric state, status, clique, health (readers/fabric.py)
    minor_number: int | None = None  # /dev/nvidia<minor>: NVIDIA's DRA driver names the GPU gpu-<minor>
    # (MIG UUID, GPU instance profile ID, placement start) per slice: how DRA names it
    mig_placements: tuple[tuple[str, int, int], ...] | None = field(default=None, metadata={"json": False})
    nvlink: NvlinkFacts | None = field(default=None, metadata={"json": False})
    processes: tuple[GpuProcess, ...] | None = field(default=None, metadata={"json": False})
    processes_window_s: float | None = field(default=None, metadata={"json": False})  # seconds the ratios cover

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if value is None or not spec.metadata.get("json", True):
                continue
            out[spec.name] = list(value) if isinstance(value, tuple) else value
        return out


INFO_FIELDS = frozenset(spec.name for spec in dataclasses.fields(GpuInfo))


class SampleWriter:
    """What a reader writes into: samples of the families it declared, plus facts for `GpuInfo`.

    Writing a family the reader did not declare raises: the `metrics.include/exclude` filter decides which readers
    run from their declarations, so an undeclared family would be silently skipped or silently kept.
    """

    def __init__(self, declared: tuple[Family, ...] | None = None) -> None:
        self.samples: list[Sample] = []
        self.info: dict[str, Any] = {}
        self._declared = None if declared is None else frozenset(f.name for f in declared)

    def add(self, family: Family, value: float | None, *labels: str) -> None:
        if value is None:
            return
        if self._declared is not None and family.name not in self._declared:
            raise ValueError(f"{family.name} is written by a reader that does not declare it")
        if len(labels) != len(family.labels):
            raise ValueError(f"{family.name} takes labels {family.labels}, got {labels}")
        self.samples.append(Sample(family.name, labels, float(value)))

    def set_info(self, **facts: Any) -> None:
        unknown = set(facts) - INFO_FIELDS
        if unknown:
            raise ValueError(f"not GpuInfo fields: {sorted(unknown)}")
        self.info.update(facts)


@dataclass(frozen=True, slots=True)
class TierReading:
    """One tier's result for one GPU."""

    samples: tuple[Sample, ...]
    info: dict[str, Any]  # GpuInfo fields this tier set
    finished_at: float


@dataclass(frozen=True, slots=True)
class GpuSnapshot:
    """One GPU as of one publication: identity, state, samples and its static facts."""

    index: int
    uuid: str
    up: bool
    stale: bool
    lost_reason: str | None
    hardware_error: str | None
    info: GpuInfo
    samples: tuple[Sample, ...]
    updated_at: dict[str, float]  # tier name → unix time of its last successful read


@dataclass(frozen=True, slots=True)
class PeerLink:
    """How this GPU reaches one peer: the topology level and the NVLinks between them."""

    peer_index: int
    peer_uuid: str
    level: str  # NV18, PIX, PXB, PHB, NODE, SYS
    nvlinks: int


@dataclass(frozen=True, slots=True)
class Verdict:
    """One health check's judgement of one GPU."""

    check: str
    level: int  # 0 ok, 1 warning, 2 critical
    severity: str  # ok, info, pending, warning, critical (info and pending: worth showing, level stays 0)
    observed: str
    threshold: str
    since: float = 0.0  # unix time this non-ok level began (as this exporter saw it); 0 while ok
    detail: str = ""  # a check's class, where it has one (the bottleneck check: tensor_bound, waiting, ...)
    # pending (a condition that holds but has not been watched for its window, or readings not read yet): the level
    # the check turns into if the condition lasts; 0 otherwise. npd-plugin and slurm-healthcheck read it as unknown
    pending_level: int = 0


@dataclass(frozen=True, slots=True)
class HostEvidence:
    """What the host's /proc showed of a waiting GPU's main process (exporter/gpuwarden/jobs/activity.py): shares of
    the samples in which its main thread ran, a thread waited on I/O, a worker child ran, or nothing ran. Data only:
    what the shares say is read in exporter/gpuwarden/jobs/host_reading.py."""

    pid: int
    samples: int
    main_running: float
    io_wait: float
    workers_running: float
    asleep: float
    workers: int
    write_bytes_per_second: float | None = None  # to storage, over the samples (None: /proc/PID/io unreadable)


@dataclass(frozen=True, slots=True)
class Cotenant:
    """A process outside a GPU's job (not its rank, nor in its pod or Slurm job) that computed on the GPU within the
    job view's window (exporter/gpuwarden/jobs/sharing.py): its kernels take turns with the job's."""

    pid: int
    name: str
    sm_ratio: float  # the largest share of the GPU's SMs it used in one NVML sample over the window


@dataclass(frozen=True, slots=True)
class JobMember:
    """The job a GPU's main process belongs to, as the host shows it (exporter/gpuwarden/jobs/grouping.py): a key
    the same on every node where a launcher or Slurm set one (`local/...` where only this node's process tree or pod
    groups the GPUs), the rank where the launcher set it, and the job's GPUs on this node."""

    job: str
    rank: str  # "unknown" where the launcher sets ranks inside the program (torch.multiprocessing.spawn)
    world_size: int | None  # ranks in the whole job, where the launcher said
    source: str  # slurm, torchrun, rendezvous, process (one process, several GPUs), pod, tree
    pid: int
    local_gpus: tuple[str, ...]  # UUIDs of the job's GPUs on this node, this one included

    @property
    def peers(self) -> int:
        """Other ranks of the job: on this node, or on others where the world size says so."""
        return max(len(self.local_gpus), self.world_size or 0) - 1


@dataclass(frozen=True, slots=True)
class CollectiveFinding:
    """A job whose GPUs disagree (exporter/gpuwarden/jobs/collective.py): the GPU the others wait for and why,
    or a whole job stuck in a collective."""

    job: str
    kind: str  # straggler | collective_hang | waiting_elsewhere
    straggler: str | None  # UUID of the GPU the others wait for (None: a hang with no odd one out, or off-node)
    cause: str  # cpu | input | io | slower_gpu | unknown
    cause_detail: str  # the numbers behind the cause
    waiting: tuple[tuple[str, float], ...]  # (UUID, share of the window spent waiting), the waiters
    since: float


@dataclass(frozen=True, slots=True)
class Allocation:
    """One container holding one device, as the kubelet reports it (device_id is the plugin's ID)."""

    device_id: str
    namespace: str
    pod: str
    container: str


@dataclass(frozen=True, slots=True)
class ProcessView:
    """A process on a GPU with who holds it: the container found through its cgroup or the GPU's allocation."""

    pid: int
    name: str  # "" where the host's /proc is not visible
    kind: str
    used_memory_bytes: int | None
    memory_share: float | None  # of the GPU's total memory
    sm_ratio: float | None
    memory_ratio: float | None
    gpu_instance: int | None
    namespace: str  # "" when no pod is known
    pod: str
    container: str
    attributed_by: str  # cgroup, allocation, or "" (unattributed)
    slurm_job: str = ""  # the Slurm job whose step holds the process, from its cgroup ("" outside Slurm)
    slurm_user: str = ""


@dataclass(frozen=True, slots=True)
class ContainerUsage:
    """What one container's processes hold of one GPU; sm_seconds_total only grows while the container is seen."""

    namespace: str
    pod: str
    container: str
    used_memory_bytes: int
    sm_seconds_total: float
    processes: int


@dataclass(frozen=True, slots=True)
class JobUsage:
    """What one Slurm job's processes hold of one GPU (the per-container rows' counterpart outside Kubernetes)."""

    job: str
    user: str
    used_memory_bytes: int
    sm_seconds_total: float
    processes: int


@dataclass(frozen=True, slots=True)
class ProcessExit:
    """A process that left a GPU whose memory was near full at the read before: the out-of-memory pattern."""

    gpu: int
    uuid: str
    pid: int
    name: str
    namespace: str
    pod: str
    container: str
    used_memory_bytes: int | None
    gpu_memory_used_ratio: float
    at: float  # unix time the exit was seen


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything /metrics and the JSON API serve, as of one publication; never changed once published."""

    id: int
    taken_at: float
    nvml_up: bool
    nvml_error: str | None
    driver: dict[str, str]
    gpus: tuple[GpuSnapshot, ...]
    topology: dict[str, tuple[PeerLink, ...]] = field(default_factory=dict)  # uuid → peers
    xid: dict[tuple[str, int], tuple[int, float]] = field(default_factory=dict)  # (uuid, xid) → (n, last)
    collect_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    collect_timeouts: dict[str, int] = field(default_factory=dict)
    reinit_total: int = 0
    tier_duration: dict[str, float] = field(default_factory=dict)
    tier_finished: dict[str, float] = field(default_factory=dict)
    health: dict[str, tuple[Verdict, ...]] = field(default_factory=dict)  # uuid → verdicts
    pods_state: str = "disabled"  # pod attribution: disabled | starting | ok | no_socket | error
    pods: dict[str, tuple[Allocation, ...]] = field(default_factory=dict)  # uuid → containers holding it
    pods_unmatched: int = 0
    mig_pods: dict[str, tuple[Allocation, ...]] = field(default_factory=dict)  # uuid → containers per MIG slice
    processes: dict[str, tuple[ProcessView, ...]] = field(default_factory=dict)  # uuid → processes, by memory
    containers: dict[str, tuple[ContainerUsage, ...]] = field(default_factory=dict)  # uuid → per-container usage
    slurm_jobs: dict[str, tuple[JobUsage, ...]] = field(default_factory=dict)  # uuid → per-Slurm-job usage
    process_exits: tuple[ProcessExit, ...] = ()  # recent exits from near-full GPUs, oldest first
    # uuid → the processes last seen on a GPU that is now lost (NVML no longer lists them): whose job died with it
    lost_holders: dict[str, tuple[ProcessView, ...]] = field(default_factory=dict)
    # uuid → what the host shows of the main process of a GPU whose class is `waiting` (where /proc is mounted)
    host_evidence: dict[str, HostEvidence] = field(default_factory=dict)
    pid_series: int = 0  # per-PID series per GPU to render (0: off)
    jobs: dict[str, JobMember] = field(default_factory=dict)  # uuid → the job of its main process
    # source of job identity (cgroup, cmdline, environ, pod_api) → whether its last read worked (jobs/sources.py)
    job_sources: dict[str, bool] = field(default_factory=dict)
    # uuid → seconds its main process spent waiting in collectives (a counter; GPUs of multi-GPU jobs only)
    collective_wait_seconds: dict[str, float] = field(default_factory=dict)
    collective: tuple[CollectiveFinding, ...] = ()  # stragglers and hangs of this node's jobs
    # uuid → processes outside the GPU's job computing on it within the job view's window (a shared GPU)
    cotenants: dict[str, tuple[Cotenant, ...]] = field(default_factory=dict)
    # the kernel log's GPU faults since boot: (kind, device, code) → (count, wall time of the latest)
    kernel: dict[tuple[str, str, int], tuple[int, float]] = field(default_factory=dict)
    kernel_log_up: bool | None = None  # the kernel log's reader reads now; None: no kernel log is read
    kernel_log_ignored: dict[str, int] = field(default_factory=dict)  # lines naming the driver not counted, by reason
    # GPUs NVML counts that discovery could not open (index → gpu_is_lost, no_permission, timeout): not in `gpus`
    gpus_skipped: dict[int, str] = field(default_factory=dict)

    def gpu(self, key: str) -> GpuSnapshot | None:
        """Find a GPU by index ("0") or UUID."""
        for gpu in self.gpus:
            if key == gpu.uuid or (key.isdigit() and int(key) == gpu.index):
                return gpu
        return None


EMPTY = Snapshot(id=0, taken_at=0.0, nvml_up=False, nvml_error="starting", driver={}, gpus=())
