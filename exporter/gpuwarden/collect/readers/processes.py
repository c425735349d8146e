"""Processes holding the GPU (fast tier): PID, memory, context kind, MIG instance and utilization.

Processes holding the GPU (fast tier): PID, used memory, compute or graphics context, MIG GPU instance, and SM
and memory-bandwidth utilization over the window since the last read.

Measured on H200 (driver 580.159.04, docs/nvml.md, Per-process calls): the running-process lists answer in well under
a millisecond and `nvmlDeviceGetProcessesUtilizationInfo` in ~2.5 ms per GPU, so both run every fast poll: memory
near the cap moves within seconds, and the OOM question needs the holder before it exits. The per-process readings
travel in GpuInfo.processes; attribution to containers and the per-container series happen in the assembly step
(exporter/gpuwarden/attribution/processes.py), which alone knows the pods.
"""

from __future__ import annotations

from gpuwarden.collect.reader import Reader
from gpuwarden.model.families import PROCESSES
from gpuwarden.model.snapshot import GpuProcess, SampleWriter, Tier
from gpuwarden.nvml import calls as nvml
from gpuwarden.nvml.device import GpuDevice

_NO_INSTANCE = 0xFFFFFFFF  # gpuInstanceId of a process outside MIG


def read_fast(dev: GpuDevice, out: SampleWriter) -> None:
    compute = dev.call_first(
        "processes",
        (nvml.nvmlDeviceGetComputeRunningProcesses_v3, ()),
        (nvml.nvmlDeviceGetComputeRunningProcesses_v2, ()),
    )
    if compute is None:
        return
    graphics = dev.call(nvml.nvmlDeviceGetGraphicsRunningProcesses_v3) or []
    rows: dict[int, dict] = {}
    for kind, listed in (("compute", compute), ("graphics", graphics)):
        for entry in listed:
            row = rows.setdefault(int(entry.pid), {"kinds": [], "memory": None, "gpu_instance": None})
            row["kinds"].append(kind)
            memory = getattr(entry, "usedGpuMemory", None)
            if memory is not None:  # a PID in both lists holds one allocation: the larger reading, not the sum
                row["memory"] = max(int(memory), row["memory"] or 0)
            instance = getattr(entry, "gpuInstanceId", _NO_INSTANCE)
            if instance is not None and instance != _NO_INSTANCE:
                row["gpu_instance"] = int(instance)
    utilization, window_s = _utilization(dev, set(rows))
    processes = tuple(
        GpuProcess(
            pid=pid,
            kind="+".join(row["kinds"]),
            used_memory_bytes=row["memory"],
            sm_ratio=utilization.get(pid, (None, None))[0],
            memory_ratio=utilization.get(pid, (None, None))[1],
            gpu_instance=row["gpu_instance"],
        )
        for pid, row in sorted(rows.items())
    )
    out.add(PROCESSES, len(processes))
    out.set_info(processes=processes, processes_window_s=window_s)


def _utilization(dev: GpuDevice, pids: set[int]) -> tuple[dict[int, tuple[float, float]], float | None]:
    """PID → (SM, memory-bandwidth) utilization, 0-1, averaged over the driver's samples since the last read; and
    the seconds since that read. A GPU without samples (no process ran since) answers NOT_FOUND: no data."""
    state = dev.state.setdefault("process_utilization", {"last_seen_us": 0})
    if not pids:
        return {}, None
    samples = dev.call(nvml.nvmlDeviceGetProcessesUtilizationInfo, state["last_seen_us"])
    if not samples:
        return {}, None
    sums: dict[int, list[float]] = {}
    newest = state["last_seen_us"]
    for sample in samples:
        newest = max(newest, int(sample.timeStamp))
        acc = sums.setdefault(int(sample.pid), [0.0, 0.0, 0])
        acc[0] += float(sample.smUtil)
        acc[1] += float(sample.memUtil)
        acc[2] += 1
    previous = state["last_seen_us"]
    state["last_seen_us"] = newest
    window_s = (newest - previous) / 1e6 if previous else None
    # a running process without a sample in the window did not use the SMs in it (seen on H100: a process
    # launching one short kernel every 50 ms has no entry): 0, not "unknown"
    found = {pid: (a[0] / a[2] / 100.0, a[1] / a[2] / 100.0) for pid, a in sums.items() if pid in pids}
    return {pid: found.get(pid, (0.0, 0.0)) for pid in pids}, window_s


FAST = Reader("processes", Tier.FAST, (PROCESSES,), read_fast)
