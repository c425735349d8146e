"""The fleet's rule for a multi-node job's straggler (gpuwarden.fleet.views.straggler_of), over what the fleet read
from real Prometheus on a lent 2x H200 (2026-11-28): a two-node DDP job (torchrun, one GPU per "node", an exporter
per GPU), stragglers injected for 44 s in turn. Each case is one answer of /api/v1/fleet/jobs, seconds after an
onset (docs/validation/2026-11-28-h200x2-jobs). The end-to-end path through Prometheus is tests/test_fleet_jobs.py.
"""

from __future__ import annotations

import pytest

from gpuwarden.fleet.views import straggler_of


def gpus(*rows: tuple[str, str, float, str]) -> list[dict]:
    return [{"node": node, "gpu": gpu, "uuid": f"GPU-{gpu}", "rank": gpu, "wait_share": share, "class": cls}
            for node, gpu, share, cls in rows]  # fmt: skip


@pytest.mark.parametrize(
    ("when", "job", "named"),
    [
        ("balanced", gpus(("node-a", "0", 0.0, "tensor_bound"), ("node-b", "1", 0.0, "tensor_bound")), None),
        # rank 1 CPU-bound from t=0: the waiter's 1m share climbs; named once it passes 0.3 (0.5 waited to 54 s)
        ("cpu, rank 1, 36 s", gpus(("node-a", "0", 0.287, "collective_wait"), ("node-b", "1", 0.0, "waiting")), None),
        ("cpu, rank 1, 42 s", gpus(("node-a", "0", 0.378, "collective_wait"), ("node-b", "1", 0.0, "waiting")), "1"),
        # 22 s after the straggle ended the 1m rate still reads 0.59, but the waiter computes again: no one to name
        ("cpu, rank 1, 66 s", gpus(("node-a", "0", 0.592, "tensor_bound"), ("node-b", "1", 0.0, "tensor_bound")), None),
        # the next injection (rank 0's loader starved): the GPU that waited last time is not named for it...
        (
            "input, rank 0, 36 s",
            gpus(("node-a", "0", 0.236, "waiting"), ("node-b", "1", 0.344, "collective_wait")),
            None,
        ),  # fmt: skip
        # ...and rank 0 is, once its own old wait has left the window
        (
            "input, rank 0, 42 s",
            gpus(("node-a", "0", 0.145, "waiting"), ("node-b", "1", 0.437, "collective_wait")),
            "0",
        ),  # fmt: skip
        ("no classes yet", gpus(("node-a", "0", 0.9, ""), ("node-b", "1", 0.0, "")), "1"),
        # four ranks on two nodes, a minute after the onset: node-a's two between classes, node-b's rank 3 spinning
        (
            "a waiter between classes",
            gpus(
                ("node-a", "0", 0.9, "mixed"),
                ("node-a", "1", 0.9, "mixed"),
                ("node-b", "2", 0.0, "waiting"),
                ("node-b", "3", 0.5, "collective_wait"),
            ),
            "2",
        ),  # fmt: skip
        ("one GPU", gpus(("node-a", "0", 0.9, "collective_wait")), None),
        (
            "every GPU waits",
            gpus(("node-a", "0", 0.6, "collective_wait"), ("node-b", "1", 0.1, "collective_wait")),
            None,
        ),  # fmt: skip
    ],
)
def test_the_straggler_is_named_while_its_peers_spin_and_only_then(when: str, job: list[dict], named: str | None):
    straggler = straggler_of(job)
    assert (straggler and straggler["gpu"]) == named, (when, straggler)
    if straggler:
        others = [g for g in job if g["gpu"] != named and g["wait_share"] >= 0.3]
        assert straggler["waiting_gpus"] == len(others) and set(straggler["waiting_nodes"]) == {
            g["node"] for g in others
        }
