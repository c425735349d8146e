"""GPM's crash containment on a GPU host, over the real driver: the exporter with a crash limit of 2 and a short
backoff; its GPM child is killed with SIGSEGV (what a native crash in the driver's GPM code does to it) whenever one
runs, until GPM turns off. Every /metrics answer is kept: status, gpu_up, the GPM window counter and
gpuwarden_gpm_unavailable_info, then GPM coming back after the backoff.

    python3 bench/gpm_containment_gpu.py OUT.json [--backoff 20]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

CRASH_LIMIT = 2


def children(pid: int) -> list[int]:
    return [int(c) for task in Path(f"/proc/{pid}/task").glob("*/children") for c in task.read_text().split()]


def scrape(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, response.read().decode()
    except (urllib.error.URLError, OSError):
        return 0, ""


def total(body: str, family: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{family}(?:{{[^}}]*}})? (\S+)$", body, re.M))


def summarise(timeline: list[dict[str, Any]], killed: list[dict[str, Any]]) -> tuple[float | None, float | None]:
    """When GPM went off after the limit's last crash, and when its windows counted again (a new child answering
    after the backoff). Between a crash and the decision the reason can be absent for a poll (seen on H200)."""
    if len(killed) < CRASH_LIMIT:
        return None, None
    last = killed[-1]["t"]
    at_kill = max(e["gpm_window_seconds"] for e in timeline if e["t"] <= last)
    off_at = next((e["t"] for e in timeline if e["t"] > last and e["gpm_off_crashed"]), None)
    back_at = next((e["t"] for e in timeline if off_at and e["t"] > off_at and e["gpm_window_seconds"] > at_kill), None)
    return off_at, back_at


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--backoff", type=float, default=20.0)
    parser.add_argument("--sim", action="store_true", help="the simulator instead of the driver (a dry run)")
    args = parser.parse_args()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "gpuwarden", "--web.listen-address", f"127.0.0.1:{port}",
         "--nvml.gpm-crash-limit", str(CRASH_LIMIT), "--nvml.gpm-crash-backoff", str(args.backoff),
         *(["--sim"] if args.sim else [])],
        stdout=subprocess.DEVNULL, stderr=open("/tmp/gpm-containment.log", "wb"),  # noqa: SIM115
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}/metrics"
    timeline: list[dict[str, Any]] = []
    killed: list[dict[str, Any]] = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < 60 + 3 * args.backoff:
            status, body = scrape(url)
            now = round(time.monotonic() - started, 2)
            child = next(iter(children(proc.pid)), None)
            windows = total(body, "gpuwarden_gpm_window_seconds_total")
            off = "gpuwarden_gpm_unavailable_info{" in body and 'reason="crashed"' in body
            timeline.append({"t": now, "status": status, "gpu_up": total(body, "gpuwarden_gpu_up"),
                             "gpm_window_seconds": windows, "gpm_off_crashed": off, "child": child})  # fmt: skip
            # kill a child once it has answered (GPM windows grew since the last kill), until GPM is off
            since_kill = [e["gpm_window_seconds"] for e in timeline if not killed or e["t"] > killed[-1]["t"]]
            # the crash limit's worth of kills, each once the new child has answered; a crash shows as "crashed" for
            # the GPU until the next child answers, and only the limit's last turns GPM off for the backoff
            went_off = len(killed) >= CRASH_LIMIT and any(
                e["gpm_off_crashed"] for e in timeline if e["t"] > killed[-1]["t"]
            )
            if child and len(killed) < CRASH_LIMIT and len(set(since_kill)) > 1:
                os.kill(child, signal.SIGSEGV)
                killed.append({"t": now, "pid": child})
            before = max((e["gpm_window_seconds"] for e in timeline if killed and e["t"] <= killed[-1]["t"]), default=0)
            if went_off and not off and windows > before + 5:
                break  # back after the backoff, its windows counting again
            time.sleep(0.5)
    finally:
        proc.terminate()
        proc.wait(10)
    off_at, back_at = summarise(timeline, killed)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "killed": killed,
        "scrapes": len(timeline),
        "scrapes_failed": sum(e["status"] != 200 for e in timeline[1:]),  # the first: before the listener
        "gpu_up_min": min(e["gpu_up"] for e in timeline if e["status"] == 200),
        "gpm_off_at": off_at,
        "gpm_back_at": back_at,
        "exporter_exit": proc.returncode,
        "timeline": timeline,
    }
    args.out.write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}))


if __name__ == "__main__":
    main()
