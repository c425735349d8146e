"""Health verdicts per GPU and check: 0 ok, 1 warning, 2 critical, from the snapshot and the exporter's own history.

Conditions that must be sustained (temperature for 5 m, a starved job for 30 m, ...) are judged over the exporter's
own samples with the same thresholds and durations as the alert rules (exporter/gpuwarden/health/thresholds.py). A
window is only judged once the exporter has watched that long: like Prometheus' `for:`, nothing fires on a half-seen
window.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, replace

from gpuwarden.health.bottleneck import WindowActivity, bottleneck_class
from gpuwarden.health.state_file import GpuMemory
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.model.families import (
    BUSY_SECONDS_TOTAL,
    CLOCK_EVENT_ACTIVE,
    ECC_ERRORS_TOTAL,
    FABRIC_HEALTH,
    FABRIC_STATE,
    GPM_DRAM_ACTIVE_SECONDS_TOTAL,
    GPM_PIPE_ACTIVE_SECONDS_TOTAL,
    GPM_SM_ACTIVE_SECONDS_TOTAL,
    GPM_WINDOW_SECONDS_TOTAL,
    MEMORY_TOTAL_BYTES,
    MEMORY_USED_BYTES,
    NVLINK_BYTES_TOTAL,
    NVLINK_ERRORS_TOTAL,
    NVLINK_UP,
    PCIE_BYTES_TOTAL,
    PCIE_REPLAY_ERRORS_TOTAL,
    PERFORMANCE_STATE,
    PERSISTENCE_MODE_ENABLED,
    POWER_DEFAULT_LIMIT_WATTS,
    POWER_LIMIT_WATTS,
    POWER_USAGE_WATTS,
    PROCESSES,
    REMAPPED_ROWS_FAILED,
    REMAPPED_ROWS_PENDING,
    RETIRED_PAGES,
    RETIRED_PAGES_PENDING,
    TEMPERATURE_CELSIUS,
    THROTTLE_SECONDS_TOTAL,
    UTILIZATION_SAMPLED_SECONDS_TOTAL,
)
from gpuwarden.model.snapshot import GpuSnapshot, JobMember, Verdict

OK, WARNING, CRITICAL = 0, 1, 2
CHECKS = (
    "gpu_lost",
    "ecc",
    "row_remap",
    "xid",
    "nvlink",
    "fabric",
    "temperature",
    "thermal_throttling",
    "power",
    "performance_state",
    "memory_pressure",
    "utilization",
    "persistence_mode",
    "pcie",
    "bottleneck",
)


def _values(gpu: GpuSnapshot) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.name, s.labels): s.value for s in gpu.samples}


# The counters the windowed checks need; everything else is judged on the current snapshot. NVLink error counters
# are kept as one sum per type over the GPU's links, not per link: the history stays a dozen numbers per point.
_HISTORY_KEYS = {
    (BUSY_SECONDS_TOTAL.name, ()),
    (UTILIZATION_SAMPLED_SECONDS_TOTAL.name, ()),
    (PCIE_REPLAY_ERRORS_TOTAL.name, ()),
    (GPM_WINDOW_SECONDS_TOTAL.name, ()),
    (GPM_SM_ACTIVE_SECONDS_TOTAL.name, ()),
    (GPM_DRAM_ACTIVE_SECONDS_TOTAL.name, ()),
    (GPM_PIPE_ACTIVE_SECONDS_TOTAL.name, ("tensor",)),
    (GPM_PIPE_ACTIVE_SECONDS_TOTAL.name, ("fp32",)),
    (GPM_PIPE_ACTIVE_SECONDS_TOTAL.name, ("fp16",)),
    (PCIE_BYTES_TOTAL.name, ("rx",)),
    (PCIE_BYTES_TOTAL.name, ("tx",)),
    (NVLINK_BYTES_TOTAL.name, ("rx",)),
    (NVLINK_BYTES_TOTAL.name, ("tx",)),
} | {
    (THROTTLE_SECONDS_TOTAL.name, (reason,))
    for reason in ("hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown", "sw_power_cap")
}
NVLINK_SUM = "nvlink_errors_sum"


def _history_values(values: dict[tuple[str, tuple[str, ...]], float]) -> dict[tuple[str, tuple[str, ...]], float]:
    kept = {key: value for key, value in values.items() if key in _HISTORY_KEYS}
    for (name, labels), value in values.items():
        if name == NVLINK_ERRORS_TOTAL.name:
            key = (NVLINK_SUM, (labels[1],))
            kept[key] = kept.get(key, 0.0) + value
    return kept


class _History:
    """Readings of one GPU's counters, one point per `spacing`-long slot, kept for the longest window.

    Bounded: (longest window / spacing) points of a few dozen counters, whatever the poll rate.
    """

    def __init__(self, spacing: float, keep: float) -> None:
        self.spacing, self.keep = spacing, keep  # resized on reload (HealthEvaluator.carry_over), never shortened early
        self.points: deque[tuple[float, dict[tuple[str, tuple[str, ...]], float]]] = deque()
        self.latest: dict[tuple[str, tuple[str, ...]], float] = {}

    def add(self, now: float, values: dict[tuple[str, tuple[str, ...]], float]) -> None:
        """Keep the first reading of each `spacing`-long slot of the clock: the slots are fixed in time, so a history
        resized by a reload keeps the points a fresh start with the new settings would have kept."""
        self.add_kept(now, _history_values(values))

    def add_kept(self, now: float, kept: dict[tuple[str, tuple[str, ...]], float]) -> None:
        """`add` for readings already reduced to the kept counters (another history's `latest`)."""
        self.latest = kept
        if not self.points or now // self.spacing > self.points[-1][0] // self.spacing:
            self.points.append((now, self.latest))
            while self.points[0][0] < now - self.keep:
                self.points.popleft()

    def span(self, now: float) -> float:
        return now - self.points[0][0] if self.points else 0.0

    def _then(self, now: float, window: float) -> tuple[float, dict[tuple[str, tuple[str, ...]], float]] | None:
        """The newest point at least `window` seconds old; None until the window has been watched."""
        if self.span(now) < window:
            return None
        found = None
        for point in self.points:
            if point[0] > now - window:
                break
            found = point
        return found

    def rate(self, key: tuple[str, tuple[str, ...]], now: float, window: float) -> float | None:
        """Increase per second of a counter over (at least) the window."""
        then = self._then(now, window)
        if then is None or key not in then[1] or key not in self.latest or now <= then[0]:
            return None
        return max(self.latest[key] - then[1][key], 0.0) / (now - then[0])

    def ratio(
        self,
        numerator: tuple[str, tuple[str, ...]],
        denominator: tuple[str, tuple[str, ...]],
        now: float,
        window: float,
    ) -> float | None:
        """Δnumerator / Δdenominator over the window (busy seconds / sampled seconds)."""
        then = self._then(now, window)
        keys = {numerator, denominator}
        if then is None or not keys <= then[1].keys() or not keys <= self.latest.keys():
            return None
        base = self.latest[denominator] - then[1][denominator]
        return None if base <= 0 else (self.latest[numerator] - then[1][numerator]) / base


BUSY = (BUSY_SECONDS_TOTAL.name, ())
SAMPLED = (UTILIZATION_SAMPLED_SECONDS_TOTAL.name, ())


THERMAL_REASONS = ("hw_thermal_slowdown", "sw_thermal_slowdown")


def _throttle(reason: str) -> tuple[str, tuple[str, ...]]:
    return (THROTTLE_SECONDS_TOTAL.name, (reason,))


Values = dict[tuple[str, tuple[str, ...]], float]


@dataclass
class CheckContext:
    """What one check sees of one GPU: its current values, its history, the node's XIDs and the evaluator's
    memory of sustained conditions."""

    name: str
    uuid: str
    values: Values
    history: _History
    xid: dict[tuple[str, int], tuple[int, float]]
    now: float
    pstate_exempt: bool
    thresholds: Thresholds
    evaluator: HealthEvaluator
    wired_links: frozenset[str] = frozenset()  # NVLinks with a remote end found at discovery (a peer or NVSwitch)
    peers: int = 0  # other ranks of the job this GPU's main process belongs to (jobs/grouping.py)
    sxids: tuple[tuple[str, int, float], ...] = ()  # the node's NVSwitch SXids (switch, SXid, wall time of the latest)

    def verdict(
        self, level: int, observed: object = "", threshold: object = "", severity: str | None = None, detail: str = ""
    ) -> Verdict:
        label = severity or ("ok", "warning", "critical")[level]
        return Verdict(self.name, level, label, str(observed), str(threshold), detail=detail)

    def sustained(self, key: str, condition: bool, duration: float) -> bool:
        """True once `condition` has held continuously for `duration` seconds."""
        return self.evaluator.sustained(self.uuid, key, condition, self.now, duration)

    def pending(self, key: str, observed: str, threshold: str, duration: float, level: int = CRITICAL) -> Verdict:
        """A condition that holds but not yet for its sustain window: still level ok (nothing pages or turns the
        gauges red), but the API says so, with how long it has been seen, instead of "ok". After a restart without
        the state file (health/state_file.py) the window starts again, and on-call reads "pending", not "no
        findings". `level`: what the check turns into if the condition lasts (critical unless the caller says
        less): npd-plugin and slurm-healthcheck report a pending check as unknown, never as no fault."""
        held = self.evaluator.held_for(self.uuid, key, self.now)
        observed = f"{observed}, seen for {held:.0f} s of {duration:g} s"
        return Verdict(self.name, OK, "pending", observed, str(threshold), pending_level=level)


def check_gpu_lost(c: CheckContext) -> Verdict:
    return c.verdict(OK, "up", "gpu_up 1")  # a lost GPU is judged before the checks run


def check_ecc(c: CheckContext) -> Verdict:
    uncorrected = c.values.get((ECC_ERRORS_TOTAL.name, ("uncorrected",)))
    if uncorrected:
        return c.verdict(CRITICAL, f"{uncorrected:.0f} uncorrected (volatile)", "0")
    return c.verdict(OK, f"{uncorrected or 0:.0f} uncorrected", "0")


def check_row_remap(c: CheckContext) -> Verdict:
    limits, values = c.thresholds, c.values
    if values.get((REMAPPED_ROWS_FAILED.name, ())):
        return c.verdict(CRITICAL, "remap failed", "no failure")
    retired = sum(values.get((RETIRED_PAGES.name, (cause,)), 0) for cause in ("single_bit", "double_bit"))
    if retired >= limits.retired_pages_limit:
        observed = f"{retired:.0f} retired pages"
        return c.verdict(CRITICAL, observed, f"< {limits.retired_pages_limit}", detail="page_retirement")
    if values.get((REMAPPED_ROWS_PENDING.name, ())):
        return c.verdict(WARNING, "row remap pending", "none pending")
    if values.get((RETIRED_PAGES_PENDING.name, ())):  # pre-Ampere GPUs retire pages instead of remapping rows
        return c.verdict(WARNING, "page retirement pending", "none pending", detail="page_retirement")
    return c.verdict(OK, "none pending", "none pending")


# What an XID code means, for the finding's text (NVIDIA's XID catalog; codes not listed are shown by number).
XID_NAMES = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remap recorded",
    64: "ECC page retirement or row remap failure",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def xid_text(codes: list[int]) -> str:
    """'XID 48 (double-bit ECC error), XID 154': the number for the catalog, the name for the reader."""
    return ", ".join(f"XID {code} ({XID_NAMES[code]})" if code in XID_NAMES else f"XID {code}" for code in codes)


def check_xid(c: CheckContext) -> Verdict:
    limits = c.thresholds
    window = f"none in {limits.xid_window_s} s"
    recent = {
        code: last for (uuid, code), (_, last) in c.xid.items() if uuid == c.uuid and c.now - last < limits.xid_window_s
    }
    critical = sorted(code for code in recent if code in limits.xid_critical)
    if critical:
        return c.verdict(CRITICAL, xid_text(critical), window)
    warning = sorted(code for code in recent if code in limits.xid_warning)
    if warning:
        return c.verdict(WARNING, xid_text(warning), window)
    return c.verdict(OK, "no critical XID", window)


def check_nvlink(c: CheckContext) -> Verdict:
    limits, values, history = c.thresholds, c.values, c.history
    links = {labels[0]: value for (name, labels), value in values.items() if name == NVLINK_UP.name}
    seen_up = c.evaluator.links_seen_up.setdefault(c.uuid, set())
    seen_up.update(link for link, up in links.items() if up)
    # a link that was never up in our history may simply be unused, unless discovery found its remote end (a peer
    # GPU or an NVSwitch): then it is wired, and down is a fault even if it went down before this exporter started
    expected = seen_up | c.wired_links
    down = sorted((link for link, up in links.items() if not up and link in expected), key=int)
    if c.sustained("nvlink_down", bool(down), limits.nvlink_down_for_s):
        return c.verdict(CRITICAL, f"link {', '.join(down)} down", "all links up")
    for kind in ("replay", "recovery"):
        if history.rate((NVLINK_SUM, (kind,)), c.now, 900):
            named = sorted(
                {
                    labels[0]
                    for (name, labels), value in values.items()
                    if name == NVLINK_ERRORS_TOTAL.name and labels[1] == kind and value
                },
                key=int,
            )
            return c.verdict(WARNING, f"{kind} errors on link {', '.join(named)}", "none in 15 m")
    crc = history.rate((NVLINK_SUM, ("crc_flit",)), c.now, limits.nvlink_crc_for_s)
    if crc is not None and crc > limits.nvlink_crc_per_second:
        # the sum over links: a conservative reading of the per-link threshold of the alert rule
        return c.verdict(WARNING, f"CRC {crc:.0f}/s over all links", f"<= {limits.nvlink_crc_per_second:g}/s")
    if down:
        return c.pending("nvlink_down", f"link {', '.join(down)} down", "all links up", limits.nvlink_down_for_s)
    return c.verdict(OK, f"{sum(links.values()):.0f} of {len(links)} up" if links else "no NVLink", "")


FABRIC_FAULTS = ("route_unhealthy", "incorrect_configuration", "registration_failed")  # CUDA jobs fail: critical
FABRIC_DEGRADED = ("degraded_bandwidth", "route_recovery", "access_timeout_recovery", "gfm_disconnected")


def check_fabric(c: CheckContext) -> Verdict:
    """The NVSwitch fabric (readers/fabric.py): not set up for fabric_setup_for_s, or an unhealthy route, a wrong
    configuration or a failed registration, is critical (CUDA cannot start or jobs fail on the GPU); degraded
    bandwidth or a recovery for fabric_degraded_for_s is a warning, and so is an SXid an NVSwitch of the node logged
    within xid_window_s (the kernel log): every GPU of an HGX baseboard routes through every switch, and a fatal
    SXid reaches the fabric's own state when Fabric Manager acts on it. A GPU without NVSwitch has no fabric rows."""
    limits = c.thresholds
    states = [labels[0] for (name, labels), value in c.values.items() if name == FABRIC_STATE.name and value]
    held = {labels[0] for (name, labels), value in c.values.items() if name == FABRIC_HEALTH.name and value}
    if not states:
        return c.verdict(OK, "no NVSwitch fabric", "")
    faults = [f for f in FABRIC_FAULTS if f in held]
    if faults:
        return c.verdict(CRITICAL, f"fabric {', '.join(faults)}", "a healthy fabric")
    state = states[0]
    unready = state != "completed"
    if c.sustained("fabric_unready", unready, limits.fabric_setup_for_s):
        return c.verdict(CRITICAL, f"fabric {state}: CUDA cannot start on this GPU", "fabric completed")
    if unready:
        return c.pending("fabric_unready", f"fabric {state}", "fabric completed", limits.fabric_setup_for_s)
    return _fabric_set_up(c, held)


def _fabric_set_up(c: CheckContext, held: set[str]) -> Verdict:
    """A fabric that is set up, with no fault: degraded for fabric_degraded_for_s, or an SXid logged within
    xid_window_s, is a warning (check_fabric)."""
    limits = c.thresholds
    degraded = [d for d in FABRIC_DEGRADED if d in held]
    if c.sustained("fabric_degraded", bool(degraded), limits.fabric_degraded_for_s):
        return c.verdict(WARNING, f"fabric {', '.join(degraded)}", "a healthy fabric")
    recent = [(switch, code) for switch, code, last in c.sxids if c.now - last < limits.xid_window_s]
    if recent:
        logged = ", ".join(f"SXid {code} on NVSwitch {switch}" for switch, code in recent)
        return c.verdict(WARNING, f"{logged} (kernel log)", f"no SXid in {limits.xid_window_s} s", detail="sxid")
    if degraded:
        observed = f"fabric {', '.join(degraded)}"
        return c.pending("fabric_degraded", observed, "a healthy fabric", limits.fabric_degraded_for_s, WARNING)
    return c.verdict(OK, "fabric completed, healthy", "")


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
    shares = [c.history.rate(_throttle(r), c.now, limits.thermal_page_window_s) for r in THERMAL_REASONS]
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
        share = c.history.rate(_throttle(reason), c.now, limits.thermal_slowdown_for_s)
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
    brake = c.history.rate(_throttle("hw_power_brake_slowdown"), c.now, limits.thermal_slowdown_for_s)
    if brake is not None and brake > limits.power_brake_ratio:
        return c.verdict(WARNING, f"power brake {brake:.0%} of the time", f"<= {limits.power_brake_ratio:.0%}")
    limit = values.get((POWER_LIMIT_WATTS.name, ()))
    default = values.get((POWER_DEFAULT_LIMIT_WATTS.name, ()))
    reduced = limit is not None and default is not None and limit < default
    if c.sustained("power_limit", reduced, limits.power_limit_reduced_for_s):
        return c.verdict(WARNING, f"limit {limit:.0f} W", f"default {default:.0f} W")
    cap = c.history.rate(_throttle("sw_power_cap"), c.now, limits.power_cap_for_s)
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
    running = _running(c.values)
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


WINDOW = (GPM_WINDOW_SECONDS_TOTAL.name, ())
HEALTHY_CLASSES = frozenset({"idle", "tensor_bound"})


def _running(values: Values) -> bool:
    return values.get((PROCESSES.name, ()), 0) > 0


THROTTLE_REASONS = ("hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown", "sw_power_cap")


def window_activity(history: _History, running: bool, now: float, window: float) -> WindowActivity | None:
    """What the GPU did over the last `window` seconds (GPM, the driver's busy ratio, NVLink and PCIe rates,
    throttle shares); None where the GPU has no GPM readings yet. `running`: a process holds the GPU now."""
    sm = history.ratio((GPM_SM_ACTIVE_SECONDS_TOTAL.name, ()), WINDOW, now, window)
    if sm is None:
        return None

    def pipe(name: str) -> float:
        return history.ratio((GPM_PIPE_ACTIVE_SECONDS_TOTAL.name, (name,)), WINDOW, now, window) or 0.0

    def rates(name: str) -> tuple[float, ...] | None:
        found = [history.rate((name, (d,)), now, window) for d in ("rx", "tx")]
        return None if None in found else tuple(found)  # type: ignore[arg-type]

    dram = history.ratio((GPM_DRAM_ACTIVE_SECONDS_TOTAL.name, ()), WINDOW, now, window) or 0.0
    nvlink, pcie = rates(NVLINK_BYTES_TOTAL.name), rates(PCIE_BYTES_TOTAL.name)
    busy = history.ratio((BUSY_SECONDS_TOTAL.name, ()), (UTILIZATION_SAMPLED_SECONDS_TOTAL.name, ()), now, window)
    throttle = tuple((r, share) for r in THROTTLE_REASONS if (share := history.rate(_throttle(r), now, window)))
    return WindowActivity(
        running,
        sm,
        pipe("tensor"),
        pipe("fp32"),
        pipe("fp16"),
        dram,
        sum(nvlink or ()),
        (pcie or (0.0, 0.0))[0],
        busy,
        pcie_tx_bytes_per_second=(pcie or (0.0, 0.0))[1],
        paths=frozenset(name for name, read in (("nvlink", nvlink), ("pcie", pcie)) if read is not None),
        throttle=throttle,
    )


def check_bottleneck(c: CheckContext) -> Verdict:
    """Information, never paged: the class and the numbers behind it (GPM; "n/a" on GPUs without it)."""
    window = c.thresholds.bottleneck_window_s
    activity = window_activity(c.history, _running(c.values), c.now, window)
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


# Every check, in the order verdicts are reported; a check is one function of its context.
CHECK_FUNCTIONS: dict[str, Callable[[CheckContext], Verdict]] = {
    "gpu_lost": check_gpu_lost,
    "ecc": check_ecc,
    "row_remap": check_row_remap,
    "xid": check_xid,
    "nvlink": check_nvlink,
    "fabric": check_fabric,
    "temperature": check_temperature,
    "thermal_throttling": check_thermal_throttling,
    "power": check_power,
    "performance_state": check_performance_state,
    "memory_pressure": check_memory_pressure,
    "utilization": check_utilization,
    "persistence_mode": check_persistence_mode,
    "pcie": check_pcie,
    "bottleneck": check_bottleneck,
}
assert tuple(CHECK_FUNCTIONS) == CHECKS
# Checks judged on slow-tier readings (NVLink state, the fabric, PCIe replays), with the worst level each gives: until
# a GPU's slow tier has been read once (the first slow cycle after a start, or a late read on a starved host), they
# have nothing to judge. They are pending then, not ok ("no NVLink" would tell NPD the links are fine), and they are
# not run, so a condition recalled from the state file keeps its start until the readings it is judged on arrive.
NEEDS_SLOW_READINGS = {"nvlink": CRITICAL, "fabric": CRITICAL, "pcie": WARNING}


NOT_READ_YET = "not read yet (slow tier)"


def not_read_yet(check: str) -> Verdict:
    return Verdict(check, OK, "pending", NOT_READ_YET, "", pending_level=NEEDS_SLOW_READINGS[check])


class HealthEvaluator:
    """Keeps per-GPU history between publications and turns each snapshot into verdicts."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.thresholds = thresholds
        self._history: dict[str, _History] = {}
        self._began: dict[tuple[str, str], tuple[int, float]] = {}  # (uuid, check) → (level, began)
        self._since: dict[tuple[str, str], float] = {}
        self._judged: tuple[str, ...] = ()  # the GPUs of the last evaluation: those the state file keeps
        self.links_seen_up: dict[str, set[str]] = {}
        # a short history, with whether a process runs, for each GPU of a multi-GPU job (the job view's window,
        # collective_window_s, ten points): the long one keeps a point per 15 s at the defaults, too coarse to name
        # a straggler within a minute
        self._short: dict[str, tuple[_History, bool]] = {}

    def _short_shape(self) -> tuple[float, float]:
        window = self.thresholds.collective_window_s
        return max(window / 10, 0.5), window * 1.2 + 1

    def collective_activity(self, uuid: str, now: float) -> WindowActivity | None:
        """What a GPU of a multi-GPU job did over the last collective_window_s (None until it has been watched)."""
        history, running = self._short.get(uuid, (None, False))
        return None if history is None else window_activity(history, running, now, self.thresholds.collective_window_s)

    def history_shape(self) -> tuple[float, float]:
        """(spacing, keep) of each GPU's history: one point per spacing, kept for the longest window the checks
        read, so every window can be judged once it has been watched."""
        limits = self.thresholds
        windows = (
            limits.utilization_for_s,
            limits.thermal_slowdown_for_s,
            limits.thermal_page_window_s,
            limits.power_cap_for_s,
            limits.pstate_for_s,
            limits.nvlink_crc_for_s,
            limits.pcie_replays_for_s,
            limits.bottleneck_window_s,
            900,
        )
        spacing = min(max(min(windows) / 10, 0.5), 15.0)
        return spacing, max(windows) + 2 * spacing

    def _new_history(self) -> _History:
        return _History(*self.history_shape())

    def carry_over(self, previous: HealthEvaluator) -> None:
        """Take over what `previous` watched (a reload built this evaluator from new thresholds): each GPU's history,
        resized for this evaluator's windows, and the conditions pending or held. A window longer than the old
        history is judged once the history has grown that long, exactly as after a fresh start with these
        settings; the points already kept count towards it."""
        spacing, keep = self.history_shape()
        for history in previous._history.values():
            history.spacing, history.keep = spacing, keep
        self._history = previous._history
        self._began = previous._began
        self._since = previous._since
        self._judged = previous._judged
        self.links_seen_up = previous.links_seen_up
        spacing, keep = self._short_shape()
        for history, _ in previous._short.values():
            history.spacing, history.keep = spacing, keep
        self._short = previous._short

    def memory(self) -> dict[str, GpuMemory]:
        """What a restart must not forget of the GPUs judged last (written by health/state_file.py)."""
        return {
            uuid: GpuMemory(
                {key: since for (held, key), since in self._since.items() if held == uuid},
                {check: began for (held, check), began in self._began.items() if held == uuid},
                frozenset(self.links_seen_up.get(uuid, ())),
            )
            for uuid in self._judged
        }

    def recall(self, memory: dict[str, GpuMemory]) -> None:
        """Take over what an earlier run remembered (before the first evaluation): a condition that had held its
        window and holds at the first reading fires at once; one that no longer holds is dropped there."""
        for uuid, gpu in memory.items():
            self._since.update({(uuid, key): since for key, since in gpu.held.items()})
            self._began.update({(uuid, check): began for check, began in gpu.levels.items()})
            self.links_seen_up.setdefault(uuid, set()).update(gpu.links_up)

    def held_for(self, uuid: str, key: str, now: float) -> float:
        """Seconds the condition under `key` has held continuously (0 when it does not hold)."""
        since = self._since.get((uuid, key))
        return 0.0 if since is None else now - since

    def sustained(self, uuid: str, key: str, condition: bool, now: float, duration: float) -> bool:
        """True once `condition` has held continuously for `duration` seconds."""
        if not condition:
            self._since.pop((uuid, key), None)
            return False
        since = self._since.setdefault((uuid, key), now)
        return now - since >= duration

    def evaluate(
        self,
        gpus: Iterable[GpuSnapshot],
        xid: dict[tuple[str, int], tuple[int, float]],
        now: float,
        jobs: dict[str, JobMember] | None = None,
        kernel: dict[tuple[str, str, int], tuple[int, float]] | None = None,
    ) -> dict[str, tuple[Verdict, ...]]:
        """Each GPU's verdicts; `kernel`: the kernel log's faults (wall times), of which the NVSwitch SXids are
        judged with each GPU's fabric."""
        result: dict[str, tuple[Verdict, ...]] = {}
        unread: set[tuple[str, str]] = set()
        limits = self.thresholds
        sxids = tuple(
            (device, code, last) for (kind, device, code), (_, last) in sorted((kernel or {}).items()) if kind == "sxid"
        )
        for gpu in gpus:
            if not gpu.up:
                result[gpu.uuid] = (Verdict("gpu_lost", CRITICAL, "critical", gpu.lost_reason or "lost", "gpu_up 1"),)
                continue
            values = _values(gpu)
            history = self._history.get(gpu.uuid) or self._history.setdefault(gpu.uuid, self._new_history())
            history.add(now, values)
            member = (jobs or {}).get(gpu.uuid)
            peers = member.peers if member is not None else 0
            if peers:  # the same kept readings as the long history, one point per short slot
                short = self._short.get(gpu.uuid, (None, False))[0] or _History(*self._short_shape())
                short.add_kept(now, history.latest)
                self._short[gpu.uuid] = (short, _running(values))
            else:
                self._short.pop(gpu.uuid, None)
            exempt = bool(re.fullmatch(limits.pstate_exempt_name_regex, gpu.info.name or ""))
            nvlink = gpu.info.nvlink
            wired = frozenset(str(link) for link, _ in nvlink.remote_bus_ids) if nvlink is not None else frozenset()
            slow_read = "slow" in gpu.updated_at
            unread.update((gpu.uuid, name) for name in NEEDS_SLOW_READINGS if not slow_read)
            result[gpu.uuid] = tuple(
                not_read_yet(name)
                if (gpu.uuid, name) in unread
                else check(
                    CheckContext(name, gpu.uuid, values, history, xid, now, exempt, limits, self, wired, peers, sxids)
                )
                for name, check in CHECK_FUNCTIONS.items()
            )
        self._judged = tuple(result)  # every GPU judged, the lost ones too
        return self._stamp(result, now, unread)

    def _stamp(
        self, result: dict[str, tuple[Verdict, ...]], now: float, unread: Collection[tuple[str, str]] = ()
    ) -> dict[str, tuple[Verdict, ...]]:
        """Carry when each non-ok level began; a level change (warning → critical) starts a new run. A check not
        read yet keeps the start it had (recalled from the state file, or before a late read)."""
        since = {key: self._began[key] for key in unread if key in self._began}
        stamped: dict[str, tuple[Verdict, ...]] = {}
        for uuid, verdicts in result.items():
            out = []
            for verdict in verdicts:
                if verdict.level > 0:
                    level, began = self._began.get((uuid, verdict.check), (verdict.level, now))
                    began = began if level == verdict.level else now
                    since[(uuid, verdict.check)] = (verdict.level, began)
                    verdict = replace(verdict, since=began)
                out.append(verdict)
            stamped[uuid] = tuple(out)
        self._began = since  # GPUs and checks that are gone or ok are forgotten: bounded by the current set
        return stamped
