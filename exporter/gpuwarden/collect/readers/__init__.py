"""Readers: one module per domain. Each declares its tier, the NVML calls it makes and the families it writes.

Adding a metric means touching one reader and the contract in exporter/gpuwarden/model/families.py.
"""

from __future__ import annotations

from gpuwarden.collect.reader import Reader


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
