"""NVML's lifecycle and each GPU's state: init, discovery, and what each tier's outcome means for a GPU.

NVML's lifecycle and each GPU's state: init with backoff, discovery and re-discovery under deadlines, and what
every tier outcome means for a GPU (reading kept, stale, lost) or for the library (re-init, exit).

Every NVML call made here runs on a worker under the call deadline, discovery included: a GPU whose discovery
hangs is skipped with a log line and a counted timeout, and the others are served.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.collect import topology
from gpuwarden.collect.tiers import Failed, Fatal, LibraryDown, Lost, Outcome, Read, Stuck, TierRunner, Waiting
from gpuwarden.model.snapshot import Tier, TierReading
from gpuwarden.nvml import driver_gpus, session
from gpuwarden.nvml.device import ErrorLedger, GpuDevice
from gpuwarden.nvml.errors import GpuLostError, NvmlDownError, NvmlFatalError
from gpuwarden.nvml.session import GpuSkipped
from gpuwarden.workers import WorkerPool, run_with_deadline

log = logging.getLogger(__name__)

BACKOFF_MIN_S = 1.0
UNKNOWN_UUID_PREFIX = "unknown-gpu-"  # the uuid label of a lost GPU that neither NVML nor the driver names
BACKOFF_MAX_S = 30.0


@dataclass
class GpuState:
    device: GpuDevice
    up: bool = True
    lost_reason: str | None = None
    readings: dict[Tier, TierReading] = field(default_factory=dict)
    stuck: set[Tier] = field(default_factory=set)
    retry_at: float = 0.0
    backoff: float = BACKOFF_MIN_S


class NvmlLifecycle:
    """The GPUs as the poller knows them, and NVML's state; changed only by the poller's threads."""

    def __init__(
        self,
        pool: WorkerPool,
        runner: TierRunner,
        ledger: ErrorLedger,
        deadline: Callable[[], float],
        on_missing: Callable[[], str],
        started_init: concurrent.futures.Future[Any] | None = None,
        devices: Callable[[], tuple[str, ...]] = lambda: (),
    ) -> None:
        self._pool, self._runner, self.ledger = pool, runner, ledger
        self._devices = devices  # the GPUs watched (index or UUID), read at each discovery; empty: all
        self._started_init = started_init  # start_init()'s future: NVML began while the rest was imported
        self._deadline = deadline  # read at each use: a reload may change it
        self._on_missing = on_missing
        self.lock = threading.RLock()
        self.gpus: dict[str, GpuState] = {}
        self.generation = 0  # bumped whenever the set of answering GPUs may have changed
        self.discovering = False
        self.pairs: dict[tuple[str, str], topology.PairFacts] = {}
        self.nvml_up = False
        self.nvml_error: str | None = "starting"
        self.driver: dict[str, str] = {}
        self.reinit_total = 0
        self.skipped: dict[int, str] = {}  # GPUs NVML counts that discovery could not open: index → why
        self.fatal: str | None = None
        self._initialised_once = False
        self._init_retry_at = 0.0
        self._init_backoff = BACKOFF_MIN_S

    # -- queries --------------------------------------------------------------------------------------------

    def up_devices(self) -> list[GpuDevice]:
        return [state.device for state in self.gpus.values() if state.up] if self.nvml_up else []

    def wedged(self) -> bool:
        return bool(self._pool.busy())

    # -- init and discovery ---------------------------------------------------------------------------------

    def ensure_up(self) -> bool:
        """True when NVML is up, initialising it first when its retry is due."""
        if self.fatal:
            return False
        if self.nvml_up:
            return True
        if time.monotonic() < self._init_retry_at:
            return False
        return self._initialise()

    def _initialise(self) -> bool:
        started, self._started_init = self._started_init, None
        try:
            answered, result = run_with_deadline(
                self._pool, "nvml-init", session.initialise, self._deadline(), started=started
            )
        except NvmlDownError as exc:
            self.library_down(exc.reason, initialising=True)
            return False
        if not answered:
            self._count_timeout("nvml-init", "nvmlInitWithFlags")
            self.library_down("init_timeout", initialising=True)
            return False
        facts, count = result
        self.driver = facts.as_dict()
        self.nvml_up, self.nvml_error = True, None
        if self._initialised_once:
            self.reinit_total += 1
        self._initialised_once = True
        self._init_backoff = BACKOFF_MIN_S
        log.info("nvml up: driver %s, %d GPU(s)", self.driver["driver_version"], count)
        self.discovering = True  # the XID watcher registers once discovery is complete, not halfway
        try:
            self._discover(count)
        finally:
            self.discovering = False
        return self.nvml_up

    def _discover(self, count: int) -> None:
        """Open every GPU concurrently (those `devices` selects), each under the deadline; a GPU that hangs or
        refuses is skipped."""
        deadline = self._deadline()
        selection = DeviceSelection.of(self._devices(), count)
        futures = {
            index: self._pool.submit(f"discover-{index}", lambda i=index: session.open_index(i))
            for index in range(count)
            if selection.may_be(index)
        }
        waiting = [future for future in futures.values() if future is not None]
        concurrent.futures.wait(waiting, timeout=deadline)
        found: list[GpuState] = []
        self.skipped = {}
        with self.lock:  # GPUs known by index only are looked for afresh
            for key in [key for key, state in self.gpus.items() if state.device.handle is None]:
                del self.gpus[key]
        for index, future in futures.items():
            if future is None or not future.done():
                call = self._count_timeout(f"discover-{index}", "nvmlDeviceGetHandleByIndex")
                log.warning("gpu %d skipped at discovery: %s did not answer within %.1f s", index, call, deadline)
                self.skipped[index] = "timeout"
                continue
            try:
                handle, uuid = future.result()
            except GpuSkipped as exc:
                # no_permission: a GPU this container may not open; lost: it will show as missing.
                log.warning("gpu %d skipped at discovery: %s", index, exc.reason)
                self.skipped[index] = exc.reason
                continue
            except NvmlDownError as exc:
                self.library_down(exc.reason)
                return
            if selection.wants(index, uuid):
                found.append(self._register(index, uuid, handle))
        selection.warn_unmatched({state.device.uuid for state in found})
        self.apply(Tier.STATIC, self._runner.run(Tier.STATIC, [s.device for s in found], deadline, deadline))
        self._keep_unopened_in_view(found, selection)
        self.probe_topology()

    def _keep_unopened_in_view(self, found: list[GpuState], selection: DeviceSelection) -> None:
        """Serve each GPU NVML counts but discovery could not open as lost (gpu_up 0), named by the kernel
        driver's list where it can be (a restarted exporter kept a lost GPU out of view: issue 36). One this
        container may not open (no_permission) is not ours to watch: it stays in `skipped`."""
        unopened = sorted(index for index, reason in self.skipped.items() if reason not in ("no_permission", "timeout"))
        if not unopened:
            return
        opened = {st.readings[Tier.STATIC].info.get("pci_bus_id") or "" for st in found if Tier.STATIC in st.readings}
        named = driver_gpus.identify_unopened(unopened, opened, session.driver_gpus())
        now = time.monotonic()
        with self.lock:
            for index in unopened:
                known = named.get(index)
                if not selection.wants(index, known.uuid if known else None):
                    continue  # another exporter's GPU, or one no selector can be matched to
                reason = self.skipped.pop(index)
                uuid = known.uuid if known else f"{UNKNOWN_UUID_PREFIX}{index}"
                state = self.gpus.get(uuid)
                if state is None:
                    state = self.gpus[uuid] = GpuState(GpuDevice(index, uuid, None, self.ledger))
                if known is not None and Tier.STATIC not in state.readings:
                    info = {"name": known.model, "pci_bus_id": known.bus_id}
                    state.readings = {Tier.STATIC: TierReading(samples=(), info=info, finished_at=now)}
                state.device.index, state.device.handle = index, None
                state.up, state.lost_reason, state.stuck = False, reason, set()
                state.retry_at = now + state.backoff
                log.warning("gpu %d (%s) served as lost: discovery could not open it (%s)", index, uuid, reason)
            self.generation += 1

    def _register(self, index: int, uuid: str, handle: Any) -> GpuState:
        with self.lock:
            state = self.gpus.get(uuid)
            if state is None:
                state = self.gpus[uuid] = GpuState(GpuDevice(index, uuid, handle, self.ledger))
            state.device.index = index
            state.device.rebind(handle)
            state.up, state.lost_reason, state.readings, state.stuck = True, None, {}, set()
            self.generation += 1
        return state

    def probe_topology(self) -> None:
        devices = self.up_devices()
        try:
            answered, pairs = run_with_deadline(
                self._pool, "topology", lambda: topology.probe_pairs(devices), self._deadline()
            )
        except (GpuLostError, NvmlDownError, NvmlFatalError) as exc:
            log.warning("topology probe failed: %s", exc)
            return
        if answered:
            self.pairs = pairs
        else:
            self.ledger.timeout("nvmlDeviceGetTopologyCommonAncestor")

    def rediscover_lost(self) -> None:
        """Reopen lost GPUs by UUID when their backoff is due; read their static tier again."""
        due = [st for st in self.gpus.values() if not st.up and time.monotonic() >= st.retry_at]
        if not due:
            return

        def reopen(dev: GpuDevice) -> TierReading:
            if dev.uuid.startswith(UNKNOWN_UUID_PREFIX):  # named by no one: open it where NVML counts it
                try:
                    handle, dev.state["opened_as"] = session.open_index(dev.index)
                except GpuSkipped as exc:
                    raise GpuLostError(exc.reason) from None
            else:
                handle = session.open_uuid(dev.uuid)
            dev.rebind(handle)
            return self._runner.read(dev, Tier.STATIC)

        deadline = self._deadline()
        outcomes = self._runner.run(Tier.STATIC, [st.device for st in due], deadline, deadline, job=reopen)
        returned = False
        for state in due:
            outcome = outcomes.get(state.device.uuid)
            if isinstance(outcome, Read):
                opened_as = state.device.state.pop("opened_as", None)
                if opened_as is not None:  # its real UUID now: served under it from here on
                    with self.lock:
                        del self.gpus[state.device.uuid]
                    state = self._register(state.device.index, opened_as, state.device.handle)
                log.info("gpu %d (%s) is back", state.device.index, state.device.uuid)
                state.readings[Tier.STATIC] = outcome.reading
                state.up, state.lost_reason, state.backoff, state.stuck = True, None, BACKOFF_MIN_S, set()
                returned = True
            elif isinstance(outcome, LibraryDown | Fatal):
                self.apply(Tier.STATIC, {state.device.uuid: outcome})
                return
            else:  # still lost, or its reopen hung: try again after the backoff
                state.retry_at = time.monotonic() + state.backoff
                state.backoff = min(state.backoff * 2, BACKOFF_MAX_S)
        if returned:
            with self.lock:
                self.generation += 1
            self.probe_topology()

    # -- what outcomes mean ------------------------------------------------------------------------------------

    def apply(self, tier: Tier, outcomes: dict[str, Outcome]) -> None:
        """Keep readings, mark stale, lost, library down or fatal, as each GPU's outcome says."""
        for uuid, outcome in outcomes.items():
            if not self.nvml_up:
                return  # the library went down (or is fatal) on an earlier GPU's outcome: the rest are moot
            state = self.gpus.get(uuid)
            if state is None:
                continue
            if isinstance(outcome, Read):
                state.stuck.discard(tier)
                state.readings[tier] = outcome.reading
            elif isinstance(outcome, Waiting):
                pass  # late, inside its call deadline: the last values stand; stale only once it is Stuck (README)
            elif isinstance(outcome, Stuck):
                self._stuck(state, tier, outcome)
            elif isinstance(outcome, Lost):
                self.mark_lost(state, outcome.reason)
            elif isinstance(outcome, LibraryDown):
                self.library_down(outcome.reason)
            elif isinstance(outcome, Fatal):
                self.set_fatal(outcome.reason)
            elif isinstance(outcome, Failed):
                log.error("gpu %d: %s read failed", state.device.index, tier.value, exc_info=outcome.error)
                self.ledger.error(f"{tier.value}_tier", "exception")

    def _stuck(self, state: GpuState, tier: Tier, outcome: Stuck) -> None:
        if outcome.newly:
            self.ledger.timeout(outcome.call)
            log.warning(
                "gpu %d: %s read stuck in %s for over %.1f s; serving its last values as stale",
                state.device.index,
                tier.value,
                outcome.call,
                self._deadline(),
            )
        state.stuck.add(tier)

    def mark_lost(self, state: GpuState, reason: str) -> None:
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
        self._runner.forget(state.device.uuid)
        with self.lock:
            self.generation += 1

    def library_down(self, reason: str, initialising: bool = False) -> None:
        """NVML is gone (driver unloaded, library missing): drop every GPU's series, re-init with backoff."""
        if reason == "lib_rm_version_mismatch":
            self.set_fatal(reason)
            return
        if not self.nvml_up and not initialising:
            return  # already down (a late answer from another tier): the re-init is scheduled
        first_failure = not self._initialised_once and initialising
        if first_failure and reason == "library_not_found" and self._on_missing() == "exit":
            self.set_fatal(reason, "no driver library at start, and nvml.on_missing is exit")
            return
        if self.nvml_up or self.nvml_error != reason:
            log.warning("nvml down: %s; retrying in %.0f s", reason, self._init_backoff)
        was_up = self.nvml_up
        self.nvml_up, self.nvml_error = False, reason
        with self.lock:
            for state in self.gpus.values():
                state.readings, state.stuck = {}, set()
                self._runner.forget(state.device.uuid)
            self.generation += 1
        if was_up and not self.wedged():
            session.shutdown()
        self._init_retry_at = time.monotonic() + self._init_backoff
        self._init_backoff = min(self._init_backoff * 2, BACKOFF_MAX_S)

    def set_fatal(self, reason: str, why: str = "the driver changed under this process") -> None:
        log.error("nvml: %s (%s); exiting so it is restarted", reason, why)
        self.nvml_up, self.nvml_error, self.fatal = False, reason, reason
        with self.lock:
            for state in self.gpus.values():
                state.readings = {}

    def shutdown(self) -> None:
        """Shut NVML down only if no call is wedged (docs/nvml.md, Hangs)."""
        if self.nvml_up and not self.wedged():
            session.shutdown()

    def _count_timeout(self, key: str, default_call: str) -> str:
        call = session.in_flight(self._pool.thread_id(key)) or default_call
        self.ledger.timeout(call)
        return call


