"""Resident memory of gpuwarden on a GPU host with one feature off at a time, beside nvitop-exporter, from bytecode:
which part of the footprint each default feature costs (NVML keeps buffers for GPM samples and event sets).

    python3 bench/rss_variants.py OUT.json [repeats]
"""

from __future__ import annotations

import http.client
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import side_by_side  # noqa: E402 - the bench's own start/stop helpers

LISTEN = f"--web.listen-address=127.0.0.1:{side_by_side.PORT}"
BASE = [sys.executable, "-m", "gpuwarden", LISTEN]
VARIANTS = {
    "gpuwarden": BASE,
    "gpm_off": [*BASE, "--no-nvml.gpm"],
    "xid_events_off": [*BASE, "--no-nvml.xid-events"],
    "pods_off": [*BASE, "--no-pods.attribution"],
    "all_three_off": [*BASE, "--no-nvml.gpm", "--no-nvml.xid-events", "--no-pods.attribution"],
}


def settled_rss(name: str) -> float:
    proc, _ = side_by_side.start(name)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", side_by_side.PORT, timeout=10)
        for _ in range(10):  # ten scrapes a second apart, as Prometheus would
            side_by_side.get(conn)
            time.sleep(1.0)
        return side_by_side.rss_mib(proc.pid)
    finally:
        side_by_side.stop(proc)
        time.sleep(0.5)


def main() -> None:
    out, repeats = Path(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 2
    side_by_side.compile_packages()
    for name, cmd in VARIANTS.items():
        side_by_side.EXPORTERS[name] = (cmd, b"gpuwarden_gpu_up")
    names = ["nvitop-exporter", *VARIANTS]
    rss: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(repeats):
        for name in names:
            rss[name].append(round(settled_rss(name), 1))
    result = {name: {"rss_mib": values, "median": statistics.median(values)} for name, values in rss.items()}
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **result}, indent=2))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
