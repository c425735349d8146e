"""Snapshot → exposition bytes, rendered at most once per snapshot and format.

The first scrape that sees a new snapshot renders it; every other scraper of that snapshot gets the same
bytes. A scrape never touches NVML, and a snapshot nobody scrapes costs no rendering.
"""

from __future__ import annotations

import gzip
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator

from prometheus_client import ProcessCollector
from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS_CONTENT_TYPE
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

from exporter import __version__
from exporter.metrics import FAMILIES, Family
from exporter.nvml.library import python_binding_version
from exporter.snapshot import Snapshot

_BINDING_VERSION = python_binding_version()
# The classic text format every scraper understands (newer prometheus_client defaults to "version=1.0.0").
TEXT_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _family(spec: Family) -> GaugeMetricFamily | CounterMetricFamily:
    cls = CounterMetricFamily if spec.type == "counter" else GaugeMetricFamily
    return cls(spec.name, spec.help, labels=list(spec.all_labels))


class SnapshotCollector:
    """A prometheus_client custom collector over one immutable snapshot (no global gauges to go stale)."""

    def __init__(self, snapshot: Snapshot, wanted: Callable[[str], bool]) -> None:
        self.snapshot = snapshot
        self.wanted = wanted

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot
        rows: dict[str, list[tuple[list[str], float]]] = defaultdict(list)

        def node(name: str, value: float, *labels: str) -> None:
            rows[name].append((list(labels), value))

        node("gpuwarden_build_info", 1, __version__, _BINDING_VERSION)
        node("gpuwarden_nvml_up", 1 if snap.nvml_up else 0)
        if not snap.nvml_up and snap.nvml_error:
            node("gpuwarden_nvml_error_info", 1, snap.nvml_error)
        if snap.driver:
            node(
                "gpuwarden_driver_info",
                1,
                snap.driver.get("driver_version", ""),
                snap.driver.get("cuda_driver_version", ""),
                snap.driver.get("nvml_version", ""),
            )
        if snap.nvml_up:
            node("gpuwarden_gpus", sum(1 for gpu in snap.gpus if gpu.up))
        for tier, seconds in sorted(snap.tier_duration.items()):
            node("gpuwarden_collect_duration_seconds", seconds, tier)
        for tier, when in sorted(snap.tier_finished.items()):
            node("gpuwarden_last_collect_timestamp_seconds", when, tier)
        for (call, error), count in sorted(snap.collect_errors.items()):
            node("gpuwarden_collect_errors_total", count, call, error)
        for call, count in sorted(snap.collect_timeouts.items()):
            node("gpuwarden_collect_timeouts_total", count, call)
        node("gpuwarden_nvml_reinit_total", snap.reinit_total)
        if snap.pods_state != "disabled":
            node("gpuwarden_pod_attribution_up", 1 if snap.pods_state == "ok" else 0)
            if snap.pods_state == "ok":
                node("gpuwarden_pod_attribution_unmatched_devices", snap.pods_unmatched)

        index_of = {gpu.uuid: str(gpu.index) for gpu in snap.gpus}
        for gpu in snap.gpus:
            ids = [str(gpu.index), gpu.uuid]
            rows["gpuwarden_gpu_up"].append((ids, 1 if gpu.up else 0))
            if not gpu.up:
                for sample in gpu.samples:  # identity only: a lost GPU's readings are dropped
                    rows[sample.name].append((ids + list(sample.labels), sample.value))
                continue
            rows["gpuwarden_gpu_stale"].append((ids, 1 if gpu.stale else 0))
            if gpu.hardware_error:
                rows["gpuwarden_gpu_hardware_error_info"].append((ids + [gpu.hardware_error], 1))
            for sample in gpu.samples:
                rows[sample.name].append((ids + list(sample.labels), sample.value))
            for allocation in snap.pods.get(gpu.uuid, ()):
                rows["gpuwarden_gpu_allocation"].append(
                    (ids + [allocation.namespace, allocation.pod, allocation.container], 1)
                )
            for peer in snap.topology.get(gpu.uuid, ()):
                rows["gpuwarden_topology_info"].append((ids + [str(peer.peer_index), peer.level], 1))
                if peer.nvlinks >= 0:
                    rows["gpuwarden_nvlink_peer_links"].append(
                        (ids + [str(peer.peer_index), peer.peer_uuid], peer.nvlinks)
                    )
        for gpu in snap.gpus:
            verdicts = snap.health.get(gpu.uuid, ())
            ids = [str(gpu.index), gpu.uuid]
            for verdict in verdicts:
                rows["gpuwarden_health"].append((ids + [verdict.check], verdict.level))
                if verdict.level > 0:
                    rows["gpuwarden_health_since_timestamp_seconds"].append((ids + [verdict.check], verdict.since))
            if verdicts:
                rows["gpuwarden_health_status"].append((ids, max(v.level for v in verdicts)))
        for (uuid, xid), (count, last) in sorted(snap.xid.items()):
            if uuid in index_of:
                ids = [index_of[uuid], uuid, str(xid)]
                rows["gpuwarden_xid_errors_total"].append((ids, count))
                rows["gpuwarden_xid_last_timestamp_seconds"].append((ids, last))

        for name, spec in FAMILIES.items():
            if name not in rows or not self.wanted(name):
                continue
            family = _family(spec)
            for labels, value in rows[name]:
                family.add_metric(labels, value)
            yield family


class _Process:
    """process_* metrics of the exporter itself, rendered with each snapshot."""

    collector = ProcessCollector(registry=None)

    def __init__(self, inner: SnapshotCollector) -> None:
        self.inner = inner

    def collect(self) -> Iterator[Metric]:
        yield from self.inner.collect()
        yield from self.collector.collect()


class Renderer:
    """Caches the exposition of the latest snapshot per (format, gzip)."""

    def __init__(self, wanted: Callable[[str], bool]) -> None:
        self.wanted = wanted
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
                    collector = _Process(SnapshotCollector(snapshot, self.wanted))
                    generate = generate_openmetrics if openmetrics else generate_latest
                    plain = generate(collector)  # type: ignore[arg-type]
                    self._cache[(openmetrics, False)] = plain
                    self.renders += 1
                cached = gzip.compress(plain, compresslevel=5) if compress else plain
                self._cache[key] = cached
            return cached


def content_type(openmetrics: bool) -> str:
    return OPENMETRICS_CONTENT_TYPE if openmetrics else TEXT_CONTENT_TYPE
