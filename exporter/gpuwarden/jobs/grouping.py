"""Grouping, after processes: which GPUs of this node belong to one job, and each GPU's rank, from the host
alone (no hook in the job). A pipeline step: it reads the processes the processes step wrote and the host's /proc.

Evidence, strongest first (docs/diagnosis.md, "Jobs"):
1. the launcher's environment (exporter/gpuwarden/jobs/launchers.py): a Slurm job, or a rendezvous
   (MASTER_ADDR:MASTER_PORT with torchrun's run id): a key the same on every node;
2. one process holding several GPUs;
3. one pod, or one Slurm job's cgroup;
4. one parent process (torchrun's agent, mp.spawn's main process), else one session.
The GPU's main process is its largest holder of memory. A GPU whose process shares nothing with another GPU's is a
job of its own (no peers). Reads are cached per PID (a process's exec-time environment never changes) and forgotten
with the PID.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.jobs import launchers
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import JobMember, ProcessView


@dataclass(frozen=True)
class _Seen:
    launch: launchers.Launch
    tree: launchers.ProcessTree | None


class JobsStep:
    """Fills draft.jobs for every GPU held by a compute process."""

    def __init__(self, proc_root: Path | None) -> None:
        self._proc_root = proc_root  # None: the host's /proc is not mounted: processes of one PID only
        self._seen: dict[int, _Seen] = {}

    def _look(self, view: ProcessView) -> _Seen:
        known = self._seen.get(view.pid)
        if known is None:
            if self._proc_root is None:
                known = _Seen(launchers.launch_from({}, view.namespace, view.slurm_job), None)
            else:
                known = _Seen(
                    launchers.read_launch(self._proc_root, view.pid, view.namespace, view.slurm_job),
                    launchers.read_tree(self._proc_root, view.pid),
                )
            if self._proc_root is not None and known.tree is None:
                return known  # not visible (yet): looked at again next time, not cached
            self._seen[view.pid] = known
        return known

    def __call__(self, draft: Draft) -> None:
        main: dict[str, ProcessView] = {}
        for gpu in draft.gpus:
            views = [v for v in draft.processes.get(gpu.uuid, ()) if v.kind == "compute"]
            if views:
                main[gpu.uuid] = views[0]  # sorted by memory, largest first
        self._seen = {pid: seen for pid, seen in self._seen.items() if pid in {v.pid for v in main.values()}}
        # each PID looked at once per snapshot, however many GPUs it holds (an invisible one is not cached)
        looked = {view.pid: self._look(view) for view in main.values()}
        gpus_of_pid = Counter(view.pid for view in main.values())
        trees = [seen.tree for seen in looked.values() if seen.tree is not None]
        parents, sessions = Counter(t.ppid for t in trees), Counter(t.session for t in trees)
        keyed = {uuid: self._key(view, looked[view.pid], gpus_of_pid, parents, sessions) for uuid, view in main.items()}
        members: dict[str, list[str]] = defaultdict(list)
        for uuid, (key, _) in keyed.items():
            members[key].append(uuid)
        draft.jobs = {}
        for uuid, view in main.items():
            key, source = keyed[uuid]
            launch = looked[view.pid].launch
            draft.jobs[uuid] = JobMember(key, launch.rank, launch.world_size, source, view.pid, tuple(members[key]))

    @staticmethod
    def _key(
        view: ProcessView, seen: _Seen, gpus_of_pid: Counter[int], parents: Counter[int], sessions: Counter[int]
    ) -> tuple[str, str]:
        """(job key, source) for one GPU's main process, the strongest evidence first."""
        if seen.launch.job:
            return seen.launch.job, seen.launch.source
        if gpus_of_pid[view.pid] > 1:  # one process: its GPUs are its job, known on this node only
            return f"local/pid-{view.pid}", "process"
        if view.pod:
            return f"local/pod/{view.namespace}/{view.pod}", "pod"
        tree = seen.tree
        if tree is not None and tree.ppid > 1 and parents[tree.ppid] > 1:
            return f"local/ppid-{tree.ppid}", "tree"
        if tree is not None and tree.session > 1 and sessions[tree.session] > 1:
            return f"local/session-{tree.session}", "tree"
        return f"local/pid-{view.pid}", "lone"
