"""MIG instances of each MIG-enabled GPU (slow tier): their UUIDs, GPU instance IDs, profiles and placement.

MIG instances of each MIG-enabled GPU (slow tier): their UUIDs, so that pod attribution can map a container
holding a MIG slice (device plugin ID `MIG-…`) to its parent GPU. Instances are created and destroyed at run time,
hence the slow tier rather than discovery. Their GPU instance IDs let the GPM reader sample each slice; their
profile and placement let DRA allocations (which name slices, never UUIDs) find them, and name the slice's profile
(gpuwarden_mig_instance_info). Each slice's memory is read in the fast tier (`FAST`): a slice runs out of memory at
its own total, and the GPU's memory says nothing about which slice is full."""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import MIG_INSTANCE_INFO, MIG_MEMORY_TOTAL_BYTES, MIG_MEMORY_USED_BYTES
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice


def _placement(dev: GpuDevice, gpu_instance: int, slot: int) -> tuple[int, int] | None:
    """(GPU instance profile ID, placement start) of one slice: with the parent's minor number, the name NVIDIA's
    DRA driver gives it (gpu-<minor>-mig-<profile>-<profile ID>-<placement start>)."""
    handle = dev.call(nvml.nvmlDeviceGetGpuInstanceById, gpu_instance, key=f"mig_gi_handle_{slot}")
    info = None if handle is None else dev.call(nvml.nvmlGpuInstanceGetInfo, on=handle, key=f"mig_gi_info_{slot}")
    return None if info is None else (int(info.profileId), int(info.placement.start))


def _profile_name(dev: GpuDevice, profile_id: int) -> str:
    """The profile as nvidia-smi names it ("MIG 1g.10gb" → 1g.10gb), asked once per profile ID and GPU."""
    names: dict[int, str] = dev.state.setdefault("mig_profile_names", {})
    if profile_id not in names:
        info = dev.call(nvml.nvmlDeviceGetGpuInstanceProfileInfoById, profile_id, key="mig_profile_info")
        if info is None:
            return "unknown"  # not kept: a passing error is asked again next cycle, an unsupported call is not
        raw = info.name
        name = (raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)).strip()
        names[profile_id] = name.removeprefix("MIG ") or "unknown"
    return names[profile_id]


def read_slow(dev: GpuDevice, out: SampleWriter) -> None:
    mode = dev.call(nvml.nvmlDeviceGetMigMode)
    if not mode or not mode[0]:
        dev.state["mig_instances"] = ()
        dev.state["mig_slots"] = ()
        return
    slots = dev.call(nvml.nvmlDeviceGetMaxMigDeviceCount) or 0
    uuids = []
    instances = []
    placements: list[tuple[str, int, int]] = []
    slots_read: list[tuple[int, int, str]] = []  # (slot, GPU instance, MIG UUID) for the fast tier's memory reads
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
            slots_read.append((slot, int(gpu_instance), text))
            placement = _placement(dev, int(gpu_instance), slot)
            if placement is not None:
                placements.append((text, *placement))
                profile_id = placement[0]
                out.add(MIG_INSTANCE_INFO, 1, str(gpu_instance), text, _profile_name(dev, profile_id), str(profile_id))
    out.set_info(mig_uuids=tuple(uuids), mig_placements=tuple(placements))
    # For the GPM and memory readers (fast tier, another thread): tuples, replaced whole, read whole.
    dev.state["mig_instances"] = tuple(instances)
    dev.state["mig_slots"] = tuple(slots_read)


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    """Each slice's memory through its MIG device handle, asked again each poll (a slice destroyed since the slow
    tier last looked answers not_found, never a stale handle)."""
    for slot, gpu_instance, mig_uuid in dev.state.get("mig_slots", ()):
        handle = dev.call(nvml.nvmlDeviceGetMigDeviceHandleByIndex, slot, key=f"mig_slot_{slot}")
        memory = None if handle is None else dev.call(nvml.nvmlDeviceGetMemoryInfo, on=handle, key=f"mig_memory_{slot}")
        if memory is None:
            continue
        out.add(MIG_MEMORY_USED_BYTES, int(memory.used), str(gpu_instance), mig_uuid)
        out.add(MIG_MEMORY_TOTAL_BYTES, int(memory.total), str(gpu_instance), mig_uuid)


SLOW = Reader("mig", Tier.SLOW, (MIG_INSTANCE_INFO,), read_slow)
FAST = Reader("mig_memory", Tier.FAST, (MIG_MEMORY_USED_BYTES, MIG_MEMORY_TOTAL_BYTES), read_fast)
