"""Who launched a GPU process, from the host's /proc alone: the job key and rank that launchers leave in the
environment at exec time, and the process tree. No hook in the job.

`/proc/PID/environ` is the environment the process was started with (changes made inside the program are not
there; proc_pid_environ(5)), readable with the same UID or CAP_SYS_PTRACE. Each launcher's conventions are one row
of `LAUNCHERS` (docs/diagnosis.md, "Jobs"), tried in order; the first that applies gives the key, rank and world
size:
- Slurm (srun): SLURM_JOB_ID (the job the cgroup names outranks it), SLURM_PROCID, SLURM_NTASKS;
- torchrun / torch.distributed.elastic: MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT,
  RANK, WORLD_SIZE;
- Kubeflow PyTorchJob and Trainer: MASTER_ADDR/PORT or PET_MASTER_ADDR/PORT, PET_NNODES, PET_NPROC_PER_NODE,
  PET_NODE_RANK;
- DeepSpeed's launcher: MASTER_ADDR/PORT, RANK, WORLD_SIZE, CROSS_RANK, CROSS_SIZE, LOCAL_SIZE;
- MPI: OMPI_COMM_WORLD_RANK/SIZE (Open MPI), PMI_RANK/SIZE (MPICH's Hydra, Intel MPI), PMIX_RANK and
  PMIX_NAMESPACE (any PMIx launcher); the rendezvous where the program's launch script set one;
- a rendezvous with a rank (Volcano, an Indexed Job, a script): MASTER_ADDR/PORT, RANK, WORLD_SIZE
  (JOB_COMPLETION_INDEX numbers pods, not ranks: a pod may run several, so it is no rank here);
- torch.multiprocessing.spawn: the rendezvous set inside the program before spawning reaches the children, the ranks
  do not: the rank is `unknown`.

The job key is the same on every node of a job, so the fleet can join a job's nodes: the Slurm job, else the
rendezvous (MASTER_ADDR:MASTER_PORT, with the torchrun run id and restart count where set), qualified by the pod's
namespace (a loopback rendezvous, as single-node jobs use, is this node's only: `local/...`). Reads are bounded; a
value that is not printable ASCII is dropped, never exported.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

_MAX_ENVIRON = 256 * 1024  # a process's environment is limited by ARG_MAX; read no more than this
_MAX_VALUE = 96
_SAFE = re.compile(rf"[\x21-\x7e]{{1,{_MAX_VALUE}}}")
_INTEGER = re.compile(r"\d{1,7}")
UNKNOWN = "unknown"
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]", "0.0.0.0"})

Variables = Mapping[str, str]
# a rank: a variable, or (node rank, processes per node, local rank): node × per node + local
RankRule = str | tuple[str, str, str]
# a world size: a variable, or (nodes, processes per node): their product
WorldRule = str | tuple[str, str]


@dataclass(frozen=True)
class Where:
    """What the host says of the process besides its environment: its pod's namespace (qualifies a rendezvous
    address: two namespaces may both run a `trainer-master-0`) and the Slurm job its cgroup names."""

    namespace: str = ""
    slurm_job: str = ""


@dataclass(frozen=True)
class Launcher:
    """One launcher's conventions: when its variables are there, the job key they give ("" where none), and where
    it puts the global rank and the world size (the first rule that reads an integer wins)."""

    name: str  # the key's source, as JobMember.source says it
    applies: Callable[[Variables, Where], bool]
    key: Callable[[Variables, Where], str]
    rank: tuple[RankRule, ...]
    world: tuple[WorldRule, ...]


@dataclass(frozen=True)
class Launch:
    """What the environment says of the process's job: a key shared by every rank on every node ("" where none
    can be known from the environment), the global rank and world size where the launcher set them."""

    job: str = ""
    rank: str = UNKNOWN
    world_size: int | None = None
    source: str = ""  # which launcher's row gave the key: slurm, torchrun, kubeflow, deepspeed, mpi, rendezvous, spawn


@dataclass(frozen=True)
class ProcessTree:
    """/proc/PID/stat's parent and session: ranks started by one launcher share a parent (torchrun's agent,
    mp.spawn's main process) or at least a session."""

    ppid: int
    session: int


