"""Snapshot assembly: the GPUs' readings merged into a draft, enriched by the steps handed in, then frozen.

Snapshot assembly: the GPUs' readings merged into a draft (model/draft.py), the topology matrix added, then the
enrichment steps the composition root hands in (health verdicts, pod allocations, processes, host evidence: see
gpuwarden/runtime/pipeline.py), in order, and the draft frozen into a Snapshot. collect/ knows none of those steps;
no step calls NVML.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gpuwarden.collect import topology
from gpuwarden.collect.topology import PairFacts
from gpuwarden.model.draft import Draft, EnrichmentStep
from gpuwarden.model.families import GPU_INFO, NVLINK_UP
from gpuwarden.model.snapshot import GpuInfo, GpuSnapshot, PeerLink, Sample, Snapshot, Tier, TierReading


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


class SnapshotAssembler:
    """Builds each snapshot from the GPUs' views and the node's state, through the steps in order."""

    def __init__(self, steps: Iterable[EnrichmentStep]) -> None:
        self.steps: tuple[EnrichmentStep, ...] = tuple(steps)  # swapped whole on reload, read once per snapshot
        self._ids = itertools.count(1)

    def assemble(self, views: Iterable[GpuView], **node: Any) -> Snapshot:
        gpus = tuple(gpu_snapshot(view) for view in views) if node["nvml_up"] else ()
        draft = Draft(gpus=gpus, **node)
        for step in self.steps:
            step(draft)
        return draft.freeze(next(self._ids))
