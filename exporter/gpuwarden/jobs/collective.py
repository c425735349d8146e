"""The job step, after host evidence: a multi-GPU job judged as one, snapshot after snapshot.

The job step, after host evidence: a multi-GPU job judged as one, snapshot after snapshot. Nothing is hooked into
the job.

Per job with GPUs on this node (jobs/grouping.py), over `collective_window_s`:
- each rank's wait over the window (jobs/waits.py): a collective's spin, or a partial wait against the slowest rank;
- the rules (jobs/judging.py) name stragglers, an imbalance, a hang or a straggler off this node, with the job's
  usual waits (jobs/onset.py) and the evidence of progress on its paths (jobs/progress.py, jobs/rdma.py);
- a job's findings are reported once its ranks have disagreed for `collective_straggler_for_s`; who is named follows
  the window from then on (a straggler that moves to another rank is followed without a new wait); a hang once
  nothing has moved for `collective_hang_for_s` (a rank that stops is named a straggler until then).
The seconds each GPU spent waiting are a counter (gpuwarden_job_collective_wait_seconds_total: a spin counts whole,
a partial wait its share), so the fleet can compare a job's nodes through Prometheus. What the step remembers
between snapshots is one `GpuWatch` per GPU of a multi-GPU job and one `JobWatch` per job.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.health.evaluator import HealthEvaluator
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.jobs import causes, judging, progress, waits
from gpuwarden.jobs.onset import UsualWaits
from gpuwarden.jobs.rdma import RdmaCounters
from gpuwarden.jobs.sharing import Sharing
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import CollectiveFinding

MAX_CREDIT_S = 30.0  # a longer gap between two snapshots (a stall, a restart) is not credited as waiting


@dataclass(frozen=True)
class WaitPoint:
    at: float
    waited: float  # the GPU's wait counter at that time


@dataclass
class GpuWatch:
    """One GPU of a multi-GPU job: its wait counter for that job and the counter's points over the window (the share
    of the window it waited)."""

    job: str
    waited: float = 0.0  # seconds spent waiting for a peer of this job
    points: deque[WaitPoint] = field(default_factory=deque)

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


@dataclass
class JobWatch:
    """One job with GPUs on this node: when its GPUs were first seen together (a GPU's window may still hold the job
    before this one, killed and restarted on the same GPUs: the job is judged once the whole window lies in its own
    life), since when its ranks have disagreed and nothing has moved (None: they do not, it does), and its usual
    waits."""

    first_seen: float
    since: float | None = None
    quiet_since: float | None = None
    usual: UsualWaits = field(default_factory=UsualWaits)


# causes measured on the named rank's own main process that corroborate its peers' waits: its CPU or its input
# workers. Not I/O: rank 0 writing a checkpoint while the others wait is a job's rhythm, and shorter than 10 s
CORROBORATED = frozenset({"cpu", "input"})


def confirmation_s(limits: Thresholds, found: list[CollectiveFinding]) -> int:
    """How long a job's ranks must disagree before its findings are reported: shorter where every straggler's cause
    is its own main process measured on the host (CORROBORATED), a second source beside its peers' waits."""
    corroborated = found and all(f.kind == "straggler" and f.cause in CORROBORATED for f in found)
    return limits.collective_straggler_corroborated_for_s if corroborated else limits.collective_straggler_for_s


def multi_gpu_jobs(draft: Draft) -> dict[str, tuple[str, ...]]:
    """Job → its GPUs on this node, for jobs with peers."""
    jobs: dict[str, list[str]] = defaultdict(list)
    for uuid, member in draft.jobs.items():
        if member.peers:
            jobs[member.job].append(uuid)
    return {job: tuple(uuids) for job, uuids in jobs.items()}


