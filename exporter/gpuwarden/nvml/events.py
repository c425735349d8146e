"""An NVML event set for XID critical errors, as plain calls (the watcher thread is gpuwarden.collect.xid_events).

NVML semantics kept here (docs/nvml.md, XID events): NotSupported leaves the set usable with nothing registered
for that GPU; Unknown leaves the set undefined, so it must be freed and rebuilt; a wait Timeout is normal.
"""

from __future__ import annotations

import contextlib
import ctypes
from typing import Any

import pynvml

from gpuwarden.nvml import calls
from gpuwarden.nvml.errors import error_code, error_name


class EventSetBroken(Exception):
    """The set must be freed and rebuilt (a registration answered Unknown, or a wait failed)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def handle_key(handle: Any) -> int:
    """A GPU handle as an int, to map an event's device back to the GPU registered with that handle."""
    return ctypes.cast(handle, ctypes.c_void_p).value or 0


class XidEventSet:
    """One event set; `register` each GPU, then `wait` returns (handle key, xid) or None on timeout."""

    def __init__(self) -> None:
        try:
            self._set = calls.nvmlEventSetCreate()
        except pynvml.NVMLError as exc:
            raise EventSetBroken(error_name(error_code(exc))) from None

    def register(self, handle: Any) -> str | None:
        """Register a GPU for XID events; None when registered, else why not (the set stays usable)."""
        try:
            mask = calls.nvmlDeviceGetSupportedEventTypes(handle) & calls.nvmlEventTypeXidCriticalError
            if not mask:
                return "not_supported"
            calls.nvmlDeviceRegisterEvents(handle, mask, self._set)
        except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
            return "not_supported"
        except pynvml.NVMLError as exc:
            if error_code(exc) == pynvml.NVML_ERROR_UNKNOWN:
                raise EventSetBroken("unknown") from None
            return error_name(error_code(exc))
        return None

    def wait(self, timeout_ms: int) -> tuple[int, int] | None:
        """The next XID event as (handle key, xid); None when the wait timed out or the event was another type."""
        try:
            data = calls.nvmlEventSetWait_v2(self._set, timeout_ms)
        except pynvml.NVMLError_Timeout:
            return None
        except pynvml.NVMLError as exc:
            raise EventSetBroken(error_name(error_code(exc))) from None
        if not data.eventType & calls.nvmlEventTypeXidCriticalError:
            return None
        return handle_key(data.device), int(data.eventData)

    def free(self) -> None:
        with contextlib.suppress(pynvml.NVMLError):
            calls.nvmlEventSetFree(self._set)