def _integer(variables: Variables, name: str) -> int | None:
    value = variables.get(name, "")
    return int(value) if _INTEGER.fullmatch(value) else None


def _first_rank(variables: Variables, rules: tuple[RankRule, ...]) -> int | None:
    for rule in rules:
        if isinstance(rule, str):
            found = _integer(variables, rule)
        else:
            node, per_node, local = (_integer(variables, name) for name in rule)
            found = None if node is None or per_node is None or local is None else node * per_node + local
        if found is not None:
            return found
    return None


def _first_world(variables: Variables, rules: tuple[WorldRule, ...]) -> int | None:
    for rule in rules:
        if isinstance(rule, str):
            found = _integer(variables, rule)
        else:
            nodes, per_node = (_integer(variables, name) for name in rule)
            found = None if nodes is None or per_node is None else nodes * per_node
        if found is not None:
            return found
    return None


# --- the keys ------------------------------------------------------------------------------------------------------


def _slurm_job(variables: Variables, where: Where) -> str:
    """The cgroup's job, else the environment's where it is a number."""
    from_environ = variables.get("SLURM_JOB_ID", "")
    return where.slurm_job or (from_environ if _INTEGER.fullmatch(from_environ) else "")


def _rendezvous(variables: Variables, where: Where) -> str:
    """MASTER_ADDR:MASTER_PORT (or the Kubeflow PET_ twins), namespaced; a loopback address is this node's only."""
    address = variables.get("MASTER_ADDR") or variables.get("PET_MASTER_ADDR")
    port = variables.get("MASTER_PORT") or variables.get("PET_MASTER_PORT")
    if not (address and port and _INTEGER.fullmatch(port)):
        return ""
    if address in LOOPBACK:  # the same on every node that runs such a job: a key for this node only
        return f"local/{address}:{port}"
    return f"{where.namespace}/{address}:{port}" if where.namespace else f"{address}:{port}"


def _run_id(variables: Variables) -> str:
    """torchrun's rendezvous id; "none" is what the static rendezvous sets, no id at all."""
    run = variables.get("TORCHELASTIC_RUN_ID", "")
    return "" if run == "none" else run


def _restarted(key: str, variables: Variables) -> str:
    """A restarted elastic job is a new key (its ranks restart together)."""
    restarts = variables.get("TORCHELASTIC_RESTART_COUNT", "")
    return key if not key or restarts in ("", "0") else f"{key}#{restarts}"


def _rendezvous_key(variables: Variables, where: Where) -> str:
    return _restarted(_rendezvous(variables, where), variables)


def _torchrun_key(variables: Variables, where: Where) -> str:
    return _restarted(f"{_rendezvous(variables, where)}/{_run_id(variables)}", variables)


def _mpi_key(variables: Variables, where: Where) -> str:
    """The rendezvous the launch script set, else the PMIx namespace (one per job, the same on every node)."""
    namespace = variables.get("PMIX_NAMESPACE", "")
    return _rendezvous_key(variables, where) or (f"mpi/{namespace}" if namespace else "")


def _any_of(*names: str) -> Callable[[Variables, Where], bool]:
    return lambda variables, _: any(name in variables for name in names)


_PET_RANK = ("PET_NODE_RANK", "PET_NPROC_PER_NODE", "LOCAL_RANK")  # a Trainer pod's node rank × per node + local
_PET_WORLD = ("PET_NNODES", "PET_NPROC_PER_NODE")

