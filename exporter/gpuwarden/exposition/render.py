"""Snapshot → exposition bytes, rendered at most once per snapshot and format.

The first scrape that sees a new snapshot renders it; every other scraper of that snapshot gets the same
bytes. A scrape never touches NVML, and a snapshot nobody scrapes costs no rendering.
"""

from __future__ import annotations

import gzip
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

from gpuwarden import __version__
from gpuwarden.exposition.buildinfo import nvml_binding_version
from gpuwarden.exposition.text import (
    OPENMETRICS_CONTENT_TYPE,
    TEXT_CONTENT_TYPE,
    ProcessFamilies,
    openmetrics_format,
    text_format,
)
from gpuwarden.exposition.text import Family as MetricFamily
from gpuwarden.model.families import (
    BOTTLENECK_INFO,
    BUILD_INFO,
    COLLECT_DURATION_SECONDS,
    COLLECT_ERRORS_TOTAL,
    COLLECT_TIMEOUTS_TOTAL,
    CONTAINER_GPU_MEMORY_USED_BYTES,
    CONTAINER_PROCESSES,
    CONTAINER_SM_ACTIVE_SECONDS_TOTAL,
    DRIVER_INFO,
    FAMILIES,
    GPU_ALLOCATION,
    GPU_HARDWARE_ERROR_INFO,
    GPU_STALE,
    GPU_UP,
    GPUS,
    HEALTH,
    HEALTH_PENDING,
    HEALTH_SINCE_TIMESTAMP_SECONDS,
    HEALTH_STATUS,
    JOB_COLLECTIVE_WAIT_SECONDS_TOTAL,
    JOB_FINDING,
    JOB_IDENTITY_SOURCE_UP,
    KERNEL_FALLEN_OFF_BUS_TOTAL,
    KERNEL_LOG_LINES_IGNORED_TOTAL,
    KERNEL_LOG_UP,
    KERNEL_SXID_ERRORS_TOTAL,
    KERNEL_SXID_LAST_TIMESTAMP_SECONDS,
    LAST_COLLECT_TIMESTAMP_SECONDS,
    MIG_ALLOCATION,
    NVLINK_PEER_LINKS,
    NVML_ERROR_INFO,
    NVML_REINIT_TOTAL,
    NVML_UP,
    POD_ATTRIBUTION_UNMATCHED_DEVICES,
    POD_ATTRIBUTION_UP,
    PROCESS_GPU_MEMORY_USED_BYTES,
    SLURM_JOB_GPU_MEMORY_USED_BYTES,
    SLURM_JOB_SM_ACTIVE_SECONDS_TOTAL,
    TOPOLOGY_INFO,
    XID_ERRORS_TOTAL,
    XID_LAST_TIMESTAMP_SECONDS,
    Family,
)
from gpuwarden.model.pci import normalise_bus_id
from gpuwarden.model.snapshot import Snapshot

_BINDING_VERSION = nvml_binding_version()


def _family(spec: Family) -> MetricFamily:
    return MetricFamily(spec.name, spec.help, spec.type, spec.all_labels)


class SnapshotCollector:
    """A custom collector over one immutable snapshot (no global gauges to go stale): families in, bytes out by
    exporter/gpuwarden/exposition/text.py."""

    def __init__(self, snapshot: Snapshot, wanted: Callable[[str], bool], own: Rows | None = None) -> None:
        self.snapshot = snapshot
        self.wanted = wanted
        self.own = own or {}  # the process's own counters (HTTP rejections, reloads), as of this render

    def collect(self) -> Iterator[MetricFamily]:
        rows: Rows = defaultdict(list)
        _node_rows(self.snapshot, rows)
        _gpu_rows(self.snapshot, rows)
        _health_rows(self.snapshot, rows)
        _xid_rows(self.snapshot, rows)
        _kernel_rows(self.snapshot, rows)
        _job_rows(self.snapshot, rows)
        for name, own_rows in self.own.items():
            rows[name].extend(own_rows)
        keep_rows = getattr(self.wanted, "rows", None)  # a metrics.Selection filters rows too (collector groups)
        for name, spec in FAMILIES.items():
            if name not in rows or not self.wanted(name):
                continue
            family = _family(spec)
            keep = keep_rows(name) if keep_rows is not None else None
            for labels, value in rows[name]:
                if keep is None or keep(labels, value):
                    family.add(labels, value)
            if family.samples:
                yield family


Rows = dict[str, list[tuple[list[str], float]]]


