"""Does pod attribution leak when the kubelet comes and goes? The simulated daemon (8 GPUs, refresh every 1 s)
against a fake kubelet that disappears and returns every `--period` seconds, with pods changing each time;
RSS, threads and open fds sampled every minute.

Usage: python -m bench.pod_attribution_flap --seconds 600 --period 20 --json OUT.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
import urllib.request
from pathlib import Path

from bench.pod_attribution_rss import simulated_uuids
from bench.sim_daemon import proc_status, report
from tests.helpers.daemon import start_daemon
from tests.helpers.kubelet import FakeKubelet


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--period", type=float, default=20)
    parser.add_argument("--port", type=int, default=10063)
    parser.add_argument("--json")
    args = parser.parse_args()
    uuids = simulated_uuids("training")
    with tempfile.TemporaryDirectory(prefix="kubelet-") as short:
        kubelet = FakeKubelet(Path(short) / "kubelet.sock").start()
        flags = [f"--pods.resources-socket={kubelet.socket_path}", "--pods.refresh-interval", "1"]
        log = Path(short) / "exporter.log"
        exporter = start_daemon(
            "--sim", "--nvml.scenario", "training", *flags, port=args.port, ready="/readyz", log=log
        )
        url, proc = exporter
        samples, flaps, up = [], 0, True
        start = time.monotonic()
        next_flap, next_sample = start + args.period, start + 60
        try:
            samples.append({"t": 0, **proc_status(proc.pid)})
            while time.monotonic() - start < args.seconds:
                now = time.monotonic()
                if now >= next_flap:
                    if up:
                        kubelet.stop()
                    else:
                        flaps += 1
                        kubelet.pods = [
                            ("team", f"job-{flaps}-{i}", [("main", [("nvidia.com/gpu", [u])])])
                            for i, u in enumerate(uuids[: 1 + flaps % 8])
                        ]
                        kubelet.start()
                    up = not up
                    next_flap = now + args.period
                if now >= next_sample:
                    samples.append({"t": round(now - start), **proc_status(proc.pid)})
                    next_sample = now + 60
                urllib.request.urlopen(url + "/metrics", timeout=5).read()
                time.sleep(1)
            samples.append({"t": round(time.monotonic() - start), **proc_status(proc.pid)})
        finally:
            exporter.stop()
            kubelet.stop()
        stderr = exporter.output()
    warm = samples[1] if len(samples) > 2 else samples[0]
    result = {
        "seconds": args.seconds,
        "period": args.period,
        "kubelet_returns": flaps,
        "rss_mib": [round(s["rss_mib"], 1) for s in samples],
        "threads": sorted({s["threads"] for s in samples}),
        "fds": sorted({s["fds"] for s in samples}),
        "rss_growth_after_first_minute_mib": round(samples[-1]["rss_mib"] - warm["rss_mib"], 2),
        "log_lines": len(stderr.splitlines()),
        "tracebacks": stderr.count("Traceback"),
        "attribution_log_lines": sum("pod attribution" in line for line in stderr.splitlines()),
    }
    report(result, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
