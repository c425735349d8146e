"""The fleet's rule for a multi-node job's stragglers (gpuwarden.fleet.stragglers.stragglers_of): each node's own
judgement (gpuwarden_job_finding: a straggler it names, or waiting_elsewhere where every rank there waits more than
usual), compared across nodes with each GPU's wait over the last scrape interval (now_share). The shares are those
the fleet read from real Prometheus on a lent 2x H200 run as two nodes, one GPU each (2026-11-28,
docs/validation/2026-11-28-h200x2-jobs); the end-to-end paths through Prometheus are tests/test_fleet_jobs.py and
the case suite's two-node case (tests/job_case_fleet.py).
"""

from __future__ import annotations

import pytest

from gpuwarden.fleet.stragglers import stragglers_of


def gpus(*rows: tuple[str, str, float, float]) -> list[dict]:
    return [{"node": node, "gpu": gpu, "uuid": f"GPU-{gpu}", "rank": gpu, "wait_share": share, "now_share": now}
            for node, gpu, share, now in rows]  # fmt: skip


def elsewhere(*nodes: str) -> list[dict]:
    return [{"node": n, "kind": "waiting_elsewhere", "uuid": "", "cause": "off_node"} for n in nodes]


TWO = (("node-a", "0"), ("node-b", "1"))


@pytest.mark.parametrize(
    ("when", "job", "findings", "named"),
    [
        ("balanced", gpus(("node-a", "0", 0.0, 0.0), ("node-b", "1", 0.0, 0.0)), [], []),
        # rank 1 CPU-bound: node-a's only rank waits more than usual, so its exporter says the straggler is off it
        (
            "cpu, rank 1, 36 s",
            gpus(("node-a", "0", 0.287, 1.0), ("node-b", "1", 0.0, 0.0)),
            elsewhere("node-a"),
            ["1"],
        ),
        # the exporter's judgement ended with the straggle: the 1m rate that still reads 0.59 names no one
        ("cpu, rank 1, 66 s", gpus(("node-a", "0", 0.592, 0.0), ("node-b", "1", 0.0, 0.0)), [], []),
        # the next injection (rank 0's loader starved): the GPU that waited last time is named only once it waits no
        # more now, whatever its 1m rate still holds
        (
            "input, rank 0, 36 s",
            gpus(("node-a", "0", 0.236, 0.0), ("node-b", "1", 0.344, 1.0)),
            elsewhere("node-b"),
            ["0"],
        ),
        # a warm-up's skew or a pipeline's imbalance: no node says waiting_elsewhere (no onset): no one named
        ("warm-up skew", gpus(("node-a", "0", 0.9, 1.0), ("node-b", "1", 0.0, 0.0)), [], []),
        # a node that holds the straggler beside a waiter names it itself, with its cause
        (
            "named on its node",
            gpus(
                ("node-a", "0", 0.9, 1.0),
                ("node-a", "1", 0.9, 1.0),
                ("node-b", "2", 0.0, 0.0),
                ("node-b", "3", 0.5, 1.0),
            ),
            [*elsewhere("node-a"), {"node": "node-b", "kind": "straggler", "uuid": "GPU-2", "cause": "cpu"}],
            ["2"],
        ),  # fmt: skip
        # two ranks off the waiting nodes do not wait: both named
        (
            "two stragglers",
            gpus(("node-a", "0", 0.9, 1.0), ("node-b", "1", 0.0, 0.0), ("node-c", "2", 0.0, 0.1)),
            elsewhere("node-a"),
            ["1", "2"],
        ),
        # the only other GPU still waits now: no one to name
        (
            "every GPU waits",
            gpus(("node-a", "0", 0.6, 1.0), ("node-b", "1", 0.4, 0.9)),
            elsewhere("node-a", "node-b"),
            [],
        ),
    ],
)
def test_the_stragglers_are_named_from_the_nodes_judgements(
    when: str, job: list[dict], findings: list[dict], named: list[str]
) -> None:
    found = stragglers_of(job, findings)
    assert [s["gpu"] for s in found] == named, (when, found)
    for straggler in found:
        waiting = [g for g in job if g["gpu"] not in named and (g["now_share"] > 0.2 or g["node"] != "node-b")]
        assert straggler["waiting_gpus"] >= 1 and set(straggler["waiting_nodes"]) <= {g["node"] for g in waiting}
