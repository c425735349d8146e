"""Memory, temperature, power, clocks and utilization: the fast tier's readings, from the scenario's trajectories."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pynvml

from gpuwarden.sim.fake_device import MIG_1G_MEMORY_MIB, mig_gpu_instance_id, mig_slot_of
from gpuwarden.sim.fakecommon import _EPOCH_US, _UINT, OK, SAMPLE_BUFFER, SAMPLE_PERIOD_S, _out, _val


class ReadingSymbols:
    """Mixed into FakeNvmlLibrary, whose state (scenario, clock, faults) these symbols read."""

    def _memory(self, index: int) -> tuple[int, int, int, int]:
        usable = self.model.memory_total - self.model.memory_reserved
        if any(spec.gpu == index for spec in self.scenario.processes):  # the processes' memory, and nothing else
            used = min(sum(self.process_memory(spec) for _, spec in self.running(index)), usable)
            return self.model.memory_total, self.model.memory_reserved, used, usable - used
        ratio = min(max(self._value(index, "memory_used_ratio"), 0.0), 1.0)
        used = int(usable * ratio)
        return self.model.memory_total, self.model.memory_reserved, used, usable - used

    def _memory_of(self, handle: Any, index: int) -> tuple[int, int, int, int]:
        """The GPU's memory, or, on a MIG device handle, its slice's (a 1g.10gb slice's total and what the
        processes in its GPU instance hold; no reserve of its own is modelled)."""
        slot = mig_slot_of(handle)
        if slot is None:
            return self._memory(index)
        instance = mig_gpu_instance_id(slot)
        used = sum(self.process_memory(spec) for _, spec in self.running(index) if spec.gpu_instance == instance)
        total = MIG_1G_MEMORY_MIB * 1024**2
        used = min(used, total)
        return total, 0, used, total - used

    def nvmlDeviceGetMemoryInfo(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetMemoryInfo")
        if code == OK:
            total, reserved, used, free = self._memory_of(handle, index)
            mem = _out(ref)
            mem.total, mem.used, mem.free = total, used + reserved, free
        return code

    def nvmlDeviceGetMemoryInfo_v2(self, handle: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetMemoryInfo_v2")
        if code == OK:
            mem = _out(ref)
            if mem.version != pynvml.nvmlMemory_v2:
                return pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
            mem.total, mem.reserved, mem.used, mem.free = self._memory_of(handle, index)
        return code

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

    def _window_mean(self, index: int, key: str, end: float) -> float:
        if self.scenario.steady_between(index, key, end - SAMPLE_PERIOD_S, end):
            return min(max(self.scenario.value(index, key, end), 0.0), 100.0)
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

    def _video(self, handle: Any, util: Any, period: Any, symbol: str, key: str) -> int:
        """Encoder or decoder utilization (%) and the driver's sampling period: 100,000 µs, as an H100 answers
        (utilization 0, period 100000; 1.2 µs a call)."""
        index, code = self._device(handle, symbol)
        if code == OK:
            _out(util).value = round(self._value(index, key))
            _out(period).value = 100_000
        return code

    def nvmlDeviceGetEncoderUtilization(self, handle: Any, util: Any, period: Any) -> int:
        return self._video(handle, util, period, "nvmlDeviceGetEncoderUtilization", "encoder_utilization")

    def nvmlDeviceGetDecoderUtilization(self, handle: Any, util: Any, period: Any) -> int:
        return self._video(handle, util, period, "nvmlDeviceGetDecoderUtilization", "decoder_utilization")

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
        first = max(1, newest - SAMPLE_BUFFER + 1)
        # the first sample newer than `since_us`: computed, then corrected for rounding (the buffer is 71 long and
        # a poll wants the last few: scanning it all per call was the simulator's costliest line)
        k = max(first, int((since_us - _EPOCH_US) / (SAMPLE_PERIOD_S * 1e6)) - 1)
        while k <= newest and _EPOCH_US + round(k * SAMPLE_PERIOD_S * 1e6) <= since_us:
            k += 1
        ks = list(range(k, newest + 1))
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
