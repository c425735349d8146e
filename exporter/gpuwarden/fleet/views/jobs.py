"""The jobs view: multi-node jobs joined by the job key every node's exporter derives alike, and their stragglers."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import stragglers
from gpuwarden.fleet.prometheus import Series
from gpuwarden.fleet.views.queries import FleetQueries


@dataclass(frozen=True)
class JobsView:
    """Multi-node jobs, joined by the job key every node's exporter derives alike (gpuwarden_job_* series), and the
    stragglers among them (fleet/stragglers.py: each node's own judgement, compared across nodes). Jobs keyed
    `local/...` are one node's only and are left out."""

    queries: FleetQueries

    async def jobs(self, at: float | None = None) -> dict[str, Any]:
        """`at`: the evaluation time (default: now)."""
        q = self.queries
        sel, node_label = q.selector, q.node_label
        job_sel = f'{sel}, job_id!~"local/.*"' if sel else 'job_id!~"local/.*"'
        counter = f"gpuwarden_job_collective_wait_seconds_total{{{job_sel}}}"
        waits, now, found = await q.many(
            f"max by ({node_label}, gpu, uuid, job_id, rank) (rate({counter}[{stragglers.JOB_WINDOW}]))",
            f"max by ({node_label}, uuid, job_id) (irate({counter}[{stragglers.JOB_WINDOW}]))",
            f"max by ({node_label}, job_id, kind, uuid, cause) (gpuwarden_job_finding{{{job_sel}, "
            f'kind=~"{"|".join((*stragglers.NAMED_KINDS, stragglers.ELSEWHERE))}"}})',
            at=at,
        )
        members = self._members(waits, now)
        findings = self._findings(found)
        jobs = []
        for job, gpus in sorted(members.items()):
            gpus.sort(key=lambda g: (g["node"], g["gpu"]))
            named = stragglers.stragglers_of(gpus, findings.get(job, []))
            nodes = sorted({g["node"] for g in gpus})
            jobs.append({"job_id": job, "nodes": nodes, "gpus": gpus, "straggler": (named or [None])[0],
                         "stragglers": named})  # fmt: skip
        jobs.sort(key=lambda j: (j["straggler"] is None, -len(j["gpus"]), j["job_id"]))
        return {
            "window": stragglers.JOB_WINDOW,
            "jobs": jobs,
            "source": "raw series: gpuwarden_job_collective_wait_seconds_total and gpuwarden_job_finding",
        }

    def _members(self, waits: list[Series], now: list[Series]) -> dict[str, list[dict[str, Any]]]:
        """Each job's GPUs with their share of time waiting over the window and over the last scrape."""
        node_of = self.queries.node
        now_of = {(node_of(s), s.labels.get("uuid", ""), s.labels.get("job_id", "")): s.value for s in now}
        members: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in waits:
            node, uuid, job = node_of(row), row.labels.get("uuid", ""), row.labels.get("job_id", "")
            members[job].append(
                {
                    "node": node,
                    "gpu": row.labels.get("gpu", ""),
                    "uuid": uuid,
                    "rank": row.labels.get("rank", "unknown"),
                    "wait_share": _share(row.value),
                    "now_share": _share(now_of.get((node, uuid, job), 0.0)),
                }
            )
        return members

    def _findings(self, found: list[Series]) -> dict[str, list[dict[str, Any]]]:
        """Each job's findings as the nodes judged them (fleet/stragglers.py compares them)."""
        findings: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for series in found:
            labels = series.labels
            findings[labels.get("job_id", "")].append(
                {
                    "node": self.queries.node(series),
                    "kind": labels.get("kind", ""),
                    "uuid": labels.get("uuid", ""),
                    "cause": labels.get("cause", ""),
                }  # fmt: skip
            )
        return findings


def _share(value: float) -> float:
    return round(min(max(value, 0.0), 1.0), 3)
