"""Health verdicts per GPU and check: 0 ok, 1 warning, 2 critical, from the snapshot and the exporter's own history.

Conditions that must be sustained (temperature for 5 m, a starved job for 30 m, ...) are judged over the exporter's
own samples with the same thresholds and durations as the alert rules (exporter/health/thresholds.py). A window is
only judged once the exporter has watched that long: like Prometheus' `for:`, nothing fires on a half-seen window.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, replace

from exporter.health.thresholds import Thresholds
from exporter.snapshot import GpuSnapshot

OK, WARNING, CRITICAL = 0, 1, 2
CHECKS = (
    "gpu_lost",
    "ecc",
    "row_remap",
    "xid",
    "nvlink",
    "temperature",
    "thermal_throttling",
    "power",
    "performance_state",
    "memory_pressure",
    "utilization",
    "persistence_mode",
    "pcie",
)


@dataclass(frozen=True)
class Verdict:
    check: str
    level: int
    severity: str  # ok, info, warning, critical (info: worth showing, level stays 0)
    observed: str
    threshold: str
    since: float = 0.0  # unix time this non-ok level began (as this exporter saw it); 0 while ok


def _values(gpu: GpuSnapshot) -> dict[tuple[str, tuple[str, ...]], float]:
    return {(s.name, s.labels): s.value for s in gpu.samples}


# The counters the windowed checks need; everything else is judged on the current snapshot. NVLink error counters
# are kept as one sum per type over the GPU's links, not per link: the history stays a dozen numbers per point.
_HISTORY_KEYS = {
    ("gpuwarden_busy_seconds_total", ()),
    ("gpuwarden_utilization_sampled_seconds_total", ()),
    ("gpuwarden_pcie_replay_errors_total", ()),
} | {
    ("gpuwarden_throttle_seconds_total", (reason,))
    for reason in ("hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown", "sw_power_cap")
}
NVLINK_SUM = "nvlink_errors_sum"


def _history_values(values: dict[tuple[str, tuple[str, ...]], float]) -> dict[tuple[str, tuple[str, ...]], float]:
    kept = {key: value for key, value in values.items() if key in _HISTORY_KEYS}
    for (name, labels), value in values.items():
        if name == "gpuwarden_nvlink_errors_total":
            key = (NVLINK_SUM, (labels[1],))
            kept[key] = kept.get(key, 0.0) + value
    return kept


class _History:
    """Readings of one GPU's counters, one point per `spacing` seconds, kept for the longest window.

    Bounded: (longest window / spacing) points of a few dozen counters, whatever the poll rate.
    """

    def __init__(self, spacing: float, keep: float) -> None:
        self.spacing, self.keep = spacing, keep
        self.points: deque[tuple[float, dict[tuple[str, tuple[str, ...]], float]]] = deque()
        self.latest: dict[tuple[str, tuple[str, ...]], float] = {}

    def add(self, now: float, values: dict[tuple[str, tuple[str, ...]], float]) -> None:
        self.latest = _history_values(values)
        if not self.points or now - self.points[-1][0] >= self.spacing:
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


BUSY = ("gpuwarden_busy_seconds_total", ())
SAMPLED = ("gpuwarden_utilization_sampled_seconds_total", ())


def _throttle(reason: str) -> tuple[str, tuple[str, ...]]:
    return ("gpuwarden_throttle_seconds_total", (reason,))


class HealthEvaluator:
    """Keeps per-GPU history between publications and turns each snapshot into verdicts."""

    def __init__(self, thresholds: Thresholds) -> None:
        self.t = thresholds
        self._history: dict[str, _History] = {}
        self._began: dict[tuple[str, str], tuple[int, float]] = {}  # (uuid, check) → (level, began)
        self._since: dict[tuple[str, str], float] = {}
        self._links_seen_up: dict[str, set[str]] = {}

    def _new_history(self) -> _History:
        t = self.t
        windows = (
            t.utilization_for_s,
            t.thermal_slowdown_for_s,
            t.power_cap_for_s,
            t.pstate_for_s,
            t.nvlink_crc_for_s,
            t.pcie_replays_for_s,
            900,
        )
        spacing = min(max(min(windows) / 10, 0.5), 15.0)
        return _History(spacing, max(windows) + 2 * spacing)

    def _sustained(self, uuid: str, key: str, condition: bool, now: float, duration: float) -> bool:
        """True once `condition` has held continuously for `duration` seconds."""
        if not condition:
            self._since.pop((uuid, key), None)
            return False
        since = self._since.setdefault((uuid, key), now)
        return now - since >= duration

    def evaluate(
        self, gpus: Iterable[GpuSnapshot], xid: dict[tuple[str, int], tuple[int, float]], now: float
    ) -> dict[str, tuple[Verdict, ...]]:
        result: dict[str, tuple[Verdict, ...]] = {}
        for gpu in gpus:
            if not gpu.up:
                result[gpu.uuid] = (Verdict("gpu_lost", CRITICAL, "critical", gpu.lost_reason or "lost", "gpu_up 1"),)
                continue
            values = _values(gpu)
            history = self._history.get(gpu.uuid) or self._history.setdefault(gpu.uuid, self._new_history())
            history.add(now, values)
            exempt = re.fullmatch(self.t.pstate_exempt_name_regex, str(gpu.info.get("name", "")))
            verdicts = [self._check(name, gpu.uuid, values, history, xid, now, bool(exempt)) for name in CHECKS]
            result[gpu.uuid] = tuple(verdicts)
        return self._stamp(result, now)

    def _stamp(self, result: dict[str, tuple[Verdict, ...]], now: float) -> dict[str, tuple[Verdict, ...]]:
        """Carry when each non-ok level began; a level change (warning → critical) starts a new run."""
        since: dict[tuple[str, str], tuple[int, float]] = {}
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

    def _check(
        self,
        name: str,
        uuid: str,
        v: dict[tuple[str, tuple[str, ...]], float],
        h: _History,
        xid: dict[tuple[str, int], tuple[int, float]],
        now: float,
        pstate_exempt: bool = False,
    ) -> Verdict:
        t = self.t

        def verdict(level: int, observed: object = "", threshold: object = "", severity: str | None = None) -> Verdict:
            label = severity or ("ok", "warning", "critical")[level]
            return Verdict(name, level, label, str(observed), str(threshold))

        if name == "gpu_lost":
            return verdict(OK, "up", "gpu_up 1")
        if name == "ecc":
            uncorrected = v.get(("gpuwarden_ecc_errors_total", ("uncorrected",)))
            if uncorrected:
                return verdict(CRITICAL, f"{uncorrected:.0f} uncorrected (volatile)", "0")
            return verdict(OK, f"{uncorrected or 0:.0f} uncorrected", "0")
        if name == "row_remap":
            if v.get(("gpuwarden_remapped_rows_failed", ())):
                return verdict(CRITICAL, "remap failed", "no failure")
            retired = sum(v.get(("gpuwarden_retired_pages", (c,)), 0) for c in ("single_bit", "double_bit"))
            if retired >= t.retired_pages_limit:
                return verdict(CRITICAL, f"{retired:.0f} retired pages", f"< {t.retired_pages_limit}")
            if v.get(("gpuwarden_remapped_rows_pending", ())) or v.get(("gpuwarden_retired_pages_pending", ())):
                return verdict(WARNING, "remap or retirement pending", "none pending")
            return verdict(OK, "none pending", "none pending")
        if name == "xid":
            recent = {code: last for (u, code), (_, last) in xid.items() if u == uuid and now - last < t.xid_window_s}
            critical = sorted(c for c in recent if c in t.xid_critical)
            if critical:
                return verdict(CRITICAL, f"XID {', '.join(map(str, critical))}", f"none in {t.xid_window_s} s")
            warning = sorted(c for c in recent if c in t.xid_warning)
            if warning:
                return verdict(WARNING, f"XID {', '.join(map(str, warning))}", f"none in {t.xid_window_s} s")
            return verdict(OK, "no critical XID", f"none in {t.xid_window_s} s")
        if name == "nvlink":
            links = {labels[0]: value for (n, labels), value in v.items() if n == "gpuwarden_nvlink_up"}
            seen_up = self._links_seen_up.setdefault(uuid, set())
            seen_up.update(link for link, up in links.items() if up)
            down = sorted((link for link, up in links.items() if not up and link in seen_up), key=int)
            # a link that was never up in our history may simply be unused: not a regression
            if self._sustained(uuid, "nvlink_down", bool(down), now, t.nvlink_down_for_s):
                return verdict(CRITICAL, f"link {', '.join(down)} down", "all links up")
            for kind in ("replay", "recovery"):
                if h.rate((NVLINK_SUM, (kind,)), now, 900):
                    named = sorted(
                        {
                            labels[0]
                            for (n, labels), value in v.items()
                            if n == "gpuwarden_nvlink_errors_total" and labels[1] == kind and value
                        },
                        key=int,
                    )
                    return verdict(WARNING, f"{kind} errors on link {', '.join(named)}", "none in 15 m")
            crc = h.rate((NVLINK_SUM, ("crc_flit",)), now, t.nvlink_crc_for_s)
            if crc is not None and crc > t.nvlink_crc_per_second:
                # the sum over links: a conservative reading of the per-link threshold of the alert rule
                return verdict(WARNING, f"CRC {crc:.0f}/s over all links", f"<= {t.nvlink_crc_per_second:g}/s")
            return verdict(OK, f"{sum(links.values()):.0f} of {len(links)} up" if links else "no NVLink", "")
        if name == "temperature":
            temp = v.get(("gpuwarden_temperature_celsius", ()))
            if temp is None:
                return verdict(OK, "n/a")
            if self._sustained(
                uuid, "temp_critical", temp > t.temperature_critical_celsius, now, t.temperature_critical_for_s
            ):
                return verdict(CRITICAL, f"{temp:.0f} °C", f"> {t.temperature_critical_celsius:g} °C")
            if self._sustained(
                uuid, "temp_warning", temp > t.temperature_warning_celsius, now, t.temperature_warning_for_s
            ):
                return verdict(WARNING, f"{temp:.0f} °C", f"> {t.temperature_warning_celsius:g} °C")
            return verdict(OK, f"{temp:.0f} °C", f"<= {t.temperature_warning_celsius:g} °C")
        if name == "thermal_throttling":
            for reason in ("hw_thermal_slowdown", "sw_thermal_slowdown"):
                share = h.rate(_throttle(reason), now, t.thermal_slowdown_for_s)
                if share is None:  # no throttle counters (old driver): fall back to the point-sampled reason
                    share = (
                        1.0
                        if self._sustained(
                            uuid,
                            reason,
                            bool(v.get(("gpuwarden_clock_event_active", (reason,)))),
                            now,
                            t.thermal_slowdown_for_s,
                        )
                        else 0.0
                    )
                if share > t.thermal_slowdown_ratio:
                    return verdict(WARNING, f"{reason} {share:.0%} of the time", f"<= {t.thermal_slowdown_ratio:.0%}")
            return verdict(OK, "no thermal slowdown", f"<= {t.thermal_slowdown_ratio:.0%}")
        if name == "power":
            brake = h.rate(_throttle("hw_power_brake_slowdown"), now, t.thermal_slowdown_for_s)
            if brake is not None and brake > t.power_brake_ratio:
                return verdict(WARNING, f"power brake {brake:.0%} of the time", f"<= {t.power_brake_ratio:.0%}")
            limit = v.get(("gpuwarden_power_limit_watts", ()))
            default = v.get(("gpuwarden_power_default_limit_watts", ()))
            reduced = limit is not None and default is not None and limit < default
            if self._sustained(uuid, "power_limit", reduced, now, t.power_limit_reduced_for_s):
                return verdict(WARNING, f"limit {limit:.0f} W", f"default {default:.0f} W")
            cap = h.rate(_throttle("sw_power_cap"), now, t.power_cap_for_s)
            if cap is not None and cap > t.power_cap_ratio:
                return verdict(OK, f"power-capped {cap:.0%} of the time", f"<= {t.power_cap_ratio:.0%}", "info")
            draw = v.get(("gpuwarden_power_usage_watts", ()))
            return verdict(OK, f"{draw:.0f} W" if draw is not None else "n/a", "")
        if name == "performance_state":
            pstate = v.get(("gpuwarden_performance_state", ()))
            busy = h.ratio(BUSY, SAMPLED, now, t.pstate_for_s)
            degraded = (
                pstate is not None
                and pstate >= t.pstate_degraded_min
                and busy is not None
                and busy > t.pstate_busy_ratio
                and not pstate_exempt
            )
            # idle GPUs (H100 idles in P0 at 345 MHz) and P-states of idle boards never count: busy must be high
            if self._sustained(uuid, "pstate", degraded, now, t.pstate_for_s):
                return verdict(
                    WARNING, f"P{pstate:.0f} while {busy:.0%} busy", f"P{t.pstate_degraded_min - 1} or better"
                )
            return verdict(OK, f"P{pstate:.0f}" if pstate is not None else "n/a", "")
        if name == "memory_pressure":
            used, total = v.get(("gpuwarden_memory_used_bytes", ())), v.get(("gpuwarden_memory_total_bytes", ()))
            if not used or not total:
                return verdict(OK, "0%" if total else "n/a")
            share = used / total
            if share >= t.memory_critical_ratio:
                return verdict(CRITICAL, f"{share:.1%} used", f"< {t.memory_critical_ratio:.0%}")
            if self._sustained(uuid, "memory", share > t.memory_warning_ratio, now, t.memory_for_s):
                return verdict(WARNING, f"{share:.1%} used", f"<= {t.memory_warning_ratio:.0%}")
            return verdict(OK, f"{share:.1%} used", f"<= {t.memory_warning_ratio:.0%}")
        if name == "utilization":
            busy = h.ratio(BUSY, SAMPLED, now, t.utilization_for_s)
            running = v.get(("gpuwarden_processes", ()), 0) > 0
            if running and busy is not None and busy < t.utilization_low_ratio:
                return verdict(WARNING, f"{busy:.0%} busy with a job running", f">= {t.utilization_low_ratio:.0%}")
            return verdict(OK, "n/a" if busy is None else f"{busy:.0%} busy", "")
        if name == "persistence_mode":
            off = v.get(("gpuwarden_persistence_mode_enabled", ())) == 0
            if self._sustained(uuid, "persistence", off, now, t.persistence_off_for_s):
                return verdict(WARNING, "off", "on")
            return verdict(OK, "off" if off else "on", "on")
        if name == "pcie":
            per_second = h.rate(("gpuwarden_pcie_replay_errors_total", ()), now, t.pcie_replays_for_s)
            if per_second is not None and per_second * 60 > t.pcie_replays_per_minute:
                return verdict(WARNING, f"{per_second * 60:.1f} replays/min", f"<= {t.pcie_replays_per_minute:g}/min")
            return verdict(OK, "", "")
        raise ValueError(f"unknown check {name}")
