"""Why a straggler holds its job back: a slower GPU where it computes (its clocks, throttling or power cap, another
process on it), else what its main process does on the host (jobs/host_reading.py), else unknown. The numbers
behind the cause go into the finding's detail, so a reader can check it."""

from __future__ import annotations

from collections.abc import Iterable

from gpuwarden.health.checks import WindowActivity
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.jobs import host_reading
from gpuwarden.model.draft import Draft
from gpuwarden.model.families import CLOCK_HERTZ
from gpuwarden.model.snapshot import GpuSnapshot, HostEvidence

# what a straggler's main process did (host_reading.dominant) → the straggler's cause; asleep is no cause of its own
HOST_CAUSES = {"checkpoint": "io", "io_wait": "io", "workers_running": "input", "main_running": "cpu"}
SLOWER_GPU_CHECKS = ("thermal_throttling", "power", "performance_state", "temperature")
SLOWER_CLOCK_RATIO = 0.95  # an SM clock below this share of the waiters' median is a slower GPU


def host_cause(evidence: HostEvidence | None) -> tuple[str, str]:
    """(cause, detail) from what the straggler's main process did on the host."""
    if evidence is None or not host_reading.sampled(evidence):
        return "unknown", "no host evidence (the host's /proc is not mounted, or not yet sampled)"
    return HOST_CAUSES.get(host_reading.dominant(evidence) or "", "unknown"), host_reading.describe(evidence)


def computes(limits: Thresholds, mine: WindowActivity) -> bool:
    """Whether the straggler's GPU computes (busy, with its math pipes or SMs at work) rather than waits."""
    busy = mine.busy or 0.0
    math = max(mine.tensor, mine.fp32, mine.fp16)
    return busy >= limits.collective_busy_ratio / 2 and (
        math >= limits.collective_math_ratio or mine.sm > limits.collective_sm_ratio
    )


def gpu_numbers(straggler: WindowActivity, waiters: Iterable[WindowActivity]) -> str:
    """The straggler's GPU activity against the waiters' medians."""
    waiters = list(waiters)
    busy = straggler.busy or 0.0
    return (
        f"driver busy {busy:.0%}, SM {straggler.sm:.0%}, tensor {straggler.tensor:.0%}, FP32 {straggler.fp32:.0%} "
        f"(the waiters: busy {median(w.busy or 0.0 for w in waiters):.0%}, SM {median(w.sm for w in waiters):.0%})"
    )


def cause(
    draft: Draft, limits: Thresholds, straggler: str, waiting: set[str], activity: dict[str, WindowActivity]
) -> tuple[str, str]:
    """(cause, detail) of the straggler: slower_gpu where its GPU computes, else its host cause."""
    numbers = gpu_numbers(activity[straggler], (activity[u] for u in waiting))
    if not computes(limits, activity[straggler]):
        found, host = host_cause(draft.host_evidence.get(straggler))
        return found, f"{numbers}; on the host: {host}"
    reasons = slower_gpu_reasons(draft, straggler, waiting)
    return "slower_gpu", numbers + (
        "; " + "; ".join(reasons) if reasons else "; no clock, power or co-located process seen"
    )


def slower_gpu_reasons(draft: Draft, straggler: str, waiting: set[str]) -> list[str]:
    """What makes the straggler's GPU slower than the waiters': a lower clock, a slowdown verdict, a co-tenant."""
    reasons = []
    clocks = {gpu.uuid: sm_clock(gpu) for gpu in draft.gpus if gpu.uuid in waiting | {straggler}}
    peers = [c for u, c in clocks.items() if u != straggler and c]
    if clocks.get(straggler) and peers and clocks[straggler] < SLOWER_CLOCK_RATIO * median(peers):  # type: ignore[operator]
        reasons.append(f"SM clock {clocks[straggler] / 1e6:.0f} MHz against {median(peers) / 1e6:.0f} MHz")  # type: ignore[operator]
    reasons += [
        f"{verdict.check}: {verdict.observed}"
        for verdict in draft.health.get(straggler, ())
        if verdict.check in SLOWER_GPU_CHECKS and verdict.level > 0
    ]
    main_pid = draft.jobs[straggler].pid
    others = [p for p in draft.processes.get(straggler, ()) if p.pid != main_pid and p.kind == "compute"]
    if others:
        reasons.append(
            "another process computes on it: "
            + ", ".join(f"pid {p.pid} ({p.name or 'unknown'}{_sm(p.sm_ratio)})" for p in others[:3])
        )
    return reasons


def _sm(ratio: float | None) -> str:
    return "" if ratio is None else f", SM {ratio:.0%}"


def sm_clock(gpu: GpuSnapshot) -> float | None:
    for sample in gpu.samples:
        if sample.name == CLOCK_HERTZ.name and sample.labels == ("sm",):
            return sample.value
    return None


def median(values: Iterable[float]) -> float:
    """The middle value (mean of the two middle ones): `statistics` costs 0.6 MiB in a process that scrapes."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
