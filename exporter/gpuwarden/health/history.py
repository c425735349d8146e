"""Each GPU's counter readings, kept for the longest window the health checks judge, and what a GPU did over one.

A window is only judged once the exporter has watched that long: like Prometheus' `for:`, nothing fires on a
half-seen window.
"""

from __future__ import annotations

from collections import deque

from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.model.families import (
    BUSY_SECONDS_TOTAL,
    GPM_DRAM_ACTIVE_SECONDS_TOTAL,
    GPM_PIPE_ACTIVE_SECONDS_TOTAL,
    GPM_SM_ACTIVE_SECONDS_TOTAL,
    GPM_WINDOW_SECONDS_TOTAL,
    NVLINK_BYTES_TOTAL,
    NVLINK_ERRORS_TOTAL,
    PCIE_BYTES_TOTAL,
    PCIE_REPLAY_ERRORS_TOTAL,
    PROCESSES,
    THROTTLE_SECONDS_TOTAL,
    UTILIZATION_SAMPLED_SECONDS_TOTAL,
)
from gpuwarden.model.snapshot import GpuSnapshot

Values = dict[tuple[str, tuple[str, ...]], float]
THROTTLE_REASONS = ("hw_thermal_slowdown", "sw_thermal_slowdown", "hw_power_brake_slowdown", "sw_power_cap")


def snapshot_values(gpu: GpuSnapshot) -> Values:
    """Each sample's value by (family, labels)."""
    return {(s.name, s.labels): s.value for s in gpu.samples}


# The counters the windowed checks need; everything else is judged on the current snapshot. NVLink error counters
# are kept as one sum per type over the GPU's links, not per link: the history stays a dozen numbers per point.
HISTORY_KEYS = {
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
} | {(THROTTLE_SECONDS_TOTAL.name, (reason,)) for reason in THROTTLE_REASONS}
NVLINK_SUM = "nvlink_errors_sum"


def history_values(values: Values) -> Values:
    """The readings a history keeps: the counters of HISTORY_KEYS, NVLink errors summed per type over the links."""
    kept = {key: value for key, value in values.items() if key in HISTORY_KEYS}
    for (name, labels), value in values.items():
        if name == NVLINK_ERRORS_TOTAL.name:
            key = (NVLINK_SUM, (labels[1],))
            kept[key] = kept.get(key, 0.0) + value
    return kept


class CounterHistory:
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
        self.add_kept(now, history_values(values))

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


def throttle_key(reason: str) -> tuple[str, tuple[str, ...]]:
    return (THROTTLE_SECONDS_TOTAL.name, (reason,))


WINDOW = (GPM_WINDOW_SECONDS_TOTAL.name, ())


def process_running(values: Values) -> bool:
    return values.get((PROCESSES.name, ()), 0) > 0


def window_activity(history: CounterHistory, running: bool, now: float, window: float) -> WindowActivity | None:
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
    throttle = tuple((r, share) for r in THROTTLE_REASONS if (share := history.rate(throttle_key(r), now, window)))
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
