"""A fake libnvidia-ml: Python callables with the C symbols' names and signatures, driven by a scenario.

It is installed *beneath* pynvml (as `pynvml.nvmlLib`), so the exporter runs its production code path:
pynvml's own wrappers build the real structs, run the two-call size probes and raise the real exception
classes from the integer return codes returned here. Symbols listed in a scenario's `driver.missing_symbols`
(or not implemented here) make pynvml raise FunctionNotFound, as an old driver does.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pynvml

from exporter.sim.models import MODELS, GpuModel
from exporter.sim.scenario import ERROR_CODES, Fault, Scenario

SAMPLE_PERIOD_S = 0.2  # H100's measured utilization sample period
SAMPLE_BUFFER = 71  # samples the driver keeps (~14 s)
_HANDLE_BASE = 0x7F0000010000
_EVENT_SET_BASE = 0x7F0000900000
_EPOCH_US = 1_795_653_828_000_000  # sample timestamps look like the real driver's (µs)
_NVSWITCH_BUS = b"FFFFFFFF:FF:FF.0"

OK = pynvml.NVML_SUCCESS
_LEVELS = {
    "PIX": pynvml.NVML_TOPOLOGY_SINGLE,
    "PXB": pynvml.NVML_TOPOLOGY_MULTIPLE,
    "PHB": pynvml.NVML_TOPOLOGY_HOSTBRIDGE,
    "NODE": pynvml.NVML_TOPOLOGY_NODE,
    "SYS": pynvml.NVML_TOPOLOGY_SYSTEM,
}

# Throttle-time fields (ns) → the clock-event bits during which they count.
_THROTTLE_FIELD_BITS = {74: 0x4, 75: 0x60, 76: 0x10, 77: 0x0, 78: 0x1, 79: 0x0, 269: 0x20, 270: 0x40, 271: 0x80}
_NVLINK_CRC_DATA = [39, 40, 41, 42, 43, 44, 102, 103, 104, 105, 106, 107]
_NVLINK_ECC = list(range(148, 160))
_UINT, _ULL = pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG


class _Hang(Exception):
    pass


class _SymbolTable:
    """The object installed as pynvml.nvmlLib: only the C symbols, as attributes (looked up once; pynvml caches)."""

    def __init__(self, fake: FakeNvmlLibrary, symbols: dict[str, Callable[..., int]]) -> None:
        self._fake = fake
        self.__dict__.update(symbols)

    def __getattr__(self, name: str) -> Any:
        self._fake.missing_lookups[name] += 1  # what an old driver lacks: pynvml raises FunctionNotFound
        raise AttributeError(name)


def _out(ref: Any) -> Any:
    """The ctypes object behind a byref() argument."""
    return getattr(ref, "_obj", ref)


def _set_pointer(ref: Any, value: int) -> None:
    ctypes.c_void_p.from_buffer(_out(ref)).value = value


def _pointer_value(handle: Any) -> int:
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


def _val(arg: Any) -> Any:
    return arg.value if hasattr(arg, "value") else arg


class FakeNvmlLibrary:
    """A simulated GPU node; `.library` stands in for the CDLL object pynvml loads (see the module docstring)."""

    def __init__(self, scenario: Scenario, clock: Callable[[], float] | None = None) -> None:
        self.scenario = scenario
        self.model: GpuModel = MODELS[scenario.node.model]
        self.count = scenario.node.count
        self._clock = clock or time.monotonic
        self._start = self._clock()
        self._lock = threading.Lock()
        self._initialised = 0
        self._closing = threading.Event()
        self.calls: Counter[str] = Counter()  # every symbol looked up and called, for tests
        self._missing = set(scenario.driver.missing_symbols)
        self._integrated_to = 0.0
        self._energy_mj = [2_770_288.0 + 1000.0 * i for i in range(self.count)]
        self._throttle_ns = [dict.fromkeys(_THROTTLE_FIELD_BITS, 0.0) for _ in range(self.count)]
        self._pcie_bytes = [[1.7e9, 1.6e9] for _ in range(self.count)]
        self._event_sets: dict[int, dict[str, Any]] = {}
        self._next_event_set = 0
        self.missing_lookups: Counter[str] = Counter()  # symbols pynvml asked for that this driver lacks
        self.library = _SymbolTable(
            self,
            {
                name: self._wrap(name, getattr(self, name))
                for name in dir(type(self))
                if name.startswith("nvml") and name not in self._missing
            },
        )

    # -- the library surface pynvml sees ---------------------------------------------------------------

    def close(self) -> None:
        """Release hung calls (test teardown)."""
        self._closing.set()

    def now(self) -> float:
        return self._clock() - self._start

    def _wrap(self, name: str, method: Callable[..., int]) -> Callable[..., int]:
        def symbol(*args: Any) -> int:
            self.calls[name] += 1
            try:
                return method(*args)
            except _Hang:
                return pynvml.NVML_ERROR_UNKNOWN

        symbol.__name__ = name
        return symbol

    # -- fault plumbing --------------------------------------------------------------------------------

    def _active(self, kind: str, gpu: int | None = None) -> list[Fault]:
        t = self.now()
        return [
            f for f in self.scenario.faults if f.kind == kind and (gpu is None or f.applies_to(gpu)) and f.active(t)
        ]

    def _global_error(self, initialising: bool = False) -> int | None:
        if self._active("library_missing"):
            return pynvml.NVML_ERROR_LIBRARY_NOT_FOUND if initialising else pynvml.NVML_ERROR_UNINITIALIZED
        if self._active("driver_unloaded"):
            self._initialised = 0  # the driver's context is gone: callers must init again
            return pynvml.NVML_ERROR_DRIVER_NOT_LOADED
        if self._active("version_mismatch"):
            return pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH
        if not initialising and not self._initialised:
            return pynvml.NVML_ERROR_UNINITIALIZED
        return None

    def _device(self, handle: Any, symbol: str) -> tuple[int, int]:
        """Map a handle to a GPU index and the return code the call must give (OK to proceed)."""
        error = self._global_error()
        if error is not None:
            return -1, error
        index = (_pointer_value(handle) - _HANDLE_BASE) // 0x100
        if not 0 <= index < self.count:
            return -1, pynvml.NVML_ERROR_INVALID_ARGUMENT
        return index, self._gpu_error(index, symbol)

    def _gpu_error(self, index: int, symbol: str) -> int:
        if self._active("gpu_lost", index):
            return pynvml.NVML_ERROR_GPU_IS_LOST
        for fault in self._active("hang", index):
            if fault.call == symbol:
                self._hang(fault)
        for fault in self._active("error", index):
            if fault.call == symbol:
                return ERROR_CODES[fault.code or "unknown"]
        for fault in self._active("not_supported", index):
            if fault.call == symbol:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
        if symbol in self.model.unsupported:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        return OK

    def _hang(self, fault: Fault) -> None:
        """Block like a wedged ioctl until the fault window ends (or the fake is closed)."""
        while fault.active(self.now()):
            if self._closing.wait(0.02):
                raise _Hang
        return

    def _value(self, index: int, key: str) -> float:
        return self.scenario.value(index, key, self.now())

    def _events(self, kind: str, index: int, t: float | None = None, **match: Any) -> int:
        t = self.now() if t is None else t
        total = 0
        for fault in self.scenario.faults:
            if fault.kind == kind and fault.applies_to(index) and all(getattr(fault, k) == v for k, v in match.items()):
                total += fault.occurrences(t) * fault.count
        return total

    def _integrate(self) -> None:
        """Advance energy, throttle-time and PCIe byte counters to now in 0.1 s steps."""
        with self._lock:
            now = self.now()
            step = 0.1
            while self._integrated_to + step <= now:
                t = self._integrated_to + step / 2
                for i in range(self.count):
                    self._energy_mj[i] += self.scenario.value(i, "power_watts", t) * step * 1000
                    reasons = int(self.scenario.value(i, "clock_event_reasons", t))
                    for field_id, bits in _THROTTLE_FIELD_BITS.items():
                        if reasons & bits:
                            self._throttle_ns[i][field_id] += step * 1e9
                    self._pcie_bytes[i][0] += self.scenario.value(i, "pcie_tx_bytes_per_second", t) * step
                    self._pcie_bytes[i][1] += self.scenario.value(i, "pcie_rx_bytes_per_second", t) * step
                self._integrated_to += step

    # -- system ----------------------------------------------------------------------------------------

    def nvmlInitWithFlags(self, flags: Any) -> int:
        error = self._global_error(initialising=True)
        if error is not None:
            return error
        self._initialised += 1
        return OK

    def nvmlInit_v2(self) -> int:
        return self.nvmlInitWithFlags(0)

    def nvmlShutdown(self) -> int:
        if not self._initialised:
            return pynvml.NVML_ERROR_UNINITIALIZED
        self._initialised -= 1
        return OK

    def nvmlErrorString(self, code: Any) -> bytes:
        return f"Simulated NVML error {_val(code)}".encode()

    def nvmlSystemGetDriverVersion(self, buf: Any, size: Any) -> int:
        return self._system_string(buf, self.scenario.driver.version)

    def nvmlSystemGetNVMLVersion(self, buf: Any, size: Any) -> int:
        return self._system_string(buf, self.scenario.driver.nvml_version)

    def _system_string(self, buf: Any, text: str) -> int:
        error = self._global_error()
        if error is not None:
            return error
        buf.value = text.encode()
        return OK

    def nvmlSystemGetCudaDriverVersion_v2(self, ref: Any) -> int:
        error = self._global_error()
        if error is not None:
            return error
        _out(ref).value = self.scenario.driver.cuda_version
        return OK

    def nvmlDeviceGetCount_v2(self, ref: Any) -> int:
        error = self._global_error()
        if error is not None:
            return error
        _out(ref).value = self.count
        return OK

    def nvmlDeviceGetHandleByIndex_v2(self, index: Any, ref: Any) -> int:
        error = self._global_error()
        if error is not None:
            return error
        i = _val(index)
        if not 0 <= i < self.count:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if self._active("gpu_lost", i):
            return pynvml.NVML_ERROR_GPU_IS_LOST
        _set_pointer(ref, _HANDLE_BASE + i * 0x100)
        return OK

    def nvmlDeviceGetHandleByUUID(self, uuid: Any, ref: Any) -> int:
        error = self._global_error()
        if error is not None:
            return error
        wanted = _val(uuid)
        wanted = wanted.decode() if isinstance(wanted, bytes) else wanted
        for i in range(self.count):
            if self.uuid(i) == wanted:
                if self._active("gpu_lost", i):
                    return pynvml.NVML_ERROR_GPU_IS_LOST
                _set_pointer(ref, _HANDLE_BASE + i * 0x100)
                return OK
        return pynvml.NVML_ERROR_NOT_FOUND

    # -- identity --------------------------------------------------------------------------------------

    def uuid(self, index: int) -> str:
        digest = hashlib.blake2b(f"{self.scenario.name}:{index}".encode(), digest_size=16).hexdigest()
        return f"GPU-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def bus_id(self, index: int) -> str:
        return f"00000000:{0x18 + index * 0x10:02X}:00.0"

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

    # -- memory ----------------------------------------------------------------------------------------

    def _memory(self, index: int) -> tuple[int, int, int, int]:
        usable = self.model.memory_total - self.model.memory_reserved
        ratio = min(max(self._value(index, "memory_used_ratio"), 0.0), 1.0)
        used = int(usable * ratio)
        return self.model.memory_total, self.model.memory_reserved, used, usable - used

    def nvmlDeviceGetMemoryInfo(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetMemoryInfo")
        if code == OK:
            total, reserved, used, free = self._memory(index)
            mem = _out(ref)
            mem.total, mem.used, mem.free = total, used + reserved, free
        return code

    def nvmlDeviceGetMemoryInfo_v2(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetMemoryInfo_v2")
        if code == OK:
            mem = _out(ref)
            if mem.version != pynvml.nvmlMemory_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            mem.total, mem.reserved, mem.used, mem.free = self._memory(index)
        return code

    # -- thermal, power, clocks ------------------------------------------------------------------------

    def nvmlDeviceGetTemperatureV(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetTemperatureV")
        if code == OK:
            _out(ref).temperature = round(self._value(index, "temperature"))
        return code

    def nvmlDeviceGetTemperature(self, handle: Any, sensor: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetTemperature")
        if code == OK:
            _out(ref).value = round(self._value(index, "temperature"))
        return code

    def nvmlDeviceGetTemperatureThreshold(self, handle: Any, threshold: Any, ref: Any) -> int:
        _, code = self._device(handle, "nvmlDeviceGetTemperatureThreshold")
        if code == OK:
            names = {0: "shutdown", 1: "slowdown", 2: "memory_max", 3: "gpu_max"}
            name = names.get(_val(threshold))
            if name is None:
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            _out(ref).value = self.model.thresholds[name]
        return code

    def _uint(self, handle: Any, ref: Any, symbol: str, compute: Callable[[int], float]) -> int:
        index, code = self._device(handle, symbol)
        if code == OK:
            _out(ref).value = int(round(compute(index)))
        return code

    def nvmlDeviceGetPowerUsage(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetPowerUsage", lambda i: self._value(i, "power_watts") * 1000)

    def nvmlDeviceGetEnforcedPowerLimit(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle, ref, "nvmlDeviceGetEnforcedPowerLimit", lambda i: self._value(i, "power_limit_watts") * 1000
        )

    def nvmlDeviceGetPowerManagementDefaultLimit(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle, ref, "nvmlDeviceGetPowerManagementDefaultLimit", lambda i: self.model.power_default_mw
        )

    def nvmlDeviceGetTotalEnergyConsumption(self, handle: Any, ref: Any) -> int:
        self._integrate()
        return self._uint(handle, ref, "nvmlDeviceGetTotalEnergyConsumption", lambda i: self._energy_mj[i])

    def nvmlDeviceGetPerformanceState(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetPerformanceState", lambda i: self._value(i, "pstate"))

    def nvmlDeviceGetClockInfo(self, handle: Any, clock: Any, ref: Any) -> int:
        key = {
            pynvml.NVML_CLOCK_GRAPHICS: "sm_clock_mhz",
            pynvml.NVML_CLOCK_SM: "sm_clock_mhz",
            pynvml.NVML_CLOCK_MEM: "memory_clock_mhz",
        }.get(_val(clock))
        if key is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        return self._uint(handle, ref, "nvmlDeviceGetClockInfo", lambda i: self._value(i, key))

    def nvmlDeviceGetMaxClockInfo(self, handle: Any, clock: Any, ref: Any) -> int:
        key = {pynvml.NVML_CLOCK_GRAPHICS: "graphics", pynvml.NVML_CLOCK_SM: "sm", pynvml.NVML_CLOCK_MEM: "memory"}.get(
            _val(clock)
        )
        if key is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        return self._uint(handle, ref, "nvmlDeviceGetMaxClockInfo", lambda i: self.model.max_clocks_mhz[key])

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle, ref, "nvmlDeviceGetCurrentClocksEventReasons", lambda i: self._value(i, "clock_event_reasons")
        )

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle, ref, "nvmlDeviceGetCurrentClocksThrottleReasons", lambda i: self._value(i, "clock_event_reasons")
        )

    # -- utilization -----------------------------------------------------------------------------------

    def _window_mean(self, index: int, key: str, end: float) -> float:
        points = [self.scenario.value(index, key, end - SAMPLE_PERIOD_S * (k + 0.5) / 8) for k in range(8)]
        return min(max(sum(points) / len(points), 0.0), 100.0)

    def nvmlDeviceGetUtilizationRates(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetUtilizationRates")
        if code == OK:
            last = int(self.now() / SAMPLE_PERIOD_S) * SAMPLE_PERIOD_S
            util = _out(ref)
            util.gpu = round(self._window_mean(index, "utilization", last))
            util.memory = round(self._window_mean(index, "memory_utilization", last))
        return code

    def nvmlDeviceGetSamples(
        self, handle: Any, sample_type: Any, last_seen: Any, value_type: Any, count: Any, samples: Any
    ) -> int:
        index, code = self._device(handle, "nvmlDeviceGetSamples")
        if code != OK:
            return code
        key = {
            pynvml.NVML_GPU_UTILIZATION_SAMPLES: "utilization",
            pynvml.NVML_MEMORY_UTILIZATION_SAMPLES: "memory_utilization",
        }.get(_val(sample_type))
        if key is None:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        newest = int(self.now() / SAMPLE_PERIOD_S)
        since_us = _val(last_seen)
        ks = [
            k
            for k in range(max(1, newest - SAMPLE_BUFFER + 1), newest + 1)
            if _EPOCH_US + round(k * SAMPLE_PERIOD_S * 1e6) > since_us
        ]
        if not ks:
            return pynvml.NVML_ERROR_NOT_FOUND
        _out(value_type).value = _UINT
        if samples is None:
            _out(count).value = len(ks)
            return OK
        ks = ks[: _out(count).value]
        for slot, k in enumerate(ks):
            samples[slot].timeStamp = _EPOCH_US + round(k * SAMPLE_PERIOD_S * 1e6)
            samples[slot].sampleValue.uiVal = round(self._window_mean(index, key, k * SAMPLE_PERIOD_S))
        _out(count).value = len(ks)
        return OK

    # -- ECC, remapping, retirement --------------------------------------------------------------------

    def nvmlDeviceGetEccMode(self, handle: Any, current: Any, pending: Any) -> int:
        _, code = self._device(handle, "nvmlDeviceGetEccMode")
        if code == OK:
            _out(current).value, _out(pending).value = 1, 1
        return code

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: Any, counter: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetTotalEccErrors")
        if code == OK:
            kind = "corrected" if _val(error_type) == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"
            _out(ref).value = self._events("ecc", index, type=kind)
        return code

    def nvmlDeviceGetRemappedRows(self, handle: Any, corr: Any, unc: Any, pending: Any, failed: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetRemappedRows")
        if code == OK:
            _out(corr).value = self._events("remapped_rows", index, cause="correctable")
            _out(unc).value = self._events("remapped_rows", index, cause="uncorrectable")
            _out(pending).value = 1 if self._active("remap_pending", index) else 0
            _out(failed).value = 1 if self._active("remap_failed", index) else 0
        return code

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: Any, count: Any, pages: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetRetiredPages")
        if code != OK:
            return code
        label = (
            "single_bit"
            if _val(cause) == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            else "double_bit"
        )
        n = self._events("retired_pages", index, cause=label)
        if pages is not None:
            for slot in range(min(n, _out(count).value)):
                pages[slot] = 0x1000 * (slot + 1)
        _out(count).value = n
        return OK

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle,
            ref,
            "nvmlDeviceGetRetiredPagesPendingStatus",
            lambda i: 1 if self._active("retired_pages_pending", i) else 0,
        )

    # -- modes, processes, fan -------------------------------------------------------------------------

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

    def mig_uuid(self, index: int, slot: int) -> str:
        digest = hashlib.blake2b(f"{self.scenario.name}:{index}:mig{slot}".encode(), digest_size=16).hexdigest()
        return f"MIG-{digest[:8]}-{digest[8:12]}-{digest[12:16]}-{digest[16:20]}-{digest[20:32]}"

    def _processes(self, handle: Any, count: Any, infos: Any, symbol: str) -> int:
        index, code = self._device(handle, symbol)
        if code != OK:
            return code
        n = max(int(round(self._value(index, "processes"))), 0)
        if infos is None:
            _out(count).value = n
            return OK if n == 0 else pynvml.NVML_ERROR_INSUFFICIENT_SIZE
        used = self._memory(index)[2]
        for slot in range(min(n, _out(count).value)):
            infos[slot].pid = 4000 + index * 100 + slot
            infos[slot].usedGpuMemory = used // max(n, 1)
        _out(count).value = n
        return OK

    def nvmlDeviceGetComputeRunningProcesses_v3(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes(handle, count, infos, "nvmlDeviceGetComputeRunningProcesses_v3")

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: Any, count: Any, infos: Any) -> int:
        return self._processes(handle, count, infos, "nvmlDeviceGetComputeRunningProcesses_v2")

    def nvmlDeviceGetFanSpeed(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetFanSpeed", lambda i: self._value(i, "fan_percent"))

    # -- PCIe ------------------------------------------------------------------------------------------

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

    # -- field values ----------------------------------------------------------------------------------

    def _link_up(self, index: int, link: int) -> bool:
        return not any(f.link == link for f in self._active("nvlink_down", index))

    def _field(self, index: int, field_id: int, scope: int) -> tuple[int, int, float]:
        """(return code, value type, value) of one field for one GPU."""
        links = self.model.nvlinks
        if field_id in self.model.unsupported_fields or any(
            f.field == field_id for f in self._active("not_supported", index)
        ):
            return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0
        simple: dict[int, Callable[[], tuple[int, float]]] = {
            82: lambda: (_UINT, self._value(index, "memory_temperature")),
            83: lambda: (_ULL, self._energy_mj[index]),
            91: lambda: (_UINT, links),
            94: lambda: (_UINT, self._events("pcie_replay", index)),
            147: lambda: (_UINT, sum(self._link_up(index, k) for k in range(links))),
            185: lambda: (_UINT, self._value(index, "power_watts") * 1000),
            186: lambda: (_UINT, self._value(index, "power_watts") * 1000),
            197: lambda: (_ULL, self._pcie_bytes[index][0]),
            198: lambda: (_ULL, self._pcie_bytes[index][1]),
            230: lambda: (_UINT, self._value(index, "recovery_action")),
        }
        if field_id in simple:
            value_type, value = simple[field_id]()
            return OK, value_type, value
        if field_id in _THROTTLE_FIELD_BITS:
            return OK, _ULL, self._throttle_ns[index][field_id]
        if field_id == 147 and self.scenario.node.nvlink != "nvswitch":
            return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0
        scoped = {165: None, 161: "replay", 162: "recovery", 163: "crc_flit"}
        if field_id in scoped:
            if scope >= links:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT, _UINT, 0
            if field_id == 165:
                return OK, _UINT, 1 if self._link_up(index, scope) else 0
            return OK, _ULL, self._events("nvlink_errors", index, link=scope, type=scoped[field_id])
        for table, kind in ((_NVLINK_CRC_DATA, "crc_data"), (_NVLINK_ECC, "ecc")):
            if field_id in table:
                link = table.index(field_id)
                if link >= links:
                    return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0
                return OK, _ULL, self._events("nvlink_errors", index, link=link, type=kind)
        return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0

    def nvmlDeviceGetFieldValues(self, handle: Any, count: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetFieldValues")
        if code != OK:
            return code
        self._integrate()
        entries = _out(ref)
        stamp = int(time.time() * 1e6)
        for slot in range(_val(count)):
            entry = entries[slot]
            ret, value_type, value = self._field(index, entry.fieldId, entry.scopeId)
            entry.nvmlReturn, entry.valueType, entry.timestamp, entry.latencyUsec = ret, value_type, stamp, 0
            if ret == OK:
                if value_type == _ULL:
                    entry.value.ullVal = int(value)
                else:
                    entry.value.uiVal = int(round(value))
        return OK

    # -- NVLink and topology ---------------------------------------------------------------------------

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle: Any, link: Any, ref: Any) -> int:
        _, code = self._device(handle, "nvmlDeviceGetNvLinkRemotePciInfo_v2")
        if code == OK:
            if _val(link) >= self.model.nvlinks:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            _out(ref).busId = _NVSWITCH_BUS
        return code

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetNvLinkState")
        if code == OK:
            if _val(link) >= self.model.nvlinks:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            _out(ref).value = 1 if self._link_up(index, _val(link)) else 0
        return code

    def _numa(self, index: int) -> int:
        return index * self.scenario.node.numa_nodes // self.count

    def nvmlDeviceGetTopologyCommonAncestor(self, first: Any, second: Any, ref: Any) -> int:
        a, code = self._device(first, "nvmlDeviceGetTopologyCommonAncestor")
        b, code_b = self._device(second, "nvmlDeviceGetTopologyCommonAncestor")
        if code != OK or code_b != OK:
            return code if code != OK else code_b
        same = self._numa(a) == self._numa(b)
        _out(ref).value = _LEVELS[self.scenario.node.pcie_same_numa if same else "SYS"]
        return OK

    def nvmlDeviceGetP2PStatus(self, first: Any, second: Any, index: Any, ref: Any) -> int:
        a, code = self._device(first, "nvmlDeviceGetP2PStatus")
        b, code_b = self._device(second, "nvmlDeviceGetP2PStatus")
        if code != OK or code_b != OK:
            return code if code != OK else code_b
        nvlink = self.scenario.node.nvlink == "nvswitch" and self.model.nvlinks > 0
        if _val(index) == pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            _out(ref).value = pynvml.NVML_P2P_STATUS_OK if nvlink else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        else:
            _out(ref).value = pynvml.NVML_P2P_STATUS_OK
        return OK

    # -- events ----------------------------------------------------------------------------------------

    def nvmlDeviceGetSupportedEventTypes(self, handle: Any, ref: Any) -> int:
        return self._uint(handle, ref, "nvmlDeviceGetSupportedEventTypes", lambda i: self.model.supported_events)

    def nvmlEventSetCreate(self, ref: Any) -> int:
        error = self._global_error()
        if error is not None:
            return error
        with self._lock:
            self._next_event_set += 1
            handle = _EVENT_SET_BASE + self._next_event_set
            self._event_sets[handle] = {"gpus": set(), "delivered": Counter()}
        _set_pointer(ref, handle)
        return OK

    def nvmlDeviceRegisterEvents(self, handle: Any, mask: Any, event_set: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceRegisterEvents")
        if code != OK:
            return code
        state = self._event_sets.get(_pointer_value(event_set))
        if state is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        if not _val(mask) & self.model.supported_events & pynvml.nvmlEventTypeXidCriticalError:
            return pynvml.NVML_ERROR_NOT_SUPPORTED
        state["gpus"].add(index)
        # No history: events that fired before registration are never delivered.
        for number, fault in enumerate(self.scenario.faults):
            if fault.kind == "xid" and fault.applies_to(index):
                state["delivered"][(number, index)] = fault.occurrences(self.now()) * fault.count
        return OK

    def _next_event(self, state: dict[str, Any]) -> tuple[int, int] | None:
        t = self.now()
        for number, fault in enumerate(self.scenario.faults):
            if fault.kind != "xid":
                continue
            for index in sorted(state["gpus"]):
                if fault.applies_to(index) and fault.occurrences(t) * fault.count > state["delivered"][(number, index)]:
                    state["delivered"][(number, index)] += 1
                    return index, int(fault.xid or 0)
        return None

    def nvmlEventSetWait_v2(self, event_set: Any, ref: Any, timeout_ms: Any) -> int:
        state = self._event_sets.get(_pointer_value(event_set))
        if state is None:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        deadline = time.monotonic() + _val(timeout_ms) / 1000
        while True:
            error = self._global_error()
            if error is not None:
                return error
            with self._lock:
                event = self._next_event(state)
            if event is not None:
                index, xid = event
                data = _out(ref)
                ctypes.c_void_p.from_buffer(data, 0).value = _HANDLE_BASE + index * 0x100
                data.eventType = pynvml.nvmlEventTypeXidCriticalError
                data.eventData = xid
                data.gpuInstanceId = data.computeInstanceId = 0xFFFFFFFF
                return OK
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return pynvml.NVML_ERROR_TIMEOUT
            if self._closing.wait(min(remaining, 0.02)):
                return pynvml.NVML_ERROR_TIMEOUT

    def nvmlEventSetFree(self, event_set: Any) -> int:
        self._event_sets.pop(_pointer_value(event_set), None)
        return OK
