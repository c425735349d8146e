"""A snapshot being assembled, and the shape of the steps that fill it in.

The draft lives in model/ because every enrichment stage reads what an earlier one wrote (the host-evidence step
reads the health verdicts; process attribution reads the pods): a typed value that all of them import from below,
instead of each reading an untyped object handed down from collect/.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

from gpuwarden.model.snapshot import (
    Allocation,
    CollectiveFinding,
    ContainerUsage,
    Cotenant,
    GpuSnapshot,
    HostEvidence,
    JobMember,
    JobUsage,
    PeerLink,
    ProcessExit,
    ProcessView,
    Snapshot,
    Verdict,
)


@dataclass
class Draft:
    """A snapshot being assembled: collect/ fills in the readings, the steps their own fields, then it is frozen."""

    taken_at: float
    nvml_up: bool
    nvml_error: str | None
    driver: dict[str, str]
    gpus: tuple[GpuSnapshot, ...]
    xid: dict[tuple[str, int], tuple[int, float]]
    collect_errors: dict[tuple[str, str], int]
    collect_timeouts: dict[str, int]
    reinit_total: int
    tier_duration: dict[str, float]
    tier_finished: dict[str, float]
    topology: dict[str, tuple[PeerLink, ...]] = field(default_factory=dict)
    health: dict[str, tuple[Verdict, ...]] = field(default_factory=dict)
    pods_state: str = "disabled"
    pods: dict[str, tuple[Allocation, ...]] = field(default_factory=dict)
    pods_unmatched: int = 0
    mig_pods: dict[str, tuple[Allocation, ...]] = field(default_factory=dict)
    processes: dict[str, tuple[ProcessView, ...]] = field(default_factory=dict)
    containers: dict[str, tuple[ContainerUsage, ...]] = field(default_factory=dict)
    slurm_jobs: dict[str, tuple[JobUsage, ...]] = field(default_factory=dict)
    process_exits: tuple[ProcessExit, ...] = ()
    lost_holders: dict[str, tuple[ProcessView, ...]] = field(default_factory=dict)
    host_evidence: dict[str, HostEvidence] = field(default_factory=dict)
    pid_series: int = 0
    jobs: dict[str, JobMember] = field(default_factory=dict)
    job_sources: dict[str, bool] = field(default_factory=dict)
    collective_wait_seconds: dict[str, float] = field(default_factory=dict)
    collective: tuple[CollectiveFinding, ...] = ()
    cotenants: dict[str, tuple[Cotenant, ...]] = field(default_factory=dict)
    kernel: dict[tuple[str, str, int], tuple[int, float]] = field(default_factory=dict)
    kernel_log_up: bool | None = None  # the kernel log's reader reads now; None: no kernel log is read
    kernel_log_ignored: dict[str, int] = field(default_factory=dict)  # lines naming the driver not counted, by reason
    # GPUs NVML counts that discovery could not open (index → lost, no_permission, timeout): missing from `gpus`
    gpus_skipped: dict[int, str] = field(default_factory=dict)

    def freeze(self, snapshot_id: int) -> Snapshot:
        """The published snapshot: every field of the draft, never changed again."""
        fields = {spec.name: getattr(self, spec.name) for spec in dataclasses.fields(self)}
        return Snapshot(id=snapshot_id, **fields)


class EnrichmentStep(Protocol):
    """One stage after the readings: reads the draft, fills in its own fields, never calls NVML."""

    def __call__(self, draft: Draft) -> None: ...
