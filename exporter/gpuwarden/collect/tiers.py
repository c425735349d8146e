"""One tier's reads for every GPU, concurrently, each on its GPU's own worker: an outcome per GPU, no side effects.

The runner never waits on a stuck GPU past the cycle's wait: a GPU that has not answered is `Waiting` (its last
values are served as they were) until its call deadline passes, then `Stuck` (abandoned, marked stale: counted
once, logged once). Its worker accepts nothing new until the hung call returns; the answer it then gives is used.
What an outcome means for the GPU or the library (lost, re-init, exit) is the poller's decision, not the runner's.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gpuwarden.collect.reader import Reader
from gpuwarden.model.snapshot import SampleWriter, Tier, TierReading
from gpuwarden.nvml.device import GpuDevice
from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError
from gpuwarden.workers import WorkerPool


@dataclass(frozen=True, slots=True)
class Read:
    """The tier answered: its reading."""

    reading: TierReading


@dataclass(frozen=True, slots=True)
class Waiting:
    """Submitted, not answered yet, still inside the call deadline."""


@dataclass(frozen=True, slots=True)
class Stuck:
    """The tier's reads are still inside an NVML call past the deadline."""

    call: str  # the NVML call it is inside
    newly: bool  # True the first cycle past the deadline (count and log once)


@dataclass(frozen=True, slots=True)
class Lost:
    """The GPU fell off the bus (or is otherwise gone) during the read."""

    reason: str


@dataclass(frozen=True, slots=True)
class LibraryDown:
    """NVML itself stopped answering (driver unloaded, library missing)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Fatal:
    """NVML cannot be used again by this process (the driver changed under it)."""

    reason: str


@dataclass(frozen=True, slots=True)
class Failed:
    """The read raised something unexpected (a bug): logged by the poller, the GPU keeps its last values."""

    error: BaseException


Outcome = Read | Waiting | Stuck | Lost | LibraryDown | Fatal | Failed


@dataclass(slots=True)
class _Pending:
    """A read handed to a GPU's worker, and when: so a late answer is not mistaken for a new one."""

    future: concurrent.futures.Future[Any]
    started: float
    abandoned: bool = False


def worker_key(tier: Tier, uuid: str) -> str:
    return f"{tier.value}-{uuid}"


class TierRunner:
    """Runs readers for a tier on each GPU's worker and turns what happened into outcomes."""

    def __init__(
        self,
        pool: WorkerPool,
        readers: Callable[[], dict[Tier, list[Reader]]],
        reader_interval: Callable[[str], float],
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self._pool = pool
        self._readers = readers  # read at each call: a reload may change the selection
        self._reader_interval = reader_interval  # PollSettings field name → seconds
        self._wall = wall_clock
        self._pending: dict[str, _Pending] = {}

    def read(self, dev: GpuDevice, tier: Tier) -> TierReading:
        """Every selected reader of the tier on one GPU (runs on the GPU's worker thread)."""
        out = SampleWriter()
        now = time.monotonic()
        for reader in self._readers()[tier]:
            if reader.every is None:
                own = SampleWriter(reader.families)
                reader.read(dev, own)
                out.samples.extend(own.samples)
                out.info.update(own.info)
                continue
            # A reader slower than its tier: run it when due, else serve what it read last time.
            cached = dev.reader_cache.get(reader.name)
            if cached is None or now >= cached[0]:
                own = SampleWriter(reader.families)
                reader.read(dev, own)
                cached = (now + self._reader_interval(reader.every), tuple(own.samples), own.info)
                dev.reader_cache[reader.name] = cached
            out.samples.extend(cached[1])
            out.info.update(cached[2])
        return TierReading(tuple(out.samples), out.info, self._wall())

    def run(
        self,
        tier: Tier,
        devices: list[GpuDevice],
        wait: float,
        deadline: float,
        job: Callable[[GpuDevice], TierReading] | None = None,
    ) -> dict[str, Outcome]:
        """Start (or keep waiting on) each GPU's job, wait up to `wait` s for all, and say how each one stands."""
        job = job or (lambda dev: self.read(dev, tier))
        started = time.monotonic()
        mine: dict[str, tuple[GpuDevice, _Pending]] = {}
        busy: dict[str, Outcome] = {}
        for dev in devices:
            key = worker_key(tier, dev.uuid)
            pending = self._pending.get(key)
            if pending is None:
                future = self._pool.submit(key, lambda dev=dev: job(dev))
                if future is None:  # still inside a job this runner stopped tracking (the GPU was lost meanwhile)
                    busy[dev.uuid] = Stuck(f"{tier.value}_tier", newly=False)
                    continue
                pending = self._pending[key] = _Pending(future, started)
            mine[key] = (dev, pending)
        futures = [pending.future for _, pending in mine.values() if not pending.future.done()]
        if futures:
            concurrent.futures.wait(futures, timeout=max(wait, 0.0))
        outcomes: dict[str, Outcome] = busy
        now = time.monotonic()
        for key, (dev, pending) in mine.items():
            if not pending.future.done():
                if now - pending.started < deadline:
                    outcomes[dev.uuid] = Waiting()
                    continue
                newly, pending.abandoned = not pending.abandoned, True
                stuck_in = next(iter(dev.in_flight.values()), f"{tier.value}_tier")
                outcomes[dev.uuid] = Stuck(stuck_in, newly)
                continue
            if self._pending.pop(key, None) is not pending:
                continue  # forgotten meanwhile by the other tier's loop (the GPU was lost): its answer is not used
            outcomes[dev.uuid] = _outcome(pending.future)
        return outcomes

    def forget(self, uuid: str) -> None:
        """Drop what is pending for a GPU (lost, or NVML went down): a late answer is not used."""
        for tier in Tier:
            self._pending.pop(worker_key(tier, uuid), None)


def _outcome(future: concurrent.futures.Future[Any]) -> Outcome:
    try:
        return Read(future.result())
    except GpuLostError as exc:
        return Lost(exc.reason)
    except NvmlDownError as exc:
        return LibraryDown(exc.reason)
    except NvmlFatalError as exc:
        return Fatal(str(exc))
    except Exception as exc:  # noqa: BLE001 - a bug in a reader: reported as an outcome, never raised here
        return Failed(exc)
