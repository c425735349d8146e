"""Where gpuwarden's start-up time and resident memory go on a GPU host: -X importtime of the serving path, the
log's timings (NVML up, first snapshot), first metrics with GPU data, and RSS with glibc's default malloc arenas
against MALLOC_ARENA_MAX=2.

    python3 -m bench.startup_profile OUTDIR
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 10075


def run(env_extra: dict[str, str], importtime: bool, out: Path, label: str) -> dict:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, *(["-X", "importtime"] if importtime else []), "-m", "gpuwarden",
           f"--web.listen-address=127.0.0.1:{PORT}", "--log.level=info"]  # fmt: skip
    spawned = time.time()
    started = time.perf_counter()
    err = (out / f"{label}.stderr").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err)
    first = None
    while time.perf_counter() - started < 30:
        try:
            body = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=1).read()
            if b"gpuwarden_gpu_up" in body:
                first = time.perf_counter() - started
                break
        except OSError:
            time.sleep(0.005)
    time.sleep(8)
    rss = int(Path(f"/proc/{proc.pid}/status").read_text().split("VmRSS:")[1].split()[0]) / 1024
    threads = len(os.listdir(f"/proc/{proc.pid}/task"))
    proc.terminate()
    proc.wait(10)
    err.close()
    return {
        "first_metrics_s": None if first is None else round(first, 3),
        "rss_mib": round(rss, 1),
        "threads": threads,
        "ms_after_spawn": milestones(out / f"{label}.stderr", spawned),
    }


MILESTONES = {"nvml up": "nvml_up", "first snapshot": "first_snapshot", "listening on": "listening"}


def milestones(stderr: Path, spawned: float) -> dict[str, float]:
    """When the log says NVML is up, the first snapshot is out and the server listens, in ms after the spawn."""
    import datetime

    found = {}
    for line in stderr.read_text().splitlines():
        for text, key in MILESTONES.items():
            if text in line and line.startswith("ts=") and key not in found:
                stamp = datetime.datetime.strptime(line[3:27], "%Y-%m-%dT%H:%M:%S.%fZ").replace(tzinfo=datetime.UTC)
                found[key] = round(1000 * (stamp.timestamp() - spawned), 1)
    return found


def top_imports(path: Path, count: int = 25) -> list[str]:
    rows = []
    for line in path.read_text().splitlines():
        if line.startswith("import time:") and "self" not in line:
            parts = line.split("|")
            name = parts[2].rstrip()
            depth = (len(name) - len(name.lstrip())) // 2
            if depth <= 1:
                rows.append((int(parts[1]), f"{int(parts[1]) / 1000:7.1f} ms {'  ' * depth}{name.strip()}"))
    return [text for _, text in sorted(rows, reverse=True)[:count]]


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    results = {
        "importtime": run({}, True, out, "importtime"),
        "default_arenas": [run({}, False, out, f"default{i}") for i in range(2)],
        "arena_max_2": [run({"MALLOC_ARENA_MAX": "2"}, False, out, f"arena{i}") for i in range(2)],
    }
    results["top_imports"] = top_imports(out / "importtime.stderr")
    lines = (out / "default0.stderr").read_text().splitlines()
    results["log_lines"] = [line for line in lines if "nvml up" in line or "first snapshot" in line]
    (out / "startup.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
