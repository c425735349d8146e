"""A straggler across nodes, named by the fleet service through real Prometheus (issue 37).

Two simulated nodes (two exporters on the simulator, beneath the real pynvml), each with two ranks of one 4-rank
job: their /proc, written for the simulated PIDs, carries the launcher's rendezvous, so both exporters derive the
same job key. From the onset rank 2, on node-b, is CPU-bound: ranks 0 and 1 on node-a and rank 3 on node-b spin in
the all-reduce. Node-a's exporter alone cannot say who is late (every rank there waits: `waiting_elsewhere`); the
fleet compares the nodes' wait counters and names node-b's GPU 0, rank 2, within 120 s of the onset (the issue's
bound: scrape interval plus rule evaluations; here Prometheus scrapes every second).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.helpers.common import free_port, wait_for
from tests.helpers.daemon import start_daemon
from tests.helpers.fleet import FleetServer, fleet_settings
from tests.helpers.stack import FAST_EXPORTER_FLAGS, PROMETHEUS, Stack, wait_ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus (the README test command installs it)"),
]

ONSET = 30.0  # seconds after each simulator starts: the job view's window (20 s) has been watched by then
BALANCED = {"utilization": 53, "sm_active": 42, "tensor_active": 11.5, "fp32_active": 2, "dram_active": 30}
WAITER = {"utilization": 92, "sm_active": 22, "tensor_active": 2, "fp32_active": 1, "dram_active": 2}
CPU_BOUND = {"utilization": 6, "sm_active": 5, "tensor_active": 2, "fp32_active": 1, "dram_active": 1}


def scenario(after: dict[int, dict[str, float]], pids: tuple[int, int]) -> dict:
    gpus = {}
    for gpu in range(2):
        switch = {
            k: {"ramp": {"start": BALANCED[k], "end": after[gpu][k], "duration": 1, "begin": ONSET}} for k in BALANCED
        }
        gpus[gpu] = {**switch, "fp16_active": {"constant": 0}, "nvlink_rx_bytes_per_second": {"constant": 1.9e9},
                     "nvlink_tx_bytes_per_second": {"constant": 1.9e9}}  # fmt: skip
    return {
        "node": {"model": "h100-sxm-80gb", "count": 2, "nvlink": "nvswitch"},
        "values": {"memory_used_ratio": 0.6},
        "gpus": gpus,
        "processes": [{"gpu": g, "pid": pids[g], "memory_gib": {"constant": 40}} for g in range(2)],
    }


def ranks_proc(root: Path, pids: tuple[int, int], first_rank: int) -> Path:
    """The node's /proc for its two ranks: torchrun's variables of a 4-rank job, main threads running (a rank
    spinning in a collective spins a core too)."""
    (root / "self").mkdir(parents=True)
    for local, pid in enumerate(pids):
        base = root / str(pid)
        (base / "task" / str(pid)).mkdir(parents=True)
        variables = {"MASTER_ADDR": "node-a.cluster", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "gpt-ft",
                     "RANK": str(first_rank + local), "LOCAL_RANK": str(local), "WORLD_SIZE": "4"}  # fmt: skip
        (base / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in variables.items()))
        (base / "stat").write_text(f"{pid} (python) S 900 900 900 0 -1\n")
        (base / "task" / str(pid) / "stat").write_text(f"{pid} (python) R 900 1 2\n")
        (base / "task" / str(pid) / "children").write_text("")
    return root


def test_the_fleet_names_the_straggler_node_gpu_and_rank_of_a_multi_node_job(tmp_path: Path) -> None:
    nodes = {
        "node-a": (scenario({0: WAITER, 1: WAITER}, (7001, 7002)), (7001, 7002), 0),
        "node-b": (scenario({0: CPU_BOUND, 1: WAITER}, (7101, 7102)), (7101, 7102), 2),
    }
    stack, exporters, targets = Stack(tmp_path), [], []
    try:
        started = {}
        for node, (sim, pids, first_rank) in nodes.items():
            path = tmp_path / f"{node}.yaml"
            path.write_text(yaml.safe_dump({"name": node, **sim}))
            proc_root = ranks_proc(tmp_path / f"{node}-proc", pids, first_rank)
            started[node] = time.monotonic()  # the scenario's clock starts with the process
            flags = ["--processes.proc-root", str(proc_root), *FAST_EXPORTER_FLAGS]
            exporters.append(start_daemon("--sim", "--nvml.scenario", str(path), *flags, log=tmp_path / f"{node}.log"))
            targets.append({"targets": [f"127.0.0.1:{exporters[-1].port}"], "labels": {"node": node}})
        (tmp_path / "targets.json").write_text(json.dumps(targets))
        prometheus_port = free_port()
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [
                {"job_name": "gpuwarden", "file_sd_configs": [{"files": [str(tmp_path / "targets.json")]}]}
            ],
        }  # fmt: skip
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        data, listen = tmp_path / "prom-data", f"127.0.0.1:{prometheus_port}"
        stack._spawn([PROMETHEUS or "prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                      f"--storage.tsdb.path={data}", f"--web.listen-address={listen}"])  # fmt: skip
        prometheus = f"http://127.0.0.1:{prometheus_port}"
        wait_ready(prometheus + "/-/ready")
        onset = max(started.values()) + ONSET
        with FleetServer(fleet_settings(prometheus, node_label="node", query_timeout=30)) as fleet:
            answer: dict = {}

            def named() -> bool:
                nonlocal answer
                answer = fleet.get("/api/v1/fleet/jobs").json()
                return any(job["straggler"] for job in answer["jobs"])

            before = fleet.get("/api/v1/fleet/jobs").json()
            assert time.monotonic() < onset and not any(job["straggler"] for job in before["jobs"]), before
            wait_for(named, timeout=onset + 120 - time.monotonic(), step=1)
            page = fleet.get("/").text
        (job,) = answer["jobs"]
        assert job["job_id"] == "node-a.cluster:29500/gpt-ft" and job["nodes"] == ["node-a", "node-b"]
        straggler = job["straggler"]
        assert (straggler["node"], straggler["gpu"], straggler["rank"]) == ("node-b", "0", "2"), straggler
        # node-a's ranks wait (node-b's rank 3 too, its share rising through the window as the others' did)
        assert "node-a" in straggler["waiting_nodes"] and straggler["waiting_gpus"] >= 2, straggler
        assert straggler["cause"] in ("cpu", "")  # "cpu" once node-b's exporter names it itself
        assert "node-b GPU 0 (rank 2" in page
        # node-a's own exporter cannot name it: every rank there waits, and it says the straggler is off the node
        port_a = int(targets[0]["targets"][0].rsplit(":", 1)[1])
        # (node-b names its own straggler after 4 s of disagreement, its cause measured on its host; node-a, whose
        # ranks only wait, confirms after 10 s: the fleet may have named node-b before node-a says so)
        jobs_a: list = []

        def node_a_says() -> bool:
            nonlocal jobs_a
            jobs_a = httpx.get(f"http://127.0.0.1:{port_a}/api/v1/health", timeout=10).json()["jobs"]
            return bool(jobs_a)

        wait_for(node_a_says, timeout=60, step=1)
        assert [j["kind"] for j in jobs_a] == ["waiting_elsewhere"], jobs_a
    finally:
        for exporter in exporters:
            exporter.stop()
        stack.stop()
