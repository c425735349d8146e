"""Polls NVML on the exporter's own timers and publishes immutable snapshots.

- Three tiers: static (at discovery), fast (every fast interval), slow (every slow interval), each on its own
  loop, so a slow or hung read never delays the fast tier.
- Each GPU's reads for a tier run on that GPU's own worker thread; all GPUs are read concurrently. A job that
  overruns the call deadline is abandoned: the GPU's data is marked stale, the timeout counted, and while its
  worker stays stuck no new job is queued behind it, so abandoned threads stay bounded (one per GPU and tier).
- NVML lifecycle: init with backoff, GPU lost → gpu_up 0 and re-discovery by UUID with backoff, library down
  → re-init with backoff, driver upgraded under us → `fatal` is set for the CLI to exit on.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fnmatch import fnmatch
from typing import Any

import pynvml

from exporter import podresources, topology
from exporter.config import Settings
from exporter.events import XidCounts, XidWatcher
from exporter.health.checks import HealthEvaluator
from exporter.health.thresholds import load_thresholds
from exporter.nvml.device import ErrorLedger, GpuDevice
from exporter.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError, error_code, error_name
from exporter.readers import Reader, all_readers
from exporter.snapshot import EMPTY, GpuSnapshot, PeerLink, Sample, SampleWriter, Snapshot, Tier, TierReading

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0


class Worker:
    """A daemon thread that runs one GPU's jobs for one tier. A hung NVML call blocks only this thread."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any] | None, concurrent.futures.Future[Any] | None]] = (
            queue.SimpleQueue()
        )
        self.busy = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def submit(self, job: Callable[[], Any]) -> concurrent.futures.Future[Any] | None:
        """Queue a job, or None while the previous one has not returned (never stack work on a hung call)."""
        if self.busy:
            return None
        self.busy = True
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self._jobs.put((job, future))
        return future

    def stop(self) -> None:
        """Let the thread end once it is idle (a thread stuck in a wedged call ends when the call returns)."""
        self._jobs.put((None, None))

    def _run(self) -> None:
        while True:
            job, future = self._jobs.get()
            if job is None:
                return
            try:
                future.set_result(job())
            except BaseException as exc:  # noqa: BLE001 - delivered to the poller through the future
                future.set_exception(exc)
            finally:
                self.busy = False


@dataclass
class GpuState:
    device: GpuDevice
    up: bool = True
    lost_reason: str | None = None
    readings: dict[Tier, TierReading] = field(default_factory=dict)
    stuck: set[Tier] = field(default_factory=set)
    retry_at: float = 0.0
    backoff: float = BACKOFF_MIN_S


def family_filter(include: tuple[str, ...], exclude: tuple[str, ...]) -> Callable[[str], bool]:
    """A predicate for metric names from include/exclude globs."""

    def wanted(name: str) -> bool:
        if include and not any(fnmatch(name, pattern) for pattern in include):
            return False
        return not any(fnmatch(name, pattern) for pattern in exclude)

    return wanted


