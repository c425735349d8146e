"""Why a straggler holds its job back, and the evidence that it does.

Why a straggler holds its job back, and the evidence that it does. A rank that computes while the others wait is
a slower GPU; it is *measurably* slower where the window shows why: another process computing on it, its clocks held
down for heat or power (the throttle reasons' share of the window), a power limit below its default, SM clocks
below its peers', or a slowdown verdict. A rank idle on its GPU is held back by what its main process does on the
host (jobs/host_reading.py). The numbers go into the finding's detail, so a reader can check them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.jobs import host_reading
from gpuwarden.model.draft import Draft
from gpuwarden.model.families import CLOCK_HERTZ, POWER_DEFAULT_LIMIT_WATTS, POWER_LIMIT_WATTS
from gpuwarden.model.snapshot import Cotenant, GpuSnapshot, HostEvidence

# what a straggler's main process did (host_reading.dominant) → the straggler's cause; asleep is no cause of its own
HOST_CAUSES = {"checkpoint": "io", "io_wait": "io", "workers_running": "input", "main_running": "cpu"}
SLOWER_GPU_CHECKS = ("thermal_throttling", "power", "performance_state", "temperature")
SLOWER_CLOCK_RATIO = 0.95  # an SM clock below this share of the waiters' median is a slower GPU
THERMAL = ("hw_thermal_slowdown", "sw_thermal_slowdown")


def host_cause(evidence: HostEvidence | None) -> tuple[str, str]:
    """(cause, detail) from what the straggler's main process did on the host."""
    if evidence is None or not host_reading.sampled(evidence):
        return "unknown", "no host evidence (the host's /proc is not mounted, or not yet sampled)"
    return HOST_CAUSES.get(host_reading.dominant(evidence) or "", "unknown"), host_reading.describe(evidence)


def gpu_numbers(straggler: WindowActivity, waiters: Iterable[WindowActivity]) -> str:
    """The straggler's GPU activity against the waiters' medians."""
    waiters = list(waiters)
    busy = straggler.busy or 0.0
    return (
        f"driver busy {busy:.0%}, SM {straggler.sm:.0%}, tensor {straggler.tensor:.0%}, FP32 {straggler.fp32:.0%} "
        f"(the waiters: busy {median(w.busy or 0.0 for w in waiters):.0%}, SM {median(w.sm for w in waiters):.0%}, "
        f"math {median(w.math for w in waiters):.0%})"
    )


@dataclass(frozen=True)
class Reason:
    """One reason a GPU is slower, with its numbers. `alone`: enough to name a straggler without an onset (another
    process on it, a thermal or power-brake slowdown, a lowered power limit, a slowdown verdict); lower clocks and a
    power cap are also what a pipeline's heavy stage shows, so they count only with an onset."""

    text: str
    alone: bool


def slower_gpu_reasons(
    draft: Draft,
    limits: Thresholds,
    straggler: str,
    peers: Iterable[str],
    activity: dict[str, WindowActivity],
    cotenants: Iterable[Cotenant] = (),
) -> list[Reason]:
    """What makes the straggler's GPU slower than its peers', each with its numbers; empty where nothing is seen.
    `cotenants`: the processes outside the job seen computing on it within the window (jobs/sharing.py)."""
    peers = [p for p in peers if p != straggler]
    gpus = {gpu.uuid: gpu for gpu in draft.gpus}
    reasons = _clock_reason(gpus, straggler, peers) + _throttle_reasons(limits, activity, straggler, peers)
    reasons += _power_limit_reason(gpus.get(straggler))
    reasons += [
        Reason(f"{verdict.check}: {verdict.observed}", True)
        for verdict in draft.health.get(straggler, ())
        if verdict.check in SLOWER_GPU_CHECKS and verdict.level > 0
    ]
    others = list(cotenants)
    if others:
        reasons.append(Reason(f"another process computes on it: {describe_cotenants(others)}", True))
    return reasons


def describe_cotenants(cotenants: Iterable[Cotenant]) -> str:
    """'pid 6001 (bench, SM 60%)', the three that used the most SMs first."""
    ordered = sorted(cotenants, key=lambda c: -c.sm_ratio)
    return ", ".join(f"pid {c.pid} ({c.name}, SM {c.sm_ratio:.0%})" for c in ordered[:3]) + (
        f" and {len(ordered) - 3} more" if len(ordered) > 3 else ""
    )


def _clock_reason(gpus: dict[str, GpuSnapshot], straggler: str, peers: list[str]) -> list[Reason]:
    mine = sm_clock(gpus[straggler]) if straggler in gpus else None
    theirs = [c for u in peers if u in gpus and (c := sm_clock(gpus[u]))]
    if mine and theirs and mine < SLOWER_CLOCK_RATIO * median(theirs):
        return [Reason(f"SM clock {mine / 1e6:.0f} MHz against {median(theirs) / 1e6:.0f} MHz", False)]
    return []


def _throttle_reasons(
    limits: Thresholds, activity: dict[str, WindowActivity], straggler: str, peers: list[str]
) -> list[Reason]:
    """Clock-event reasons that held the straggler's clocks down for a share of the window its peers did not see."""
    mine = activity[straggler]
    found = []
    for name, reasons, alone in (
        ("thermal slowdown", THERMAL, True),
        ("power brake", ("hw_power_brake_slowdown",), True),
        ("power cap", ("sw_power_cap",), False),
    ):
        share = mine.throttled(*reasons)
        theirs = median(activity[u].throttled(*reasons) for u in peers if u in activity)
        if share >= limits.thermal_slowdown_ratio and share > theirs + limits.thermal_slowdown_ratio:
            found.append(Reason(f"{name} {share:.0%} of the window (its peers: {theirs:.0%})", alone))
    return found


def _power_limit_reason(gpu: GpuSnapshot | None) -> list[Reason]:
    if gpu is None:
        return []
    wanted = (POWER_LIMIT_WATTS.name, POWER_DEFAULT_LIMIT_WATTS.name)
    values = {s.name: s.value for s in gpu.samples if s.name in wanted}
    limit, default = values.get(POWER_LIMIT_WATTS.name), values.get(POWER_DEFAULT_LIMIT_WATTS.name)
    if limit is not None and default is not None and limit < default * SLOWER_CLOCK_RATIO:
        return [Reason(f"power limit {limit:.0f} W, below its default {default:.0f} W", True)]
    return []


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
