"""Soak: run the daemon for a long time at fast polling with faults injected, sample RSS, fds and threads.

Usage: python -m bench.soak --seconds 3600 --json OUT.json   (defaults: bench/soak-faults.yaml, 0.1 s polling)
Scrapes /metrics every 5 s and /api/v1/gpus every 30 s; samples every 60 s; counts failed scrapes and tracebacks.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.request
from pathlib import Path

from bench.sim_daemon import proc_status, report
from tests.helpers.daemon import start_daemon


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3600)
    parser.add_argument("--scenario", default=str(Path(__file__).resolve().parent / "soak-faults.yaml"))
    parser.add_argument("--port", type=int, default=10051)
    parser.add_argument("--json")
    args = parser.parse_args()
    log = Path("/tmp/gpuwarden-soak.log")
    flags = ["--poll.fast-interval", "0.1", "--poll.slow-interval", "1", "--poll.call-deadline", "2"]
    exporter = start_daemon("--sim", "--nvml.scenario", args.scenario, *flags, port=args.port, log=log)
    url, proc = exporter
    start = time.monotonic()
    samples, failures, scrapes = [], 0, 0
    next_sample = 0.0
    while time.monotonic() - start < args.seconds:
        elapsed = time.monotonic() - start
        if elapsed >= next_sample:
            samples.append({"t_s": round(elapsed), **proc_status(proc.pid)})
            print(json.dumps(samples[-1]), flush=True)
            next_sample += 60
        try:
            urllib.request.urlopen(url + "/metrics", timeout=5).read()
            if int(elapsed) % 30 < 5:
                urllib.request.urlopen(url + "/api/v1/gpus", timeout=5).read()
            scrapes += 1
        except OSError:
            failures += 1
        time.sleep(5)
    samples.append({"t_s": round(time.monotonic() - start), **proc_status(proc.pid)})
    exporter.stop(timeout=15)
    logs = exporter.output()
    after_warmup = [s for s in samples if s["t_s"] >= 120] or samples
    result = {
        "seconds": samples[-1]["t_s"],
        "scrapes": scrapes,
        "failed_scrapes": failures,
        "rss_mib_first": round(samples[0]["rss_mib"], 1),
        "rss_mib_at_2min": round(after_warmup[0]["rss_mib"], 1),
        "rss_mib_last": round(samples[-1]["rss_mib"], 1),
        "rss_growth_after_2min_mib": round(samples[-1]["rss_mib"] - after_warmup[0]["rss_mib"], 2),
        "threads": sorted({s["threads"] for s in samples}),
        "fds": sorted({s["fds"] for s in samples}),
        "cpu_millicores": round(1000 * (samples[-1]["cpu_s"] - samples[0]["cpu_s"]) / max(samples[-1]["t_s"], 1), 1),
        "tracebacks_in_log": logs.count("Traceback"),
        "log_lines": logs.count("\n"),
        "exit_code": proc.returncode,
        "samples": samples,
    }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
