"""The collective rules: from one job's GPUs on this node over the window to a finding (or none). The decisive
evidence is relational: ranks spinning in a collective wait for a peer that is doing something else, and that peer is
the straggler. Launch-bound work is symmetric across ranks; a collective wait is not. The step that keeps the state
between snapshots and confirms a finding over time is jobs/collective.py.

- some GPUs wait and one does not: that one is the **straggler**, with its cause (jobs/causes.py);
- none waits outright, but one rank's GPU is shared with a process outside the job that computes on it (time
  slicing: the rank's kernels queue behind the other's), while the others are busy with less SM work than it: that
  rank is the straggler, cause a slower GPU. On 2x H200 a co-located bf16 matmul took the waiter only to busy 77 %,
  SM 43 % (half its time waiting, half computing): the spin signature alone missed it;
- all of the job's GPUs here wait: where the job has ranks on other nodes (its world size says so) the straggler is
  elsewhere (the fleet view names it); where it has none, and the links carry nothing, it is a **collective hang**.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.health.checks import WindowActivity
from gpuwarden.health.thresholds import Thresholds
from gpuwarden.jobs import causes
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import CollectiveFinding, ProcessView

HANG_LINK_BYTES_PER_SECOND = 1e7  # links this quiet carry no collective's data: nothing moves
SHARING_SM_RATIO = 0.05  # a process outside the job using this share of a rank's GPU's SMs computes on it


@dataclass(frozen=True)
class JobWindow:
    """One job's GPUs on this node, as judged over the window: each GPU's activity, and which of them wait."""

    job: str
    uuids: tuple[str, ...]  # in the job's order on this node
    activity: dict[str, WindowActivity]  # the GPUs watched for the whole window
    waiting: frozenset[str]

    @property
    def complete(self) -> bool:
        """Every GPU of the job was watched for the window: only then is the job judged."""
        return len(self.activity) == len(self.uuids)

    @property
    def others(self) -> list[str]:
        """The GPUs that do not wait."""
        return [u for u in self.uuids if u not in self.waiting]

    def waiters(self, share: float = 0.0) -> tuple[tuple[str, float], ...]:
        """The waiting GPUs in the job's order, each with a share of the window spent waiting."""
        return tuple((u, share) for u in self.uuids if u in self.waiting)


def judge(draft: Draft, limits: Thresholds, window: JobWindow) -> CollectiveFinding | None:
    """Some of the job's GPUs wait: the odd one out, or a hang, or a straggler off this node."""
    member = draft.jobs[window.uuids[0]]
    others = window.others
    quiet = all(window.activity[u].nvlink_bytes_per_second < HANG_LINK_BYTES_PER_SECOND for u in window.waiting)
    if not others:
        if member.world_size is not None and member.world_size > len(window.uuids):
            elsewhere = (
                f"every rank on this node waits ({len(window.uuids)} of {member.world_size}): the straggler is off it"
            )
            return CollectiveFinding(
                window.job, "waiting_elsewhere", None, "off_node", elsewhere, window.waiters(), 0.0
            )
        if quiet:
            stuck = "every rank spins in a collective and the links carry nothing"
            return CollectiveFinding(window.job, "collective_hang", None, "unknown", stuck, window.waiters(), 0.0)
        return None
    if len(others) > len(window.waiting):
        return None  # most ranks are not waiting: no one to single out
    # the odd one out: the GPU furthest from a waiter's spin (least busy relative to the waiters), one named
    straggler = min(others, key=lambda u: window.activity[u].busy or 0.0)
    cause, detail = causes.cause(draft, limits, straggler, set(window.waiting), window.activity)
    # nothing moves over the links while the odd one out does not compute: the job does not progress
    kind = "collective_hang" if quiet and cause != "slower_gpu" else "straggler"
    return CollectiveFinding(window.job, kind, straggler, cause, detail, window.waiters(), 0.0)


def _same_owner(process: ProcessView, main: ProcessView | None) -> bool:
    """Whether a process belongs where the rank's main process does (its pod, or its Slurm job): the job's own
    helpers (an asynchronous checkpoint writer, a compile worker) are not another tenant on the GPU."""
    if main is None or not (main.pod or main.slurm_job):
        return False
    return (process.namespace, process.pod, process.slurm_job) == (main.namespace, main.pod, main.slurm_job)


def cotenants(draft: Draft, uuids: tuple[str, ...]) -> dict[str, set[int]]:
    """Per GPU of the job, the PIDs outside the job (and outside its pod or Slurm job) that compute on it."""
    ours = {draft.jobs[u].pid for u in uuids}
    found: dict[str, set[int]] = {}
    for uuid in uuids:
        on_gpu = draft.processes.get(uuid, ())
        main = next((p for p in on_gpu if p.pid == draft.jobs[uuid].pid), None)
        found[uuid] = {p.pid for p in on_gpu if p.pid not in ours and _computes_beside(p, main)}
    return found


def _computes_beside(process: ProcessView, main: ProcessView | None) -> bool:
    return not _same_owner(process, main) and "compute" in process.kind and (process.sm_ratio or 0) >= SHARING_SM_RATIO


def shared(draft: Draft, limits: Thresholds, window: JobWindow, shared_gpus: set[str]) -> CollectiveFinding | None:
    """No GPU waits outright: the one GPU of the job that a process outside it has computed on within the window
    (`shared_gpus`), where the others are busy (waiting or computing: `collective_busy_ratio`) with fewer SMs active
    than it."""
    if len(shared_gpus) != 1:
        return None
    (straggler,) = shared_gpus
    peers = [u for u in window.uuids if u != straggler]
    mine = window.activity[straggler]
    if not all(_busy_below(window.activity[u], mine, limits) for u in peers):
        return None
    _, detail = causes.cause(draft, limits, straggler, set(peers), window.activity)
    # ranks in lockstep wait while the shared GPU runs the other process: its share of the GPU's SM time
    ours = {draft.jobs[u].pid for u in window.uuids}
    sm = {p.pid: p.sm_ratio or 0.0 for p in draft.processes.get(straggler, ())}
    foreign = sum(v for pid, v in sm.items() if pid not in ours)
    total = foreign + sm.get(draft.jobs[straggler].pid, 0.0)
    estimate = round(foreign / total, 3) if total > 0 else 0.0
    waiters = tuple((u, estimate) for u in peers)
    return CollectiveFinding(window.job, "straggler", straggler, "slower_gpu", detail, waiters, 0.0)


def _busy_below(peer: WindowActivity, mine: WindowActivity, limits: Thresholds) -> bool:
    return (peer.busy or 0.0) >= limits.collective_busy_ratio and peer.sm < mine.sm
