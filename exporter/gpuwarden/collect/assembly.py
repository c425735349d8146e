"""Snapshot assembly: the GPUs' readings merged into an immutable Snapshot, then enriched by an ordered list of
steps (topology matrix, health verdicts, pod allocations; later profiling or processes), each a small object that
reads the draft and fills in its own part. No step calls NVML.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from gpuwarden.attribution import podresources
from gpuwarden.collect import topology
from gpuwarden.collect.topology import PairFacts
from gpuwarden.health.checks import HealthEvaluator
from gpuwarden.model.families import GPU_INFO, NVLINK_UP
from gpuwarden.model.snapshot import (
    Allocation,
    ContainerUsage,
    GpuInfo,
    GpuSnapshot,
    HostEvidence,
    JobUsage,
    PeerLink,
    ProcessExit,
    ProcessView,
    Sample,
    Snapshot,
    Tier,
    TierReading,
    Verdict,
)


@dataclass(frozen=True, slots=True)
class GpuView:
    """What the lifecycle knows of one GPU at publication time (a copy, taken under its lock)."""

    index: int
    uuid: str
    up: bool
    stale: bool
    lost_reason: str | None
    hardware_error: str | None
    readings: dict[Tier, TierReading]


@dataclass
class Draft:
    """A snapshot being assembled: the steps fill in their fields, then it is frozen into a Snapshot."""

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
    # GPUs NVML counts that discovery could not open (index → lost, no_permission, timeout): missing from `gpus`
    gpus_skipped: dict[int, str] = field(default_factory=dict)


class EnrichmentStep(Protocol):
    def __call__(self, draft: Draft) -> None: ...


def gpu_snapshot(view: GpuView) -> GpuSnapshot:
    """Merge a GPU's tiers (static, fast, slow) into one frozen view; a lost GPU keeps only its identity."""
    samples: list[Sample] = []
    info: dict[str, Any] = {}
    updated: dict[str, float] = {}
    for tier in (Tier.STATIC, Tier.FAST, Tier.SLOW):
        reading = view.readings.get(tier)
        if reading is not None:
            samples.extend(reading.samples)
            info.update(reading.info)
            updated[tier.value] = reading.finished_at
    if not view.up:
        samples = [s for s in samples if s.name == GPU_INFO.name]
    return GpuSnapshot(
        index=view.index,
        uuid=view.uuid,
        up=view.up,
        stale=view.stale,
        lost_reason=view.lost_reason,
        hardware_error=view.hardware_error,
        info=GpuInfo(**info),
        samples=tuple(samples),
        updated_at=updated,
    )


class TopologyStep:
    """The NV#/PCIe matrix, rebuilt only when the GPU population, the pair facts or a link's state change."""

    def __init__(self, pairs: Callable[[], dict[tuple[str, str], PairFacts]]) -> None:
        self._pairs = pairs
        self._key: tuple[Any, ...] = ()
        self._matrix: dict[str, tuple[PeerLink, ...]] = {}

    def __call__(self, draft: Draft) -> None:
        up = [gpu for gpu in draft.gpus if gpu.up] if draft.nvml_up else []
        active: dict[str, set[int]] = {}
        for gpu in up:
            links = [s for s in gpu.samples if s.name == NVLINK_UP.name]
            if links:
                active[gpu.uuid] = {int(s.labels[0]) for s in links if s.value}
        pairs = self._pairs()
        key = (
            tuple((gpu.index, gpu.uuid, gpu.info.nvlink, gpu.info.pci_bus_id) for gpu in up),
            id(pairs),
            tuple(sorted((uuid, tuple(sorted(links))) for uuid, links in active.items())),
        )
        if key != self._key:
            self._key = key
            self._matrix = topology.build_matrix(up, pairs, active)
        draft.topology = self._matrix


class HealthStep:
    """Health verdicts from the exporter's own history (only while NVML is up)."""

    def __init__(self, evaluator: Callable[[], HealthEvaluator]) -> None:
        self._evaluator = evaluator

    def __call__(self, draft: Draft) -> None:
        if draft.nvml_up:
            draft.health = self._evaluator().evaluate(draft.gpus, draft.xid, draft.taken_at)


class PodsStep:
    """Which containers hold each GPU, from the kubelet's last answer (never fetched here)."""

    def __init__(self, attribution: Callable[[], podresources.PodAttribution | None]) -> None:
        self._attribution = attribution

    def __call__(self, draft: Draft) -> None:
        attribution = self._attribution()
        view = attribution.view if attribution is not None else podresources.DISABLED
        draft.pods_state = view.state
        gpus = [(g.index, g.uuid, g.info.mig_uuids or ()) for g in draft.gpus if g.up]
        aliases = podresources.dra_aliases(
            (g.uuid, g.info.minor_number, g.info.mig_placements or ()) for g in draft.gpus if g.up
        )
        draft.pods, draft.pods_unmatched = podresources.assign(view, gpus, aliases)
        draft.mig_pods = podresources.assign_mig(view, gpus, aliases)


class SnapshotAssembler:
    """Builds each snapshot from the GPUs' views and the node's state, through the steps in order."""

    def __init__(self, steps: Iterable[EnrichmentStep]) -> None:
        self.steps = list(steps)
        self._ids = itertools.count(1)

    def assemble(self, views: Iterable[GpuView], **node: Any) -> Snapshot:
        gpus = tuple(gpu_snapshot(view) for view in views) if node["nvml_up"] else ()
        draft = Draft(gpus=gpus, **node)
        for step in self.steps:
            step(draft)
        fields = {spec.name: getattr(draft, spec.name) for spec in dataclasses.fields(draft)}
        return Snapshot(id=next(self._ids), **fields)
