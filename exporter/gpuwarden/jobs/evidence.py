"""The host-evidence stage: what the main process of a waiting GPU, or of a job's GPU, does on the host.

The host-evidence stage, after health: for a GPU whose bottleneck class is `waiting` or that belongs to a job
with peers, what the threads of its largest holder do on the host (jobs/activity.py). It reads the verdicts
the health step wrote and the processes and jobs the steps before it wrote, all typed fields of the draft, so none
of those stages knows this one.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path

from gpuwarden.attribution.host import BackgroundLookups
from gpuwarden.jobs import activity
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import HostEvidence


def waiting_gpus(draft: Draft, suspects: Collection[str] = ()) -> set[str]:
    """GPUs the health step classed `waiting` that hold at least one process, and the job view's suspects (GPUs its
    peers wait for, jobs/collective.py): their cause is what their main process does. Only suspects: sampling
    every rank of every job cost 12 ms of CPU a poll for one 8-rank job on the simulator."""
    waiting = {
        uuid
        for uuid, verdicts in draft.health.items()
        if any(v.check == "bottleneck" and v.detail == "waiting" for v in verdicts) and draft.processes.get(uuid)
    }
    return waiting | {uuid for uuid in suspects if draft.processes.get(uuid)}


@dataclass
class Watched:
    """A GPU being sampled: its main process and that process's samples (a new main process starts afresh)."""

    pid: int
    tally: activity.ActivityTally = field(default_factory=activity.ActivityTally)


class HostEvidenceStep:
    """Fills draft.host_evidence; samples each waiting GPU's main process at most every activity.SAMPLE_EVERY_S."""

    def __init__(
        self,
        proc_root: Path | None,
        job_window: Callable[[], float] = lambda: float("inf"),
        suspects: Callable[[], set[str]] = set,
        submit: Callable[[str, Callable[[], None]], None] | None = None,
    ) -> None:
        """`submit` runs a listing of a process's threads off the assembly (host.BackgroundLookups.submit); by
        default a lookup thread of this step's own."""
        self._proc_root = proc_root  # None: the host's /proc is not mounted, nothing to look at
        self._job_window = job_window  # seconds the job view judges over (health collective_window_s), per snapshot
        self._suspects = suspects  # the job view's suspects as of the last snapshot
        self._watched: dict[str, Watched] = {}  # waiting GPU → its main process's samples
        self._threads = (
            activity.ThreadLists(proc_root, submit or BackgroundLookups().submit) if proc_root is not None else None
        )

    def __call__(self, draft: Draft) -> None:
        waiting = waiting_gpus(draft, self._suspects())
        self._watched = {uuid: watched for uuid, watched in self._watched.items() if uuid in waiting}
        if self._proc_root is None or self._threads is None:
            draft.host_evidence = {}
            return
        self._threads.retain({draft.processes[uuid][0].pid for uuid in waiting})
        found: dict[str, HostEvidence] = {}
        looked: dict[int, activity.ThreadSample | None] = {}  # one look per process, however many GPUs it holds
        for uuid in waiting:
            pid = draft.processes[uuid][0].pid  # the largest holder of the GPU's memory: the job's main process
            watched = self._watched.get(uuid)
            if watched is None or watched.pid != pid:
                watched = self._watched[uuid] = Watched(pid)
            tally = watched.tally
            if draft.taken_at - tally.sampled_at >= activity.SAMPLE_EVERY_S:
                tally.sampled_at = draft.taken_at
                if pid not in looked:
                    tids, turn = self._threads.for_sample(pid, draft.taken_at)
                    looked[pid] = activity.sample(self._proc_root, pid, draft.taken_at, tids, turn)
                if looked[pid] is not None:
                    tally.add(looked[pid])
            if tally.samples:
                member = draft.jobs.get(uuid)
                recent = draft.taken_at - self._job_window() if member is not None and member.peers else float("-inf")
                found[uuid] = tally.evidence(pid, recent)
        draft.host_evidence = found
