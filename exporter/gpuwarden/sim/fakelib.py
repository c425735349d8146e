"""A fake libnvidia-ml: Python callables with the C symbols' names and signatures, driven by a scenario.

It is installed *beneath* pynvml (as `pynvml.nvmlLib`), so the exporter runs its production code path:
pynvml's own wrappers build the real structs, run the two-call size probes and raise the real exception
classes from the integer return codes returned here. Symbols listed in a scenario's `driver.missing_symbols`
(or not implemented here) make pynvml raise FunctionNotFound, as an old driver does.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pynvml

from gpuwarden.sim.fake_device import DeviceSymbols
from gpuwarden.sim.fake_events import EventSymbols
from gpuwarden.sim.fake_gpm import GPM_CALL_SECONDS, GpmSymbols
from gpuwarden.sim.fake_health import HealthSymbols
from gpuwarden.sim.fake_readings import ReadingSymbols
from gpuwarden.sim.fakecommon import (
    _HANDLE_BASE,
    _THROTTLE_FIELD_BITS,
    OK,
    _Hang,
    _out,
    _pointer_value,
    _set_pointer,
    _val,
)
from gpuwarden.sim.faults import ERROR_CODES, Fault
from gpuwarden.sim.models import MODELS, GpuModel
from gpuwarden.sim.scenario import Scenario


class _SymbolTable:
    """The object installed as pynvml.nvmlLib: only the C symbols, as attributes (looked up once; pynvml caches)."""

    def __init__(self, fake: FakeNvmlLibrary, symbols: dict[str, Callable[..., int]]) -> None:
        self._fake = fake
        self.__dict__.update(symbols)

    def __getattr__(self, name: str) -> Any:
        self._fake.missing_lookups[name] += 1  # what an old driver lacks: pynvml raises FunctionNotFound
        raise AttributeError(name)


class FakeNvmlLibrary(DeviceSymbols, ReadingSymbols, HealthSymbols, EventSymbols, GpmSymbols):
    """A simulated GPU node; `.library` stands in for the CDLL object pynvml loads (see the module docstring)."""

    def __init__(
        self, scenario: Scenario, clock: Callable[[], float] | None = None, start: float | None = None
    ) -> None:
        self.scenario = scenario
        self.model: GpuModel = MODELS[scenario.node.model]
        self.count = scenario.node.count
        self._clock = clock or time.monotonic
        self._start = self._clock() if start is None else start
        self._lock = threading.Lock()
        self._initialised = 0
        self._closing = threading.Event()
        self.calls: Counter[str] = Counter()  # every symbol looked up and called, for tests
        self._missing = set(scenario.driver.missing_symbols)
        self._faults_by_kind: dict[str, tuple[Fault, ...]] = {}
        for fault in scenario.faults:
            self._faults_by_kind[fault.kind] = (*self._faults_by_kind.get(fault.kind, ()), fault)
        self._integrated_to = 0.0
        self._energy_mj = [2_770_288.0 + 1000.0 * i for i in range(self.count)]
        self._throttle_ns = [dict.fromkeys(_THROTTLE_FIELD_BITS, 0.0) for _ in range(self.count)]
        self._pcie_bytes = [[1.7e9, 1.6e9] for _ in range(self.count)]
        self._event_sets: dict[int, dict[str, Any]] = {}
        self._gpm_sample_table: dict[int, tuple[int, int | None, float] | None] = {}
        self._gpm_freed: set[int] = set()  # freed sample ids (never reused: a use after free is caught)
        self._gpm_in_flight: dict[int, str] = {}  # thread id → the GPM call it is inside
        self._gpm_next_sample = 0
        self.gpm_call_seconds = GPM_CALL_SECONDS
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

    @property
    def start(self) -> float:
        """The scenario's time zero on its clock."""
        return self._start

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
        faults = self._faults_by_kind.get(kind)
        if not faults:  # most calls, in most scenarios: no clock read
            return []
        t = self.now()
        return [f for f in faults if (gpu is None or f.applies_to(gpu)) and f.active(t)]

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
        for fault in self._active("hang"):  # a wedged driver at start: a hang fault on this call, any `gpu`
            if fault.call == "nvmlInitWithFlags":
                self._hang(fault)
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

    # -- memory ----------------------------------------------------------------------------------------

    # -- thermal, power, clocks ------------------------------------------------------------------------

    # -- utilization -----------------------------------------------------------------------------------

    # -- ECC, remapping, retirement --------------------------------------------------------------------

    # -- modes, processes, fan -------------------------------------------------------------------------

    # -- PCIe ------------------------------------------------------------------------------------------

    # -- field values ----------------------------------------------------------------------------------

    # -- NVLink and topology ---------------------------------------------------------------------------

    # -- events ----------------------------------------------------------------------------------------
