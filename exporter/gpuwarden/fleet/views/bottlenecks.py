"""The bottleneck part of the utilization view: GPUs per GPM bottleneck class, and the hours each class wasted."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import recording
from gpuwarden.fleet.views.queries import FleetQueries, Recorded


@dataclass(frozen=True)
class BottlenecksView:
    """GPUs per bottleneck class now, by node and namespace, and the window's idle hours by class."""

    queries: FleetQueries

    def _queries(self, window: str, idle_s: str, recorded: Recorded, step: float) -> list[str]:
        """Counts per class (fleet, node, namespace), then the window's idle seconds per class."""
        sel, node_label = self.queries.selector, self.queries.node_label
        if recorded:
            classes = recorded.latest(recording.NODE_CLASSES, sel)
            namespaces = recorded.latest(recording.NS_CLASSES, sel)
            return [
                f"sum by (class) ({classes})",
                f"sum by ({node_label}, class) ({classes})",
                f"sum by (namespace, class) ({namespaces})",
                f"sum by (class) (sum_over_time({recording.CLASS_IDLE}{{{sel}}}[{window}])) * {step:g}",
            ]
        info = f"gpuwarden_bottleneck_info{{{sel}}}"
        allocation = f"max by (instance, uuid, namespace) (gpuwarden_gpu_allocation{{{sel}}})"
        return [
            f"count by (class) ({info})",
            f"count by ({node_label}, class) ({info})",
            f"count by (namespace, class) ({info} * on (instance, uuid) group_left (namespace) {allocation})",
            f"sum by (class) ({idle_s} * on (instance, uuid) group_left (class) {info})",
        ]

    async def bottlenecks(self, window: str, idle_s: str, recorded: Recorded) -> dict[str, Any]:
        """GPUs per bottleneck class (GPM) now, by node and namespace, and the GPU-hours in the window in which no
        kernel ran by class: from the recording rules, each minute by the class the GPU was in then; from the raw
        series, the whole window by the class the GPU is in now (a scan of every GPU's counters)."""
        q = self.queries
        step = await q.recording_step(recording.CLASS_IDLE) if recorded else 0.0
        totals, by_node, by_namespace, wasted = await q.many(*self._queries(window, idle_s, recorded, step))
        per_node: dict[str, dict[str, int]] = defaultdict(dict)
        for row in by_node:
            per_node[q.node(row)][row.labels.get("class", "")] = int(row.value)
        per_namespace: dict[str, dict[str, int]] = defaultdict(dict)
        for row in by_namespace:
            per_namespace[row.labels.get("namespace", "")][row.labels.get("class", "")] = int(row.value)
        return {
            "gpus_by_class": {row.labels.get("class", ""): int(row.value) for row in totals},
            "wasted_gpu_hours_by_class": {row.labels.get("class", ""): round(row.value / 3600, 4) for row in wasted},
            "by_node": [{"node": node, "classes": classes} for node, classes in sorted(per_node.items())],
            "by_namespace": [{"namespace": ns, "classes": classes} for ns, classes in sorted(per_namespace.items())],
            "definition": "gpuwarden_bottleneck_info (GPM, Hopper and newer): what each GPU's time went to over the "
            "exporter's bottleneck window; wasted hours are the window's hours with no kernel running, by the class "
            + ("the GPU was in at each minute (recording rules)" if recorded else "the GPU is in now (raw series)"),
        }
