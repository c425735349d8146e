"""MIG instances of each MIG-enabled GPU (slow tier): their UUIDs, so that pod attribution can map a container
holding a MIG slice (device plugin ID `MIG-…`) to its parent GPU. Instances are created and destroyed at run time,
hence the slow tier rather than discovery. Their GPU instance IDs let the GPM reader sample each slice; their
profile and placement let DRA allocations (which name slices, never UUIDs) find them."""

from __future__ import annotations

from gpuwarden.collect.readers import Reader
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice


def _placement(dev: GpuDevice, gpu_instance: int, slot: int) -> tuple[int, int] | None:
    """(GPU instance profile ID, placement start) of one slice: with the parent's minor number, the name NVIDIA's
    DRA driver gives it (gpu-<minor>-mig-<profile>-<profile ID>-<placement start>)."""
    handle = dev.call(nvml.nvmlDeviceGetGpuInstanceById, gpu_instance, key=f"mig_gi_handle_{slot}")
    info = None if handle is None else dev.call(nvml.nvmlGpuInstanceGetInfo, on=handle, key=f"mig_gi_info_{slot}")
    return None if info is None else (int(info.profileId), int(info.placement.start))


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    mode = dev.call(nvml.nvmlDeviceGetMigMode)
    if not mode or not mode[0]:
        dev.state["mig_instances"] = ()
        return
    slots = dev.call(nvml.nvmlDeviceGetMaxMigDeviceCount) or 0
    uuids = []
    instances = []
    placements: list[tuple[str, int, int]] = []
    for slot in range(slots):
        # An empty slot answers NOT_FOUND (no data: None); a slot destroyed meanwhile, likewise.
        handle = dev.call(nvml.nvmlDeviceGetMigDeviceHandleByIndex, slot, key=f"mig_slot_{slot}")
        uuid = None if handle is None else dev.call(nvml.nvmlDeviceGetUUID, on=handle, key=f"mig_uuid_{slot}")
        if uuid is None:
            continue
        text = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
        uuids.append(text)
        gpu_instance = dev.call(nvml.nvmlDeviceGetGpuInstanceId, on=handle, key=f"mig_gi_{slot}")
        if gpu_instance is not None:
            instances.append((int(gpu_instance), text))
            placement = _placement(dev, int(gpu_instance), slot)
            if placement is not None:
                placements.append((text, *placement))
    out.set_info(mig_uuids=tuple(uuids), mig_placements=tuple(placements))
    # For the GPM reader (fast tier, another thread): one tuple, replaced whole, read whole.
    dev.state["mig_instances"] = tuple(instances)


SLOW = Reader("mig", Tier.SLOW, (), read_slow)
