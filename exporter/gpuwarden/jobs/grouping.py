"""Grouping, after processes: which GPUs of this node belong to one job, and each GPU's rank.

Grouping, after processes: which GPUs of this node belong to one job, and each GPU's rank, from the host alone
(no hook in the job). A pipeline step: it reads the processes the processes step wrote and the host's /proc
(jobs/identity.py).

Only evidence of a distributed launch makes a job, strongest first (docs/diagnosis.md, "Jobs"):
1. the Slurm job slurmstepd put the process in (its cgroup, or a root-owned slurmstepd parent): `slurm/<job>`;
2. a launcher agent that is the process's parent and names its rendezvous on its command line (torchrun, DeepSpeed):
   the rendezvous and run id, the same on every node (a standalone torchrun: its workers, this node's only). It
   outranks the environment so that an exporter that cannot read the environment keys the job as root does;
3. the launcher variables of the process's environment where readable (jobs/launchers.py, one row per launcher),
   else of its pod's spec as the API server has it (jobs/pod_api.py: the literal values the operator wrote; under a
   torchrun agent they are the agent's, so the rank is the node rank's first rank plus the worker's place);
4. the training operator's labels of its pod (`<namespace>/<kind>/<name>`: Kubeflow, JobSet, Volcano,
   LeaderWorkerSet, an Indexed Job);
5. an agent that names no rendezvous: its workers, on this node only (`local/<scope>/torchrun-<pid>`);
6. one process holding several GPUs (`local/pid-<pid>`).
A shared parent or session alone never makes a job (eight inference replicas under one supervisor, two jobs started
from one shell), nor does a pod alone. A loopback rendezvous is kept to its pod, container or cgroup. The rank is
the environment's where readable, else the agent's node rank and the worker's place among its children, else
`unknown`. The GPU's main process is its largest holder of memory; a GPU whose process shares no key with another
GPU's is a job of its own (no peers).
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.jobs import launchers, sources
from gpuwarden.jobs.identity import Identity, IdentityReader
from gpuwarden.jobs.launchers import UNKNOWN, Launch, Where
from gpuwarden.jobs.pod_api import PodApi, PodFacts
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import JobMember, ProcessView


@dataclass(frozen=True)
class Keyed:
    """A GPU's main process placed in its job: the key, the evidence that gave it, the rank and world size."""

    job: str
    source: str
    rank: str = UNKNOWN
    world_size: int | None = None


def where_of(identity: Identity | None, view: ProcessView) -> Where:
    """The process's scope for keys: its pod's namespace where its own cgroup named the pod (not the GPU's
    allocation), its Slurm job and its loopback scope."""
    if identity is None:
        return Where()
    namespace = view.namespace if view.attributed_by == "cgroup" else ""
    return Where(namespace, identity.slurm_job, identity.scope, unnamed_pod=bool(identity.pod_uid) and not namespace)


def _rank(identity: Identity, environ: Launch | None) -> tuple[str, int | None]:
    """The environment's rank where readable, else the agent's; and the world size likewise."""
    agent = identity.agent
    agent_rank = agent.rank(identity.local_rank) if agent is not None else None
    agent_world = agent.world_size if agent is not None else None
    rank = environ.rank if environ is not None and environ.rank != UNKNOWN else agent_rank
    world = environ.world_size if environ is not None and environ.world_size is not None else agent_world
    return (UNKNOWN if rank is None else str(rank)), world


def _variables(identity: Identity, pod: PodFacts | None) -> dict[str, str] | None:
    """The launcher variables: the process's own where readable, else its pod spec's (None: neither). Under a
    launcher agent the spec's are the agent's: the worker's rank is then its place under the agent, not the spec's
    RANK (the operator's node rank)."""
    if identity.environ is not None:
        return identity.environ
    if pod is None:
        return None
    variables = dict(pod.variables(identity.container_id))
    if identity.agent is not None:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            variables.pop(name, None)
        if identity.local_rank is not None:
            variables["LOCAL_RANK"] = str(identity.local_rank)
    return variables


