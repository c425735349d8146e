"""What one health check sees of one GPU, and the verdict levels it answers with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from gpuwarden.health.history import CounterHistory, Values
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.model.snapshot import Verdict

OK, WARNING, CRITICAL = 0, 1, 2


class ConditionMemory(Protocol):
    """The evaluator's memory of sustained conditions (health/evaluator.py HealthEvaluator), as a check reads it."""

    links_seen_up: dict[str, set[str]]

    def sustained(self, uuid: str, key: str, condition: bool, now: float, duration: float) -> bool: ...

    def held_for(self, uuid: str, key: str, now: float) -> float: ...


@dataclass
class CheckContext:
    """What one check sees of one GPU: its current values, its history, the node's XIDs and the evaluator's
    memory of sustained conditions."""

    name: str
    uuid: str
    values: Values
    history: CounterHistory
    xid: dict[tuple[str, int], tuple[int, float]]
    now: float
    pstate_exempt: bool
    thresholds: Thresholds
    evaluator: ConditionMemory
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
