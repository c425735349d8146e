"""The GPUs the kernel driver lists in /proc/driver/nvidia/gpus: the identity of a GPU that NVML counts but cannot open.

A GPU that fell off the bus before the exporter started answers `nvmlDeviceGetHandleByIndex` with GPU_IS_LOST:
NVML gives no UUID for it. The kernel driver still lists it, one directory per PCI bus location, whose
`information` file names its UUID (read on an H200, driver 580.159.04, 2026-11-28; tests/data/driver_information.txt).
The GPUs discovery opened are matched by bus id; the rest are the ones it could not open, taken in bus order as
NVML enumerates them. Where the counts disagree (a GPU this container may not see, the directory not mounted) no
identity is guessed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.model.pci import normalise_bus_id

log = logging.getLogger(__name__)

DRIVER_PROC_ROOT = Path("/proc/driver/nvidia")


@dataclass(frozen=True)
class DriverGpu:
    """One GPU as the kernel driver lists it."""

    bus_id: str  # NVML's form: 00000000:18:00.0
    uuid: str
    model: str = ""


def parse_information(text: str) -> DriverGpu | None:
    """A GPU from its `information` file ("Key: <tabs> value" lines); None without a bus location and a UUID."""
    fields = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            fields[key.strip()] = value.strip()
    bus_id = normalise_bus_id(fields.get("Bus Location", ""))
    uuid = fields.get("GPU UUID", "")
    if bus_id is None or not uuid.startswith("GPU-"):
        return None
    return DriverGpu(bus_id=bus_id, uuid=uuid, model=fields.get("Model", ""))


def read_driver_gpus(root: Path = DRIVER_PROC_ROOT) -> list[DriverGpu]:
    """The driver's GPUs in bus order; empty where the directory is missing or unreadable (one debug line)."""
    gpus = []
    try:
        entries = sorted((root / "gpus").iterdir())
    except OSError as exc:
        log.debug("no driver GPU list at %s: %s", root / "gpus", exc)
        return []
    for entry in entries:
        try:
            gpu = parse_information((entry / "information").read_text(errors="replace"))
        except OSError:
            continue
        if gpu is not None:
            gpus.append(gpu)
    return sorted(gpus, key=lambda gpu: gpu.bus_id)


def identify_unopened(unopened: list[int], opened_bus_ids: set[str], driver: list[DriverGpu]) -> dict[int, DriverGpu]:
    """The driver's identity of each GPU index discovery could not open: the driver's GPUs that no opened GPU
    matches, in bus order, one for one with the indexes in order; nothing where the counts differ."""
    opened = {normalise_bus_id(bus) for bus in opened_bus_ids}
    rest = [gpu for gpu in driver if gpu.bus_id not in opened]
    if not unopened or len(rest) != len(unopened):
        return {}
    return dict(zip(sorted(unopened), rest, strict=True))