class CollectiveStep:
    """Fills draft.collective and draft.collective_wait_seconds. `sys_root`: the host's /sys, for its RDMA ports."""

    def __init__(self, evaluator: Callable[[], HealthEvaluator], sys_root: Path | None = None) -> None:
        self._evaluator = evaluator  # read per snapshot: a reload swaps the evaluator (and its thresholds)
        self._gpus: dict[str, GpuWatch] = {}
        self._jobs: dict[str, JobWatch] = {}
        self._last_at: float | None = None
        self._rdma = RdmaCounters(sys_root)
        self._sharing = Sharing()
        # GPUs that others of their job wait for, as of the last snapshot: host evidence samples these
        self.suspects: set[str] = set()

    def read_rdma_under(self, sys_root: Path | None) -> None:
        """A reload changed the host's /sys: its RDMA ports are read there from now on."""
        self._rdma = RdmaCounters(sys_root)

    def __call__(self, draft: Draft) -> None:
        evaluator = self._evaluator()
        limits, now = evaluator.thresholds, draft.taken_at
        elapsed = 0.0 if self._last_at is None else min(max(now - self._last_at, 0.0), MAX_CREDIT_S)
        self._last_at = now
        self._rdma.sample(now, limits.collective_window_s * 1.5)
        draft.cotenants = self._sharing.update(draft, limits.collective_window_s)
        jobs = multi_gpu_jobs(draft)
        self._gpus = {uuid: self._gpu(uuid, job) for job, uuids in jobs.items() for uuid in uuids}
        self._jobs = {job: self._jobs.get(job) or JobWatch(now) for job in jobs}
        findings: list[CollectiveFinding] = []
        self.suspects = set()
        for job, uuids in sorted(jobs.items()):
            window = self._window(draft, evaluator, job, uuids, now)
            if window is None:
                continue
            for uuid, rank in window.ranks.items():
                self._gpus[uuid].waited += elapsed * rank.wait
            judged = self._judge(draft, limits, window, now)
            stepped = waits.steps(window.ranks)
            computing = {u for u, r in window.ranks.items() if r.computes}
            self._jobs[job].usual.add(now, {u: r.wait for u, r in window.ranks.items()}, stepped, elapsed,
                                      limits.collective_baseline_s, computing)  # fmt: skip
            findings += self._confirm(self._jobs[job], judged, limits, now)
        for watch in self._gpus.values():
            watch.record(now, limits.collective_window_s)
        draft.collective_wait_seconds = {uuid: watch.waited for uuid, watch in self._gpus.items()}
        draft.collective = tuple(findings)

    def _gpu(self, uuid: str, job: str) -> GpuWatch:
        """The GPU's watch for this job; a GPU that moved to another job starts afresh."""
        known = self._gpus.get(uuid)
        return known if known is not None and known.job == job else GpuWatch(job)

    def _window(
        self, draft: Draft, evaluator: HealthEvaluator, job: str, uuids: tuple[str, ...], now: float
    ) -> judging.JobWindow | None:
        """The job's GPUs over the window, once the whole window lies in the job's life and every GPU of it was
        watched that long."""
        limits = evaluator.thresholds
        if now - self._jobs[job].first_seen < limits.collective_window_s:
            return None
        activity = {uuid: evaluator.collective_activity(uuid, now) for uuid in uuids}
        watched: dict[str, WindowActivity] = {u: a for u, a in activity.items() if a is not None}
        if len(watched) != len(uuids):
            return None
        ranks = waits.read(limits, watched, self._own_shares(draft, uuids))
        waiters = {u: r.wait for u, r in ranks.items() if r.waits}
        usual = self._jobs[job].usual
        risen = usual.onset(waiters, 0.0, limits.collective_partial_wait_ratio) if waiters else None
        member = draft.jobs[uuids[0]]
        across = member.world_size is not None and member.world_size > len(uuids)
        linked = ((watched[u], any(p.level.startswith("NV") for p in draft.topology.get(u, ()))) for u in uuids)
        evidence = progress.evidence(limits, linked, self._rdma.rate(now, limits.collective_window_s), across)
        idle = frozenset(u for u in uuids if usual.never_computed(u))
        return judging.JobWindow(job, uuids, ranks, risen, evidence, idle)

    def _own_shares(self, draft: Draft, uuids: tuple[str, ...]) -> dict[str, float]:
        """Each rank's share of its GPU's SM time where a process outside the job computed on it within the window
        (NVML's per-process SM shares; 1 where none did, or where the rank's own share is unknown)."""
        shares = {}
        for uuid in uuids:
            theirs = sum(c.sm_ratio for c in draft.cotenants.get(uuid, ()))
            main = next((p for p in draft.processes.get(uuid, ()) if p.pid == draft.jobs[uuid].pid), None)
            mine = None if main is None else main.sm_ratio
            shares[uuid] = mine / (mine + theirs) if mine is not None and theirs > 0 and mine + theirs > 0 else 1.0
        return shares

    def _judge(self, draft: Draft, limits: Thresholds, window: judging.JobWindow, now: float) -> judging.Judgement:
        activity = {u: r.activity for u, r in window.ranks.items()}

        def reasons(uuid: str) -> list[causes.Reason]:
            peers = [u for u in window.uuids if u != uuid]
            return causes.slower_gpu_reasons(draft, limits, uuid, peers, activity, draft.cotenants.get(uuid, ()))

        judged = judging.judge(draft, window, reasons)
        self.suspects |= {f.straggler for f in judged.findings if f.straggler}
        return judged

    def _confirm(
        self, watch: JobWatch, judged: judging.Judgement, limits: Thresholds, now: float
    ) -> list[CollectiveFinding]:
        """The findings once the job's ranks have disagreed for collective_straggler_for_s; a hang once nothing has
        moved for collective_hang_for_s (its stragglers reported until then)."""
        if not judged.findings and judged.hang is None:
            watch.since = watch.quiet_since = None
            return []
        watch.since = now if watch.since is None else watch.since
        found, since = list(judged.findings), watch.since
        if judged.hang is None:
            watch.quiet_since = None
        else:
            watch.quiet_since = now if watch.quiet_since is None else watch.quiet_since
            if now - watch.quiet_since >= limits.collective_hang_for_s:
                found, since = [judged.hang], watch.quiet_since
        if now - watch.since < confirmation_s(limits, found):
            return []
        # each waiter's share of the window spent waiting, from its counter
        return [
            replace(f, since=since, waiting=tuple((u, self._gpus[u].wait_share(now)) for u, _ in f.waiting))
            for f in found
        ]
