"""Health checks of operating conditions: heat, throttling, power, P-state, memory, utilization, PCIe, bottleneck.

Most are judged over a window of the exporter's own samples (health/history.py) and must hold as long as the alert
rules' `for:`; one that holds but not yet that long is pending (CheckContext.pending), not ok."""

from __future__ import annotations

from gpuwarden.health.bottleneck import bottleneck_class
from gpuwarden.health.context import CRITICAL, OK, WARNING, CheckContext
from gpuwarden.health.history import BUSY, SAMPLED, process_running, throttle_key, window_activity
from gpuwarden.model.families import (
    CLOCK_EVENT_ACTIVE,
    GPM_SM_ACTIVE_SECONDS_TOTAL,
    MEMORY_TOTAL_BYTES,
    MEMORY_USED_BYTES,
    PCIE_REPLAY_ERRORS_TOTAL,
    PERFORMANCE_STATE,
    PERSISTENCE_MODE_ENABLED,
    POWER_DEFAULT_LIMIT_WATTS,
    POWER_LIMIT_WATTS,
    POWER_USAGE_WATTS,
    TEMPERATURE_CELSIUS,
)
from gpuwarden.model.snapshot import Verdict

THERMAL_REASONS = ("hw_thermal_slowdown", "sw_thermal_slowdown")


def check_temperature(c: CheckContext) -> Verdict:
    limits = c.thresholds
    temp = c.values.get((TEMPERATURE_CELSIUS.name, ()))
    if temp is None:
        return c.verdict(OK, "n/a")
    critical, warning = limits.temperature_critical_celsius, limits.temperature_warning_celsius
    if c.sustained("temp_critical", temp > critical, limits.temperature_critical_for_s):
        return c.verdict(CRITICAL, f"{temp:.0f} °C", f"> {critical:g} °C")
    if c.sustained("temp_warning", temp > warning, limits.temperature_warning_for_s):
        return c.verdict(WARNING, f"{temp:.0f} °C", f"> {warning:g} °C")
    if temp > critical:
        threshold = f"> {critical:g} °C for {limits.temperature_critical_for_s} s"
        return c.pending("temp_critical", f"{temp:.0f} °C", threshold, limits.temperature_critical_for_s)
    if temp > warning:
        threshold = f"> {warning:g} °C for {limits.temperature_warning_for_s} s"
        return c.pending("temp_warning", f"{temp:.0f} °C", threshold, limits.temperature_warning_for_s, WARNING)
    return c.verdict(OK, f"{temp:.0f} °C", f"<= {warning:g} °C")


def _thermal_page(c: CheckContext) -> Verdict | None:
    """The critical tier, where the page is (GpuwardenThermalThrottling: HW or SW thermal slowdown above
    thermal_page_ratio of thermal_page_window_s, for thermal_page_for_s); None below it."""
    limits = c.thresholds
    window = f"{limits.thermal_page_window_s} s"
    shares = [c.history.rate(throttle_key(r), c.now, limits.thermal_page_window_s) for r in THERMAL_REASONS]
    most = max((share for share in shares if share is not None), default=None)
    if most is None:  # the window not watched yet (a start): what the state file recalls is kept, not judged
        throttled = any(c.values.get((CLOCK_EVENT_ACTIVE.name, (r,))) for r in THERMAL_REASONS)
        if throttled and c.evaluator.held_for(c.uuid, "thermal_page", c.now):
            threshold = f"<= {limits.thermal_page_ratio:.0%} of {window}"
            return c.pending("thermal_page", "thermal slowdown active", threshold, limits.thermal_page_for_s)
        return None
    if c.sustained("thermal_page", most > limits.thermal_page_ratio, limits.thermal_page_for_s):
        return c.verdict(
            CRITICAL, f"thermal slowdown {most:.0%} of {window}", f"<= {limits.thermal_page_ratio:.0%} of {window}"
        )
    return None