class Poller:
    def __init__(self, settings: Settings, wall_clock: Callable[[], float] = time.time) -> None:
        self.settings = settings
        self.health = HealthEvaluator(load_thresholds(settings.health.thresholds_file))
        self._wall = wall_clock
        self.readers = self._select_readers(settings)
        self.ledger = ErrorLedger()
        self.xid = XidCounts()
        self._lock = threading.RLock()
        self._gpus: dict[str, GpuState] = {}
        self._workers: dict[tuple[str, str], Worker] = {}
        self._pairs: dict[tuple[str, str], topology.PairFacts] = {}
        self._matrix_key: tuple[Any, ...] = ()
        self._matrix: dict[str, tuple[PeerLink, ...]] = {}
        self._generation = 0
        self._discovering = False
        self.nvml_up = False
        self.nvml_error: str | None = "starting"
        self.driver: dict[str, str] = {}
        self.reinit_total = 0
        self._initialised_once = False
        self._init_retry_at = 0.0
        self._init_backoff = BACKOFF_MIN_S
        self.fatal: str | None = None
        self.tier_duration: dict[str, float] = {}
        self.tier_finished: dict[str, float] = {}
        self._snapshot_ids = itertools.count(1)
        self._snapshot = EMPTY
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watcher = XidWatcher(self._event_devices, self.xid) if settings.nvml.xid_events else None
        self.pods = self._pod_attribution(settings)
        self.ready_once = threading.Event()  # set after the first fast cycle was published

    @staticmethod
    def _select_readers(settings: Settings) -> dict[Tier, list[Reader]]:
        """A reader with no wanted family is never run: query only what is exported (nvml.md §3)."""
        wanted = family_filter(settings.metrics.include, settings.metrics.exclude)
        readers: dict[Tier, list[Reader]] = {tier: [] for tier in Tier}
        for reader in all_readers():
            if not reader.families or any(wanted(name) for name in reader.families):
                readers[reader.tier].append(reader)
        return readers

    def _pod_attribution(self, settings: Settings) -> podresources.PodAttribution | None:
        pods = settings.pods
        if not pods.attribution:
            return None
        return podresources.PodAttribution(
            pods.resources_socket, pods.refresh_interval, pods.resource_names, wall_clock=self._wall
        )

    # -- public ----------------------------------------------------------------------------------------

    def reconfigure(self, settings: Settings) -> None:
        """Apply a reloaded configuration: intervals, deadlines, metric selection and thresholds take effect at
        the next cycle. Each attribute is swapped whole, so a cycle sees the old or the new value, never a mix."""
        self.readers = self._select_readers(settings)
        self.health.t = load_thresholds(settings.health.thresholds_file)
        if settings.pods != self.settings.pods:
            old, self.pods = self.pods, self._pod_attribution(settings)
            if old is not None:
                old.stop()
            if self.pods is not None and self._threads:
                self.pods.start()
        self.settings = settings

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def start(self) -> None:
        for name, loop in (("gpuwarden-fast", self._fast_loop), ("gpuwarden-slow", self._slow_loop)):
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._watcher is not None:
            self._watcher.start()
        if self.pods is not None:
            self.pods.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loops; shut NVML down only if no call is wedged (nvml.md §11)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        if self.pods is not None:
            self.pods.stop()
        for thread in self._threads:
            thread.join(timeout)
        wedged = any(worker.busy for worker in self._workers.values())
        for worker in self._workers.values():
            worker.stop()
        if self.nvml_up and not wedged:
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def poll_once(self) -> Snapshot:
        """One fast cycle (initialising if needed) and one slow cycle, synchronously: for tests and tools."""
        self._fast_cycle()
        self._tier_cycle(Tier.SLOW)
        return self._publish()

    # -- loops -----------------------------------------------------------------------------------------

    def _fast_loop(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            interval = self.settings.poll.fast_interval  # read each cycle: a reload may change it
            try:
                self._fast_cycle()
                self._publish()
                self.ready_once.set()
            except Exception:  # a bug in one cycle must not end collection
                log.exception("fast poll cycle failed")
            next_tick = max(next_tick + interval, time.monotonic())
            self._stop.wait(max(next_tick - time.monotonic(), 0))

    def _slow_loop(self) -> None:
        self.ready_once.wait(self.settings.poll.call_deadline * 2)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            interval = self.settings.poll.slow_interval
            try:
                if self.nvml_up:
                    self._tier_cycle(Tier.SLOW)
                    self._publish()
            except Exception:
                log.exception("slow poll cycle failed")
            next_tick = max(next_tick + interval, time.monotonic())
            self._stop.wait(max(next_tick - time.monotonic(), 0))

    def _fast_cycle(self) -> None:
        if self.fatal:
            return
        if not self.nvml_up and (time.monotonic() < self._init_retry_at or not self._initialise()):
            return
        self._rediscover_lost()
        self._tier_cycle(Tier.FAST)

    # -- NVML lifecycle ----------------------------------------------------------------------------------

    def _initialise(self) -> bool:
        try:
            pynvml.nvmlInitWithFlags(pynvml.NVML_INIT_FLAG_NO_GPUS)
            self.driver = {
                "driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
                "nvml_version": _text(pynvml.nvmlSystemGetNVMLVersion()),
                "cuda_driver_version": _cuda_version(pynvml.nvmlSystemGetCudaDriverVersion_v2()),
            }
            count = pynvml.nvmlDeviceGetCount()
        except pynvml.NVMLError as exc:
            self._library_down(error_name(error_code(exc)), initialising=True)
            return False
        self.nvml_up, self.nvml_error = True, None
        if self._initialised_once:
            self.reinit_total += 1
        self._initialised_once = True
        self._init_backoff = BACKOFF_MIN_S
        log.info("nvml up: driver %s, %d GPU(s)", self.driver["driver_version"], count)
        self._discover(count)
        return self.nvml_up

    def _discover(self, count: int) -> None:
        self._discovering = True  # the XID watcher registers once discovery is complete, not halfway
        try:
            self._discover_gpus(count)
        finally:
            self._discovering = False

    def _discover_gpus(self, count: int) -> None:
        found: list[GpuDevice] = []
        for index in range(count):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(index)
                uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
            except pynvml.NVMLError as exc:
                # NoPermission: a GPU this container may not open. Lost: it will show as missing.
                log.warning("gpu %d skipped at discovery: %s", index, error_name(error_code(exc)))
                continue
            with self._lock:
                state = self._gpus.get(uuid)
                if state is None:
                    state = GpuState(GpuDevice(index, uuid, handle, self.ledger))
                    self._gpus[uuid] = state
                state.device.index = index
                state.device.rebind(handle)
                state.up, state.lost_reason, state.readings, state.stuck = True, None, {}, set()
            found.append(state.device)
        self._run_static([self._gpus[d.uuid] for d in found])
        self._probe_topology()

    def _run_static(self, states: list[GpuState]) -> None:
        self._run_jobs(Tier.STATIC, states, lambda st: self._read_tier(st.device, Tier.STATIC))
        with self._lock:
            self._generation += 1

    def _probe_topology(self) -> None:
        devices = [st.device for st in self._gpus.values() if st.up]
        worker = self._worker("topology", Tier.STATIC)
        future = worker.submit(lambda: topology.probe_pairs(devices))
        if future is None:
            return
        try:
            self._pairs = future.result(timeout=self.settings.poll.call_deadline)
        except concurrent.futures.TimeoutError:
            self.ledger.timeout("nvmlDeviceGetTopologyCommonAncestor")
        except (GpuLostError, NvmlDownError, NvmlFatalError) as exc:
            log.warning("topology probe failed: %s", exc)

    def _library_down(self, reason: str, initialising: bool = False) -> None:
        """NVML is gone (driver unloaded, library missing): drop every GPU's series, re-init with backoff."""
        if reason == "lib_rm_version_mismatch":
            self._fatal(reason)
            return
        if not self.nvml_up and not initialising:
            return  # already down (a late answer from another tier): the re-init is scheduled
        first_failure = not self._initialised_once and initialising
        if first_failure and reason == "library_not_found" and self.settings.nvml.on_missing == "exit":
            self._fatal(reason)
            return
        if self.nvml_up or self.nvml_error != reason:
            log.warning("nvml down: %s; retrying in %.0f s", reason, self._init_backoff)
        was_up = self.nvml_up
        self.nvml_up, self.nvml_error = False, reason
        with self._lock:
            for state in self._gpus.values():
                state.readings, state.stuck = {}, set()
            self._generation += 1
        if was_up and not any(worker.busy for worker in self._workers.values()):
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()
        self._init_retry_at = time.monotonic() + self._init_backoff
        self._init_backoff = min(self._init_backoff * 2, BACKOFF_MAX_S)

    def _fatal(self, reason: str) -> None:
        log.error("nvml: %s (the driver changed under this process); exiting so it is restarted", reason)
        self.nvml_up, self.nvml_error, self.fatal = False, reason, reason
        with self._lock:
            for state in self._gpus.values():
                state.readings = {}

    def _mark_lost(self, state: GpuState, reason: str) -> None:
        if state.up:
            log.warning(
                "gpu %d (%s) lost: %s; its series are dropped until it returns",
                state.device.index,
                state.device.uuid,
                reason,
            )
        # Keep only the static identity: alerts name the model and serial of the GPU that fell off the bus.
        identity = {Tier.STATIC: state.readings[Tier.STATIC]} if Tier.STATIC in state.readings else {}
        state.up, state.lost_reason, state.readings, state.stuck = False, reason, identity, set()
        state.retry_at = time.monotonic() + state.backoff
        state.backoff = min(state.backoff * 2, BACKOFF_MAX_S)
        with self._lock:
            self._generation += 1

    def _rediscover_lost(self) -> None:
        due = [st for st in self._gpus.values() if not st.up and time.monotonic() >= st.retry_at]
        if not due:
            return

        def rediscover(state: GpuState) -> TierReading:
            handle = pynvml.nvmlDeviceGetHandleByUUID(state.device.uuid)
            state.device.rebind(handle)
            return self._read_tier(state.device, Tier.STATIC)

        def job(state: GpuState) -> TierReading:
            try:
                return rediscover(state)
            except pynvml.NVMLError as exc:
                raise GpuLostError(error_name(error_code(exc))) from None

        returned = self._run_jobs(Tier.STATIC, due, job, lost_ok=True)
        for state in returned:
            log.info("gpu %d (%s) is back", state.device.index, state.device.uuid)
            state.up, state.lost_reason, state.backoff = True, None, BACKOFF_MIN_S
        if returned:
            with self._lock:
                self._generation += 1
            self._probe_topology()

    # -- tiers -----------------------------------------------------------------------------------------

    def _worker(self, uuid: str, tier: Tier) -> Worker:
        key = (uuid, tier.value)
        worker = self._workers.get(key)
        if worker is None:
            worker = self._workers[key] = Worker(f"gpuwarden-{tier.value}-{uuid[-8:]}")
        return worker

    def _read_tier(self, dev: GpuDevice, tier: Tier) -> TierReading:
        out = SampleWriter()
        now = time.monotonic()
        for reader in self.readers[tier]:
            if reader.every is None:
                reader.read(dev, out)
                continue
            # A reader slower than its tier: run it when due, else serve what it read last time.
            cached = dev.reader_cache.get(reader.name)
            if cached is None or now >= cached[0]:
                own = SampleWriter()
                reader.read(dev, own)
                cached = (now + getattr(self.settings.poll, reader.every), tuple(own.samples), own.info)
                dev.reader_cache[reader.name] = cached
            out.samples.extend(cached[1])
            out.info.update(cached[2])
        return TierReading(tuple(out.samples), out.info, self._wall())

    def _tier_cycle(self, tier: Tier) -> None:
        if not self.nvml_up:
            return
        started = time.monotonic()
        states = [st for st in self._gpus.values() if st.up]
        self._run_jobs(tier, states, lambda st: self._read_tier(st.device, tier))
        self.tier_duration[tier.value] = time.monotonic() - started
        self.tier_finished[tier.value] = self._wall()

    def _run_jobs(
        self, tier: Tier, states: list[GpuState], job: Callable[[GpuState], TierReading], lost_ok: bool = False
    ) -> list[GpuState]:
        """Run `job` for every GPU concurrently under the deadline; return the GPUs whose job succeeded."""
        futures: dict[str, concurrent.futures.Future[Any]] = {}
        for state in states:
            worker = self._worker(state.device.uuid, tier)
            future = worker.submit(lambda st=state: job(st))
            if future is None:
                state.stuck.add(tier)  # still inside the call abandoned earlier
                continue
            futures[state.device.uuid] = future
        if futures:
            concurrent.futures.wait(futures.values(), timeout=self.settings.poll.call_deadline)
        succeeded = []
        for uuid, future in futures.items():
            state = self._gpus[uuid]
            if not future.done():
                stuck_in = next(iter(state.device.in_flight.values()), f"{tier.value}_tier")
                self.ledger.timeout(stuck_in)
                if tier not in state.stuck:
                    log.warning(
                        "gpu %d: %s read stuck in %s for over %.1f s; serving its last values as stale",
                        state.device.index,
                        tier.value,
                        stuck_in,
                        self.settings.poll.call_deadline,
                    )
                state.stuck.add(tier)
                continue
            try:
                reading = future.result()
            except GpuLostError as exc:
                if lost_ok:
                    state.retry_at = time.monotonic() + state.backoff
                    state.backoff = min(state.backoff * 2, BACKOFF_MAX_S)
                else:
                    self._mark_lost(state, exc.reason)
                continue
            except NvmlDownError as exc:
                self._library_down(exc.reason)
                return []
            except NvmlFatalError as exc:
                self._fatal(str(exc))
                return []
            except Exception:
                log.exception("gpu %d: %s read failed", state.device.index, tier.value)
                self.ledger.error(f"{tier.value}_tier", "exception")
                continue
            state.stuck.discard(tier)
            state.readings[tier] = reading
            succeeded.append(state)
        return succeeded

    # -- publication -----------------------------------------------------------------------------------

    def _event_devices(self) -> tuple[int, list[GpuDevice]]:
        with self._lock:
            if not self.nvml_up or self._discovering:
                return self._generation, []
            return self._generation, [st.device for st in self._gpus.values() if st.up]

    def _publish(self) -> Snapshot:
        with self._lock:
            gpus = []
            active_links: dict[str, set[int]] = {}
            bus_ids: dict[str, str] = {}
            for state in sorted(self._gpus.values(), key=lambda st: st.device.index):
                if not self.nvml_up:
                    break
                samples: list[Sample] = []
                info: dict[str, Any] = {}
                updated: dict[str, float] = {}
                for tier in (Tier.STATIC, Tier.FAST, Tier.SLOW):
                    reading = state.readings.get(tier)
                    if reading is not None:
                        samples.extend(reading.samples)
                        info.update(reading.info)
                        updated[tier.value] = reading.finished_at
                if not state.up:
                    samples = [s for s in samples if s.name == "gpuwarden_gpu_info"]
                bus_ids[state.device.uuid] = info.get("pci_bus_id", "")
                links = [s for s in samples if s.name == "gpuwarden_nvlink_up"]
                if links:
                    active_links[state.device.uuid] = {int(s.labels[0]) for s in links if s.value}
                gpus.append(
                    GpuSnapshot(
                        index=state.device.index,
                        uuid=state.device.uuid,
                        up=state.up,
                        stale=bool(state.stuck),
                        lost_reason=state.lost_reason,
                        hardware_error=state.device.hardware_error,
                        info=info,
                        samples=tuple(samples),
                        updated_at=updated,
                    )
                )
            up_devices = [st.device for st in self._gpus.values() if st.up and self.nvml_up]
            # The matrix changes only with the GPU population or a link's state: rebuild it only then.
            key = (
                tuple((d.index, d.uuid) for d in up_devices),
                id(self._pairs),
                tuple(sorted((uuid, tuple(sorted(links))) for uuid, links in active_links.items())),
            )
            if key != self._matrix_key:
                self._matrix_key = key
                self._matrix = topology.build_matrix(up_devices, bus_ids, self._pairs, active_links)
            matrix = self._matrix
            xid = self.xid.snapshot()
            now = self._wall()
            health = self.health.evaluate(gpus, xid, now) if self.nvml_up else {}
            view = self.pods.view if self.pods is not None else podresources.DISABLED
            pods, unmatched = podresources.assign(
                view, ((g.index, g.uuid, g.info.get("mig_uuids", ())) for g in gpus if g.up)
            )
            snapshot = Snapshot(
                id=next(self._snapshot_ids),
                taken_at=now,
                nvml_up=self.nvml_up,
                nvml_error=self.nvml_error,
                driver=dict(self.driver) if self.nvml_up else {},
                gpus=tuple(gpus),
                topology=matrix,
                xid=xid,
                health=health,
                pods_state=view.state,
                pods=pods,
                pods_unmatched=unmatched,
                collect_errors=self.ledger.errors(),
                collect_timeouts=self.ledger.timeouts(),
                reinit_total=self.reinit_total,
                tier_duration=dict(self.tier_duration),
                tier_finished=dict(self.tier_finished),
            )
            self._snapshot = snapshot
            return snapshot


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _cuda_version(raw: int) -> str:
    """13000 → '13.0' (nvidia-smi's CUDA Version)."""
    return f"{raw // 1000}.{raw % 1000 // 10}"
