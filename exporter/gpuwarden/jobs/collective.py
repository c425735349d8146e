"""The job step, after host evidence: a multi-GPU job judged as one, snapshot after snapshot. Nothing is hooked into
the job.

Per job with GPUs on this node (jobs/grouping.py), over `collective_window_s`:
- a GPU *waits* when its signature is a collective's spin (health/checks.py `collective_wait`);
- the rules (jobs/judging.py) name a straggler, a hang or a straggler off this node;
- a finding is reported once it has held for `collective_straggler_for_s` with the same straggler; a hang once the
  links have been quiet for `collective_hang_for_s` (a rank that stops, a deadlock in its host code, is named a
  straggler first, and the finding becomes a hang, still naming it, once the links have been quiet that long).
The seconds each GPU spent waiting are a counter (gpuwarden_job_collective_wait_seconds_total), so the fleet can
compare a job's nodes through Prometheus. What the step remembers between snapshots is one `GpuWatch` per GPU of a
multi-GPU job and one `JobWatch` per job.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from gpuwarden.health.checks import HealthEvaluator, WindowActivity, collective_wait
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.jobs import judging
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import CollectiveFinding

MAX_CREDIT_S = 30.0  # a longer gap between two snapshots (a stall, a restart) is not credited as waiting


@dataclass(frozen=True)
class WaitPoint:
    at: float
    waited: float  # the GPU's wait counter at that time


@dataclass
class GpuWatch:
    """One GPU of a multi-GPU job: its wait counter for that job, the counter's points over the window (the share of
    the window it waited), and the processes outside the job seen computing on it."""

    job: str
    waited: float = 0.0  # seconds spent spinning in a collective for this job
    points: deque[WaitPoint] = field(default_factory=deque)
    cotenants: dict[int, float] = field(default_factory=dict)  # PID outside the job → last seen computing on it

    def wait_share(self, now: float) -> float:
        """The share of the window spent waiting, from the counter (the points are the earlier snapshots')."""
        first = self.points[0] if self.points else None
        if first is None or now <= first.at:
            return 0.0
        return round(min(max((self.waited - first.waited) / (now - first.at), 0.0), 1.0), 3)

    def record(self, now: float, window: float) -> None:
        self.points.append(WaitPoint(now, self.waited))
        while len(self.points) > 1 and self.points[1].at <= now - window:
            self.points.popleft()

    def forget_cotenants(self, before: float) -> None:
        self.cotenants = {pid: at for pid, at in self.cotenants.items() if at >= before}


@dataclass
class Onset:
    """Since when a job's GPUs have disagreed naming the same straggler (None: none named), and since when its links
    have been quiet (None: not quiet)."""

    straggler: str | None
    since: float
    quiet_since: float | None = None


@dataclass
class JobWatch:
    """One job with GPUs on this node: when its GPUs were first seen together (a GPU's window may still hold the job
    before this one, killed and restarted on the same GPUs: the job is judged once the whole window lies in its own
    life), and the onset of its current finding."""

    first_seen: float
    onset: Onset | None = None


def multi_gpu_jobs(draft: Draft) -> dict[str, tuple[str, ...]]:
    """Job → its GPUs on this node, for jobs with peers."""
    jobs: dict[str, list[str]] = defaultdict(list)
    for uuid, member in draft.jobs.items():
        if member.peers:
            jobs[member.job].append(uuid)
    return {job: tuple(uuids) for job, uuids in jobs.items()}


class CollectiveStep:
    """Fills draft.collective and draft.collective_wait_seconds."""

    def __init__(self, evaluator: Callable[[], HealthEvaluator]) -> None:
        self._evaluator = evaluator  # read per snapshot: a reload swaps the evaluator (and its thresholds)
        self._gpus: dict[str, GpuWatch] = {}
        self._jobs: dict[str, JobWatch] = {}
        self._last_at: float | None = None
        # GPUs that others of their job wait for, as of the last snapshot: host evidence samples these
        self.suspects: set[str] = set()

    def __call__(self, draft: Draft) -> None:
        evaluator = self._evaluator()
        limits, now = evaluator.thresholds, draft.taken_at
        elapsed = 0.0 if self._last_at is None else min(max(now - self._last_at, 0.0), MAX_CREDIT_S)
        self._last_at = now
        jobs = multi_gpu_jobs(draft)
        self._gpus = {uuid: self._gpu(uuid, job) for job, uuids in jobs.items() for uuid in uuids}
        self._jobs = {job: self._jobs.get(job) or JobWatch(now) for job in jobs}
        findings: list[CollectiveFinding] = []
        self.suspects = set()
        for job, uuids in sorted(jobs.items()):
            window = self._window(evaluator, job, uuids, now)
            for uuid in window.waiting if window is not None else ():
                self._gpus[uuid].waited += elapsed
            finding = self._finding(draft, limits, window, now) if window is not None and window.complete else None
            if finding is None:
                self._jobs[job].onset = None
                continue
            self.suspects |= set(window.others)  # type: ignore[union-attr]
            confirmed = self._confirm(self._jobs[job], finding, limits, now)
            if confirmed is not None:
                findings.append(confirmed)
        for watch in self._gpus.values():
            watch.forget_cotenants(now - limits.collective_window_s)
            watch.record(now, limits.collective_window_s)
        draft.collective_wait_seconds = {uuid: watch.waited for uuid, watch in self._gpus.items()}
        draft.collective = tuple(findings)

    def _gpu(self, uuid: str, job: str) -> GpuWatch:
        """The GPU's watch for this job; a GPU that moved to another job starts afresh."""
        known = self._gpus.get(uuid)
        return known if known is not None and known.job == job else GpuWatch(job)

    def _window(
        self, evaluator: HealthEvaluator, job: str, uuids: tuple[str, ...], now: float
    ) -> judging.JobWindow | None:
        """The job's GPUs over the window, once the whole window lies in the job's life."""
        limits = evaluator.thresholds
        if now - self._jobs[job].first_seen < limits.collective_window_s:
            return None
        activity = {uuid: evaluator.collective_activity(uuid, now) for uuid in uuids}
        watched: dict[str, WindowActivity] = {u: a for u, a in activity.items() if a is not None}
        return judging.JobWindow(
            job, uuids, watched, frozenset(u for u, a in watched.items() if collective_wait(limits, a))
        )

    def _finding(
        self, draft: Draft, limits: Thresholds, window: judging.JobWindow, now: float
    ) -> CollectiveFinding | None:
        if window.waiting:
            return judging.judge(draft, limits, window)
        for uuid, pids in judging.cotenants(draft, window.uuids).items():
            self._gpus[uuid].cotenants.update(dict.fromkeys(pids, now))
        shared = {u for u in window.uuids if self._gpus[u].cotenants}
        return judging.shared(draft, limits, window, shared)

    def _confirm(
        self, watch: JobWatch, finding: CollectiveFinding, limits: Thresholds, now: float
    ) -> CollectiveFinding | None:
        """The finding once it has held for collective_straggler_for_s naming the same straggler; a hang once the
        links have been quiet for collective_hang_for_s (named a straggler until then, or not at all without one)."""
        onset = watch.onset
        if onset is None or onset.straggler != finding.straggler:
            onset = watch.onset = Onset(finding.straggler, now)
        since = onset.since
        if finding.kind != "collective_hang":
            onset.quiet_since = None
        else:
            onset.quiet_since = now if onset.quiet_since is None else onset.quiet_since
            if now - onset.quiet_since >= limits.collective_hang_for_s:
                since = onset.quiet_since
            elif finding.straggler is None:
                return None
            else:
                finding = replace(finding, kind="straggler")
        if now - since < limits.collective_straggler_for_s:
            return None
        # the waiting counter's share; the sharing estimate (judging.shared) where larger: a partial wait
        shares = tuple((u, max(self._gpus[u].wait_share(now), e)) for u, e in finding.waiting)
        return replace(finding, since=since, waiting=shares)
