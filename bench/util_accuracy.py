"""Utilization accuracy on a real GPU: gpuwarden's busy-time counters vs the true duty cycle of a load.

Usage (GPU host, PyTorch installed): python3 -m bench.util_accuracy --gpu 0 --json OUT.json --md OUT.md

For each duty (20/50/80 %) and period (0.1-2 s) a child process runs bf16 matmuls for duty × period of every
period and sleeps the rest, measuring its own on-time. gpuwarden's pipeline (1 s fast interval) runs in this process;
over a 10 s window we compare rate(busy)/rate(sampled) with the duty cycle, and with what one
nvmlDeviceGetUtilizationRates read per scrape would have reported (the read at the end of each window, as a
scrape would take it, plus the spread of reads taken every second).
The duty is what the GPU really ran: CUDA events around each on-phase.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pynvml

from gpuwarden.config.settings import load_settings
from gpuwarden.runtime.pipeline import Pipeline

LOAD = r"""
import sys, time, torch
duty, period, seconds, gpu = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]), int(sys.argv[4])
torch.cuda.set_device(gpu)
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
for _ in range(50): a @ a
torch.cuda.synchronize()
t = time.perf_counter()
for _ in range(200): a @ a
torch.cuda.synchronize()
per_kernel = (time.perf_counter() - t) / 200
kernels = max(1, round(duty * period / per_kernel))
print("ready", flush=True)
busy_ms = 0.0
start = time.perf_counter()
while time.perf_counter() - start < seconds:
    cycle = time.perf_counter()
    # Queue the whole on-phase at once so the GPU never waits on the CPU; CUDA events time what really ran.
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(kernels): a @ a
    end.record()
    end.synchronize()
    busy_ms += begin.elapsed_time(end)
    rest = cycle + period - time.perf_counter()
    if rest > 0: time.sleep(rest)