def check_thermal_throttling(c: CheckContext) -> Verdict:
    """Critical where the page is (_thermal_page); a warning above thermal_slowdown_ratio of thermal_slowdown_for_s,
    as GpuwardenHwThermalSlowdown and GpuwardenSwThermalSlowdown are."""
    page = _thermal_page(c)
    if page is not None:
        return page
    limits = c.thresholds
    active_now = None
    for reason in THERMAL_REASONS:
        active = bool(c.values.get((CLOCK_EVENT_ACTIVE.name, (reason,))))
        held = c.sustained(f"{reason}_active", active, limits.thermal_slowdown_for_s)
        share = c.history.rate(throttle_key(reason), c.now, limits.thermal_slowdown_for_s)
        if share is None:  # no window of counters yet (just started), or none at all (old driver): the point sample
            share = 1.0 if held else 0.0
        if share > limits.thermal_slowdown_ratio:
            return c.verdict(WARNING, f"{reason} {share:.0%} of the time", f"<= {limits.thermal_slowdown_ratio:.0%}")
        if active and active_now is None:
            active_now = reason
    if active_now is not None:
        threshold = f"<= {limits.thermal_slowdown_ratio:.0%} of {limits.thermal_slowdown_for_s} s"
        return c.pending(f"{active_now}_active", f"{active_now} active", threshold, limits.thermal_slowdown_for_s)
    return c.verdict(OK, "no thermal slowdown", f"<= {limits.thermal_slowdown_ratio:.0%}")


def check_power(c: CheckContext) -> Verdict:
    limits, values = c.thresholds, c.values
    brake = c.history.rate(throttle_key("hw_power_brake_slowdown"), c.now, limits.thermal_slowdown_for_s)
    if brake is not None and brake > limits.power_brake_ratio:
        return c.verdict(WARNING, f"power brake {brake:.0%} of the time", f"<= {limits.power_brake_ratio:.0%}")
    limit = values.get((POWER_LIMIT_WATTS.name, ()))
    default = values.get((POWER_DEFAULT_LIMIT_WATTS.name, ()))
    reduced = limit is not None and default is not None and limit < default
    if c.sustained("power_limit", reduced, limits.power_limit_reduced_for_s):
        return c.verdict(WARNING, f"limit {limit:.0f} W", f"default {default:.0f} W")
    cap = c.history.rate(throttle_key("sw_power_cap"), c.now, limits.power_cap_for_s)
    if cap is not None and cap > limits.power_cap_ratio:
        return c.verdict(OK, f"power-capped {cap:.0%} of the time", f"<= {limits.power_cap_ratio:.0%}", "info")
    draw = values.get((POWER_USAGE_WATTS.name, ()))
    return c.verdict(OK, f"{draw:.0f} W" if draw is not None else "n/a", "")


def check_performance_state(c: CheckContext) -> Verdict:
    limits = c.thresholds
    pstate = c.values.get((PERFORMANCE_STATE.name, ()))
    busy = c.history.ratio(BUSY, SAMPLED, c.now, limits.pstate_for_s)
    # idle GPUs (H100 idles in P0 at 345 MHz) and P-states of idle boards never count: busy must be high
    degraded = (
        pstate is not None
        and pstate >= limits.pstate_degraded_min
        and busy is not None
        and busy > limits.pstate_busy_ratio
        and not c.pstate_exempt
    )
    if c.sustained("pstate", degraded, limits.pstate_for_s):
        return c.verdict(
            WARNING, f"P{pstate:.0f} while {busy:.0%} busy", f"P{limits.pstate_degraded_min - 1} or better"
        )
    return c.verdict(OK, f"P{pstate:.0f}" if pstate is not None else "n/a", "")


