"""PCIe link (max: static; current: slow), replay and byte counters (slow; fields 197/198, R555+).

Never nvmlDeviceGetPcieThroughput: it blocks ~21 ms per call while it counts.
"""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier

_BYTES = {pynvml.NVML_FI_DEV_PCIE_COUNT_TX_BYTES: "tx", pynvml.NVML_FI_DEV_PCIE_COUNT_RX_BYTES: "rx"}


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    out.add("gpuwarden_pcie_link_generation", dev.call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration), "max")
    out.add("gpuwarden_pcie_link_width", dev.call(pynvml.nvmlDeviceGetMaxPcieLinkWidth), "max")


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    out.add("gpuwarden_pcie_link_generation", dev.call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration), "current")
    out.add("gpuwarden_pcie_link_width", dev.call(pynvml.nvmlDeviceGetCurrPcieLinkWidth), "current")
    out.add("gpuwarden_pcie_replay_errors_total", dev.call(pynvml.nvmlDeviceGetPcieReplayCounter))
    values = dev.fields(_BYTES)
    for field_id, direction in _BYTES.items():
        out.add("gpuwarden_pcie_bytes_total", values.get((field_id, 0)), direction)


STATIC = Reader("pcie_max", Tier.STATIC, ("gpuwarden_pcie_link_generation", "gpuwarden_pcie_link_width"), read_static)
SLOW = Reader(
    "pcie",
    Tier.SLOW,
    (
        "gpuwarden_pcie_link_generation",
        "gpuwarden_pcie_link_width",
        "gpuwarden_pcie_replay_errors_total",
        "gpuwarden_pcie_bytes_total",
    ),
    read_slow,
)
