"""Per-process validation on a real GPU host: two PyTorch processes with known allocations (10 GiB and 20 GiB) and
different loads; gpuwarden's per-process memory against `nvidia-smi --query-compute-apps`, its per-process SM
utilization against the loads, and the cost of the per-process NVML reads per GPU.

    python3 -m bench.process_validation OUTDIR      # on the GPU host (PyTorch there; our dependencies as wheels)

Writes OUTDIR/processes.json. GPU 0 is used; gpuwarden reads the host's /proc (it runs on the host here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PORT = 10055
GIB = 1024**3

# (label, GiB to hold, load): the busy one runs bf16 matmuls back to back, the light one one matmul every 50 ms
LOADS = {
    "busy_10gib": (10, "for _ in range(10):\n        y = x @ x\n    torch.cuda.synchronize()"),
    "light_20gib": (20, "y = x @ x\n    torch.cuda.synchronize()\n    time.sleep(0.05)"),
}
PROGRAM = """
import time, torch
hold = torch.empty({gib} * 1024**3, dtype=torch.uint8, device="cuda")
x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
torch.cuda.synchronize()
print("READY", flush=True)
end = time.time() + {seconds}
while time.time() < end:
    {body}
"""


def get_json(path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=5).read())


def start_exporter() -> subprocess.Popen:
    from bench.gpm_validation import exporter

    return exporter(
        "--poll.fast-interval", "1", "--processes.proc-root", "/proc", "--processes.per-pid-series", port=PORT
    )


def smi_apps() -> dict[int, int]:
    """PID → used memory in bytes (nvidia-smi reports MiB)."""
    text = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True,
    ).stdout  # fmt: skip
    out = {}
    for line in text.strip().splitlines():
        pid, memory = (part.strip() for part in line.split(","))
        out[int(pid)] = int(memory) * 1024 * 1024
    return out


def read_costs() -> dict:
    """Median and p90 of the per-process NVML reads on GPU 0 while the processes run (200 calls each)."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    out = {}
    calls = {
        "nvmlDeviceGetComputeRunningProcesses_v3": lambda: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(handle),
        "nvmlDeviceGetGraphicsRunningProcesses_v3": lambda: pynvml.nvmlDeviceGetGraphicsRunningProcesses_v3(handle),
        "nvmlDeviceGetProcessesUtilizationInfo": lambda: pynvml.nvmlDeviceGetProcessesUtilizationInfo(handle, 0),
    }
    for name, call in calls.items():
        times = []
        for _ in range(200):
            started = time.perf_counter()
            try:
                call()
            except pynvml.NVMLError as exc:
                out[f"{name}_error"] = str(exc)
            times.append(time.perf_counter() - started)
        times.sort()
        out[name] = {"median_ms": round(1000 * times[100], 3), "p90_ms": round(1000 * times[180], 3)}
    pynvml.nvmlShutdown()
    return out


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    host = subprocess.run(
        ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0"],
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    results: dict = {"host": host, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    exporter = start_exporter()
    loads = {}
    try:
        for label, (gib, body) in LOADS.items():
            code = textwrap.dedent(PROGRAM).format(gib=gib, seconds=40, body=body)
            proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            assert proc.stdout is not None
            while proc.stdout.readline().strip() != "READY":
                if proc.poll() is not None:
                    raise RuntimeError(f"{label} died before it was ready")
            loads[label] = proc
        time.sleep(8)  # a few fast polls with both running
        smi = smi_apps()
        api = get_json("/api/v1/processes")["processes"]
        gpu0 = get_json("/api/v1/gpus/0")
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{PORT}/metrics", timeout=5).read().decode()
        rows = []
        for label, proc in loads.items():
            ours = next((p for p in api if p["pid"] == proc.pid), None)
            theirs = smi.get(proc.pid)
            rows.append({
                "load": label,
                "pid": proc.pid,
                "exporter_memory_bytes": None if ours is None else ours["used_memory_bytes"],
                "nvidia_smi_memory_bytes": theirs,
                "difference_pct": None if ours is None or not theirs
                else round(100.0 * (ours["used_memory_bytes"] - theirs) / theirs, 3),
                "exporter_sm_ratio": None if ours is None else ours["sm_ratio"],
                "exporter_memory_share": None if ours is None else ours["memory_share"],
                "name": None if ours is None else ours["name"],
            })  # fmt: skip
        results["processes"] = rows
        results["api_processes"] = api
        results["gpu0_memory_used_bytes"] = gpu0["metrics"]["memory_used_bytes"]["values"][0]["value"]
        results["series"] = [
            line for line in metrics.splitlines() if line.startswith(("gpuwarden_container_", "gpuwarden_process_"))
        ]
        results["read_costs"] = read_costs()
    finally:
        for proc in loads.values():
            proc.kill()
        exporter.terminate()
        exporter.wait(10)
    (out / "processes.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results["processes"], indent=1))
    print(json.dumps(results["read_costs"], indent=1))


if __name__ == "__main__":
    main()
