"""What pod attribution costs: RSS and CPU of the simulated daemon with attribution off, and on against a fake
kubelet (a real gRPC server on a unix socket, 8 GPUs held by 12 containers, time-sliced on two of them).

Usage: python -m bench.pod_attribution_rss --seconds 120 --json OUT.json
Each run: 8 simulated H100s, fast poll 1 s, /metrics scraped every 5 s, pod-resources refreshed every 10 s.
"""

from __future__ import annotations

import argparse
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.sim_daemon import proc_status, report
from tests.helpers.daemon import running_cli
from tests.helpers.kubelet import FakeKubelet


def simulated_uuids(scenario: str) -> list[str]:
    """The GPU UUIDs a daemon simulating `scenario` reports: the simulator derives them from the scenario."""
    from gpuwarden.sim import install_simulator
    from gpuwarden.sim.scenario import load_scenario

    fake = install_simulator(load_scenario(scenario))
    return [fake.uuid(i) for i in range(fake.count)]


def run(seconds: float, port: int, socket: Path | None) -> dict[str, float]:
    flags = ["--no-pods.attribution"] if socket is None else [f"--pods.resources-socket={socket}"]
    with running_cli("--sim", "--nvml.scenario", "training", *flags, port=port, ready="/readyz") as (url, proc):
        start = proc_status(proc.pid)
        end_at = time.monotonic() + seconds
        body = b""
        while time.monotonic() < end_at:
            body = urllib.request.urlopen(url + "/metrics", timeout=5).read()
            time.sleep(5)
        end = proc_status(proc.pid)
        allocations = sum(1 for line in body.decode().splitlines() if line.startswith("gpuwarden_gpu_allocation{"))
        return {
            "rss_mib": round(end["rss_mib"], 1),
            "cpu_millicores": round(1000 * (end["cpu_s"] - start["cpu_s"]) / seconds, 2),
            "allocation_series": allocations,
        }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120)
    parser.add_argument("--json")
    args = parser.parse_args()
    off = run(args.seconds, 10061, None)
    with tempfile.TemporaryDirectory(prefix="kubelet-") as short:
        kubelet = FakeKubelet(Path(short) / "kubelet.sock").start()
        uuids = simulated_uuids("training")
        kubelet.pods = [("train", f"worker-{i}", [("main", [("nvidia.com/gpu", [uuids[i]])])]) for i in range(6)]
        kubelet.pods += [
            ("dev", f"nb-{i}", [("jupyter", [("nvidia.com/gpu.shared", [f"{uuids[6 + i % 2]}::{i}"])])])
            for i in range(6)
        ]
        try:
            on = run(args.seconds, 10062, kubelet.socket_path)
        finally:
            kubelet.stop()
    result = {"seconds": args.seconds, "off": off, "on": on, "rss_delta_mib": round(on["rss_mib"] - off["rss_mib"], 1)}
    report(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