def check_memory_pressure(c: CheckContext) -> Verdict:
    limits = c.thresholds
    used, total = c.values.get((MEMORY_USED_BYTES.name, ())), c.values.get((MEMORY_TOTAL_BYTES.name, ()))
    if not used or not total:
        return c.verdict(OK, "0%" if total else "n/a")
    share = used / total
    # A warning at most, as the alert (GpuwardenMemoryNearlyFull) is: a full GPU is the job's to fix (frameworks
    # preallocate), not a page for the node's on-call. Past memory_critical_ratio it needs no sustain.
    if share >= limits.memory_critical_ratio:
        return c.verdict(WARNING, f"{share:.1%} used", f"< {limits.memory_critical_ratio:.0%}")
    if c.sustained("memory", share > limits.memory_warning_ratio, limits.memory_for_s):
        return c.verdict(WARNING, f"{share:.1%} used", f"<= {limits.memory_warning_ratio:.0%}")
    return c.verdict(OK, f"{share:.1%} used", f"<= {limits.memory_warning_ratio:.0%}")


def check_utilization(c: CheckContext) -> Verdict:
    limits = c.thresholds
    busy = c.history.ratio(BUSY, SAMPLED, c.now, limits.utilization_for_s)
    running = process_running(c.values)
    if running and busy is not None and busy < limits.utilization_low_ratio:
        return c.verdict(WARNING, f"{busy:.0%} busy with a job running", f">= {limits.utilization_low_ratio:.0%}")
    return c.verdict(OK, "n/a" if busy is None else f"{busy:.0%} busy", "")


def check_persistence_mode(c: CheckContext) -> Verdict:
    off = c.values.get((PERSISTENCE_MODE_ENABLED.name, ())) == 0
    if c.sustained("persistence", off, c.thresholds.persistence_off_for_s):
        return c.verdict(WARNING, "off", "on")
    if off:
        return c.pending("persistence", "off", "on", c.thresholds.persistence_off_for_s, WARNING)
    return c.verdict(OK, "on", "on")


def check_pcie(c: CheckContext) -> Verdict:
    limits = c.thresholds
    per_second = c.history.rate((PCIE_REPLAY_ERRORS_TOTAL.name, ()), c.now, limits.pcie_replays_for_s)
    if per_second is not None and per_second * 60 > limits.pcie_replays_per_minute:
        return c.verdict(WARNING, f"{per_second * 60:.1f} replays/min", f"<= {limits.pcie_replays_per_minute:g}/min")
    return c.verdict(OK, "", "")


HEALTHY_CLASSES = frozenset({"idle", "tensor_bound"})


def check_bottleneck(c: CheckContext) -> Verdict:
    """Information, never paged: the class and the numbers behind it (GPM; "n/a" on GPUs without it)."""
    window = c.thresholds.bottleneck_window_s
    activity = window_activity(c.history, process_running(c.values), c.now, window)
    if activity is None:
        seen = c.history.span(c.now)
        if (GPM_SM_ACTIVE_SECONDS_TOTAL.name, ()) in c.values and seen < window:  # GPM read, the window not yet
            return c.verdict(OK, f"measuring: {seen:.0f} s of the {window} s window", "")
        return c.verdict(OK, "n/a", "")
    nvlink, pcie_rx = activity.nvlink_bytes_per_second, activity.pcie_rx_bytes_per_second
    pcie_tx = activity.pcie_tx_bytes_per_second
    kind = bottleneck_class(c.thresholds, activity, c.peers)
    busy = activity.busy
    busy_text = "n/a" if busy is None else f"{busy:.0%}"
    observed = (
        f"{kind}: driver busy {busy_text}, SM {activity.sm:.0%}, tensor {activity.tensor:.0%}, FP32 "
        f"{activity.fp32:.0%}, FP16 {activity.fp16:.0%}, DRAM {activity.dram:.0%}, NVLink {nvlink / 1e9:.1f} GB/s, "
        f"PCIe rx {pcie_rx / 1e9:.1f} GB/s, tx {pcie_tx / 1e9:.1f} GB/s over {window} s"
    )
    # Healthy classes (no process; tensor cores busy) are said by the gauge and the verdict, not as findings of
    # /api/v1/diagnosis: a healthy node has none.
    return c.verdict(OK, observed, "", severity="ok" if kind in HEALTHY_CLASSES else "info", detail=kind)
