"""The suite's case across nodes (issue 49): one 4-rank job on three nodes, balanced for 12 minutes, then rank 2
(node-b's only GPU) CPU-bound. Each node's exporter runs in turn on the simulator; Prometheus holds what it would
have scraped (tests/helpers/fleet_history.py); the fleet's job view is evaluated every 5 s of the history around the
onset. Node-a (ranks 0 and 1) and node-c (rank 3) wait; node-b's exporter has no peer of its rank to compare with,
so only the fleet can name it: within 90 s of the onset, never another GPU, never before.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.fleet.prometheus import PrometheusClient
from gpuwarden.fleet.views import Fleet
from tests.helpers.fleet import fleet_settings
from tests.helpers.fleet_history import BackfilledPrometheus, Scrapes
from tests.helpers.job_cases import IDLE, RUNNING, SPIN, Case, Proc, run
from tests.job_case_list import gpus, torchrun

ONSET, END = 720.0, 840.0  # the job has run 12 minutes when rank 2 turns CPU-bound
BOUND_S = 90.0
NODES = {"node-a": (0, 1), "node-b": (2,), "node-c": (3,)}  # node → the job's ranks there, one GPU each


def node_case(node: str, ranks: tuple[int, ...]) -> Case:
    changes = (ONSET, {local: (IDLE if rank == 2 else SPIN) for local, rank in enumerate(ranks)})
    procs = tuple(
        Proc(7000 + rank, local, environ=torchrun(rank, 4, addr="node-a.cluster", run="gpt-ft"),
             host=((0.0, RUNNING),))
        for local, rank in enumerate(ranks)
    )  # fmt: skip
    return Case(
        f"fleet-{node}",
        "two-node straggler",
        gpus(len(ranks), changes),
        procs,
        seconds=END,
        node={"model": "h100-sxm-80gb", "count": len(ranks), "nvlink": "nvswitch"},
    )


@dataclass
class FleetResult:
    named_after: float | None = None  # seconds after the onset the fleet first named node-b's GPU
    wrong: list[str] = field(default_factory=list)  # any other naming: (t, node, GPU)
    answers: int = 0

    @property
    def passed(self) -> bool:
        return self.named_after is not None and self.named_after <= BOUND_S and not self.wrong

    def row(self) -> str:
        named = "MISSED" if self.named_after is None else f"{self.named_after:.0f} s"
        false = ", ".join(self.wrong) or "-"
        verdict = "ok" if self.passed else "FAIL"
        return (
            f"| fleet-two-node | two-node straggler (real Prometheus, job 12 min old) | straggler node-b GPU 0@720: "
            f"{named} | {false} | {verdict} |"
        )


def run_fleet_case(work: Path) -> FleetResult:
    """The three nodes' history backfilled into Prometheus, and the fleet's answers around the onset."""
    start = time.time() - END - 120  # the history ends two minutes ago: every sample lies in the past
    scrapes = Scrapes()
    for node, ranks in NODES.items():
        run(node_case(node, ranks), work, start=start, scrape=scrapes.of(node))
    prometheus = BackfilledPrometheus(work / "prometheus", scrapes.openmetrics())
    try:
        return asyncio.run(_answers(prometheus.url, start))
    finally:
        prometheus.stop()


async def _answers(url: str, start: float) -> FleetResult:
    client = PrometheusClient(url, timeout=30, cache_ttl=0)
    fleet = Fleet(client, fleet_settings(url, node_label="node"))
    result = FleetResult()
    try:
        for t in range(int(ONSET) - 120, int(END) + 1, 5):
            answer = await fleet.jobs(at=start + t)
            result.answers += 1
            for job in answer["jobs"]:
                for straggler in job["stragglers"]:
                    where = (straggler["node"], straggler["gpu"], straggler["rank"])
                    if where == ("node-b", "0", "2") and t >= ONSET:
                        result.named_after = t - ONSET if result.named_after is None else result.named_after
                    else:
                        result.wrong.append(f"{t - ONSET:+.0f} s: {where[0]} GPU {where[1]} rank {where[2]}")
    finally:
        await client.close()
    return result
