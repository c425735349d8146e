"""The poller keeps the loops: a fast and a slow loop on the exporter's own timers, each running its tier for
every GPU and publishing a snapshot on the tier's own cadence.

The parts it drives call one way and do not call back:
- `tiers.TierRunner` reads a tier on each GPU's worker and returns one outcome per GPU; a stuck GPU never holds a
  cycle past the publish wait (its last values are served, marked stale);
- `lifecycle.NvmlLifecycle` owns NVML's state and the GPUs': init, discovery and re-discovery under deadlines,
  and what each outcome means (reading kept, lost, re-init, exit);
- `assembly.SnapshotAssembler` merges readings into an immutable snapshot and runs the enrichment steps.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from gpuwarden.attribution import podresources
from gpuwarden.attribution.host import HostProcesses
from gpuwarden.attribution.processes import ProcessesStep
from gpuwarden.collect.assembly import GpuView, HealthStep, PodsStep, SnapshotAssembler, TopologyStep
from gpuwarden.collect.lifecycle import NvmlLifecycle
from gpuwarden.collect.readers import Reader, all_readers
from gpuwarden.collect.tiers import TierRunner
from gpuwarden.collect.xid_events import XidCounts, XidWatcher
from gpuwarden.config.settings import Settings
from gpuwarden.health.checks import HealthEvaluator
from gpuwarden.health.thresholds import load_thresholds
from gpuwarden.model.families import family_filter
from gpuwarden.model.snapshot import EMPTY, Snapshot, Tier
from gpuwarden.nvml import gpm_sampler
from gpuwarden.nvml.device import ErrorLedger, GpuDevice
from gpuwarden.workers import WorkerPool

log = logging.getLogger(__name__)

# A cycle waits this share of its interval for every GPU's answer before publishing those that answered.
PUBLISH_WAIT_SHARE = 0.5
PUBLISH_WAIT_MIN_S = 0.25


def select_readers(settings: Settings) -> dict[Tier, list[Reader]]:
    """A reader with no wanted family is never run: query only what is exported (docs/nvml.md, Cost classes)."""
    wanted = family_filter(settings.metrics.include, settings.metrics.exclude)
    readers: dict[Tier, list[Reader]] = {tier: [] for tier in Tier}
    for reader in all_readers():
        if reader.name == "gpm" and not settings.nvml.gpm:
            continue
        if not reader.families or any(wanted(family.name) for family in reader.families):
            readers[reader.tier].append(reader)
    return readers


class Poller:
    def __init__(
        self,
        settings: Settings,
        wall_clock: Callable[[], float] = time.time,
        pool: WorkerPool | None = None,
        started_init: concurrent.futures.Future[Any] | None = None,
    ) -> None:
        """`pool` and `started_init`: a worker pool on which lifecycle.start_init already began NVML's init."""
        self.settings = settings
        self._wall = wall_clock
        self.health = HealthEvaluator(load_thresholds(settings.health.thresholds_file))
        self.readers = select_readers(settings)
        gpm_sampler.reset()
        self._configure_gpm(settings)
        self.ledger = ErrorLedger()
        self.xid = XidCounts()
        self.pool = pool or WorkerPool()
        self.runner = TierRunner(
            self.pool, lambda: self.readers, lambda name: getattr(self.settings.poll, name), wall_clock
        )
        self.nvml = NvmlLifecycle(
            self.pool,
            self.runner,
            self.ledger,
            deadline=lambda: self.settings.poll.call_deadline,
            on_missing=lambda: self.settings.nvml.on_missing,
            started_init=started_init,
        )
        self.pods = self._pod_attribution(settings)
        self.host = HostProcesses(settings.processes.proc_root, settings.processes.pod_logs_root)
        self.assembler = SnapshotAssembler(
            [
                TopologyStep(lambda: self.nvml.pairs),
                HealthStep(lambda: self.health),
                PodsStep(lambda: self.pods),
                ProcessesStep(
                    self.host,
                    lambda: self.settings.processes.max_pid_series if self.settings.processes.per_pid_series else 0,
                ),
            ]
        )
        self.tier_duration: dict[str, float] = {}
        self.tier_finished: dict[str, float] = {}
        self._snapshot = EMPTY
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watcher = XidWatcher(self._event_devices, self.xid) if settings.nvml.xid_events else None
        self.ready_once = threading.Event()  # set after the first fast cycle was published

    def _pod_attribution(self, settings: Settings) -> podresources.PodAttribution | None:
        pods = settings.pods
        if not pods.attribution:
            return None
        return podresources.PodAttribution(
            pods.resources_socket,
            pods.refresh_interval,
            pods.resource_names,
            wall_clock=self._wall,
            dra_drivers=pods.dra_drivers,
        )

    # -- public ----------------------------------------------------------------------------------------

    @property
    def fatal(self) -> str | None:
        """Why the process must exit (the driver changed under it, or no library and `on_missing: exit`)."""
        return self.nvml.fatal

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    @staticmethod
    def _configure_gpm(settings: Settings) -> None:
        nvml = settings.nvml
        gpm_sampler.configure(nvml.gpm_isolation, nvml.gpm_crash_limit, nvml.gpm_crash_backoff)

    def reconfigure(self, settings: Settings) -> None:
        """Apply a reloaded configuration: intervals, deadlines, metric selection and thresholds take effect at
        the next cycle. Each attribute is swapped whole, so a cycle sees the old or the new value, never a mix."""
        self._configure_gpm(settings)
        self.readers = select_readers(settings)
        self.health.thresholds = load_thresholds(settings.health.thresholds_file)
        if settings.pods != self.settings.pods:
            old, self.pods = self.pods, self._pod_attribution(settings)
            if old is not None:
                old.stop()
            if self.pods is not None and self._threads:
                self.pods.start()
        self.settings = settings

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
        """Stop the loops; shut NVML down only if no call is wedged (docs/nvml.md, Hangs)."""
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        if self.pods is not None:
            self.pods.stop()
        for thread in self._threads:
            thread.join(timeout)
        gpm_sampler.reset()  # the GPM child process ends with the poller
        self.nvml.shutdown()
        self.pool.stop()

    def poll_once(self) -> Snapshot:
        """One fast cycle (initialising if needed) and one slow cycle, each waiting out the call deadline, then
        a publication: synchronous, for tests and tools (the host lookups it started, user names and pod logs, are
        waited for after it, up to the call deadline, so the next poll sees them)."""
        deadline = self.settings.poll.call_deadline
        self._fast_cycle(deadline)
        self._tier_cycle(Tier.SLOW, deadline)
        snapshot = self._publish()
        self.host.lookups.wait_idle(deadline)
        return snapshot

    # -- loops -----------------------------------------------------------------------------------------

    def _publish_wait(self, interval: float) -> float:
        return min(self.settings.poll.call_deadline, max(interval * PUBLISH_WAIT_SHARE, PUBLISH_WAIT_MIN_S))

    def _fast_loop(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            interval = self.settings.poll.fast_interval  # read each cycle: a reload may change it
            try:
                self._fast_cycle(self._publish_wait(interval))
                self._publish()
                if not self.ready_once.is_set():
                    log.info(
                        "first snapshot published %.0f ms after the poller started",
                        1000 * (time.monotonic() - next_tick),
                    )
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
                if self.nvml.nvml_up:
                    self._tier_cycle(Tier.SLOW, self._publish_wait(interval))
                    self._publish()
            except Exception:
                log.exception("slow poll cycle failed")
            next_tick = max(next_tick + interval, time.monotonic())
            self._stop.wait(max(next_tick - time.monotonic(), 0))

    def _fast_cycle(self, wait: float) -> None:
        if not self.nvml.ensure_up():
            return
        self.nvml.rediscover_lost()
        self._tier_cycle(Tier.FAST, wait)

    def _tier_cycle(self, tier: Tier, wait: float) -> None:
        if not self.nvml.nvml_up:
            return
        started = time.monotonic()
        outcomes = self.runner.run(tier, self.nvml.up_devices(), wait, self.settings.poll.call_deadline)
        self.nvml.apply(tier, outcomes)
        self.tier_duration[tier.value] = time.monotonic() - started
        self.tier_finished[tier.value] = self._wall()

    # -- publication -----------------------------------------------------------------------------------

    def _event_devices(self) -> tuple[int, list[GpuDevice]]:
        with self.nvml.lock:
            if not self.nvml.nvml_up or self.nvml.discovering:
                return self.nvml.generation, []
            return self.nvml.generation, self.nvml.up_devices()

    def _publish(self) -> Snapshot:
        nvml = self.nvml
        with self._publish_lock, nvml.lock:
            views = [
                GpuView(
                    index=state.device.index,
                    uuid=state.device.uuid,
                    up=state.up,
                    stale=bool(state.stuck),
                    lost_reason=state.lost_reason,
                    hardware_error=state.device.hardware_error,
                    readings=dict(state.readings),
                )
                for state in sorted(nvml.gpus.values(), key=lambda st: st.device.index)
            ]
            snapshot = self.assembler.assemble(
                views,
                taken_at=self._wall(),
                nvml_up=nvml.nvml_up,
                nvml_error=nvml.nvml_error,
                driver=dict(nvml.driver) if nvml.nvml_up else {},
                xid=self.xid.snapshot(),
                collect_errors=self.ledger.errors(),
                collect_timeouts=self.ledger.timeouts(),
                reinit_total=nvml.reinit_total,
                gpus_skipped=dict(nvml.skipped) if nvml.nvml_up else {},
                tier_duration=dict(self.tier_duration),
                tier_finished=dict(self.tier_finished),
            )
            self._snapshot = snapshot
            return snapshot
