"""Static identity: name, serial, PCI bus id, VBIOS, compute capability (read at discovery)."""

from __future__ import annotations

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.readers import Reader
from exporter.snapshot import SampleWriter, Tier


def _text(value: object) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    name = _text(dev.call(pynvml.nvmlDeviceGetName))
    serial = _text(dev.call(pynvml.nvmlDeviceGetSerial))
    pci = dev.call(pynvml.nvmlDeviceGetPciInfo_v3)
    bus_id = _text(pci.busId) if pci is not None else ""
    vbios = _text(dev.call(pynvml.nvmlDeviceGetVbiosVersion))
    capability = dev.call(pynvml.nvmlDeviceGetCudaComputeCapability)
    cc = f"{capability[0]}.{capability[1]}" if capability else ""
    out.add("gpuwarden_gpu_info", 1, name, serial, bus_id, vbios, cc)
    out.info.update(name=name, serial=serial, pci_bus_id=bus_id, vbios_version=vbios, compute_capability=cc)


STATIC = Reader("identity", Tier.STATIC, ("gpuwarden_gpu_info",), read_static)
