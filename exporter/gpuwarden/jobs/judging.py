"""The collective rules: from one job's GPUs on this node over the window to its findings.

The collective rules: from one job's GPUs on this node over the window to its findings. The decisive evidence is
relational: ranks that wait (spinning in a collective, or computing less than the slowest rank: jobs/waits.py) wait
for a peer that is doing something else, and that peer is the straggler. The step that keeps the state between
snapshots and confirms findings over time is jobs/collective.py.

- some ranks wait and others hold them back: each of those is a **straggler** where there is evidence of it: its GPU
  is measurably slower (a co-located process, a thermal or power throttle, a lowered power limit, lower clocks:
  jobs/causes.py), or its peers wait more than they usually do (an onset, jobs/onset.py). Without either it is an
  **imbalance** built into the job (pipeline stages, a warm-up's skew): information, never a straggler;
- every rank here waits: where the job has ranks on other nodes the straggler is elsewhere (`waiting_elsewhere`,
  after an onset; the fleet view names it);
- a **collective hang** needs positive evidence that nothing progresses: ranks spin, none computes, and every path
  the job's data may take (NVLink, PCIe, the host's RDMA ports) carried nothing over the window (jobs/progress.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuwarden.jobs import causes
from gpuwarden.jobs.progress import Progress
from gpuwarden.jobs.waits import RankWindow
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import CollectiveFinding

ODD_ONE_OUT_BUSY = 0.2  # ranks idle on their GPU within this much busy of the least busy hold the spinners back


@dataclass(frozen=True)
class JobWindow:
    """One job's GPUs on this node, as judged over the window: each rank's reading, whether the job's waits rose
    above its usual ones (None: no usual waits known yet), and the evidence of progress on its paths."""

    job: str
    uuids: tuple[str, ...]  # in the job's order on this node
    ranks: dict[str, RankWindow]  # the GPUs watched for the whole window
    risen: bool | None = None
    progress: Progress = Progress(False, "")
    never_computed: frozenset[str] = frozenset()  # ranks idle in every window in which the job computed

    @property
    def complete(self) -> bool:
        """Every GPU of the job was watched for the window: only then is the job judged."""
        return len(self.ranks) == len(self.uuids)

    @property
    def waiting(self) -> tuple[str, ...]:
        return tuple(u for u in self.uuids if self.ranks[u].waits)

    def waiters(self) -> tuple[tuple[str, float], ...]:
        """The waiting GPUs in the job's order, each with its share of the window spent waiting."""
        return tuple((u, self.ranks[u].wait) for u in self.waiting)

    def holding_back(self) -> list[str]:
        """The ranks the waiters wait for: where ranks wait partially, those that compute at the top of the job
        (the slowest, setting each step); where ranks only spin, the ranks that do not, least busy first (idle on
        their GPU while their process works elsewhere), or that compute while the others spin. Never a rank that
        has not computed while the job did."""
        others = [u for u in self.uuids if not self.ranks[u].waits and u not in self.never_computed]
        if not others or not self.waiting:
            return []
        if any(not self.ranks[u].spins for u in self.waiting):
            top = max(self.ranks[u].math for u in self.uuids)
            return [u for u in others if self.ranks[u].math >= top * 0.9]
        busy = {u: self.ranks[u].activity.busy or 0.0 for u in others}
        least = min(busy.values())
        return [u for u in others if self.ranks[u].computes or busy[u] <= least + ODD_ONE_OUT_BUSY]


Reasons = Callable[[str], list[causes.Reason]]  # a straggler's measured slowness (causes.slower_gpu_reasons)


@dataclass(frozen=True)
class Judgement:
    """What one window says of a job: its stragglers (or imbalances, or the straggler off this node), and a hang
    where nothing progresses (the step reports the hang once that has lasted collective_hang_for_s, the stragglers
    until then)."""

    findings: tuple[CollectiveFinding, ...] = ()
    hang: CollectiveFinding | None = None


def judge(draft: Draft, window: JobWindow, reasons: Reasons) -> Judgement:
    """The job's findings over this window."""
    held = window.holding_back()
    waiting = window.waiting
    if not waiting or len(held) > len(waiting):
        return Judgement()  # nothing waits, or most ranks do not wait: no one to single out
    stopped = window.progress.stopped and not any(window.ranks[u].computes for u in window.uuids)
    if not held:
        return _all_waiting(draft, window, stopped)
    found = tuple(_straggler(draft, window, uuid, reasons) for uuid in held)
    if not stopped:
        return Judgement(found)
    # nothing moves: the job does not progress; the rank it stopped at named (the least busy of those it waits for)
    first = next(f for f in found if f.straggler == min(held, key=lambda u: window.ranks[u].activity.busy or 0.0))
    detail = f"{first.cause_detail}; {window.progress.detail}"
    return Judgement(found, CollectiveFinding(window.job, "collective_hang", first.straggler, first.cause, detail,
                                              window.waiters(), 0.0))  # fmt: skip


def _all_waiting(draft: Draft, window: JobWindow, stopped: bool) -> Judgement:
    member = draft.jobs[window.uuids[0]]
    if stopped:
        stuck = f"every rank spins in a collective and nothing moves ({window.progress.detail})"
        return Judgement(hang=CollectiveFinding(window.job, "collective_hang", None, "unknown", stuck,
                                                window.waiters(), 0.0))  # fmt: skip
    if member.world_size is not None and member.world_size > len(window.uuids) and window.risen:
        elsewhere = (
            f"every rank on this node waits ({len(window.uuids)} of {member.world_size}), more than usual: the "
            "straggler is off it"
        )
        found = CollectiveFinding(window.job, "waiting_elsewhere", None, "off_node", elsewhere, window.waiters(), 0.0)
        return Judgement((found,))
    return Judgement()


def _straggler(draft: Draft, window: JobWindow, uuid: str, reasons: Reasons) -> CollectiveFinding:
    """The rank named with its cause where there is evidence of it; an imbalance where there is none."""
    rank = window.ranks[uuid]
    waiters = window.waiters()
    activity = {u: r.activity for u, r in window.ranks.items()}
    numbers = causes.gpu_numbers(rank.activity, (activity[u] for u, _ in waiters))
    if rank.computes:
        found = reasons(uuid)
        seen = "; ".join(r.text for r in found) or "no clock, power or co-located process seen"
        cause, detail, measured = "slower_gpu", f"{numbers}; {seen}", any(r.alone for r in found)
    else:
        cause, host = causes.host_cause(draft.host_evidence.get(uuid))
        detail, measured = f"{numbers}; on the host: {host}", False
    kind = "straggler" if measured or window.risen else "imbalance"
    if kind == "imbalance":
        detail += "; the others waited as much since the job began: an imbalance built into it, not a straggler"
    return CollectiveFinding(window.job, kind, uuid, cause, detail, waiters, 0.0)
