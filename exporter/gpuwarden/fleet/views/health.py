"""The health view: unhealthy GPUs with their checks and since when, and the page's grouping of them by node."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import recording
from gpuwarden.fleet.prometheus import Series
from gpuwarden.fleet.views.queries import FleetQueries, source

PAGE_ROWS = {"cordon": 20, "health_nodes": 50, "stale": 20}  # the page's sections; the JSON endpoints list all


@dataclass(frozen=True)
class HealthView:
    """Unhealthy GPUs with their checks, severity and since when; nodes whose exporter is down."""

    queries: FleetQueries

    async def health(self) -> dict[str, Any]:
        q = self.queries
        sel = q.selector
        # Durations are as of the instant the queries describe, not the moment of answering: a cached answer
        # repeated a second later must say the same (it said 15 s, then 16 s, before).
        now = q.client.evaluation_time()
        # with the recording rules, the non-ok verdicts are already a series each (up to an evaluation interval
        # old); without them, one query per check, as the rules do it (recording.check_partitions: VictoriaMetrics'
        # series limit)
        recorded = await q.recorded(recording.HEALTH)
        verdicts = (
            [f"{recording.HEALTH}{{{sel}}}"]
            if recorded
            else [f"gpuwarden_health{{{sel},{part}}} > 0" for _, part in recording.check_partitions()]
        )
        down, since, *per_check = await q.many(
            f"up{{{sel}}} == 0",
            # present only while a check is not ok: a handful of series, whatever the fleet's size
            f"gpuwarden_health_since_timestamp_seconds{{{sel}}}",
            *verdicts,
            at=now,
        )
        gpus = self._unhealthy_gpus([row for rows in per_check for row in rows], since, now)
        ordered = sorted(gpus, key=lambda g: (g["severity"] != "critical", g["node"], g["gpu"] or ""))
        return {
            "unhealthy_gpus": ordered,
            "counts": {
                "critical": sum(g["severity"] == "critical" for g in ordered),
                "warning": sum(g["severity"] == "warning" for g in ordered),
            },
            "unknown_nodes": sorted({q.node(r) for r in down}),
            "source": source(recorded, "verdicts (up to one evaluation interval old)"),
            "note": "since: when the exporter first judged the current level (restarts with the exporter)",
        }

    def _unhealthy_gpus(self, unhealthy: list[Series], since: list[Series], now: float) -> list[dict[str, Any]]:
        """A GPU per (node, uuid) with each non-ok check, worst first, and since when (as of `now`)."""
        node_of = self.queries.node
        began = {(node_of(r), r.labels.get("uuid"), r.labels.get("check")): r.value for r in since}
        gpus: dict[tuple[str, str], dict[str, Any]] = {}
        for row in unhealthy:
            node, uuid = node_of(row), row.labels.get("uuid", "")
            gpu = gpus.setdefault(
                (node, uuid),
                {"node": node, "gpu": row.labels.get("gpu"), "uuid": uuid, "severity": "warning", "checks": []},
            )
            level = int(row.value)
            started = began.get((node, uuid, row.labels.get("check")))
            gpu["checks"].append(
                {
                    "check": row.labels.get("check"),
                    "level": level,
                    "severity": "critical" if level >= 2 else "warning",
                    "since": started,
                    "for_seconds": round(now - started, 0) if started else None,
                }
            )
            if level >= 2:
                gpu["severity"] = "critical"
        for gpu in gpus.values():
            gpu["checks"].sort(key=lambda c: (-c["level"], c["check"]))
            known = [c["since"] for c in gpu["checks"] if c["since"]]
            gpu["since"] = min(known) if known else None
        return list(gpus.values())


def health_by_node(unhealthy_gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unhealthy GPUs grouped by node and check: a row per node ("xid: GPU 1, 3"), critical nodes first, so a
    thousand failing GPUs read as the few hundred nodes and handful of checks they are."""
    nodes: dict[str, dict[str, Any]] = {}
    for gpu in unhealthy_gpus:
        entry = nodes.setdefault(gpu["node"], {"node": gpu["node"], "severity": "warning", "checks": {}})
        for check in gpu["checks"]:
            item = entry["checks"].setdefault(check["check"], {"level": 0, "gpus": []})
            item["level"] = max(item["level"], check["level"])
            item["gpus"].append(gpu["gpu"])
        if gpu["severity"] == "critical":
            entry["severity"] = "critical"
    for entry in nodes.values():
        entry["checks"] = dict(sorted(entry["checks"].items(), key=lambda kv: (-kv[1]["level"], kv[0])))
    return sorted(nodes.values(), key=lambda e: (e["severity"] != "critical", e["node"]))