def identify(identity: Identity, where: Where, pod: PodFacts | None = None) -> Keyed | None:
    """The job the evidence names, strongest first; None where it names none."""
    variables = _variables(identity, pod)
    environ = None if variables is None else launchers.launch_from(variables, where)
    rank, world = _rank(identity, environ)
    if where.slurm_job:
        return Keyed(f"slurm/{where.slurm_job}", "slurm", rank, world)
    agent = identity.agent
    if agent is not None and agent.key(where):  # the same for root and for a user that cannot read the environment
        return Keyed(agent.key(where), agent.kind, rank, world)
    if environ is not None and environ.job:
        return Keyed(environ.job, environ.source, rank, world)
    labelled = pod.job_key() if pod is not None else ""
    if labelled:
        return Keyed(labelled, "pod_labels", rank, world)
    if agent is not None:  # its rendezvous in the agent's environment (PET_ variables), unreadable here
        return Keyed(agent.key(where) or agent.local_key(where), agent.kind, rank, world)
    return None


class JobsStep:
    """Fills draft.jobs for every GPU held by a compute process, and draft.job_sources."""

    def __init__(self, proc_root: Path | None, pod_api: PodApi | None = None) -> None:
        self._states = pod_api.states if pod_api is not None else sources.SourceStates()
        sources.probe(proc_root, self._states)  # one line at start (and on a reload that moves /proc)
        self._pod_api = pod_api
        # None: the host's /proc is not mounted: processes of one PID only
        self._reader = None if proc_root is None else IdentityReader(proc_root, self._states)
        self._seen: dict[int, Identity] = {}

    def _look(self, pid: int) -> Identity | None:
        known = self._seen.get(pid)
        if known is None and self._reader is not None:
            known = self._reader.read(pid)
            if known is not None:  # not visible (yet): looked at again next time, not cached
                self._seen[pid] = known
        return known

    def __call__(self, draft: Draft) -> None:
        main: dict[str, ProcessView] = {}
        for gpu in draft.gpus:
            views = [v for v in draft.processes.get(gpu.uuid, ()) if v.kind == "compute"]
            if views:
                main[gpu.uuid] = views[0]  # sorted by memory, largest first
        self._seen = {pid: seen for pid, seen in self._seen.items() if pid in {v.pid for v in main.values()}}
        gpus_of_pid = Counter(view.pid for view in main.values())
        keyed = {uuid: self._key(view, gpus_of_pid[view.pid]) for uuid, view in main.items()}
        members: dict[str, list[str]] = defaultdict(list)
        for uuid, found in keyed.items():
            members[found.job].append(uuid)
        draft.jobs = {
            uuid: JobMember(
                found.job, found.rank, found.world_size, found.source, main[uuid].pid, tuple(members[found.job])
            )  # fmt: skip
            for uuid, found in keyed.items()
        }
        if self._pod_api is not None:
            self._pod_api.retain({seen.pod_uid for seen in self._seen.values() if seen.pod_uid})
        draft.job_sources = self._states.snapshot()

    def _pod(self, identity: Identity, view: ProcessView) -> PodFacts | None:
        """The process's pod from the API server, where configured and the pod's name is known from its cgroup."""
        if self._pod_api is None or not identity.pod_uid or view.attributed_by != "cgroup":
            return None
        return self._pod_api.facts(view.namespace, view.pod, identity.pod_uid)

    def _key(self, view: ProcessView, gpus: int) -> Keyed:
        """(job key, source, rank, world size) of one GPU's main process, the strongest evidence first."""
        identity = self._look(view.pid)  # each PID read once, however many GPUs it holds
        found = identify(identity, where_of(identity, view), self._pod(identity, view)) if identity else None
        if found is not None:
            return found
        if gpus > 1:  # one process: its GPUs are its job, known on this node only
            return Keyed(f"local/pid-{view.pid}", "process")
        return Keyed(f"local/pid-{view.pid}", "lone")