def _node_rows(snap: Snapshot, rows: Rows) -> None:
    """The exporter's and the node's own series."""

    def node(family: Family, value: float, *labels: str) -> None:
        rows[family.name].append((list(labels), value))

    node(BUILD_INFO, 1, __version__, _BINDING_VERSION)
    if snap.id == 0:
        # Nothing collected yet (the first cycle is running): NVML is not known to be down, so say nothing of it.
        # Exporting nvml_up 0 here made GpuwardenNvmlDown fire on healthy nodes that started slowly.
        return
    node(NVML_UP, 1 if snap.nvml_up else 0)
    if not snap.nvml_up and snap.nvml_error:
        node(NVML_ERROR_INFO, 1, snap.nvml_error)
    if snap.driver:
        driver = snap.driver
        node(
            DRIVER_INFO,
            1,
            driver.get("driver_version", ""),
            driver.get("cuda_driver_version", ""),
            driver.get("nvml_version", ""),
        )
    if snap.nvml_up:
        node(GPUS, sum(1 for gpu in snap.gpus if gpu.up))
    for tier, seconds in sorted(snap.tier_duration.items()):
        node(COLLECT_DURATION_SECONDS, seconds, tier)
    for tier, when in sorted(snap.tier_finished.items()):
        node(LAST_COLLECT_TIMESTAMP_SECONDS, when, tier)
    for (call, error), count in sorted(snap.collect_errors.items()):
        node(COLLECT_ERRORS_TOTAL, count, call, error)
    for call, count in sorted(snap.collect_timeouts.items()):
        node(COLLECT_TIMEOUTS_TOTAL, count, call)
    node(NVML_REINIT_TOTAL, snap.reinit_total)
    for source, up in sorted(snap.job_sources.items()):
        node(JOB_IDENTITY_SOURCE_UP, 1 if up else 0, source)
    if snap.pods_state != "disabled":
        node(POD_ATTRIBUTION_UP, 1 if snap.pods_state == "ok" else 0)
        if snap.pods_state == "ok":
            node(POD_ATTRIBUTION_UNMATCHED_DEVICES, snap.pods_unmatched)


def _gpu_rows(snap: Snapshot, rows: Rows) -> None:
    """Each GPU's readings, state, allocations and topology."""
    for gpu in snap.gpus:
        ids = [str(gpu.index), gpu.uuid]
        rows[GPU_UP.name].append((ids, 1 if gpu.up else 0))
        for sample in gpu.samples:  # a lost GPU's samples are its identity only
            rows[sample.name].append((ids + list(sample.labels), sample.value))
        if not gpu.up:
            continue
        rows[GPU_STALE.name].append((ids, 1 if gpu.stale else 0))
        if gpu.hardware_error:
            rows[GPU_HARDWARE_ERROR_INFO.name].append((ids + [gpu.hardware_error], 1))
        for allocation in snap.pods.get(gpu.uuid, ()):
            rows[GPU_ALLOCATION.name].append((ids + [allocation.namespace, allocation.pod, allocation.container], 1))
        for usage in snap.containers.get(gpu.uuid, ()):
            holder = [usage.namespace, usage.pod, usage.container]
            rows[CONTAINER_GPU_MEMORY_USED_BYTES.name].append((ids + holder, usage.used_memory_bytes))
            rows[CONTAINER_SM_ACTIVE_SECONDS_TOTAL.name].append((ids + holder, usage.sm_seconds_total))
            rows[CONTAINER_PROCESSES.name].append((ids + holder, usage.processes))
        for job in snap.slurm_jobs.get(gpu.uuid, ()):
            rows[SLURM_JOB_GPU_MEMORY_USED_BYTES.name].append((ids + [job.job, job.user], job.used_memory_bytes))
            rows[SLURM_JOB_SM_ACTIVE_SECONDS_TOTAL.name].append((ids + [job.job, job.user], job.sm_seconds_total))
        member = snap.jobs.get(gpu.uuid)
        if member is not None and gpu.uuid in snap.collective_wait_seconds:
            waited = snap.collective_wait_seconds[gpu.uuid]
            rows[JOB_COLLECTIVE_WAIT_SECONDS_TOTAL.name].append((ids + [member.job, member.rank], waited))
        for process in snap.processes.get(gpu.uuid, ())[: snap.pid_series]:  # sorted by memory: the largest
            if process.used_memory_bytes is not None:
                labels = [str(process.pid), process.name, process.namespace, process.pod, process.container]
                rows[PROCESS_GPU_MEMORY_USED_BYTES.name].append((ids + labels, process.used_memory_bytes))
        for allocation in snap.mig_pods.get(gpu.uuid, ()):
            labels = [allocation.device_id, allocation.namespace, allocation.pod, allocation.container]
            rows[MIG_ALLOCATION.name].append((ids + labels, 1))
        for peer in snap.topology.get(gpu.uuid, ()):
            rows[TOPOLOGY_INFO.name].append((ids + [str(peer.peer_index), peer.level], 1))
            if peer.nvlinks >= 0:
                rows[NVLINK_PEER_LINKS.name].append((ids + [str(peer.peer_index), peer.peer_uuid], peer.nvlinks))


def _health_rows(snap: Snapshot, rows: Rows) -> None:
    for gpu in snap.gpus:
        verdicts = snap.health.get(gpu.uuid, ())
        ids = [str(gpu.index), gpu.uuid]
        for verdict in verdicts:
            rows[HEALTH.name].append((ids + [verdict.check], verdict.level))
            if verdict.level > 0:
                rows[HEALTH_SINCE_TIMESTAMP_SECONDS.name].append((ids + [verdict.check], verdict.since))
            elif verdict.pending_level:
                rows[HEALTH_PENDING.name].append((ids + [verdict.check], verdict.pending_level))
        if verdicts:
            rows[HEALTH_STATUS.name].append((ids, max(v.level for v in verdicts)))
        for verdict in verdicts:
            if verdict.check == "bottleneck" and verdict.detail:
                rows[BOTTLENECK_INFO.name].append((ids + [verdict.detail], 1))


