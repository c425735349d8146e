"""Fast-tier poll cost per GPU on real hardware against the raw NVML calls it makes, measured in the same run.

Usage (GPU host): python3 -m bench.poll_cost --json OUT.json --md OUT.md [--repeat 50]

1. Trace the NVML calls one fast-tier read of a GPU makes (wrapping pynvml's functions in this process only).
2. Time gpuwarden's fast-tier read of each GPU (all readers, error policy, sample building) `repeat` times.
3. Time the same traced calls made back to back directly through pynvml, `repeat` times.
Also: slow tier per GPU, the whole fast cycle (all GPUs concurrently), `nvidia-smi --query-gpu` per run (what
nvidia-smi-per-scrape exporters pay), and the daemon's CPU, RSS and time to ready over a run of `--cpu-seconds`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pynvml

from gpuwarden.config.settings import load_settings
from gpuwarden.model.snapshot import Tier
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.daemon import start_daemon

SMI_QUERY = (
    "timestamp,name,pci.bus_id,driver_version,pstate,temperature.gpu,utilization.gpu,utilization.memory,"
    "memory.total,memory.free,memory.used,power.draw,power.limit,clocks.current.sm,clocks.current.memory,"
    "ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total,fan.speed,"
    "clocks_event_reasons.active,persistence_mode"
)


def trace_calls(read: Callable[[], Any]) -> list[tuple[Callable[..., Any], tuple[Any, ...]]]:
    """The pynvml calls `read` makes, with their arguments."""
    calls: list[tuple[Callable[..., Any], tuple[Any, ...]]] = []
    originals = {name: fn for name, fn in vars(pynvml).items() if name.startswith("nvmlDevice") and callable(fn)}

    depth = [0]

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any) -> Any:
            if depth[0] == 0:  # only what the readers call, not pynvml's own nested wrappers
                calls.append((fn, args))
            depth[0] += 1
            try:
                return fn(*args)
            finally:
                depth[0] -= 1

        return traced

    for name, fn in originals.items():
        setattr(pynvml, name, wrap(fn))
    try:
        read()
    finally:
        for name, fn in originals.items():
            setattr(pynvml, name, fn)
    return calls


def time_ms(fn: Callable[[], Any], repeat: int) -> dict[str, float]:
    """Wall time (median, p90) and CPU time of this thread (median: user + system, the driver's ioctls included)."""
    samples, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.thread_time()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
        cpu.append((time.thread_time() - start_cpu) * 1000)
    samples.sort()
    return {
        "median_ms": round(statistics.median(samples), 3),
        "p90_ms": round(samples[int(0.9 * len(samples))], 3),
        "cpu_median_ms": round(statistics.median(cpu), 3),
    }


def replay(calls: list[tuple[Callable[..., Any], tuple[Any, ...]]]) -> None:
    for fn, args in calls:
        with contextlib.suppress(pynvml.NVMLError):  # e.g. GetSamples' NOT_FOUND: the exporter pays it too
            fn(*args)


def daemon_run(seconds: float) -> dict[str, float]:
    """Start the daemon, measure time to ready, scrape every 15 s, report CPU millicores and RSS."""
    start = time.monotonic()
    exporter = start_daemon(port=10047, ready="/readyz", step=0.02, stderr=subprocess.DEVNULL)
    ready = time.monotonic() - start
    url, proc = exporter
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu() -> float:
        fields = Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    time.sleep(5)
    cpu0, t0 = cpu(), time.monotonic()
    while time.monotonic() - t0 < seconds:
        urllib.request.urlopen(url + "/metrics", timeout=5).read()
        time.sleep(15)
    cpu1, t1 = cpu(), time.monotonic()
    status = Path(f"/proc/{proc.pid}/status").read_text().splitlines()
    rss = int(next(line.split()[1] for line in status if line.startswith("VmRSS")))
    exporter.stop()
    return {
        "time_to_ready_s": round(ready, 3),
        "cpu_millicores": round(1000 * (cpu1 - cpu0) / (t1 - t0), 2),
        "cpu_core_seconds_per_hour": round(3600 * (cpu1 - cpu0) / (t1 - t0), 1),
        "rss_mib": round(rss / 1024, 1),
        "measured_s": round(t1 - t0, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--cpu-seconds", type=float, default=60)
    parser.add_argument("--json")
    parser.add_argument("--md")
    args = parser.parse_args()
    # samples_interval 0: every timed fast read includes the sample-buffer drain (the worst case per poll)
    pipeline = Pipeline(load_settings(None, environ={}, flags={"nvml.xid_events": False, "poll.samples_interval": 0}))
    pipeline.poll_once()
    time.sleep(1.1)
    pipeline.poll_once()
    results: dict[str, Any] = {"gpus": []}
    for state in sorted(pipeline.poller.nvml.gpus.values(), key=lambda st: st.device.index):
        dev = state.device
        calls = trace_calls(lambda dev=dev: pipeline.poller.runner.read(dev, Tier.FAST))
        ours = time_ms(lambda dev=dev: pipeline.poller.runner.read(dev, Tier.FAST), args.repeat)
        raw = time_ms(lambda calls=calls: replay(calls), args.repeat)
        slow = time_ms(lambda dev=dev: pipeline.poller.runner.read(dev, Tier.SLOW), max(5, args.repeat // 5))
        slow_calls = trace_calls(lambda dev=dev: pipeline.poller.runner.read(dev, Tier.SLOW))
        slow_raw = time_ms(lambda calls=slow_calls: replay(calls), max(5, args.repeat // 5))
        results["gpus"].append(
            {
                "index": dev.index,
                "name": state.readings[Tier.STATIC].info.get("name"),
                "fast_calls": [fn.__name__ for fn, _ in calls],
                "fast_gpuwarden": ours,
                "fast_raw_nvml": raw,
                "fast_target_ms": round(2 * raw["median_ms"] + 0.5, 3),
                "slow_gpuwarden": slow,
                "slow_raw_nvml": slow_raw,
                "slow_calls": len(slow_calls),
            }
        )
    cycle = time_ms(lambda: pipeline.poller._tier_cycle(Tier.FAST, pipeline.settings.poll.call_deadline), 20)
    results["fast_cycle_all_gpus"] = cycle
    results["driver"] = pipeline.snapshot.driver.get("driver_version")
    pipeline.stop()
    try:
        smi = time_ms(
            lambda: subprocess.run(
                ["nvidia-smi", f"--query-gpu={SMI_QUERY}", "--format=csv"], capture_output=True, check=True
            ),
            10,
        )
    except (OSError, subprocess.CalledProcessError):
        smi = {"median_ms": None, "p90_ms": None}  # no nvidia-smi here (simulator run)
    results["nvidia_smi_query_per_run"] = smi
    results["daemon"] = daemon_run(args.cpu_seconds)
    results["date"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    lines = [
        f"# Poll cost on {len(results['gpus'])}× {results['gpus'][0]['name']}, driver {results['driver']}, "
        f"{results['date']}",
        "",
        "| GPU | fast tier: gpuwarden median (p90) | same NVML calls raw median (p90) | target 2×raw+0.5 | calls |"
        " fast CPU: gpuwarden / raw | slow tier: gpuwarden / raw | slow CPU: gpuwarden / raw |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for g in results["gpus"]:
        lines.append(
            f"| {g['index']} | {g['fast_gpuwarden']['median_ms']} ms ({g['fast_gpuwarden']['p90_ms']}) | "
            f"{g['fast_raw_nvml']['median_ms']} ms ({g['fast_raw_nvml']['p90_ms']}) | "
            f"{g['fast_target_ms']} ms | {len(g['fast_calls'])} | {g['fast_gpuwarden']['cpu_median_ms']} / "
            f"{g['fast_raw_nvml']['cpu_median_ms']} ms | {g['slow_gpuwarden']['median_ms']} / "
            f"{g['slow_raw_nvml']['median_ms']} ms | {g['slow_gpuwarden']['cpu_median_ms']} / "
            f"{g['slow_raw_nvml']['cpu_median_ms']} ms |"
        )
    d = results["daemon"]
    lines += [
        "",
        f"Whole fast cycle, all GPUs concurrently: {cycle['median_ms']} ms median ({cycle['p90_ms']} p90).",
        f"`nvidia-smi --query-gpu=… --format=csv` per run: {smi['median_ms']} ms median.",
        f"Daemon (1 s fast, 15 s slow, a scrape every 15 s, {d['measured_s']} s): ready in "
        f"{d['time_to_ready_s']} s, CPU {d['cpu_millicores']} millicores ({d['cpu_core_seconds_per_hour']} "
        f"core-s/h), RSS {d['rss_mib']} MiB.",
        "",
        "Fast-tier calls per GPU: " + ", ".join(results["gpus"][0]["fast_calls"]),
    ]
    report = "\n".join(lines) + "\n"
    print(report)
    if args.md:
        Path(args.md).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
