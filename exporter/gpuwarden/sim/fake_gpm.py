"""GPM in the fake library: support by compute capability, sample buffers, metrics from the scenario.

GPM in the fake library: support by compute capability (Hopper, 9.0, and newer), opaque sample buffers, and
the metrics struct filled with the scenario's values averaged over the window between two samples.

A scenario sets `sm_active`, `tensor_active`, `dram_active`, … directly; where it does not they follow its
`utilization` as a bf16 training job's do (graphics = utilization, SM = 0.9 × utilization, occupancy = 0.5 ×,
tensor = 0.23 ×, FP32 = 0.02 ×, FP64 0, DRAM = `memory_utilization`), so every shipped scenario stays consistent.
Faults use the usual `error` and `not_supported` kinds with the GPM symbols as `call` (NO_PERMISSION, a failing
sample, no GPM), and `crash`, which kills the process inside the call with SIGSEGV, as the real library does.

As strict as the driver (docs/nvml.md, GPM): where the real libnvidia-ml corrupts memory or segfaults, this one raises
`SimulatedMemoryCorruption`:
- a sample used or freed after it was freed;
- two GPM calls in flight at once in one process, on the same sample or on different GPUs (driver 580.159.04
  segfaulted with two threads inside nvmlGpmMetricsGet, one per GPU). Each call holds the library for
  `GPM_CALL_SECONDS`, about what the real calls take, so an unserialised caller overlaps as it would on a GPU host.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pynvml

from gpuwarden.sim.fake_device import mig_gpu_instance_id
from gpuwarden.sim.fakecommon import OK, SimulatedMemoryCorruption, _out, _pointer_value, _set_pointer, _val

_GPM_SAMPLE_BASE = 0x7F0000A00000
_MIB = 1024 * 1024
_KEYS = {
    pynvml.NVML_GPM_METRIC_GRAPHICS_UTIL: "graphics_active",
    pynvml.NVML_GPM_METRIC_SM_UTIL: "sm_active",
    pynvml.NVML_GPM_METRIC_SM_OCCUPANCY: "sm_occupancy",
    pynvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL: "tensor_active",
    pynvml.NVML_GPM_METRIC_FP64_UTIL: "fp64_active",
    pynvml.NVML_GPM_METRIC_FP32_UTIL: "fp32_active",
    pynvml.NVML_GPM_METRIC_FP16_UTIL: "fp16_active",
    pynvml.NVML_GPM_METRIC_DRAM_BW_UTIL: "dram_active",
    pynvml.NVML_GPM_METRIC_PCIE_RX_PER_SEC: "pcie_rx_bytes_per_second",
    pynvml.NVML_GPM_METRIC_PCIE_TX_PER_SEC: "pcie_tx_bytes_per_second",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC: "nvlink_rx_bytes_per_second",
    pynvml.NVML_GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC: "nvlink_tx_bytes_per_second",
}
# The default profile of a busy GPU is a bf16 mixed-precision training job's, as measured on H100 (8 encoder layers,
# d=1024, AdamW, torch.autocast(bfloat16): SM 86 %, tensor 22 %, FP32 2 % at ~95 % utilization). Scenarios of other
# jobs (FP32 training, memory-bound, starved, communication-bound) set their own values.
_FROM_UTILIZATION = {
    "graphics_active": 1.0,
    "sm_active": 0.9,
    "sm_occupancy": 0.5,
    "tensor_active": 0.23,
    "fp32_active": 0.02,
}
GPM_CALL_SECONDS = 0.002  # nvmlGpmMetricsGet took 1.2-3.6 ms for 12 metrics on H200 (docs/nvml.md, GPM)


class GpmSymbols:
    """Mixed into FakeNvmlLibrary, whose state (scenario, clock, faults) these symbols read."""

    # sample id → (GPU, MIG GPU instance or None for the whole GPU, time taken); set by the library
    _gpm_sample_table: dict[int, tuple[int, int | None, float] | None]
    _gpm_freed: set[int]
    _gpm_in_flight: dict[int, str]
    _gpm_next_sample: int
    gpm_call_seconds: float

    def _gpm_samples(self) -> dict[int, tuple[int, int | None, float] | None]:
        return self._gpm_sample_table

    def _gpm_supported(self) -> bool:
        return tuple(self.model.compute_capability) >= (9, 0)

    def nvmlGpmQueryDeviceSupport(self, handle: Any, ref: Any) -> int:
        _, code = self._device(handle, "nvmlGpmQueryDeviceSupport")
        if code == OK:
            _out(ref).isSupportedDevice = 1 if self._gpm_supported() else 0
        return code

    def nvmlGpmSampleAlloc(self, ref: Any) -> int:
        with self._lock:
            samples = self._gpm_samples()
            self._gpm_next_sample += 1  # ids are never reused, so a freed one stays recognisable
            sample_id = self._gpm_next_sample
            samples[sample_id] = None
        _set_pointer(ref, _GPM_SAMPLE_BASE + sample_id * 0x10)
        return OK

    def nvmlGpmSampleFree(self, sample: Any) -> int:
        sample_id = self._sample_id(sample)
        with self._gpm_call("nvmlGpmSampleFree", [sample_id], None):
            if sample_id not in self._gpm_samples():
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            del self._gpm_samples()[sample_id]
            self._gpm_freed.add(sample_id)
        return OK

    def _gpm_call(self, symbol: str, sample_ids: list[int], index: int | None) -> _GpmCall:
        return _GpmCall(self, symbol, sample_ids, index)

    def _gpm_crash(self, symbol: str, index: int | None) -> None:
        """A `crash` fault on this call: die as a segfault in the driver's library does (faulthandler, if on,
        prints the stacks first)."""
        for fault in self._active("crash", index):
            if fault.call == symbol:
                os.kill(os.getpid(), signal.SIGSEGV)

    def _sample_id(self, sample: Any) -> int:
        return (_pointer_value(sample) - _GPM_SAMPLE_BASE) // 0x10

    def nvmlGpmSampleGet(self, handle: Any, sample: Any) -> int:
        return self._gpm_take(handle, None, sample, "nvmlGpmSampleGet")

    def nvmlGpmMigSampleGet(self, handle: Any, gpu_instance: Any, sample: Any) -> int:
        return self._gpm_take(handle, _val(gpu_instance), sample, "nvmlGpmMigSampleGet")

    def _gpm_take(self, handle: Any, gpu_instance: int | None, sample: Any, symbol: str) -> int:
        index, code = self._device(handle, symbol)
        sample_id = self._sample_id(sample)
        with self._gpm_call(symbol, [sample_id], index if index >= 0 else None):
            if code != OK:
                return code
            if not self._gpm_supported():
                return pynvml.NVML_ERROR_NOT_SUPPORTED
            if gpu_instance is not None and self._mig_slot(index, gpu_instance) is None:
                return pynvml.NVML_ERROR_NOT_FOUND  # no such GPU instance (destroyed, or MIG off)
            if sample_id not in self._gpm_samples():
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            self._gpm_samples()[sample_id] = (index, gpu_instance, self.now())
        return OK

    def _mig_slot(self, index: int, gpu_instance: int) -> int | None:
        slots = self.scenario.node.mig_instances.get(index, 0)
        return next((slot for slot in range(slots) if mig_gpu_instance_id(slot) == gpu_instance), None)

    def nvmlGpmMetricsGet(self, ref: Any) -> int:
        request = _out(ref)
        samples = self._gpm_samples()
        ids = [self._sample_id(request.sample1), self._sample_id(request.sample2)]
        first, second = samples.get(ids[0]), samples.get(ids[1])
        with self._gpm_call("nvmlGpmMetricsGet", ids, first[0] if first else None):
            return self._fill_metrics(request, first, second)

    def _fill_metrics(self, request: Any, first: Any, second: Any) -> int:
        if first is None or second is None or first[:2] != second[:2]:
            return pynvml.NVML_ERROR_INVALID_ARGUMENT
        index, gpu_instance = first[0], first[1]
        start, end = min(first[2], second[2]), max(first[2], second[2])
        share = 1.0 if gpu_instance is None else self._mig_share(index, gpu_instance)
        for position in range(request.numMetrics):
            entry = request.metrics[position]
            key = _KEYS.get(entry.metricId)
            if key is None:
                entry.nvmlReturn = pynvml.NVML_ERROR_INVALID_ARGUMENT  # as the cumulative IDs answer on 580
                continue
            entry.value = self._gpm_mean(index, key, start, end) * share
            entry.nvmlReturn = OK
        return OK

    def _mig_share(self, index: int, gpu_instance: int) -> float:
        slot = self._mig_slot(index, gpu_instance)
        shares = self.scenario.node.mig_activity.get(index, [])
        return shares[slot] if slot is not None and slot < len(shares) else 1.0

    def _gpm_mean(self, index: int, key: str, start: float, end: float) -> float:
        steady = end <= start or self._gpm_steady(index, key, start, end)
        points = [end] if steady else [start + (end - start) * (k + 0.5) / 16 for k in range(16)]
        values = [self._gpm_value(index, key, t) for t in points]
        mean = sum(values) / len(values)
        return mean / _MIB if key.endswith("bytes_per_second") else min(max(mean, 0.0), 100.0)

    def _gpm_steady(self, index: int, key: str, start: float, end: float) -> bool:
        """Whether every value `_gpm_value` reads for `key` is the same at every instant of [start, end]."""
        scenario = self.scenario
        if scenario.sets(index, key):
            return scenario.steady_between(index, key, start, end)
        if key in _FROM_UTILIZATION:
            return scenario.steady_between(index, "utilization", start, end)
        if key == "dram_active":
            return scenario.steady_between(index, "memory_utilization", start, end)
        return True  # the model's idle value, or 0: the scenario sets none for it

    def _gpm_value(self, index: int, key: str, t: float) -> float:
        explicit = self.scenario.explicit(index, key, t)
        if explicit is not None:
            return explicit
        if key in _FROM_UTILIZATION:
            return _FROM_UTILIZATION[key] * self.scenario.value(index, "utilization", t)
        if key == "dram_active":
            return self.scenario.value(index, "memory_utilization", t)
        if key in self.model.idle:
            return self.scenario.value(index, key, t)
        return 0.0


class _GpmCall:
    """One GPM call in flight: refuses freed samples and a second GPM call at once (see the module docstring),
    and runs a `crash` fault."""

    _guard = threading.Lock()

    def __init__(self, fake: Any, symbol: str, sample_ids: list[int], index: int | None) -> None:
        self.fake, self.symbol, self.sample_ids, self.index = fake, symbol, sample_ids, index

    def __enter__(self) -> None:
        freed = [s for s in self.sample_ids if s in self.fake._gpm_freed]
        if freed:
            raise SimulatedMemoryCorruption(
                f"{self.symbol} on GPM sample {freed[0]} after nvmlGpmSampleFree: the real library reads freed memory"
            )
        with self._guard:
            busy = self.fake._gpm_in_flight
            if busy:
                other = next(iter(busy.values()))
                raise SimulatedMemoryCorruption(
                    f"{self.symbol} called while {other} is in flight on another thread: concurrent GPM calls "
                    "segfault the real library (driver 580.159.04); serialise them"
                )
            busy[threading.get_ident()] = self.symbol
        self.fake._gpm_crash(self.symbol, self.index)
        hold = self.fake.gpm_call_seconds
        if hold:
            threading.Event().wait(hold)

    def __exit__(self, *exc: object) -> None:
        with self._guard:
            self.fake._gpm_in_flight.pop(threading.get_ident(), None)
