"""The inventory view: nodes, GPUs, models, drivers and exporter versions; which exporters are stale."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import recording
from gpuwarden.fleet.prometheus import Series
from gpuwarden.fleet.views.queries import FleetQueries, Recorded, source


def models_query(sel: str, by: str, recorded: Recorded) -> str:
    """GPUs per model (and `by`): the recorded per-node counts, else a count of gpuwarden_gpu_info."""
    if recorded:
        return f"sum by ({by}) ({recorded.latest(recording.NODE_MODELS, sel)})"
    return f"count by ({by}) (gpuwarden_gpu_info{{{sel}}})"


def memory_query(sel: str, by: str, recorded: Recorded) -> str:
    """Memory per GPU model (and `by`): the recorded per-node maximum, else joined from the raw series."""
    if recorded:
        return f"max by ({by}) ({recorded.latest(recording.NODE_MEMORY, sel)})"
    return (
        f"max by ({by}) (gpuwarden_memory_total_bytes{{{sel}}} "
        f"* on (instance, uuid) group_left (name) gpuwarden_gpu_info{{{sel}}})"
    )


def _new_node() -> dict[str, Any]:
    return {
        "gpus": 0,
        "models": {},
        "memory_bytes": {},
        "driver_version": None,
        "cuda_driver_version": None,
        "exporter_version": None,
        "exporter_up": False,
        "nvml_up": None,
        "last_poll_age_seconds": None,
        "gpus_visible": None,
    }


@dataclass(frozen=True)
class InventoryView:
    """Nodes, GPUs, models, drivers and exporter versions; which exporters are stale."""

    queries: FleetQueries

    async def inventory(self) -> dict[str, Any]:
        q = self.queries
        sel, node_label = q.selector, q.node_label
        recorded = await q.recorded(recording.NODE_MODELS, recording.NODE_MEMORY)
        answers = await q.many(
            f"max by ({node_label}) (up{{{sel}}})",
            models_query(sel, f"{node_label}, name", recorded),
            memory_query(sel, f"{node_label}, name", recorded),
            f"max by ({node_label}, driver_version, cuda_driver_version) (gpuwarden_driver_info{{{sel}}})",
            f"max by ({node_label}, version) (gpuwarden_build_info{{{sel}}})",
            f"max by ({node_label}) (gpuwarden_nvml_up{{{sel}}})",
            f'time() - max by ({node_label}) (gpuwarden_last_collect_timestamp_seconds{{{sel},tier="fast"}})',
            f"max by ({node_label}) (gpuwarden_gpus{{{sel}}})",
        )
        nodes = self._nodes(*answers)
        stale = []
        for name, entry in nodes.items():
            reason = self._staleness(entry)
            entry["state"] = reason or "ok"
            if reason:
                stale.append({"node": name, "reason": reason, "last_poll_age_seconds": entry["last_poll_age_seconds"]})
        return {
            "nodes": [{"node": name, **entry} for name, entry in sorted(nodes.items())],
            "totals": _totals(nodes),
            "stale_exporters": sorted(stale, key=lambda x: x["node"]),
            "source": source(recorded, "models and memory"),
        }

    def _nodes(self, *answers: list[Series]) -> dict[str, dict[str, Any]]:
        """Each node's entry from the answers, in the order `inventory` asks them."""
        up, models, memory, drivers, versions, nvml, age, visible = answers
        nodes: dict[str, dict[str, Any]] = {}

        def entry(row: Series) -> dict[str, Any]:
            return nodes.setdefault(self.queries.node(row), _new_node())

        for row in up:
            entry(row)["exporter_up"] = row.value == 1
        for row in models:
            item = entry(row)
            item["models"][row.labels.get("name", "")] = int(row.value)
            item["gpus"] += int(row.value)
        for row in memory:
            entry(row)["memory_bytes"][row.labels.get("name", "")] = row.value
        for row in drivers:
            entry(row).update(
                driver_version=row.labels.get("driver_version"),
                cuda_driver_version=row.labels.get("cuda_driver_version"),
            )
        for row in versions:
            entry(row)["exporter_version"] = row.labels.get("version")
        for row in nvml:
            entry(row)["nvml_up"] = row.value == 1
        for row in age:
            entry(row)["last_poll_age_seconds"] = round(row.value, 1)
        for row in visible:
            entry(row)["gpus_visible"] = int(row.value)
        return nodes

    def _staleness(self, entry: dict[str, Any]) -> str | None:
        if not entry["exporter_up"]:
            return "exporter down (scrape failing)"
        if entry["nvml_up"] is False:
            return "nvml down on the node"
        age = entry["last_poll_age_seconds"]
        if age is not None and age > self.queries.settings.stale_after:
            return f"last fast poll {age:.0f} s ago"
        return None


def _totals(nodes: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The fleet's counts: nodes, GPUs, each model's GPUs, nodes and memory, the versions in use."""
    by_model: dict[str, dict[str, Any]] = {}
    for entry in nodes.values():
        for model, count in entry["models"].items():
            item = by_model.setdefault(model, {"gpus": 0, "nodes": 0, "memory_bytes": 0.0})
            item["gpus"] += count
            item["nodes"] += 1
            item["memory_bytes"] = max(item["memory_bytes"], entry["memory_bytes"].get(model, 0.0))
    return {
        "nodes": len(nodes),
        "gpus": sum(e["gpus"] for e in nodes.values()),
        "models": dict(sorted(by_model.items())),
        "driver_versions": _tally(e["driver_version"] for e in nodes.values()),
        "exporter_versions": _tally(e["exporter_version"] for e in nodes.values()),
    }


def _tally(values: Iterable[str | None]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        if value:
            counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))
