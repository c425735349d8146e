"""The exporter's memory when node-problem-detector asks /api/v1/health every 30 s and nobody uses the JSON API:
the whole process tree (the serving process and the GPM child), RSS and PSS from /proc/PID/smaps_rollup, after
scrapes only, then after N health requests, then after one request to the JSON API (which loads FastAPI).

    python3 bench/health_rss.py OUT.json [--sim | --real] [--requests 1000]

--sim (default) runs the simulator's `training` scenario; --real the driver's library on a GPU host.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tree(pid: int) -> list[int]:
    """The process and its descendants (the GPM child)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        for task in Path(f"/proc/{current}/task").glob("*/children"):
            todo += [int(c) for c in task.read_text().split()]
    return found


def rollup(pid: int) -> dict[str, float]:
    fields = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        name, value = line.split(":", 1)
        fields[name] = int(value.split()[0]) / 1024
    return {"rss_mib": round(fields["Rss"], 1), "pss_mib": round(fields["Pss"], 1)}


def measure(pid: int) -> dict:
    processes = {str(p): rollup(p) for p in tree(pid)}
    return {
        "processes": processes,
        "total_rss_mib": round(sum(p["rss_mib"] for p in processes.values()), 1),
        "total_pss_mib": round(sum(p["pss_mib"] for p in processes.values()), 1),
    }


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--real", action="store_true")
    parser.add_argument("--requests", type=int, default=1000)
    args = parser.parse_args()
    port = free_port()
    command = [sys.executable, "-m", "gpuwarden", "--web.listen-address", f"127.0.0.1:{port}"]
    if not args.real:
        command += ["--sim", "--nvml.scenario", "training"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUWARDEN_")}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                get(url + "/readyz")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
        for _ in range(20):
            get(url + "/metrics")
            time.sleep(0.5)
        out = {
            "date": time.strftime("%Y-%m-%d"),
            "backend": "real" if args.real else "sim",
            "scrape_only": measure(proc.pid),
        }
        for i in range(args.requests):
            get(url + "/api/v1/health")
            if i % 50 == 0:
                get(url + "/metrics")
        out[f"after_{args.requests}_health"] = measure(proc.pid)
        get(url + "/api/v1/gpus")
        for _ in range(5):
            get(url + "/metrics")
            time.sleep(0.2)
        out["after_json_api"] = measure(proc.pid)
        out["health_minus_scrape_only_rss_mib"] = round(
            out[f"after_{args.requests}_health"]["total_rss_mib"] - out["scrape_only"]["total_rss_mib"], 1
        )
    finally:
        proc.terminate()
        proc.wait(10)
    args.out.write_text(json.dumps(out, indent=1))
    print(json.dumps({k: v for k, v in out.items() if k != "processes"}, indent=1))


if __name__ == "__main__":
    main()
