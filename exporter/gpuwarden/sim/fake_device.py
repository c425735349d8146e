"""Identity, PCI, MIG, processes, modes and fan: the symbols discovery and the slow tier use."""

from __future__ import annotations

import hashlib
from typing import Any

import pynvml

from gpuwarden.nvml.driver_gpus import DriverGpu
from gpuwarden.sim.fakecommon import (
    _HANDLE_BASE,
    OK,
    SimulatedMemoryCorruption,
    _out,
    _pointer_value,
    _set_pointer,
    _val,
)
from gpuwarden.sim.scenario import ProcessSpec, Scenario

_GIB = 1024**3


def node_identity(scenario: Scenario) -> str:
    """What a simulated node's UUIDs are derived from: `node.identity`, else the scenario's name."""
    return scenario.node.identity or scenario.name


def gpu_uuid(scenario: Scenario, index: int) -> str:
    """The UUID GPU `index` of this scenario's node has at every start."""
    digest = hashlib.blake2b(f"{node_identity(scenario)}:{index}".encode(), digest_size=16).hexdigest()
    return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"


class DeviceSymbols:
    """Mixed into FakeNvmlLibrary, whose state (scenario, clock, faults) these symbols read."""

    @property
    def identity(self) -> str:
        return node_identity(self.scenario)

    def uuid(self, index: int) -> str:
        return gpu_uuid(self.scenario, index)

    def bus_id(self, index: int) -> str:
        return f"00000000:{0x18 + index * 0x10:02X}:00.0"

    def driver_gpus(self) -> list[DriverGpu]:
        """/proc/driver/nvidia/gpus of this node: the kernel driver lists every GPU, a lost one included (it
        has no answer for a node whose driver is not loaded; NVML's init is not needed: the exporter's kernel-log
        reader asks before it)."""
        if self._global_error(initialising=True) is not None or not self.scenario.driver.lists_gpus:
            return []
        return [DriverGpu(self.bus_id(i), self.uuid(i), self.model.name) for i in range(self.count)]

    def _string(self, handle: Any, buf: Any, text: str, symbol: str) -> int:
        _, code = self._device(handle, symbol)
        if code == OK:
            buf.value = text.encode()
        return code

    def nvmlDeviceGetName(self, handle: Any, buf: Any, size: Any) -> int:
        return self._string(handle, buf, self.model.name, "nvmlDeviceGetName")

    def nvmlDeviceGetUUID(self, handle: Any, buf: Any, size: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetUUID")
        if code == OK:
            slot = (_pointer_value(handle) - _HANDLE_BASE) % 0x100 - 1  # MIG handles sit after their parent's
            buf.value = (self.uuid(index) if slot < 0 else self.mig_uuid(index, slot)).encode()
        return code

    def nvmlDeviceGetSerial(self, handle: Any, buf: Any, size: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetSerial")
        if code == OK:
            buf.value = str(self.model.serial_base + index).encode()
        return code

    def nvmlDeviceGetVbiosVersion(self, handle: Any, buf: Any, size: Any) -> int:
        return self._string(handle, buf, self.model.vbios, "nvmlDeviceGetVbiosVersion")

    def nvmlDeviceGetPciInfo_v3(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetPciInfo_v3")
        if code == OK:
            info = _out(ref)
            bus = self.bus_id(index)
            info.busId = bus.encode()
            info.busIdLegacy = bus[4:].encode()
            info.domain, info.bus, info.device = 0, 0x18 + index * 0x10, 0
            info.pciDeviceId = 0x233010DE
        return code

    def nvmlDeviceGetCudaComputeCapability(self, handle: Any, major: Any, minor: Any) -> int:
        _, code = self._device(handle, "nvmlDeviceGetCudaComputeCapability")
        if code == OK:
            _out(major).value, _out(minor).value = self.model.compute_capability
        return code

    def nvmlDeviceGetPersistenceMode(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetPersistenceMode", lambda i: self._value(i, "persistence_mode"))

    def nvmlDeviceGetComputeMode(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetComputeMode", lambda i: 0)

    def nvmlDeviceGetMigMode(self, handle: Any, current: Any, pending: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetMigMode")
        if code == OK:
            mode = 1 if index in self.scenario.node.mig_instances else 0
            _out(current).value, _out(pending).value = mode, mode
        return code

    def nvmlDeviceGetMaxMigDeviceCount(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle, ref, "nvmlDeviceGetMaxMigDeviceCount", lambda i: 7 if i in self.scenario.node.mig_instances else 0
        )

    def nvmlDeviceGetMigDeviceHandleByIndex(self, handle: Any, slot: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetMigDeviceHandleByIndex")
        if code != OK:
            return code
        if _val(slot) >= self.scenario.node.mig_instances.get(index, 0):
            return pynvml.NVML_ERROR_NOT_FOUND  # an empty slot, as the driver answers
        _set_pointer(ref, _HANDLE_BASE + index * 0x100 + 1 + _val(slot))
        return OK

    def nvmlDeviceGetGpuInstanceId(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetGpuInstanceId")
        if code != OK:
            return code
        slot = mig_slot_of(handle)
        if slot is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT  # a whole GPU is not a GPU instance
        _out(ref).value = mig_gpu_instance_id(slot)
        return OK

    def nvmlDeviceGetMinorNumber(self, handle: Any, ref: Any) -> int:
        """/dev/nvidia<minor>: the number NVIDIA's DRA driver names a GPU by (gpu-<minor>)."""
        return self._uint(handle, ref, "nvmlDeviceGetMinorNumber", lambda i: i)

    def nvmlDeviceGetGpuInstanceById(self, handle: Any, gi_id: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetGpuInstanceById")
        if code != OK:
            return code
        if (_pointer_value(handle) - _HANDLE_BASE) % 0x100:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT  # a MIG handle is not a parent GPU
        slots = range(self.scenario.node.mig_instances.get(index, 0))
        slot = next((s for s in slots if mig_gpu_instance_id(s) == _val(gi_id)), None)
        if slot is None:
            return pynvml.NVML_ERROR_NOT_FOUND
        _set_pointer(ref, _GI_HANDLE_BASE + index * 0x100 + slot)
        return OK

    def nvmlGpuInstanceGetInfo(self, gi: Any, ref: Any) -> int:
        """A 1g.10gb slice (H100 GPU instance profile ID 19) placed at its slot, as the real driver fills it."""
        value = _pointer_value(gi) - _GI_HANDLE_BASE
        index, slot = divmod(value, 0x100)
        if value < 0 or index >= self.count or slot >= self.scenario.node.mig_instances.get(index, 0):
            raise SimulatedMemoryCorruption(f"nvmlGpuInstanceGetInfo on {hex(_pointer_value(gi))}: not a GPU instance")
        info = _out(ref)
        info.id = mig_gpu_instance_id(slot)
        info.profileId = MIG_1G_PROFILE_ID
        info.placement.start = slot
        info.placement.size = 1
        return OK

    def nvmlDeviceGetGpuInstanceProfileInfoByIdV(self, handle: Any, profile_id: Any, ref: Any) -> int:
        """The 1g.10gb profile of an H100 80GB, as the driver fills the v2 structure; refused, as nvml.h says, when
        the caller left its version unset, and loudly when the structure is passed by value."""
        if not hasattr(ref, "_obj"):
            raise SimulatedMemoryCorruption("nvmlDeviceGetGpuInstanceProfileInfoByIdV: the structure passed by value")
        index, code = self._device(handle, "nvmlDeviceGetGpuInstanceProfileInfoByIdV")
        if code != OK:
            return code
        if mig_slot_of(handle) is not None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT  # a MIG handle is not a parent GPU
        info = _out(ref)
        if info.version != pynvml.nvmlGpuInstanceProfileInfo_v2:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        if index not in self.scenario.node.mig_instances:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        if _val(profile_id) != MIG_1G_PROFILE_ID:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        info.id, info.sliceCount, info.instanceCount, info.multiprocessorCount = MIG_1G_PROFILE_ID, 1, 7, 16
        info.memorySizeMB, info.name = MIG_1G_MEMORY_MIB, b"MIG 1g.10gb"
        return OK

    def nvmlDeviceGetGpuFabricInfoV(self, handle: Any, ref: Any) -> int:
        """The NVSwitch fabric's state for the GPU, as an H200 HGX node answers it once Fabric Manager has set it
        up (state 3 completed, status success, clique 0, health mask all false, summary healthy); state 0 (not
        supported) on a node without NVSwitch. The structure must be passed by pointer (by value, the real library
        crashed the process on a lent H200) with version v3 or v2."""
        if not hasattr(ref, "_obj"):
            raise SimulatedMemoryCorruption("nvmlDeviceGetGpuFabricInfoV: the structure passed by value, not a pointer")
        index, code = self._device(handle, "nvmlDeviceGetGpuFabricInfoV")
        if code != OK:
            return code
        info = _out(ref)
        if info.version not in (pynvml.nvmlGpuFabricInfo_v3, pynvml.nvmlGpuFabricInfo_v2):
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        v3 = info.version == pynvml.nvmlGpuFabricInfo_v3
        if self.scenario.node.nvlink != "nvswitch":
            info.state, info.status, info.healthMask = pynvml.NVML_GPU_FABRIC_STATE_NOT_SUPPORTED, OK, 0
            if v3:
                info.healthSummary = pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED
            return OK
        state, degraded, unhealthy = pynvml.NVML_GPU_FABRIC_STATE_COMPLETED, False, False
        if self._active("fabric_not_started", index):
            state = pynvml.NVML_GPU_FABRIC_STATE_NOT_STARTED
        elif self._active("fabric_in_progress", index):
            state = pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS
        degraded, unhealthy = (
            bool(self._active("fabric_degraded", index)),
            bool(self._active("fabric_unhealthy", index)),
        )
        info.state = state
        info.status = OK if state == pynvml.NVML_GPU_FABRIC_STATE_COMPLETED else pynvml.NVML_ERROR_NOT_READY
        info.cliqueId = 0
        digest = hashlib.blake2b(f"{self.identity}:fabric".encode(), digest_size=16).digest()
        for position, byte in enumerate(digest):
            info.clusterUuid[position] = byte
        flag = {True: 1, False: 2}  # the mask's two-bit fields: 1 true, 2 false (0: not supported)
        info.healthMask = (
            flag[degraded] << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW
            | flag[False] << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY
            | flag[unhealthy] << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY
            | flag[False] << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY
            | pynvml.NVML_GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE
            << pynvml.NVML_GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION
        )
        if v3:
            summary = pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
            if unhealthy:
                summary = pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY
            elif degraded:
                summary = pynvml.NVML_GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
            info.healthSummary = summary
        return OK

    def mig_uuid(self, index: int, slot: int) -> str:
        digest = hashlib.blake2b(f"{self.identity}:{index}:mig{slot}".encode(), digest_size=16).hexdigest()
        return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def running(self, index: int, kind: str | None = None) -> list[tuple[int, ProcessSpec]]:
        """(pid, spec) of the scenario's processes alive on the GPU now."""
        t = self.now()
        alive = []
        for spec in self.scenario.processes:
            if spec.gpu != index or (kind is not None and spec.kind != kind):
                continue
            pid = spec.alive(t)
            if pid is not None:
                alive.append((pid, spec))
        return alive

    def process_memory(self, spec: ProcessSpec) -> int:
        return int(max(spec.memory_gib.at(self.now(), f"{self.scenario.name}:pid{spec.pid}:memory"), 0.0) * _GIB)

    def _processes(self, handle: Any, count: Any, infos: Any, symbol: str, kind: str = "compute") -> int:
        index, code = self._device(handle, symbol)
        if code != OK:
            return code
        listed = any(spec.gpu == index for spec in self.scenario.processes)
        if listed:
            rows = [(pid, self.process_memory(spec), spec.gpu_instance) for pid, spec in self.running(index, kind)]
        elif kind == "compute":
            n = max(int(round(self._value(index, "processes"))), 0)
            used = self._memory(index)[2]
            rows = [(4000 + index * 100 + slot, used // max(n, 1), None) for slot in range(n)]
        else:
            rows = []
        if infos is None:
            _out(count).value = len(rows)
            return OK if not rows else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        if _out(count).value < len(rows):
            _out(count).value = len(rows)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        for slot, (pid, memory, gpu_instance) in enumerate(rows):
            infos[slot].pid = pid
            infos[slot].usedGpuMemory = memory
            if hasattr(infos[slot], "gpuInstanceId"):
                infos[slot].gpuInstanceId = 0xFFFFFFFF if gpu_instance is None else gpu_instance
                infos[slot].computeInstanceId = 0xFFFFFFFF if gpu_instance is None else 0
        _out(count).value = len(rows)
        return OK

    def nvmlDeviceGetGraphicsRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes(handle, count, infos, "nvmlDeviceGetGraphicsRunningProcesses_v3", "graphics")

    def nvmlDeviceGetProcessesUtilizationInfo(self, handle: Any, ref: Any) -> int:
        """One sample per process alive now, stamped now (µs); NOT_FOUND when nothing is newer than lastSeen."""
        index, code = self._device(handle, "nvmlDeviceGetProcessesUtilizationInfo")
        if code != OK:
            return code
        info = _out(ref)
        if info.version != pynvml.ProcessesUtilizationInfo_v1:
            return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        stamp = int(self.now() * 1e6) + 1
        rows = [] if info.lastSeenTimeStamp >= stamp else self.running(index)
        if not rows:
            return pynvml.NVML_ERROR_NOT_FOUND
        if not info.procUtilArray or info.processSamplesCount < len(rows):
            info.processSamplesCount = len(rows)
            return pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        t = self.now()
        for slot, (pid, spec) in enumerate(rows):
            sample = info.procUtilArray[slot]
            sample.pid, sample.timeStamp = pid, stamp
            sample.smUtil = int(min(max(spec.sm.at(t, f"{self.scenario.name}:pid{spec.pid}:sm"), 0), 100))
            sample.memUtil = int(
                min(max(spec.memory_activity.at(t, f"{self.scenario.name}:pid{spec.pid}:mem"), 0), 100)
            )
        info.processSamplesCount = len(rows)
        return OK

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes(handle, count, infos, "nvmlDeviceGetComputeRunningProcesses_v3")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes(handle, count, infos, "nvmlDeviceGetComputeRunningProcesses_v2")

    def nvmlDeviceGetFanSpeed(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetFanSpeed", lambda i: self._value(i, "fan_percent"))

    def nvmlDeviceGetMaxPcieLinkGeneration(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetMaxPcieLinkGeneration", lambda i: self.model.pcie_max[0])

    def nvmlDeviceGetMaxPcieLinkWidth(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetMaxPcieLinkWidth", lambda i: self.model.pcie_max[1])

    def nvmlDeviceGetCurrPcieLinkGeneration(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetCurrPcieLinkGeneration", lambda i: self._value(i, "pcie_gen"))

    def nvmlDeviceGetCurrPcieLinkWidth(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetCurrPcieLinkWidth", lambda i: self._value(i, "pcie_width"))

    def nvmlDeviceGetPcieReplayCounter(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetPcieReplayCounter", lambda i: self._events("pcie_replay", i))


_GI_HANDLE_BASE = 0x7F0000A00000  # GPU instance handles: apart from device handles, so a mix-up fails loudly
MIG_1G_PROFILE_ID = 19  # nvidia-smi mig -lgip: 1g.10gb on H100 80GB
MIG_1G_MEMORY_MIB = 9984  # its memory (nvmlGpuInstanceProfileInfo_v2.memorySizeMB; nvidia-smi: 9.75 GiB)


def mig_slot_of(handle: Any) -> int | None:
    """The MIG slot a device handle names, or None for a whole GPU's handle."""
    slot = (_pointer_value(handle) - _HANDLE_BASE) % 0x100 - 1
    return None if slot < 0 else slot


def mig_gpu_instance_id(slot: int) -> int:
    """GPU instance IDs as an H100 with seven 1g slices numbers them (7-13): not the slot index."""
    return 7 + slot
