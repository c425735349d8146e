"""The composition root of the collection pipeline: the one place that turns settings into stage objects.

It builds, from one Settings: the readers (only those whose families are exported), the poll plan, the GPM
sampler's mode, and the enrichment stages after the readings, in the order `Pipeline._steps` gives (drawn in
docs/architecture.md; tests/test_architecture_doc.py keeps the two in step), and hands them to collect/'s Poller,
which knows none of them. It owns reload: every stage whose shape depends on a setting is rebuilt from the new
settings (the health evaluator from the new thresholds, its history resized for the new windows; pod attribution
when its settings change; host lookups when the host paths change), between two publications, so no reload leaves a
stage sized for the old settings.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpuwarden.attribution import podresources
from gpuwarden.attribution.host import HostProcesses
from gpuwarden.attribution.pods import PodsStep
from gpuwarden.attribution.processes import ProcessesStep
from gpuwarden.collect.poller import Poller, PollPlan
from gpuwarden.collect.reader import Reader
from gpuwarden.collect.readers import all_readers
from gpuwarden.config.settings import Settings
from gpuwarden.health import state_file
from gpuwarden.health.evaluator import HealthEvaluator
from gpuwarden.health.step import HealthStep
from gpuwarden.health.thresholds import load_thresholds
from gpuwarden.jobs.collective import CollectiveStep
from gpuwarden.jobs.evidence import HostEvidenceStep
from gpuwarden.jobs.grouping import JobsStep
from gpuwarden.jobs.pod_api import PodApi
from gpuwarden.jobs.sources import SourceStates
from gpuwarden.model.draft import EnrichmentStep
from gpuwarden.model.families import family_filter
from gpuwarden.model.snapshot import Snapshot, Tier
from gpuwarden.nvml import gpm_sampler, library
from gpuwarden.workers import WorkerPool


def select_readers(settings: Settings) -> dict[Tier, list[Reader]]:
    """A reader with no wanted family is never run: query only what is exported (docs/nvml.md, Cost classes)."""
    wanted = family_filter(settings.metrics.include, settings.metrics.exclude)
    readers: dict[Tier, list[Reader]] = {tier: [] for tier in Tier}
    for reader in all_readers():
        if reader.name == "gpm" and not settings.nvml.gpm:
            continue
        if reader.name == "video" and "video" not in settings.metrics.enable_groups:
            continue  # an opt-in group whose reads cost NVML calls: made only when it is on
        if not reader.families or any(wanted(family.name) for family in reader.families):
            readers[reader.tier].append(reader)
    return readers


def poll_plan(settings: Settings) -> PollPlan:
    """What collect/ needs of the settings, as plain values."""
    poll = settings.poll
    return PollPlan(
        readers=select_readers(settings),
        fast_interval=poll.fast_interval,
        slow_interval=poll.slow_interval,
        samples_interval=poll.samples_interval,
        nvlink_errors_interval=poll.nvlink_errors_interval,
        call_deadline=poll.call_deadline,
        on_missing=settings.nvml.on_missing,
        xid_events=settings.nvml.xid_events,
        devices=settings.nvml.devices,
        kernel_log=kernel_log_path(settings),
    )


def kernel_log_path(settings: Settings) -> str:
    """`auto`: the kernel log beside the installed library: /dev/kmsg under the real driver, the simulator's own
    (its scenario's `kernel_log`, or none) under the simulator, whose GPUs are not this host's."""
    chosen = settings.nvml.kernel_log
    if chosen == "auto":
        beside = library.kernel_log()
        if settings.nvml.backend == "sim":
            return "" if beside == library.HOST_KERNEL_LOG else beside  # never this host's log under a simulator
        return library.HOST_KERNEL_LOG
    return "" if chosen == "off" else chosen


def proc_root(settings: Settings) -> Path | None:
    """The host's /proc: processes.proc_root; unset, the simulator's /proc of its scenario's host processes (none
    under the real driver: the host's is read only where configured)."""
    beside = library.host_proc()
    return settings.processes.proc_root or (Path(beside) if beside else None)


def pod_api(settings: Settings) -> PodApi | None:
    """The job view's pod API client where pods.api_server is set."""
    pods = settings.pods
    if not pods.api_server:
        return None
    return PodApi(pods.api_server, pods.api_token_file, pods.api_ca_file, SourceStates())


def configure_gpm(settings: Settings) -> None:
    nvml = settings.nvml
    gpm_sampler.configure(nvml.gpm_isolation, nvml.gpm_crash_limit, nvml.gpm_crash_backoff)


def pod_attribution(settings: Settings, wall_clock: Callable[[], float]) -> podresources.PodAttribution | None:
    """The kubelet pod-resources watcher, or None: turned off, or a simulated node whose socket is the default path
    and absent (a laptop, where no kubelet will ever appear: no watcher, and no log line every start saying it keeps
    looking). A simulator given a socket explicitly (the tests' fake kubelet) watches it as a real node does."""
    pods = settings.pods
    if not pods.attribution:
        return None
    default_socket = type(pods)().resources_socket
    if settings.nvml.backend == "sim" and pods.resources_socket == default_socket and not default_socket.exists():
        return None
    return podresources.PodAttribution(
        pods.resources_socket,
        pods.refresh_interval,
        pods.resource_names,
        wall_clock=wall_clock,
        dra_drivers=pods.dra_drivers,
    )


def recall_state(
    settings: Settings, evaluator: HealthEvaluator, wall_clock: Callable[[], float]
) -> state_file.StateKeeper | None:
    """The state file's keeper, once the evaluator has recalled what the file remembers (None where none is kept:
    `health.state_file` off, or auto under the simulator)."""
    path = settings.health.state_path(settings.nvml.backend)
    if path is None:
        return None
    boot = state_file.boot_id()
    evaluator.recall(state_file.read(path, wall_clock(), settings.health.state_max_gap, boot))
    return state_file.StateKeeper(path, boot)


class Pipeline:
    """NVML → readings → snapshot, with every stage built here from the settings in force."""

    def __init__(
        self,
        settings: Settings,
        wall_clock: Callable[[], float] = time.time,
        pool: WorkerPool | None = None,
        started_init: concurrent.futures.Future[Any] | None = None,
    ) -> None:
        """`pool` and `started_init`: a worker pool on which nvml.session.start_init already began NVML's init."""
        self.settings = settings
        self._wall = wall_clock
        gpm_sampler.reset()
        configure_gpm(settings)
        self.health = HealthEvaluator(load_thresholds(settings.health.thresholds_file))
        self.state = recall_state(settings, self.health, wall_clock)
        self.pods = pod_attribution(settings, wall_clock)
        self.host = HostProcesses(proc_root(settings), settings.processes.pod_logs_root)
        self.processes = ProcessesStep(self.host, self._pid_series)
        self.evidence = HostEvidenceStep(
            self.host.proc_root, self._job_window, lambda: self.collective.suspects, self.host.lookups.submit
        )
        self.jobs = JobsStep(self.host.proc_root, pod_api(settings))
        self.collective = CollectiveStep(lambda: self.health, settings.processes.sys_root)
        self.poller = Poller(poll_plan(settings), self._steps(), wall_clock, pool, started_init)
        self._running = False

    def _steps(self) -> tuple[EnrichmentStep, ...]:
        """The enrichment stages in order: processes read the pods, jobs the processes, health the jobs (a GPU with
        peers can be waiting in a collective), host evidence the verdicts and jobs, the job view all of them."""
        return (
            PodsStep(self.pods),
            self.processes,
            self.jobs,
            HealthStep(self.health, self.state),
            self.evidence,
            self.collective,
        )

    def _job_window(self) -> float:
        """The job view's window, read per snapshot from the thresholds in force (a reload changes it)."""
        return float(self.health.thresholds.collective_window_s)

    def _pid_series(self) -> int:
        """Per-PID series per GPU (0: off), read per snapshot from the settings in force."""
        processes = self.settings.processes
        return processes.max_pid_series if processes.per_pid_series else 0

    # -- what the rest of the process reads -------------------------------------------------------------

    @property
    def snapshot(self) -> Snapshot:
        return self.poller.snapshot

    @property
    def fatal(self) -> str | None:
        """Why the process must exit (the driver changed under it, or no library and `on_missing: exit`)."""
        return self.poller.fatal

    @property
    def ready_once(self) -> threading.Event:
        """Set once the first fast cycle was published."""
        return self.poller.ready_once

    # -- running ---------------------------------------------------------------------------------------

    def start(self) -> None:
        self.poller.start()
        if self.pods is not None:
            self.pods.start()
        self._running = True

    def stop(self, timeout: float = 2.0) -> None:
        if self.pods is not None:
            self.pods.stop()
        self.poller.stop(timeout)
        if self.state is not None:  # a clean stop: the next start measures its gap from now
            self.state.close(self.health.memory(), self._wall(), timeout)
        self._running = False

    def poll_once(self) -> Snapshot:
        """One synchronous fast and slow cycle and a publication (tests and tools); the host lookups it started
        (user names, pod logs) are waited for after it, up to the call deadline, so the next poll sees them."""
        snapshot = self.poller.poll_once()
        self.host.lookups.wait_idle(self.settings.poll.call_deadline)
        return snapshot

    def reload(self, new: Settings) -> None:
        """Apply reloaded settings: the stages that depend on them are rebuilt between two publications; intervals,
        deadlines, metric selection and thresholds take effect at the next cycle. The thresholds file is read
        first: ConfigError from it leaves everything as it was."""
        old = self.settings
        thresholds = load_thresholds(new.health.thresholds_file)
        configure_gpm(new)
        pods_changed = new.pods != old.pods
        replaced_pods = self.pods if pods_changed else None

        def rebuild() -> tuple[EnrichmentStep, ...]:
            evaluator = HealthEvaluator(thresholds)
            evaluator.carry_over(self.health)  # history resized for the new windows, pending conditions kept
            self.health = evaluator
            if pods_changed:
                self.pods = pod_attribution(new, self._wall)
            host_paths = (proc_root(new), new.processes.pod_logs_root)
            moved = host_paths != (self.host.proc_root, self.host.pod_logs_root)
            if moved:
                self.host = HostProcesses(*host_paths)
                self.processes = ProcessesStep(self.host, self._pid_series)
                self.evidence = HostEvidenceStep(
                    self.host.proc_root, self._job_window, lambda: self.collective.suspects, self.host.lookups.submit
                )
            if moved or pods_changed:
                self.jobs = JobsStep(self.host.proc_root, pod_api(new))
            if new.processes.sys_root != old.processes.sys_root:
                self.collective.read_rdma_under(new.processes.sys_root)
            self.settings = new
            return self._steps()

        self.poller.reconfigure(poll_plan(new), rebuild)
        if replaced_pods is not None:
            replaced_pods.stop()
            if self.pods is not None and self._running:
                self.pods.start()
