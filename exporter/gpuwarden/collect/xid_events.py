"""XID critical-error events: one NVML event set, waited on by its own thread, independent of scrapes.

NVML keeps no history: counts start when gpuwarden registers. The set is rebuilt when the GPU population
changes and after any wait error other than a timeout (docs/nvml.md, XID events).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from gpuwarden.nvml.device import GpuDevice
from gpuwarden.nvml.events import EventSetBroken, XidEventSet, handle_key

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
            except EventSetBroken as exc:
                log.warning("xid watcher: %s; rebuilding the event set", exc.reason)
            except Exception:  # a bug must not end XID collection for the life of the process
                log.exception("xid watcher failed; rebuilding the event set")
            finally:
                self.registered = set()
            self._stop.wait(REBUILD_BACKOFF_S)

    def _watch(self, generation: int, devices: list[GpuDevice]) -> None:
        event_set = XidEventSet()
        try:
            by_handle = self._register(event_set, devices)
            if not by_handle:
                self._stop.wait(5.0)  # nothing supports XID events; look again later
                return
            while not self._stop.is_set() and self._devices()[0] == generation:
                event = event_set.wait(WAIT_MS)
                if event is not None and event[0] in by_handle:
                    self.counts.record(by_handle[event[0]], event[1], time.time())
        finally:
            event_set.free()

    def _register(self, event_set: XidEventSet, devices: list[GpuDevice]) -> dict[int, str]:
        by_handle: dict[int, str] = {}
        for dev in devices:
            refused = event_set.register(dev.handle)
            if refused is not None:
                if refused != "not_supported":
                    log.info("xid watcher: gpu %s not registered (%s)", dev.index, refused)
                continue
            # Cache the UUID now: the GPU may be unreadable when its event arrives.
            by_handle[handle_key(dev.handle)] = dev.uuid
        self.registered = set(by_handle.values())
        return by_handle
