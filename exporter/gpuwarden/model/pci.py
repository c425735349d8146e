"""One name for a GPU's PCI address, whoever wrote it: NVML's bus ID and the kernel log's differ in form."""

from __future__ import annotations


def pci_key(address: str) -> str:
    """'0000:3b:00' or '00000000:3B:00.0' → '0000:3b:00': domain, bus and device, as the kernel log names a GPU
    (no function) and NVML's bus ID does (eight-digit domain, upper case, with the function)."""
    parts = address.lower().split(":")
    if len(parts) != 3:
        return address.lower()
    domain, bus, device = parts
    try:
        return f"{int(domain, 16):04x}:{bus}:{device.split('.')[0]}"
    except ValueError:
        return address.lower()