@dataclass(frozen=True)
class DeviceSelection:
    """The GPUs `nvml.devices` selects, by NVML index or UUID (empty: every GPU)."""

    indices: frozenset[int]
    uuids: frozenset[str]
    count: int

    @classmethod
    def of(cls, devices: tuple[str, ...], count: int) -> DeviceSelection:
        return cls(
            frozenset(int(d) for d in devices if d.isdigit()), frozenset(d for d in devices if not d.isdigit()), count
        )

    @property
    def everything(self) -> bool:
        return not self.indices and not self.uuids

    def may_be(self, index: int) -> bool:
        """Whether the GPU at `index` is to be opened (a UUID is known only once it is)."""
        return self.everything or bool(self.uuids) or index in self.indices

    def wants(self, index: int, uuid: str | None) -> bool:
        return self.everything or index in self.indices or (uuid is not None and uuid in self.uuids)

    def warn_unmatched(self, opened: set[str]) -> None:
        """One line for the selectors that name no GPU: an index past NVML's count, a UUID no GPU opened has (a
        GPU that could not be opened is served as lost where the driver's list names it)."""
        unmatched = [str(i) for i in sorted(self.indices) if i >= self.count] + sorted(self.uuids - opened)
        if unmatched:
            log.warning("nvml.devices: no GPU opened for %s (NVML counts %d)", ", ".join(unmatched), self.count)
