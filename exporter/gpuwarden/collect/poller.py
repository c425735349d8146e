"""The poller: the fast and slow loops, each running its tier for every GPU and publishing a snapshot.

The poller keeps the loops: a fast and a slow loop on the exporter's own timers, each running its tier for
every GPU and publishing a snapshot on the tier's own cadence.

The parts it drives call one way and do not call back:
- `tiers.TierRunner` reads a tier on each GPU's worker and returns one outcome per GPU; a stuck GPU never holds a
  cycle past the publish wait (its last values are served, marked stale);
- `lifecycle.NvmlLifecycle` owns NVML's state and the GPUs': init, discovery and re-discovery under deadlines,
  and what each outcome means (reading kept, lost, re-init, exit);
- `assembly.SnapshotAssembler` merges readings into an immutable snapshot and runs the enrichment steps it is
  handed (collect/ builds none of them: the composition root does, gpuwarden/runtime/pipeline.py).
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpuwarden.collect.assembly import GpuView, SnapshotAssembler, TopologyStep
from gpuwarden.collect.kernel_log import KernelLogTally, KnownDevices, on_wall_clock, with_kernel_xids
from gpuwarden.collect.kernel_log_follower import KernelLogFollower
from gpuwarden.collect.lifecycle import NvmlLifecycle
from gpuwarden.collect.reader import Reader
from gpuwarden.collect.tiers import TierRunner
from gpuwarden.collect.xid_events import XidCounts, XidWatcher
from gpuwarden.model.draft import EnrichmentStep
from gpuwarden.model.snapshot import EMPTY, Snapshot, Tier
from gpuwarden.nvml import gpm_sampler, library
from gpuwarden.nvml.device import ErrorLedger, GpuDevice
from gpuwarden.workers import WorkerPool

log = logging.getLogger(__name__)

# A cycle waits this share of its interval for every GPU's answer before publishing those that answered.
PUBLISH_WAIT_SHARE = 0.5
PUBLISH_WAIT_MIN_S = 0.25


@dataclass(frozen=True)
class PollPlan:
    """What the loops need of the settings, as plain values: collect/ knows nothing of config/ (the composition
    root, gpuwarden/runtime/pipeline.py, builds a plan from the settings and hands a new one in on reload).

    The interval names are PollSettings' own: a reader's `every=` names one of them (tests/test_tiers.py)."""

    readers: Mapping[Tier, Sequence[Reader]]
    fast_interval: float
    slow_interval: float
    samples_interval: float
    nvlink_errors_interval: float
    call_deadline: float
    on_missing: str  # stay_up | exit: when NVML cannot be loaded at start
    xid_events: bool
    devices: tuple[str, ...] = ()  # the GPUs watched, by index or UUID; empty: every GPU
    kernel_log: str = ""  # the kernel log's path (/dev/kmsg), read for XIDs from boot on; empty: not read


class Poller:
    def __init__(
        self,
        plan: PollPlan,
        steps: Sequence[EnrichmentStep] = (),
        wall_clock: Callable[[], float] = time.time,
        pool: WorkerPool | None = None,
        started_init: concurrent.futures.Future[Any] | None = None,
    ) -> None:
        """`steps`: the enrichment steps after the topology matrix, in order; `pool` and `started_init`: a worker
        pool on which lifecycle.start_init already began NVML's init."""
        self.plan = plan
        self._wall = wall_clock
        self.ledger = ErrorLedger()
        self.xid = XidCounts()
        self.known_devices = KnownDevices()  # the host's GPUs and NVSwitches: the addresses the kernel log may name
        self.kernel = KernelLogTally(self.known_devices)
        self.kernel_reader: KernelLogFollower | None = None
        self.pool = pool or WorkerPool()
        self.runner = TierRunner(
            self.pool, lambda: self.plan.readers, lambda name: getattr(self.plan, name), wall_clock
        )
        self.nvml = NvmlLifecycle(
            self.pool,
            self.runner,
            self.ledger,
            deadline=lambda: self.plan.call_deadline,
            on_missing=lambda: self.plan.on_missing,
            started_init=started_init,
            devices=lambda: self.plan.devices,
        )
        self._topology = TopologyStep(lambda: self.nvml.pairs)
        self.assembler = SnapshotAssembler((self._topology, *steps))
        self.tier_duration: dict[str, float] = {}
        self.tier_finished: dict[str, float] = {}
        self._snapshot = EMPTY
        self._publish_lock = threading.Lock()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._watcher = XidWatcher(self._event_devices, self.xid) if plan.xid_events else None
        self.ready_once = threading.Event()  # set after the first fast cycle was published

    # -- public ----------------------------------------------------------------------------------------

    @property
    def fatal(self) -> str | None:
        """Why the process must exit (the driver changed under it, or no library and `on_missing: exit`)."""
        return self.nvml.fatal

    @property
    def snapshot(self) -> Snapshot:
        return self._snapshot

    def reconfigure(self, plan: PollPlan, rebuild_steps: Callable[[], Sequence[EnrichmentStep]]) -> None:
        """A reload: the new plan and steps take effect at the next cycle. `rebuild_steps` runs between two
        publications (steps that take over their predecessors' state find it settled); the plan and the steps are
        each swapped whole, so a cycle sees the old or the new ones, never a mix."""
        with self._publish_lock:
            self.assembler.steps = (self._topology, *rebuild_steps())
        previous, self.plan = self.plan, plan
        if plan.kernel_log != previous.kernel_log and self._threads:
            self.follow_kernel_log(plan.kernel_log)
        if plan.xid_events != (self._watcher is not None):
            if self._watcher is not None:
                self._watcher.stop()
                self._watcher = None
            else:
                self._watcher = XidWatcher(self._event_devices, self.xid)
                if self._threads:
                    self._watcher.start()

    def start(self) -> None:
        for name, loop in (("gpuwarden-fast", self._fast_loop), ("gpuwarden-slow", self._slow_loop)):
            thread = threading.Thread(target=loop, name=name, daemon=True)
            thread.start()
            self._threads.append(thread)
        if self._watcher is not None:
            self._watcher.start()
        self.follow_kernel_log(self.plan.kernel_log)

    def follow_kernel_log(self, path: str) -> None:
        """Start (or restart on a reload that changed the path, or stop) the kernel log's reader; a new path is
        read from boot into a fresh tally. The reader starts once the GPUs are known: at once where the kernel
        driver lists them, else after NVML's discovery (_publish)."""
        if self.kernel_reader is not None:
            self.kernel_reader.stop()
            self.kernel_reader = None
            self.kernel = KernelLogTally(self.known_devices)
        if path:
            driver = [gpu.bus_id for gpu in library.driver_gpus()]
            self.known_devices.add(driver, library.nvswitches(), ready=bool(driver))
            self.kernel_reader = KernelLogFollower(Path(path), self.kernel)
            self.kernel_reader.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Stop the loops; shut NVML down only if no call is wedged (docs/nvml.md, Hangs)."""
        if self.kernel_reader is not None:
            self.kernel_reader.stop()
        self._stop.set()
        if self._watcher is not None:
            self._watcher.stop()
        for thread in self._threads:
            thread.join(timeout)
        gpm_sampler.reset()  # the GPM child process ends with the poller
        self.nvml.shutdown()
        self.pool.stop()

    def poll_once(self) -> Snapshot:
        """One fast cycle (initialising if needed) and one slow cycle, each waiting out the call deadline, then
        a publication: synchronous, for tests and tools."""
        deadline = self.plan.call_deadline
        self._fast_cycle(deadline)
        self._tier_cycle(Tier.SLOW, deadline)
        return self._publish()

    # -- loops -----------------------------------------------------------------------------------------

    def _publish_wait(self, interval: float) -> float:
        return min(self.plan.call_deadline, max(interval * PUBLISH_WAIT_SHARE, PUBLISH_WAIT_MIN_S))

    def _fast_loop(self) -> None:
        next_tick = time.monotonic()
        while not self._stop.is_set():
            interval = self.plan.fast_interval  # read each cycle: a reload may change it
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
        self.ready_once.wait(self.plan.call_deadline * 2)
        next_tick = time.monotonic()
        while not self._stop.is_set():
            interval = self.plan.slow_interval
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
        outcomes = self.runner.run(tier, self.nvml.up_devices(), wait, self.plan.call_deadline)
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
            taken_at = self._wall()
            bus_ids = _bus_ids(nvml.gpus.values())
            if nvml.nvml_up:  # discovery is done: every GPU NVML or the driver names, lost ones too
                self.known_devices.add(bus_ids)
            kernel = on_wall_clock(self.kernel.counts(), taken_at - library.uptime())
            reader = self.kernel_reader
            snapshot = self.assembler.assemble(
                views,
                taken_at=taken_at,
                nvml_up=nvml.nvml_up,
                nvml_error=nvml.nvml_error,
                driver=dict(nvml.driver) if nvml.nvml_up else {},
                xid=with_kernel_xids(self.xid.snapshot(), kernel, bus_ids),
                kernel=kernel,
                kernel_log_up=None if reader is None else reader.reading,
                kernel_log_ignored=self.kernel.ignored() if reader is not None else {},
                collect_errors=self.ledger.errors(),
                collect_timeouts=self.ledger.timeouts(),
                reinit_total=nvml.reinit_total,
                gpus_skipped=dict(nvml.skipped) if nvml.nvml_up else {},
                tier_duration=dict(self.tier_duration),
                tier_finished=dict(self.tier_finished),
            )
            self._snapshot = snapshot
            return snapshot


def _bus_ids(states) -> dict[str, str]:  # noqa: ANN001 - the lifecycle's GPU states
    """PCI bus ID (as NVML gives it) → UUID, for every GPU whose static readings name one (lost ones too)."""
    out = {}
    for state in states:
        static = state.readings.get(Tier.STATIC)
        bus_id = static.info.get("pci_bus_id") if static is not None else None
        if bus_id:
            out[bus_id] = state.device.uuid
    return out
