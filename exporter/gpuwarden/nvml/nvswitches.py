"""The host's NVSwitches by PCI address: the only switch addresses whose SXids count (collect/kernel_log.py).

NVML lists GPUs, not switches (the links of an NVSwitch-attached GPU name the switch FFFFFFFF:FF:FF.0: docs/nvml.md),
so the PCI bus says: an NVIDIA device (vendor 0x10de) of class 0x068000 (bridge, other) is an NVSwitch, as NCCL
tells them from GPUs. sysfs lists every PCI device of the host, in a container too; its root is a parameter (tests
name their own; the simulator answers for its baseboard through nvml.library).
"""

from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

SYSFS_PCI_DEVICES = Path("/sys/bus/pci/devices")
NVIDIA_VENDOR = "0x10de"
NVSWITCH_CLASS = "0x068000"


def read_nvswitches(root: Path = SYSFS_PCI_DEVICES) -> list[str]:
    """The NVSwitches' PCI addresses as sysfs names them (0000:86:00.0), sorted; empty where `root` cannot be read
    (one debug line)."""
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        log.debug("no PCI device list at %s: %s", root, exc)
        return []
    found = []
    for entry in entries:
        try:
            vendor = (entry / "vendor").read_text().strip()
            if vendor == NVIDIA_VENDOR and (entry / "class").read_text().strip() == NVSWITCH_CLASS:
                found.append(entry.name)
        except OSError:
            continue  # a device that went away while listed, or a stray entry
    return found
