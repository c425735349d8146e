"""The XID event set: registration, waits that deliver the scenario's XIDs, free."""

from __future__ import annotations

import ctypes
import time
from collections import Counter
from typing import Any

import pynvml

from gpuwarden.sim.fakecommon import _EVENT_SET_BASE, _HANDLE_BASE, OK, _out, _pointer_value, _set_pointer, _val


class EventSymbols:
    """Mixed into FakeNvmlLibrary, whose state (scenario, clock, faults) these symbols read."""

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