print(f"measured_duty {busy_ms / 1000 / (time.perf_counter() - start):.4f}", flush=True)
"""

WINDOW_S = 10.0
# The counters move when the sample buffer is drained (every poll.samples_interval = 5 s): let the load run longer
# than that before the window opens, so every sample counted inside the window was taken under the load.
SETTLE_S = 7.0


def counters(pipeline: Pipeline, index: int) -> tuple[float, float, dict[str, float]]:
    gpu = next(g for g in pipeline.snapshot.gpus if g.index == index)
    values = {s.name + ("" if not s.labels else "{" + ",".join(s.labels) + "}"): s.value for s in gpu.samples}
    return values["gpuwarden_busy_seconds_total"], values["gpuwarden_utilization_sampled_seconds_total"], values


def run_case(pipeline: Pipeline, handle: object, index: int, duty: float, period: float) -> dict[str, object]:
    seconds = SETTLE_S + WINDOW_S + 2
    load = subprocess.Popen(
        [sys.executable, "-c", LOAD, str(duty), str(period), str(seconds), str(index)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert load.stdout is not None
    assert load.stdout.readline().strip() == "ready"
    time.sleep(max(SETTLE_S, pipeline.settings.poll.samples_interval + 2))
    busy0, sampled0, _ = counters(pipeline, index)
    single_reads = []
    for _ in range(int(WINDOW_S)):
        time.sleep(1.0)
        single_reads.append(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    busy1, sampled1, _ = counters(pipeline, index)
    out, _ = load.communicate(timeout=60)
    measured = float(out.split("measured_duty")[1])
    exporter = (busy1 - busy0) / (sampled1 - sampled0)
    return {
        "duty": duty,
        "period_s": period,
        "measured_duty": round(measured, 4),
        "exporter_ratio": round(exporter, 4),
        "exporter_error_points": round(100 * (exporter - measured), 2),
        "window_sampled_s": round(sampled1 - sampled0, 2),
        "single_read_at_scrape": single_reads[-1] / 100,
        "single_read_error_points": round(single_reads[-1] - 100 * measured, 1),
        "single_reads_each_second": single_reads,
        "single_reads_mean": round(statistics.mean(single_reads) / 100, 4),
    }


def response(pipeline: Pipeline, index: int) -> list[dict[str, float]]:
    """Power, clocks, P-state and temperature, second by second: idle, 8 s of 80 % load, idle."""
    load = subprocess.Popen(
        [sys.executable, "-c", LOAD, "0.8", "2.0", "8", str(index)], stdout=subprocess.PIPE, text=True
    )
    rows = []
    start = time.time()
    for _ in range(16):
        time.sleep(1.0)
        _, _, values = counters(pipeline, index)
        rows.append(
            {
                "t_s": round(time.time() - start, 1),
                "utilization_ratio": values.get("gpuwarden_utilization_ratio"),
                "power_watts": values.get("gpuwarden_power_usage_watts"),
                "sm_clock_mhz": values.get("gpuwarden_clock_hertz{sm}", 0) / 1e6,
                "pstate": values.get("gpuwarden_performance_state"),
                "temperature_celsius": values.get("gpuwarden_temperature_celsius"),
                "gpu_idle_reason": values.get("gpuwarden_clock_event_active{gpu_idle}"),
            }
        )
    load.wait(timeout=60)
    return rows


def markdown(cases: list[dict[str, object]], rows: list[dict[str, float]], header: str) -> str:
    lines = [
        header,
        "",
        "| duty | period | measured duty | gpuwarden (10 s window) | span sampled | error "
        "| one read per scrape | error | reads each second (%) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        lines.append(
            f"| {c['duty']:.0%} | {c['period_s']} s | {c['measured_duty']:.1%} | {c['exporter_ratio']:.1%} | "
            f"{c['window_sampled_s']} s | {c['exporter_error_points']:+.1f} pt | "
            f"{c['single_read_at_scrape']:.0%} | "
            f"{c['single_read_error_points']:+.0f} pt | {c['single_reads_each_second']} |"
        )
    worst = max(abs(float(c["exporter_error_points"])) for c in cases)
    worst_single = max(abs(float(c["single_read_error_points"])) for c in cases)
    lines += [
        "",
        f"Worst gpuwarden error: {worst:.1f} points (target ≤ 5). Worst single-read error: {worst_single:.0f} points.",
        "",
        "Response to 8 s of 80 % load (2 s period) in gpuwarden's data:",
        "",
        "| t (s) | utilization (last sample) | power (W) | SM clock (MHz) | P-state | temperature (°C) | gpu_idle |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['t_s']} | {r['utilization_ratio']} | {r['power_watts']} | {r['sm_clock_mhz']:.0f} | "
            f"P{r['pstate']:.0f} | {r['temperature_celsius']:.0f} | {r['gpu_idle_reason']:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu", type=int, default=0)
    parser.add_argument("--json")
    parser.add_argument("--md")
    parser.add_argument("--duties", default="0.2,0.5,0.8")
    parser.add_argument("--periods", default="0.1,0.5,2.0")
    parser.add_argument(
        "--samples-interval",
        type=float,
        default=5.0,
        help="poll.samples_interval: how often the counters take in new samples (default 5 s)",
    )
    args = parser.parse_args()
    pipeline = Pipeline(
        load_settings(
            None,
            environ={},
            flags={"poll.fast_interval": 1, "nvml.xid_events": False, "poll.samples_interval": args.samples_interval},
        )
    )
    pipeline.start()
    pipeline.ready_once.wait(10)
    time.sleep(1.5)
    handle = pynvml.nvmlDeviceGetHandleByIndex(args.gpu)
    header = (
        f"# Utilization accuracy: {pynvml.nvmlDeviceGetName(handle)} (GPU {args.gpu}), driver "
        f"{pynvml.nvmlSystemGetDriverVersion()}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"poll.samples_interval {args.samples_interval:g} s"
    )
    cases = []
    for duty in args.duties.split(","):
        for period in args.periods.split(","):
            cases.append(run_case(pipeline, handle, args.gpu, float(duty), float(period)))
            print(json.dumps(cases[-1]), flush=True)  # partial results survive a later failure
    rows = response(pipeline, args.gpu)
    pipeline.stop()
    report = markdown(cases, rows, header)
    print(report)
    if args.md:
        Path(args.md).write_text(report)
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": cases, "response": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
