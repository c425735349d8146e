"""Find what kills the exporter under a real NCCL job (GPM with the throttle-time field counters).

Run on a GPU host with 2+ GPUs, from the repository root, while nothing else uses the GPUs:
  python3 -m bench.gpm_crash_probe --out DIR
It starts a 2-rank DDP bf16 transformer job (bench/workloads/train.py) and, while it trains, runs in turn:
  fields   what the throttle-time field counters answer (return codes, value types) under the job;
  exporter the exporter at its defaults with faulthandler and debug logs, scraped every 0.5 s (collect errors,
           gpu_up, nvml_up kept) until it exits or `--exporter-seconds` pass;
  race     plain pynvml: per GPU, one thread takes GPM samples and metrics at 10 Hz, another reads the throttle
           field counters at 10 Hz (the in-library race hypothesis);
  reinit   plain pynvml: one thread per GPU takes GPM windows, another calls nvmlShutdown/nvmlInit every 2 s
           (the lifecycle hypothesis: GPM buffers used across a library re-init).
Each plain-pynvml phase runs in its own process under faulthandler; its return code and stderr are kept.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}

FIELDS_PROBE = """
import time, pynvml
from gpuwarden.collect.readers.clocks import THROTTLE_FIELDS
pynvml.nvmlInit()
seen = {}
end = time.time() + SECONDS
while time.time() < end:
    for i in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(i)
        for e in pynvml.nvmlDeviceGetFieldValues(h, list(THROTTLE_FIELDS)):
            key = (i, THROTTLE_FIELDS[e.fieldId], int(e.nvmlReturn), int(e.valueType))
            seen[key] = seen.get(key, 0) + 1
    time.sleep(0.25)
for (gpu, name, code, vtype), n in sorted(seen.items()):
    print(f"gpu {gpu} {name:24s} return {code} valueType {vtype} x{n}")
"""

# One GPM window between two samples, as the programs below take it: pynvml's own structures, nothing of gpuwarden's
# but the metric list.
GPM_WINDOW = """
import pynvml
from gpuwarden.collect.readers.gpm import METRICS
def gpm_window(first, second):
    m = pynvml.c_nvmlGpmMetricsGet_t(); m.version = pynvml.NVML_GPM_METRICS_GET_VERSION
    m.numMetrics = len(METRICS); m.sample1, m.sample2 = first, second
    for p, metric in enumerate(METRICS): m.metrics[p].metricId = metric
    pynvml.nvmlGpmMetricsGet(m)
"""

RACE = (
    GPM_WINDOW
    + """
