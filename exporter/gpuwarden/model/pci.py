"""One spelling of a PCI bus ID, whoever wrote it (NVML, the kernel driver's /proc, the kernel log).

One spelling of a PCI bus ID, whoever wrote it: NVML (00000000:18:00.0), the kernel driver's /proc (0000:18:00.0)
and the kernel log (0000:18:00, no function) name the same GPU differently."""

from __future__ import annotations

import re

_BUS_ID = re.compile(r"^(?:([0-9a-fA-F]{1,8}):)?([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.([0-7]))?$")


def normalise_bus_id(text: str) -> str | None:
    """NVML's form of a PCI bus ID (8-digit domain, upper case, function 0 where none is written); None where the
    text is not a bus ID."""
    match = _BUS_ID.match(text.strip())
    if match is None:
        return None
    domain, bus, device, function = match.groups()
    return f"{int(domain or '0', 16):08X}:{int(bus, 16):02X}:{int(device, 16):02X}.{function or '0'}"
