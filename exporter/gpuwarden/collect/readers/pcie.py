"""PCIe link (max: static; current: slow), replay and byte counters (slow; fields 197/198, R555+).

Never nvmlDeviceGetPcieThroughput: it blocks ~21 ms per call while it counts.
"""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.collect.readers.gpm import serves_pcie_bytes
from gpuwarden.model.families import PCIE_BYTES_TOTAL, PCIE_LINK_GENERATION, PCIE_LINK_WIDTH, PCIE_REPLAY_ERRORS_TOTAL
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_BYTES = {nvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: "tx", nvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: "rx"}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    out.add(PCIE_LINK_GENERATION, dev.call(nvml.nvmlDeviceGetMaxPcieLinkGeneration), "max")
    out.add(PCIE_LINK_WIDTH, dev.call(nvml.nvmlDeviceGetMaxPcieLinkWidth), "max")


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    out.add(PCIE_LINK_GENERATION, dev.call(nvml.nvmlDeviceGetCurrPcieLinkGeneration), "current")
    out.add(PCIE_LINK_WIDTH, dev.call(nvml.nvmlDeviceGetCurrPcieLinkWidth), "current")
    out.add(PCIE_REPLAY_ERRORS_TOTAL, dev.call(nvml.nvmlDeviceGetPcieReplayCounter))
    if serves_pcie_bytes(dev):
        return  # GPM counts PCIe bytes on this GPU (readers/gpm.py says why)
    values = dev.fields(_BYTES)
    for field_id, direction in _BYTES.items():
        out.add(PCIE_BYTES_TOTAL, values.get((field_id, 0)), direction)


STATIC = Reader("pcie_max", Tier.STATIC, (PCIE_LINK_GENERATION, PCIE_LINK_WIDTH), read_static)
SLOW = Reader(
    "pcie",
    Tier.SLOW,
    (
        PCIE_LINK_GENERATION,
        PCIE_LINK_WIDTH,
        PCIE_REPLAY_ERRORS_TOTAL,
        PCIE_BYTES_TOTAL,
    ),
    read_slow,
)
