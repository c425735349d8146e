"""Shared GPUs: processes outside a GPU's job that compute on it.

Shared GPUs: processes outside a GPU's job that compute on it. Their kernels take turns with the job's (time
slicing), so the job runs slower on that GPU: a multi-GPU job's straggler cause (jobs/causes.py), and a single-GPU
job's finding (jobs/findings.py).

The GPU's job is its main process's (the largest memory holder; for a GPU of a multi-GPU job, every rank of the job
on this node), with the processes in its pod or Slurm job: a job's own helper (an asynchronous checkpoint writer, a
compile worker) is not another tenant. A process counts once it used at least SHARING_SM_RATIO of the GPU's SMs in
an NVML sample; it is kept for the job view's window with the largest share seen, because NVML's per-process samples
are noisy (a co-located matmul on a lent H200 read 59 %, 0 %, 19 %, 98 % on successive polls).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import Cotenant, ProcessView

SHARING_SM_RATIO = 0.05


@dataclass
class Seen:
    """One process outside a GPU's job: its name and its SM samples over the window."""

    name: str
    samples: deque[tuple[float, float]] = field(default_factory=deque)  # (time, SM share) of each sample computing


def same_owner(process: ProcessView, main: ProcessView | None) -> bool:
    """Whether a process belongs where the job's main process does (its pod, or its Slurm job)."""
    if main is None or not (main.pod or main.slurm_job):
        return False
    return (process.namespace, process.pod, process.slurm_job) == (main.namespace, main.pod, main.slurm_job)


def foreign_computing(draft: Draft, uuid: str) -> list[ProcessView]:
    """The processes computing on the GPU now that are outside its job."""
    on_gpu = draft.processes.get(uuid, ())
    member = draft.jobs.get(uuid)
    main_pid = member.pid if member is not None else (on_gpu[0].pid if on_gpu else None)
    ours = {draft.jobs[u].pid for u in member.local_gpus if u in draft.jobs} if member is not None else set()
    ours.add(main_pid)  # type: ignore[arg-type]
    main = next((p for p in on_gpu if p.pid == main_pid), None)
    return [
        p
        for p in on_gpu
        if p.pid not in ours
        and not same_owner(p, main)
        and "compute" in p.kind
        and (p.sm_ratio or 0.0) >= SHARING_SM_RATIO
    ]


class Sharing:
    """Remembers, per GPU, the processes outside its job seen computing on it within the window."""

    def __init__(self) -> None:
        self._seen: dict[str, dict[int, Seen]] = {}

    def update(self, draft: Draft, window: float) -> dict[str, tuple[Cotenant, ...]]:
        now = draft.taken_at
        held = {uuid for uuid, views in draft.processes.items() if views}
        self._seen = {uuid: seen for uuid, seen in self._seen.items() if uuid in held}
        for uuid in held:
            seen = self._seen.setdefault(uuid, {})
            alive = {p.pid for p in draft.processes[uuid]}
            for process in foreign_computing(draft, uuid):
                entry = seen.setdefault(process.pid, Seen(process.name or "unknown"))
                entry.samples.append((now, process.sm_ratio or 0.0))
            for pid in list(seen):
                samples = seen[pid].samples
                while samples and samples[0][0] < now - window:
                    samples.popleft()
                if not samples or pid not in alive:
                    del seen[pid]
        return {
            uuid: tuple(Cotenant(pid, s.name, max(sm for _, sm in s.samples)) for pid, s in sorted(seen.items()))
            for uuid, seen in self._seen.items()
            if seen
        }
