"""The utilization view: idle and starved GPUs, GPU-hours seen and wasted, and their cost, by node and namespace."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from gpuwarden.fleet import recording
from gpuwarden.fleet.prometheus import Series
from gpuwarden.fleet.views.bottlenecks import BottlenecksView
from gpuwarden.fleet.views.queries import FleetQueries, Recorded

DEFINITIONS = {
    "utilization": "share of the window in which a kernel ran (busy / sampled seconds)",
    "idle": "utilization < {ratio} and no process on the GPU during the window",
    "starved": "utilization < {ratio} while a process held the GPU the whole window",
    "gpu_hours": "hours the driver sampled utilization in the window (a GPU seen for part of it counts that part)",
    "wasted_gpu_hours": "sampled minus busy hours: time no kernel ran",
    "by_namespace": "from gpuwarden_gpu_allocation (pod attribution): a GPU's hours go to the namespaces that held it "
    "during the window; a GPU shared by n containers counts 1/n to each",
}


def raw_queries(sel: str, node_label: str, window: str, limit: int, idle_ratio: float) -> tuple[list[str], str]:
    """The utilization queries over the raw per-GPU counters: exact, and what costs at scale; and the expression of
    each GPU's idle seconds in the window (the bottlenecks' raw path weighs classes by it)."""
    util = (
        f"clamp_max(rate(gpuwarden_busy_seconds_total{{{sel}}}[{window}]) "
        f"/ rate(gpuwarden_utilization_sampled_seconds_total{{{sel}}}[{window}]), 1)"
    )
    sampled = f"increase(gpuwarden_utilization_sampled_seconds_total{{{sel}}}[{window}])"
    idle_s = f"clamp_min({sampled} - increase(gpuwarden_busy_seconds_total{{{sel}}}[{window}]), 0)"
    alloc = f"max_over_time(gpuwarden_gpu_allocation{{{sel}}}[{window}])"
    share = f"({alloc} / on (instance, uuid) group_left () count by (instance, uuid) ({alloc}))"
    idle_expr = (
        f"{util} < {idle_ratio:g} and on (instance, uuid) max_over_time(gpuwarden_processes{{{sel}}}[{window}]) == 0"
    )
    starved_expr = (
        f"{util} < {idle_ratio:g} and on (instance, uuid) min_over_time(gpuwarden_processes{{{sel}}}[{window}]) > 0"
    )
    return [
        f"sum by ({node_label}) ({sampled})",
        f"sum by ({node_label}) ({idle_s})",
        f"count by ({node_label}) ({util})",
        f"avg by ({node_label}) ({util})",
        f"bottomk({limit}, {idle_expr})",
        f"bottomk({limit}, {starved_expr})",
        f"count({idle_expr})",
        f"count({starved_expr})",
        f"sum by (namespace) ({idle_s} * on (instance, uuid) group_right () {share})",
        f"sum by (namespace) ({sampled} * on (instance, uuid) group_right () {share})",
    ], idle_s


def recorded_queries(sel: str, node_label: str, window: str, limit: int, step: float) -> list[str]:
    """The same answers from the recording rules: sums of recorded rates times the rules' interval (`step`) are
    the window's increases; a GPU is idle (starved) when it was so at every evaluation its node was recorded."""

    def total(name: str) -> str:
        return f"sum_over_time({name}{{{sel}}}[{window}])"

    seen, busy = total(recording.SAMPLED), total(recording.BUSY)
    evaluations = f"count_over_time({recording.GPUS}{{{sel}}}[{window}])"

    def throughout(name: str) -> str:
        return (
            f"avg_over_time({name}{{{sel}}}[{window}]) and on (instance, uuid) "
            f"(count_over_time({name}{{{sel}}}[{window}]) >= on (instance) group_left () {evaluations})"
        )

    def by_namespace(name: str) -> str:
        return f"sum by (namespace) (sum_over_time({name}{{{sel}}}[{window}])) * {step:g}"

    return [
        f"sum by ({node_label}) ({seen}) * {step:g}",
        f"sum by ({node_label}) (clamp_min({seen} - {busy}, 0)) * {step:g}",
        f"max by ({node_label}) (max_over_time({recording.GPUS}{{{sel}}}[{window}]))",
        f"sum by ({node_label}) ({busy}) / sum by ({node_label}) ({seen})",
        f"bottomk({limit}, {throughout(recording.GPU_IDLE)})",
        f"bottomk({limit}, {throughout(recording.GPU_STARVED)})",
        f"count({throughout(recording.GPU_IDLE)})",
        f"count({throughout(recording.GPU_STARVED)})",
        by_namespace(recording.NS_IDLE),
        by_namespace(recording.NS_SAMPLED),
    ]


def hours(seconds: float) -> float:
    return round(seconds / 3600, 4)


def source(recorded: Recorded) -> str:
    """Where the utilization answer came from, and what reading the raw series costs."""
    if recorded:
        return "recording rules (alert_rules/gpuwarden.recording.yaml)" + (
            f"; {recorded.note}" if recorded.note else ""
        )
    if recorded.note:
        return f"raw series: {recorded.note}; every view scans every GPU's counters over the window"
    return (
        "raw series: the recording rules (alert_rules/gpuwarden.recording.yaml) are not loaded in this "
        "Prometheus; every view scans every GPU's counters over the window (slow past ~1,000 nodes)"
    )