import threading, time, pynvml
from gpuwarden.collect.readers.clocks import THROTTLE_FIELDS
pynvml.nvmlInit()
stop = time.time() + SECONDS
counts = {}
def gpm(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    s = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    pynvml.nvmlGpmSampleGet(h, s[0]); k = 0
    while time.time() < stop:
        time.sleep(PERIOD)
        pynvml.nvmlGpmSampleGet(h, s[1 - k % 2])
        gpm_window(s[k % 2], s[1 - k % 2]); k += 1
    counts[f"gpm{i}"] = k
def fields(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i); k = 0
    while time.time() < stop:
        pynvml.nvmlDeviceGetFieldValues(h, list(THROTTLE_FIELDS)); k += 1; time.sleep(PERIOD)
    counts[f"fields{i}"] = k
threads = [threading.Thread(target=f, args=(i,)) for i in range(pynvml.nvmlDeviceGetCount()) for f in (gpm, fields)]
[t.start() for t in threads]; [t.join() for t in threads]
print("survived", counts)
"""
)

GPM_ONLY = (
    GPM_WINDOW
    + """
import threading, time, pynvml
pynvml.nvmlInit()
def gpm(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    s = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    pynvml.nvmlGpmSampleGet(h, s[0]); k = 0
    while True:
        time.sleep(PERIOD)
        pynvml.nvmlGpmSampleGet(h, s[1 - k % 2])
        gpm_window(s[k % 2], s[1 - k % 2]); k += 1
threads = [threading.Thread(target=gpm, args=(i,), daemon=True) for i in range(pynvml.nvmlDeviceGetCount())]
[t.start() for t in threads]
time.sleep(SECONDS)
"""
)

REINIT = (
    GPM_WINDOW
    + """
import threading, time, pynvml
pynvml.nvmlInit()
stop = time.time() + SECONDS
def gpm(i):
    h = pynvml.nvmlDeviceGetHandleByIndex(i)
    s = [pynvml.nvmlGpmSampleAlloc(), pynvml.nvmlGpmSampleAlloc()]
    k = 0; errors = 0
    while time.time() < stop:
        try:
            pynvml.nvmlGpmSampleGet(h, s[k % 2])
            if k:
                gpm_window(s[1 - k % 2], s[k % 2])
            k += 1
        except pynvml.NVMLError as e:
            errors += 1
        time.sleep(0.2)
    print("gpm thread", i, "windows", k, "errors", errors)
def reinit():
    while time.time() < stop:
        time.sleep(2); pynvml.nvmlShutdown(); time.sleep(0.3); pynvml.nvmlInit()
threads = [threading.Thread(target=gpm, args=(i,)) for i in range(pynvml.nvmlDeviceGetCount())]
threads.append(threading.Thread(target=reinit))
[t.start() for t in threads]; [t.join() for t in threads]
print("survived")
"""
)


def env() -> dict[str, str]:
    return {**os.environ, **NCCL_ENV, "PYTHONUNBUFFERED": "1"}


def snippet(name: str, code: str, seconds: float, out: Path, **subs: float) -> dict:
    for key, value in {"SECONDS": seconds, **subs}.items():
        code = code.replace(key, repr(value))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    )
    (out / f"{name}.log").write_text(result.stdout + "\n--- stderr ---\n" + result.stderr)
    return {
        "phase": name,
        "rc": result.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "stdout_tail": result.stdout[-1500:],
        "stderr_tail": result.stderr[-3000:],
    }


def scrape(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return response.read().decode()
    except Exception:  # noqa: BLE001 - a failed scrape is a data point here
        return None


def run_exporter(name: str, extra: list[str], seconds: float, out: Path, port: int) -> dict:
    log = open(out / f"{name}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-X",
            "faulthandler",
            "-m",
            "gpuwarden",
            "--web.listen-address",
            f"127.0.0.1:{port}",
            "--log.level",
            "debug",
            *extra,
        ],
        cwd=ROOT,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    started, keep, failures = time.monotonic(), [], 0
    while time.monotonic() - started < seconds and proc.poll() is None:
        body = scrape(f"http://127.0.0.1:{port}/metrics")
        if body is None:
            failures += 1
        else:
            keep = [
                line
                for line in body.splitlines()
                if line.startswith(
                    (
                        "gpuwarden_collect_errors_total",
                        "gpuwarden_gpu_up",
                        "gpuwarden_nvml_up",
                        "gpuwarden_collect_timeouts_total",
                        "gpuwarden_gpm_window_seconds_total",
                        "gpuwarden_reinit",
                    )
                )
            ]
        time.sleep(0.5)
    alive = proc.poll() is None
    if alive:
        proc.send_signal(signal.SIGTERM)
        proc.wait(10)
    log.close()
    (out / f"{name}.last-metrics.txt").write_text("\n".join(keep))
    text = (out / f"{name}.log").read_text()
    return {
        "phase": name,
        "args": extra,
        "alive": alive,
        "rc": proc.returncode,
        "seconds": round(time.monotonic() - started, 1),
        "scrape_failures": failures,
        "log_tail": text[-4000:],
        "last_metrics": keep,
    }


def start_job(out: Path, n: int, seconds: float) -> subprocess.Popen:
    log = open(out / f"job{n}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "bench/workloads/train.py",
            "--seconds",
            str(seconds),
        ],
        cwd=ROOT,
        env=env(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def start_monitor(name: str, out: Path, port: int) -> subprocess.Popen:
    """The exporter (name 'exporter...') or a plain-pynvml loop (name of a snippet), under faulthandler."""
    log = open(out / f"{name}.log", "a")  # noqa: SIM115 - closed with the process
    if name.startswith("exporter"):
        argv = ["-m", "gpuwarden", "--web.listen-address", f"127.0.0.1:{port}", "--log.level", "debug"]
        if name.endswith("nothrottle"):
            argv += ["--metrics.exclude", "gpuwarden_throttle*"]
    else:
        code = {"race": RACE, "gpmonly": GPM_ONLY}[name].replace("SECONDS", "3600").replace("PERIOD", "0.1")
        argv = ["-c", textwrap.dedent(code)]
    return subprocess.Popen(
        [sys.executable, "-X", "faulthandler", *argv], cwd=ROOT, env=env(), stdout=log, stderr=subprocess.STDOUT
    )


def cycle_phase(name: str, cycles: int, job_seconds: float, out: Path, port: int) -> dict:
    """Start the monitor, then start and stop the DDP job `cycles` times; a monitor that dies is restarted."""
    t0 = time.monotonic()
    events: list[str] = []
    monitor = start_monitor(name, out, port)
    time.sleep(4)
    deaths = 0
    for n in range(cycles):
        job = start_job(out, n, job_seconds)
        events.append(f"{time.monotonic() - t0:.1f} job {n} start")
        while job.poll() is None:
            time.sleep(0.25)
            if monitor.poll() is not None:
                deaths += 1
                events.append(f"{time.monotonic() - t0:.1f} monitor died rc={monitor.returncode}")
                monitor = start_monitor(name, out, port)
        events.append(f"{time.monotonic() - t0:.1f} job {n} end rc={job.returncode}")
        for _ in range(16):
            time.sleep(0.25)
            if monitor.poll() is not None:
                deaths += 1
                events.append(f"{time.monotonic() - t0:.1f} monitor died after job rc={monitor.returncode}")
                monitor = start_monitor(name, out, port)
    alive = monitor.poll() is None
    if alive:
        monitor.send_signal(signal.SIGTERM)
        try:
            monitor.wait(10)
        except subprocess.TimeoutExpired:
            monitor.kill()
    return {"phase": name, "cycles": cycles, "deaths": deaths, "alive_at_end": alive, "events": events}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--plan", default="exporter:3,gpmonly:2,race:2")
    parser.add_argument("--job-seconds", type=float, default=20)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = [snippet("fields", FIELDS_PROBE, 3, out)]
    for n, item in enumerate(args.plan.split(",")):
        name, cycles = item.split(":")
        results.append(cycle_phase(name, int(cycles), args.job_seconds, out, 10060 + n))
        print(json.dumps(results[-1]), flush=True)
    (out / "probe.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
