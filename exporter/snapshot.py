"""Immutable snapshots: what the poller publishes and everything downstream (render, JSON, readiness) reads.

A snapshot is never modified after publication, so HTTP handlers read it without locks.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from exporter.metrics import FAMILIES
from exporter.podresources import Allocation


class Tier(enum.Enum):
    STATIC = "static"
    FAST = "fast"
    SLOW = "slow"


@dataclass(frozen=True, slots=True)
class Sample:
    name: str
    labels: tuple[str, ...]  # values for the family's labels beyond gpu/uuid, in contract order
    value: float


class SampleWriter:
    """What a reader writes into: samples for the contract's families, plus JSON-only facts."""

    def __init__(self) -> None:
        self.samples: list[Sample] = []
        self.info: dict[str, Any] = {}

    def add(self, name: str, value: float | None, *labels: str) -> None:
        if value is None:
            return
        family = FAMILIES[name]  # KeyError here means a reader emits a name outside the contract
        if len(labels) != len(family.labels):
            raise ValueError(f"{name} takes labels {family.labels}, got {labels}")
        self.samples.append(Sample(name, labels, float(value)))


@dataclass(frozen=True)
class TierReading:
    """One tier's result for one GPU."""

    samples: tuple[Sample, ...]
    info: dict[str, Any]
    finished_at: float


@dataclass(frozen=True)
class GpuSnapshot:
    index: int
    uuid: str
    up: bool
    stale: bool
    lost_reason: str | None
    hardware_error: str | None
    info: dict[str, Any]
    samples: tuple[Sample, ...]
    updated_at: dict[str, float]  # tier name → unix time of its last successful read


@dataclass(frozen=True)
class PeerLink:
    peer_index: int
    peer_uuid: str
    level: str  # NV18, PIX, PXB, PHB, NODE, SYS
    nvlinks: int


@dataclass(frozen=True)
class Snapshot:
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
    health: dict[str, tuple[Any, ...]] = field(default_factory=dict)  # uuid → health Verdicts
    pods_state: str = "disabled"  # pod attribution: disabled | starting | ok | no_socket | error
    pods: dict[str, tuple[Allocation, ...]] = field(default_factory=dict)  # uuid → containers holding it
    pods_unmatched: int = 0

    def gpu(self, key: str) -> GpuSnapshot | None:
        """Find a GPU by index ("0") or UUID."""
        for gpu in self.gpus:
            if key == gpu.uuid or (key.isdigit() and int(key) == gpu.index):
                return gpu
        return None


EMPTY = Snapshot(id=0, taken_at=0.0, nvml_up=False, nvml_error="starting", driver={}, gpus=())