@dataclass(frozen=True)
class UtilizationView:
    """Idle and starved GPUs, GPU-hours seen and wasted by node and namespace, and the bottleneck classes."""

    queries: FleetQueries
    classes: BottlenecksView = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "classes", BottlenecksView(self.queries))

    async def utilization(self, window: str, limit: int) -> dict[str, Any]:
        """Hours come from the utilization counters themselves (seconds sampled, seconds busy), so a GPU seen for
        part of the window counts only the part it was seen. From the recording rules where they are loaded."""
        q, settings = self.queries, self.queries.settings
        recorded = await q.recorded(*recording.UTILIZATION_RECORDS)
        step = await q.recording_step(recording.SAMPLED) if recorded else 0.0  # and NS_*: the same group
        raw, idle_s = raw_queries(q.selector, q.node_label, window, limit, settings.idle_ratio)
        asked = recorded_queries(q.selector, q.node_label, window, limit, step) if recorded else raw
        answers, bottlenecks = await asyncio.gather(q.many(*asked), self.classes.bottlenecks(window, idle_s, recorded))
        observed, wasted_s, gpu_count, average, idle, starved, idle_count, starved_count, *namespaced = answers
        price, ratio = settings.price_per_gpu_hour, f"{settings.idle_ratio:g}"
        nodes = self._by_node(observed, wasted_s, gpu_count, average, price)
        wasted = sum(r.value for r in wasted_s) / 3600
        return {
            "source": source(recorded),
            "bottlenecks": bottlenecks,
            "window": window,
            "idle_ratio": settings.idle_ratio,
            "price_per_gpu_hour": price,
            "currency": settings.currency,
            "totals": {
                "gpus": sum(e.get("gpus", 0) for e in nodes),
                "gpu_hours": hours(sum(r.value for r in observed)),
                "wasted_gpu_hours": round(wasted, 4),
                "wasted_cost": round(wasted * price, 2),
                "idle_gpus": int(idle_count[0].value) if idle_count else 0,
                "starved_gpus": int(starved_count[0].value) if starved_count else 0,
            },
            "listed": f"the {limit} least utilized idle and starved GPUs (?limit=)",
            "idle_gpus": self._gpu_rows(idle),
            "starved_gpus": self._gpu_rows(starved),
            "by_node": sorted(nodes, key=lambda e: -e.get("wasted_gpu_hours", 0.0))[:limit],
            "by_namespace": _by_namespace(*namespaced, price),
            "definitions": {name: text.format(ratio=ratio) for name, text in DEFINITIONS.items()},
        }

    def _by_node(
        self,
        observed: list[Series],
        wasted_s: list[Series],
        gpu_count: list[Series],
        average: list[Series],
        price: float,
    ) -> list[dict[str, Any]]:
        """Each node's GPUs, utilization, hours seen and wasted, and the cost of the waste."""
        nodes: dict[str, dict[str, Any]] = {}

        def node_entry(row: Series) -> dict[str, Any]:
            name = self.queries.node(row)
            return nodes.setdefault(name, {"node": name})

        for row in gpu_count:
            node_entry(row)["gpus"] = int(row.value)
        for row in average:
            node_entry(row)["utilization"] = round(row.value, 4)
        for row in observed:
            node_entry(row)["gpu_hours"] = hours(row.value)
        for row in wasted_s:
            entry = node_entry(row)
            entry["wasted_gpu_hours"] = hours(row.value)
            entry["wasted_cost"] = round(row.value / 3600 * price, 2)
        return list(nodes.values())

    def _gpu_rows(self, rows: list[Series]) -> list[dict[str, Any]]:
        return sorted(
            (
                {
                    "node": self.queries.node(r),
                    "gpu": r.labels.get("gpu"),
                    "uuid": r.labels.get("uuid"),
                    "utilization": round(r.value, 4),
                }
                for r in rows
            ),
            key=lambda x: (x["node"], x["gpu"] or ""),
        )


def _by_namespace(ns_wasted: list[Series], ns_allocated: list[Series], price: float) -> list[dict[str, Any]]:
    """Each namespace's allocated and wasted GPU-hours (pod attribution), the most wasteful first."""
    namespaces: dict[str, dict[str, Any]] = {}
    for row in ns_allocated:
        name = row.labels.get("namespace", "")
        namespaces.setdefault(name, {"namespace": name})["allocated_gpu_hours"] = hours(row.value)
    for row in ns_wasted:
        entry = namespaces.setdefault(row.labels.get("namespace", ""), {"namespace": row.labels.get("namespace")})
        entry["wasted_gpu_hours"] = hours(row.value)
        entry["wasted_cost"] = round(row.value / 3600 * price, 2)
    return sorted(namespaces.values(), key=lambda e: -e.get("wasted_gpu_hours", 0.0))
