"""Run the daemon on a simulated node and record time to ready, RSS, threads, fds and CPU over a long run.

Usage: python -m bench.sim_daemon --seconds 600 --scenario training [--scrape-interval 15] --json OUT.json
Polls at 1 s (fast) and 15 s (slow); /metrics is scraped every 15 s, as Prometheus would (or at
--scrape-interval). RSS, threads and open fds are sampled every 60 s; CPU is user + system time of the process
over the run.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers.daemon import start_daemon


def proc_status(pid: int) -> dict[str, float]:
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return {
        "rss_mib": int(status["VmRSS"].split()[0]) / 1024,
        "threads": int(status["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "cpu_s": (int(fields[11]) + int(fields[12])) / ticks,
    }


def report(result: dict[str, Any], path: str | None) -> None:
    """A run's result on stdout (its per-minute samples left out) and, whole, as JSON into `path` if given."""
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}))
    if path:
        Path(path).write_text(json.dumps(result, indent=1) + "\n")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--scenario", default="training")
    parser.add_argument("--port", type=int, default=10048)
    parser.add_argument("--scrape-interval", type=float, default=15.0)
    parser.add_argument("--json")
    args = parser.parse_args()
    start = time.monotonic()
    exporter = start_daemon(
        "--sim", "--nvml.scenario", args.scenario, port=args.port, ready="/readyz", step=0.01, stderr=subprocess.DEVNULL
    )
    ready_s = time.monotonic() - start
    url, proc = exporter
    samples = [{"t_s": 0.0, **proc_status(proc.pid)}]
    t0 = time.monotonic()
    next_sample = 60.0
    while time.monotonic() - t0 < args.seconds:
        urllib.request.urlopen(url + "/metrics", timeout=5).read()
        time.sleep(args.scrape_interval)
        if time.monotonic() - t0 >= next_sample:
            samples.append({"t_s": round(time.monotonic() - t0), **proc_status(proc.pid)})
            next_sample += 60
    end = {"t_s": round(time.monotonic() - t0), **proc_status(proc.pid)}
    exporter.stop()
    first_minute = samples[1] if len(samples) > 1 else samples[0]
    result = {
        "scenario": args.scenario,
        "scrape_interval_s": args.scrape_interval,
        "seconds": round(end["t_s"]),
        "time_to_ready_s": round(ready_s, 3),
        "rss_mib_end": round(end["rss_mib"], 1),
        "rss_mib_after_1min": round(first_minute["rss_mib"], 1),
        "rss_growth_mib_after_1min": round(end["rss_mib"] - first_minute["rss_mib"], 2),
        "cpu_millicores": round(1000 * (end["cpu_s"] - samples[0]["cpu_s"]) / end["t_s"], 2),
        "threads": sorted({s["threads"] for s in samples + [end]}),
        "fds": sorted({s["fds"] for s in samples + [end]}),
        "samples": samples + [end],
        "exit_code": proc.returncode,
    }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
