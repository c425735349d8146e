"""The job stage, after host evidence: a multi-GPU job judged as one. The decisive evidence is relational: ranks
spinning in a collective wait for a peer that is doing something else, and that peer is the straggler. Launch-bound
work is symmetric across ranks; a collective wait is not. Nothing is hooked into the job.

Per job with GPUs on this node (attribution/jobs.py), over `collective_window_s`:
- a GPU *waits* when its signature is a collective's spin (health/checks.py `collective_wait`);
- some wait and one does not, for `collective_straggler_for_s`: that one is the **straggler**, with its cause:
  a slower GPU where it computes (its clocks, throttling or power cap, another process on it), else what its main
  process does on the host (CPU-bound main thread, input-bound loader workers, I/O), else unknown;
- none waits outright, but one rank's GPU is shared with a process outside the job that computes on it (time
  slicing: the rank's kernels queue behind the other's), while the others are busy with less SM work than it: that
  rank is the straggler, cause a slower GPU. On 2x H200 a co-located bf16 matmul took the waiter only to busy 77 %,
  SM 43 % (half its time waiting, half computing): the spin signature alone missed it;
- all of the job's GPUs here wait: where the job has ranks on other nodes (its world size says so) the straggler is
  elsewhere (the fleet view names it); where it has none, and the links have carried nothing for
  `collective_hang_for_s`, it is a **collective hang**. A rank that stops (a deadlock in its host code) is named a
  straggler first, and the finding becomes a hang, still naming it, once the links have been quiet that long.
The seconds each GPU spent waiting are a counter (gpuwarden_job_collective_wait_seconds_total), so the fleet can
compare a job's nodes through Prometheus.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import replace

from gpuwarden.health.checks import HealthEvaluator, WindowActivity, collective_wait
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.model.draft import Draft
from gpuwarden.model.families import CLOCK_HERTZ
from gpuwarden.model.snapshot import CollectiveFinding, HostEvidence, JobMember, ProcessView

MAX_CREDIT_S = 30.0  # a longer gap between two snapshots (a stall, a restart) is not credited as waiting
HANG_LINK_BYTES_PER_SECOND = 1e7  # links this quiet carry no collective's data: nothing moves
# what a straggler's main process did (HostEvidence.dominant) → the straggler's cause; asleep is no cause of its own
HOST_CAUSES = {"checkpoint": "io", "io_wait": "io", "workers_running": "input", "main_running": "cpu"}
SLOWER_GPU_CHECKS = ("thermal_throttling", "power", "performance_state", "temperature")
SHARING_SM_RATIO = 0.05  # a process outside the job using this share of a rank's GPU's SMs computes on it


def _same_owner(process: ProcessView, main: ProcessView | None) -> bool:
    """Whether a process belongs where the rank's main process does (its pod, or its Slurm job): the job's own
    helpers (an asynchronous checkpoint writer, a compile worker) are not another tenant on the GPU."""
    if main is None or not (main.pod or main.slurm_job):
        return False
    return (process.namespace, process.pod, process.slurm_job) == (main.namespace, main.pod, main.slurm_job)


def _sm(ratio: float | None) -> str:
    return "" if ratio is None else f", SM {ratio:.0%}"


def _host_cause(evidence: HostEvidence | None) -> tuple[str, str]:
    if evidence is None or not evidence.sampled:
        return "unknown", "no host evidence (the host's /proc is not mounted, or not yet sampled)"
    return HOST_CAUSES.get(evidence.dominant() or "", "unknown"), evidence.describe()


class CollectiveStep:
    """Fills draft.collective and draft.collective_wait_seconds."""

    def __init__(self, evaluator: Callable[[], HealthEvaluator]) -> None:
        self._evaluator = evaluator  # read per snapshot: a reload swaps the evaluator (and its thresholds)
        self._wait_total: dict[tuple[str, str], float] = {}  # (uuid, job) → seconds waiting
        self._waits: dict[str, deque[tuple[float, float]]] = {}  # uuid → (time, total) over the window
        self._last_at: float | None = None
        self._since: dict[tuple[str, str, str | None], float] = {}  # (job, kind, straggler) → first seen
        self._job_seen: dict[str, float] = {}  # job → when its GPUs were first seen together
        self._computing: dict[tuple[str, int], float] = {}  # (uuid, pid outside its job) → last seen computing
        # GPUs that others of their job wait for, as of the last snapshot: host evidence samples these
        self.suspects: set[str] = set()

    def __call__(self, draft: Draft) -> None:
        evaluator = self._evaluator()
        limits, now = evaluator.thresholds, draft.taken_at
        elapsed = 0.0 if self._last_at is None else min(max(now - self._last_at, 0.0), MAX_CREDIT_S)
        self._last_at = now
        jobs: dict[str, list[str]] = defaultdict(list)
        for uuid, member in draft.jobs.items():
            if member.peers:
                jobs[member.job].append(uuid)
        findings: list[CollectiveFinding] = []
        suspects: set[str] = set()
        seen: set[tuple[str, str, str | None]] = set()
        totals: dict[tuple[str, str], float] = {}
        self._job_seen = {job: self._job_seen.get(job, now) for job in jobs}
        for job, uuids in sorted(jobs.items()):
            # a GPU's window may still hold the job before this one (killed and restarted on the same GPUs): the job
            # is judged once the whole window lies in its own life
            watched = now - self._job_seen[job] >= limits.collective_window_s
            activity = {uuid: evaluator.collective_activity(uuid, now) if watched else None for uuid in uuids}
            waiting = {u for u, a in activity.items() if a is not None and collective_wait(limits, a)}
            for uuid in uuids:
                key = (uuid, job)
                totals[key] = self._wait_total.get(key, 0.0) + (elapsed if uuid in waiting else 0.0)
            if any(a is None for a in activity.values()):
                continue
            if waiting:
                finding = self._judge(draft, limits, job, uuids, waiting, activity)  # type: ignore[arg-type]
            else:
                finding = self._shared(draft, limits, job, uuids, activity, now)  # type: ignore[arg-type]
            if finding is None:
                continue
            suspects |= set(uuids) - waiting
            # a hung rank is a straggler first; once the links have been quiet for collective_hang_for_s, a hang
            quiet = finding.kind == "collective_hang"
            disagree = (job, "disagree", finding.straggler)
            seen.add(disagree)
            since = self._since.setdefault(disagree, now)
            if quiet:
                seen.add((job, "quiet", finding.straggler))
                quiet_since = self._since.setdefault((job, "quiet", finding.straggler), now)
                if now - quiet_since < limits.collective_hang_for_s:
                    if finding.straggler is None:
                        continue
                    finding = replace(finding, kind="straggler")
                else:
                    since = quiet_since
            if now - since >= limits.collective_straggler_for_s:
                # the waiting counter's share; the sharing estimate (_shared) where larger: a partial wait
                counted = self._shares(finding.waiting, job, totals, now, limits.collective_window_s)
                shares = tuple((u, max(c, e)) for (u, c), (_, e) in zip(counted, finding.waiting, strict=True))
                findings.append(replace(finding, since=since, waiting=shares))
        self._since = {k: v for k, v in self._since.items() if k in seen}
        window = limits.collective_window_s
        self._computing = {k: t for k, t in self._computing.items() if now - t <= window}
        self.suspects = suspects
        self._wait_total = totals
        self._record(totals, now, limits.collective_window_s)
        draft.collective_wait_seconds = {uuid: total for (uuid, _), total in totals.items()}
        draft.collective = tuple(findings)

    def _record(self, totals: dict[tuple[str, str], float], now: float, window: float) -> None:
        for (uuid, _), total in totals.items():
            points = self._waits.setdefault(uuid, deque())
            points.append((now, total))
            while len(points) > 1 and points[1][0] <= now - window:
                points.popleft()
        for uuid in [u for u in self._waits if u not in {u for u, _ in totals}]:
            del self._waits[uuid]

    def _shares(
        self, waiters: tuple[tuple[str, float], ...], job: str, totals: dict[tuple[str, str], float], now: float,
        window: float,
    ) -> tuple[tuple[str, float], ...]:  # fmt: skip
        """Each waiter's share of the window spent waiting, from its counter."""
        out = []
        for uuid, _ in waiters:
            points = self._waits.get(uuid)
            total = totals.get((uuid, job), 0.0)
            share = (total - points[0][1]) / (now - points[0][0]) if points and now > points[0][0] else 0.0
            out.append((uuid, round(min(max(share, 0.0), 1.0), 3)))
        return tuple(out)

    def _judge(
        self,
        draft: Draft,
        limits: Thresholds,
        job: str,
        uuids: list[str],
        waiting: set[str],
        activity: dict[str, WindowActivity],
    ) -> CollectiveFinding | None:
        member: JobMember = draft.jobs[uuids[0]]
        others = [u for u in uuids if u not in waiting]
        waiters = tuple((u, 0.0) for u in sorted(waiting, key=lambda u: uuids.index(u)))
        quiet = all(activity[u].nvlink_bytes_per_second < HANG_LINK_BYTES_PER_SECOND for u in waiting)
        if not others:
            if member.world_size is not None and member.world_size > len(uuids):
                elsewhere = (
                    f"every rank on this node waits ({len(uuids)} of {member.world_size}): the straggler is off it"
                )
                return CollectiveFinding(job, "waiting_elsewhere", None, "off_node", elsewhere, waiters, 0.0)
            if quiet:
                stuck = "every rank spins in a collective and the links carry nothing"
                return CollectiveFinding(job, "collective_hang", None, "unknown", stuck, waiters, 0.0)
            return None
        if len(others) > len(waiting):
            return None  # most ranks are not waiting: no one to single out
        # the odd one out: the GPU furthest from a waiter's spin (least busy relative to the waiters), one named
        straggler = min(others, key=lambda u: activity[u].busy or 0.0) if len(others) > 1 else others[0]
        cause, detail = self._cause(draft, limits, straggler, waiting, activity)
        # nothing moves over the links while the odd one out does not compute: the job does not progress
        kind = "collective_hang" if quiet and cause != "slower_gpu" else "straggler"
        return CollectiveFinding(job, kind, straggler, cause, detail, waiters, 0.0)

    def _shared(
        self, draft: Draft, limits: Thresholds, job: str, uuids: list[str], activity: dict[str, WindowActivity],
        now: float,
    ) -> CollectiveFinding | None:  # fmt: skip
        """The one GPU of the job that a process outside it has computed on within the window, where the others are
        busy (waiting or computing: `collective_busy_ratio`) with fewer SMs active than it."""
        ours = {draft.jobs[u].pid for u in uuids}
        for uuid in uuids:
            on_gpu = draft.processes.get(uuid, ())
            main = next((p for p in on_gpu if p.pid == draft.jobs[uuid].pid), None)
            for process in on_gpu:
                if (
                    process.pid not in ours
                    and not _same_owner(process, main)
                    and "compute" in process.kind
                    and (process.sm_ratio or 0) >= SHARING_SM_RATIO
                ):
                    self._computing[(uuid, process.pid)] = now
        shared = {u for u, _ in self._computing if u in uuids}
        if len(shared) != 1:
            return None
        (straggler,) = shared
        peers = [u for u in uuids if u != straggler]
        mine = activity[straggler]
        if not all(
            (activity[u].busy or 0.0) >= limits.collective_busy_ratio and activity[u].sm < mine.sm for u in peers
        ):
            return None
        _, detail = self._cause(draft, limits, straggler, set(peers), activity)
        # ranks in lockstep wait while the shared GPU runs the other process: its share of the GPU's SM time
        sm = {p.pid: p.sm_ratio or 0.0 for p in draft.processes.get(straggler, ())}
        foreign = sum(v for pid, v in sm.items() if pid not in ours)
        total = foreign + sm.get(draft.jobs[straggler].pid, 0.0)
        estimate = round(foreign / total, 3) if total > 0 else 0.0
        waiters = tuple((u, estimate) for u in peers)
        return CollectiveFinding(job, "straggler", straggler, "slower_gpu", detail, waiters, 0.0)

    @staticmethod
    def _cause(
        draft: Draft, limits: Thresholds, straggler: str, waiting: set[str], activity: dict[str, WindowActivity]
    ) -> tuple[str, str]:
        mine = activity[straggler]
        busy = mine.busy or 0.0
        computing = busy >= limits.collective_busy_ratio / 2 and (
            max(mine.tensor, mine.fp32, mine.fp16) >= limits.collective_math_ratio
            or mine.sm > limits.collective_sm_ratio
        )
        gpu_numbers = (
            f"driver busy {busy:.0%}, SM {mine.sm:.0%}, tensor {mine.tensor:.0%}, FP32 {mine.fp32:.0%} "
            f"(the waiters: busy {_median(activity[u].busy or 0.0 for u in waiting):.0%}, SM "
            f"{_median(activity[u].sm for u in waiting):.0%})"
        )
        if not computing:
            cause, host = _host_cause(draft.host_evidence.get(straggler))
            return cause, f"{gpu_numbers}; on the host: {host}"
        reasons = []
        clocks = {gpu.uuid: _clock(gpu) for gpu in draft.gpus if gpu.uuid in waiting | {straggler}}
        peers = [c for u, c in clocks.items() if u != straggler and c]
        if clocks.get(straggler) and peers and clocks[straggler] < 0.95 * _median(peers):
            reasons.append(f"SM clock {clocks[straggler] / 1e6:.0f} MHz against {_median(peers) / 1e6:.0f} MHz")
        for verdict in draft.health.get(straggler, ()):
            if verdict.check in SLOWER_GPU_CHECKS and verdict.level > 0:
                reasons.append(f"{verdict.check}: {verdict.observed}")
        job = draft.jobs[straggler]
        others = [p for p in draft.processes.get(straggler, ()) if p.pid != job.pid and p.kind == "compute"]
        if others:
            reasons.append(
                "another process computes on it: "
                + ", ".join(f"pid {p.pid} ({p.name or 'unknown'}{_sm(p.sm_ratio)})" for p in others[:3])
            )
        detail = gpu_numbers + (
            "; " + "; ".join(reasons) if reasons else "; no clock, power or co-located process seen"
        )
        return "slower_gpu", detail


def _clock(gpu) -> float | None:  # noqa: ANN001
    for sample in gpu.samples:
        if sample.name == CLOCK_HERTZ.name and sample.labels == ("sm",):
            return sample.value
    return None


def _median(values) -> float:  # noqa: ANN001
    """The middle value (mean of the two middle ones): `statistics` costs 0.6 MiB in a process that scrapes."""
    ordered = sorted(values)
    if not ordered:
        return 0.0
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2
