"""XID critical-error events: one NVML event set, waited on by its own thread, independent of scrapes.

NVML keeps no history: counts start when gpuwarden registers. The set is rebuilt when the GPU population
changes and after any wait error other than a timeout (nvml.md §10).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable

import pynvml

from exporter.nvml.device import GpuDevice
from exporter.nvml.errors import error_code, error_name

log = logging.getLogger(__name__)

WAIT_MS = 1000
REBUILD_BACKOFF_S = 1.0


class XidCounts:
    """(uuid, xid) → (count, last-seen unix time); thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, int], tuple[int, float]] = {}

    def record(self, uuid: str, xid: int, when: float) -> None:
        with self._lock:
            count, _ = self._counts.get((uuid, xid), (0, 0.0))
            self._counts[(uuid, xid)] = (count + 1, when)

    def snapshot(self) -> dict[tuple[str, int], tuple[int, float]]:
        with self._lock:
            return dict(self._counts)


class XidWatcher:
    """Waits on the event set in a daemon thread; `devices()` says which GPUs to register and when to rebuild."""

    def __init__(self, devices: Callable[[], tuple[int, list[GpuDevice]]], counts: XidCounts) -> None:
        self._devices = devices  # → (generation, up devices); a new generation means rebuild
        self.counts = counts
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpuwarden-xid", daemon=True)
        self.registered: set[str] = set()

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            generation, devices = self._devices()
            if not devices:
                self._stop.wait(0.5)
                continue
            try:
                self._watch(generation, devices)
                continue  # the GPU population changed: re-register at once
            except pynvml.NVMLError as exc:
                log.warning("xid watcher: %s; rebuilding the event set", error_name(error_code(exc)))
            except Exception:  # a bug must not end XID collection for the life of the process
                log.exception("xid watcher failed; rebuilding the event set")
            finally:
                self.registered = set()
            self._stop.wait(REBUILD_BACKOFF_S)

    def _watch(self, generation: int, devices: list[GpuDevice]) -> None:
        event_set = pynvml.nvmlEventSetCreate()
        try:
            by_handle = self._register(event_set, devices)
            if not by_handle:
                self._stop.wait(5.0)  # nothing supports XID events; look again later
                return
            while not self._stop.is_set() and self._devices()[0] == generation:
                try:
                    data = pynvml.nvmlEventSetWait_v2(event_set, WAIT_MS)
                except pynvml.NVMLError_Timeout:
                    continue
                if data.eventType & pynvml.nvmlEventTypeXidCriticalError:
                    uuid = by_handle.get(ctypes.cast(data.device, ctypes.c_void_p).value or 0)
                    if uuid is not None:
                        self.counts.record(uuid, int(data.eventData), time.time())
        finally:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlEventSetFree(event_set)

    def _register(self, event_set: object, devices: list[GpuDevice]) -> dict[int, str]:
        by_handle: dict[int, str] = {}
        for dev in devices:
            try:
                supported = pynvml.nvmlDeviceGetSupportedEventTypes(dev.handle)
                mask = supported & pynvml.nvmlEventTypeXidCriticalError
                if not mask:
                    continue
                pynvml.nvmlDeviceRegisterEvents(dev.handle, mask, event_set)
            except (pynvml.NVMLError_NotSupported, pynvml.NVMLError_FunctionNotFound):
                continue
            except pynvml.NVMLError as exc:
                if error_code(exc) == pynvml.NVML_ERROR_UNKNOWN:
                    raise  # the set is undefined now: rebuild it
                log.info("xid watcher: gpu %s not registered (%s)", dev.index, error_name(error_code(exc)))
                continue
            # Cache the UUID now: the GPU may be unreadable when its event arrives.
            by_handle[ctypes.cast(dev.handle, ctypes.c_void_p).value or 0] = dev.uuid
        self.registered = set(by_handle.values())
        return by_handle