def _job_rows(snap: Snapshot, rows: Rows) -> None:
    index_of = {gpu.uuid: str(gpu.index) for gpu in snap.gpus}
    for found in snap.collective:
        uuid = found.straggler or ""
        member = snap.jobs.get(uuid)
        labels = [found.job, found.kind, index_of.get(uuid, ""), uuid, member.rank if member else "", found.cause]
        rows[JOB_FINDING.name].append((labels, 1))


def _xid_rows(snap: Snapshot, rows: Rows) -> None:
    index_of = {gpu.uuid: str(gpu.index) for gpu in snap.gpus}
    for (uuid, xid), (count, last) in sorted(snap.xid.items()):
        if uuid in index_of:
            ids = [index_of[uuid], uuid, str(xid)]
            rows[XID_ERRORS_TOTAL.name].append((ids, count))
            rows[XID_LAST_TIMESTAMP_SECONDS.name].append((ids, last))


def _kernel_rows(snap: Snapshot, rows: Rows) -> None:
    """The kernel log's faults: per GPU where its PCI address is one of this node's GPUs, per switch; whether it is
    read, and the lines naming the driver that counted for nothing."""
    if snap.kernel_log_up is not None:
        rows[KERNEL_LOG_UP.name].append(([], 1 if snap.kernel_log_up else 0))
    for reason, count in sorted(snap.kernel_log_ignored.items()):
        if count:  # no series until a line is ignored for the reason: a clean host costs one series, the status
            rows[KERNEL_LOG_LINES_IGNORED_TOTAL.name].append(([reason], count))
    by_bus = {normalise_bus_id(gpu.info.pci_bus_id): gpu for gpu in snap.gpus if gpu.info.pci_bus_id}
    for (kind, device, code), (count, last) in sorted(snap.kernel.items()):
        if kind == "sxid":
            rows[KERNEL_SXID_ERRORS_TOTAL.name].append(([device, str(code)], count))
            rows[KERNEL_SXID_LAST_TIMESTAMP_SECONDS.name].append(([device, str(code)], last))
        elif kind == "fallen_off_bus" and device in by_bus:
            gpu = by_bus[device]
            rows[KERNEL_FALLEN_OFF_BUS_TOTAL.name].append(([str(gpu.index), gpu.uuid], count))


_PROCESS = ProcessFamilies()  # process_* of the exporter itself, rendered with each snapshot


class Renderer:
    """Caches the exposition of the latest snapshot per (format, gzip)."""

    def __init__(self, wanted: Callable[[str], bool], own_counters: Callable[[], Rows] | None = None) -> None:
        self.wanted = wanted
        self.own_counters = own_counters or dict  # read at each render: they change between snapshots
        self._lock = threading.Lock()
        self._snapshot_id = -1
        self._cache: dict[tuple[bool, bool], bytes] = {}
        self.renders = 0  # how many times bytes were actually produced (tests assert one per snapshot)

    def refilter(self, wanted: Callable[[str], bool]) -> None:
        """Serve a new metric selection (config reload): drop the cached bytes so the next scrape re-renders."""
        with self._lock:
            self.wanted = wanted
            self._cache = {}
            self._snapshot_id = -1

    def cached(self, snapshot: Snapshot, openmetrics: bool = False, compress: bool = False) -> bytes | None:
        """This snapshot's bytes if already rendered: no lock, no work (the hot path of a scrape)."""
        if self._snapshot_id != snapshot.id:  # read the id first: render() swaps the dict before the id
            return None
        return self._cache.get((openmetrics, compress))

    def families(self, snapshot: Snapshot) -> list[MetricFamily]:
        """What a scrape of this snapshot exports, before formatting (render's input; the tests read series here)."""
        return [*SnapshotCollector(snapshot, self.wanted, self.own_counters()).collect(), *_PROCESS.collect()]

    def render(self, snapshot: Snapshot, openmetrics: bool = False, compress: bool = False) -> bytes:
        key = (openmetrics, compress)
        with self._lock:
            if snapshot.id != self._snapshot_id:
                self._cache = {}  # replace the dict before the id, so cached() never pairs a new id with old bytes
                self._snapshot_id = snapshot.id
            cached = self._cache.get(key)
            if cached is None:
                plain = self._cache.get((openmetrics, False))
                if plain is None:
                    plain = (openmetrics_format if openmetrics else text_format)(self.families(snapshot))
                    self._cache[(openmetrics, False)] = plain
                    self.renders += 1
                cached = gzip.compress(plain, compresslevel=5) if compress else plain
                self._cache[key] = cached
            return cached


def content_type(openmetrics: bool) -> str:
    return OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE
