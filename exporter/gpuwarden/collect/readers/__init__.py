"""Readers: one module per domain. Each declares its tier, the NVML calls it makes and the families it writes.

Adding a metric means touching one reader and the contract in exporter/gpuwarden/model/families.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuwarden.model.families import Family
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml.device import GpuDevice


@dataclass(frozen=True)
class Reader:
    """One reader: its name, tier, the families it fills and the function that reads a GPU."""

    name: str
    tier: Tier
    families: tuple[Family, ...]  # every family `read` may write (SampleWriter enforces it)
    read: Callable[[GpuDevice, SampleWriter], None]
    # A costly reader may run less often than its tier: the PollSettings field holding its interval. Between
    # runs the poller serves the reader's last samples (they are counters: nothing is lost, only delayed).
    every: str | None = None


def all_readers() -> list[Reader]:
    """Every reader, in the order their families appear in the exposition."""
    from gpuwarden.collect.readers import (
        clocks,
        ecc,
        fabric,
        gpm,
        identity,
        memory,
        mig,
        modes,
        nvlink,
        pcie,
        power,
        processes,
        thermal,
        utilization,
    )

    return [
        identity.STATIC,
        modes.STATIC,
        memory.STATIC,
        thermal.STATIC,
        power.STATIC,
        clocks.STATIC,
        pcie.STATIC,
        nvlink.STATIC,
        utilization.SAMPLES,
        utilization.FAST,
        utilization.VIDEO,
        memory.FAST,
        mig.FAST,
        thermal.FAST,
        power.FAST,
        clocks.FAST,
        ecc.FAST,
        modes.FAST,
        processes.FAST,
        gpm.FAST,
        clocks.SLOW,
        power.SLOW,
        ecc.SLOW,
        pcie.SLOW,
        nvlink.SLOW,
        nvlink.ERRORS,
        fabric.SLOW,
        modes.SLOW,
        mig.SLOW,
    ]
