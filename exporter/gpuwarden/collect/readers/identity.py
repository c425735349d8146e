"""Static identity: name, serial, PCI bus id, VBIOS, compute capability, minor number (read at discovery)."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import GPU_INFO
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice


def _text(value: object) -> str:
    if value is None:
        return ""
    return value.decode() if isinstance(value, bytes) else str(value)


def read_static(dev: GpuDevice, out: SampleWriter) -> None:
    name = _text(dev.call(nvml.nvmlDeviceGetName))
    serial = _text(dev.call(nvml.nvmlDeviceGetSerial))
    pci = dev.call(nvml.nvmlDeviceGetPciInfo_v3)
    bus_id = _text(pci.busId) if pci is not None else ""
    vbios = _text(dev.call(nvml.nvmlDeviceGetVbiosVersion))
    capability = dev.call(nvml.nvmlDeviceGetCudaComputeCapability)
    cc = f"{capability[0]}.{capability[1]}" if capability else ""
    out.add(GPU_INFO, 1, name, serial, bus_id, vbios, cc)
    minor = dev.call(nvml.nvmlDeviceGetMinorNumber)  # /dev/nvidia<minor>; NVIDIA's DRA driver says gpu-<minor>
    out.set_info(name=name, serial=serial, pci_bus_id=bus_id, vbios_version=vbios, compute_capability=cc)
    if minor is not None:
        out.set_info(minor_number=int(minor))


STATIC = Reader("identity", Tier.STATIC, (GPU_INFO,), read_static)