# One row per launcher, in the order they are tried: the first that applies names the job.
LAUNCHERS: tuple[Launcher, ...] = (
    Launcher(
        "slurm",
        applies=lambda variables, where: bool(_slurm_job(variables, where)),
        key=lambda variables, where: f"slurm/{_slurm_job(variables, where)}",
        rank=("RANK", "SLURM_PROCID"),
        world=("WORLD_SIZE", "SLURM_NTASKS"),
    ),
    Launcher(
        "torchrun",
        applies=lambda variables, where: bool(_rendezvous(variables, where) and _run_id(variables)),
        key=_torchrun_key,
        rank=("RANK", _PET_RANK),
        world=("WORLD_SIZE", _PET_WORLD),
    ),
    Launcher(
        "kubeflow",
        applies=_any_of("PET_MASTER_ADDR", "PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK"),
        key=_rendezvous_key,
        rank=("RANK", _PET_RANK),
        world=("WORLD_SIZE", _PET_WORLD),
    ),
    Launcher(
        "deepspeed",
        applies=_any_of("CROSS_RANK"),
        key=_rendezvous_key,
        rank=("RANK", ("CROSS_RANK", "LOCAL_SIZE", "LOCAL_RANK")),
        world=("WORLD_SIZE", ("CROSS_SIZE", "LOCAL_SIZE")),
    ),
    Launcher(
        "mpi",
        applies=_any_of("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
        key=_mpi_key,
        rank=("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"),
        world=("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"),
    ),
    Launcher(
        "rendezvous",
        applies=lambda variables, where: "RANK" in variables and bool(_rendezvous(variables, where)),
        key=_rendezvous_key,
        rank=("RANK",),
        world=("WORLD_SIZE",),
    ),
    Launcher(
        "spawn",
        applies=lambda variables, where: bool(_rendezvous(variables, where)),
        key=_rendezvous_key,
        rank=(),  # set inside the program
        world=("WORLD_SIZE",),
    ),
)

# the variables read; everything else in the environment (secrets included) is never kept
_RULE_NAMES = {
    name
    for row in LAUNCHERS
    for rule in (*row.rank, *row.world)
    for name in ((rule,) if isinstance(rule, str) else rule)
}
LAUNCH_VARIABLES = frozenset(
    _RULE_NAMES
    | {
        "LOCAL_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "PET_MASTER_ADDR",
        "PET_MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "JOB_COMPLETION_INDEX",
        "SLURM_JOB_ID",
        "SLURM_LOCALID",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "PMIX_NAMESPACE",
    }
)


def _read(path: Path, limit: int) -> bytes:
    try:
        with path.open("rb") as handle:
            return handle.read(limit)
    except OSError:
        return b""


def parse_environ(raw: bytes) -> dict[str, str]:
    """The launcher variables of a NUL-separated environment; unsafe or overlong values are dropped."""
    found: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if not sep:
            continue
        key = name.decode("ascii", "replace")
        if key not in LAUNCH_VARIABLES:
            continue
        text = value.decode("ascii", "replace")
        if _SAFE.fullmatch(text):
            found[key] = text
    return found


def launch_from(variables: Variables, namespace: str = "", slurm_job: str = "") -> Launch:
    """The job key, rank and world size from the first launcher row that applies; `namespace` qualifies a
    rendezvous address, `slurm_job` is the job the cgroup names (stronger than the environment)."""
    where = Where(namespace, slurm_job)
    row = next((row for row in LAUNCHERS if row.applies(variables, where)), None)
    if row is None:
        rank, world = _first_rank(variables, ("RANK",)), _first_world(variables, ("WORLD_SIZE",))
        return Launch("", UNKNOWN if rank is None else str(rank), world, "")
    rank = _first_rank(variables, row.rank)
    key = row.key(variables, where)[: _MAX_VALUE * 2]
    return Launch(
        key, UNKNOWN if rank is None else str(rank), _first_world(variables, row.world), row.name if key else ""
    )


def read_launch(proc_root: Path, pid: int, namespace: str = "", slurm_job: str = "") -> Launch:
    return launch_from(parse_environ(_read(proc_root / str(pid) / "environ", _MAX_ENVIRON)), namespace, slurm_job)


def parse_stat(text: str) -> ProcessTree | None:
    """(ppid, session) from /proc/PID/stat; the command name may hold spaces and parentheses, so the fields are
    read after its last ')'."""
    _, sep, rest = text.rpartition(")")
    fields = rest.split()
    if not sep or len(fields) < 4 or not all(_INTEGER.fullmatch(f) for f in fields[1:4]):
        return None
    return ProcessTree(int(fields[1]), int(fields[3]))


def read_tree(proc_root: Path, pid: int) -> ProcessTree | None:
    return parse_stat(_read(proc_root / str(pid) / "stat", 4096).decode("ascii", "replace"))
