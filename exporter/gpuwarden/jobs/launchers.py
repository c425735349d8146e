"""Who launched a GPU process, from the host's /proc alone: the job key and rank launchers leave behind.

Who launched a GPU process, from the host's /proc alone: the job key and rank that launchers leave in the
environment at exec time, and the process tree. No hook in the job.

`/proc/PID/environ` is the environment the process was started with (changes made inside the program are not
there; proc_pid_environ(5)), readable with the same UID or CAP_SYS_PTRACE. Each launcher's conventions are one row
of `LAUNCHERS` (docs/diagnosis.md, "Jobs"), tried in order; the first that applies gives the key, rank and world
size:
- Slurm (srun): the job slurmstepd put the process in (its cgroup, or a slurmstepd ancestor: jobs/identity.py);
  SLURM_PROCID, SLURM_NTASKS. SLURM_JOB_ID alone names no job: any process can set it;
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
namespace. A loopback rendezvous, as single-node jobs use, is this node's only and its pod's, container's or
cgroup's only (`local/<scope>/...`): two pods may both use localhost:29500. The environment is scanned in chunks for
the launcher variables, however large it is (bounded by a deadline and a fixed buffer, not by a first-N cut); a value
that is not printable ASCII is dropped, never exported.
"""

from __future__ import annotations

import ipaddress
import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

ENVIRON_CHUNK = 64 * 1024
ENVIRON_DEADLINE_S = 0.2  # per process; a scan cut short keeps what it found (jobs/sources.py counts none)
_MAX_VALUE = 96
_MAX_ENTRY = 160  # NAME=value of any launcher variable fits; a longer entry is skipped as it streams past
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
    address: two namespaces may both run a `trainer-master-0`), the Slurm job slurmstepd put it in, and the scope
    of a loopback address (its pod, container or cgroup: jobs/identity.py). `unnamed_pod`: in a pod whose namespace
    is not known, so a rendezvous by name is kept to the pod."""

    namespace: str = ""
    slurm_job: str = ""
    scope: str = ""
    unnamed_pod: bool = False


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


def safe(value: str) -> bool:
    """Whether a value may go into a key: printable ASCII without spaces, at most _MAX_VALUE characters."""
    return bool(_SAFE.fullmatch(value))


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


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address.strip("[]"))
    except ValueError:
        return False
    return True


def rendezvous_key(address: str, port: str, where: Where) -> str:
    """A rendezvous address as a job key: namespaced in a pod; a loopback address (the same on every node that runs
    such a job), or a name in a pod of unknown namespace, is kept to its scope on this node."""
    if address in LOOPBACK or (where.unnamed_pod and not _is_ip(address)):
        return "/".join(part for part in ("local", where.scope, f"{address}:{port}") if part)
    return f"{where.namespace}/{address}:{port}" if where.namespace else f"{address}:{port}"


def _rendezvous(variables: Variables, where: Where) -> str:
    """MASTER_ADDR:MASTER_PORT (or the Kubeflow PET_ twins) as a key."""
    address = variables.get("MASTER_ADDR") or variables.get("PET_MASTER_ADDR")
    port = variables.get("MASTER_PORT") or variables.get("PET_MASTER_PORT")
    if not (address and port and _INTEGER.fullmatch(port)):
        return ""
    return rendezvous_key(address, port, where)


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
        applies=lambda _, where: bool(where.slurm_job),
        key=lambda _, where: f"slurm/{where.slurm_job}",
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


class _Entries:
    """NUL-separated entries of a stream, fed in chunks: only entries up to _MAX_ENTRY bytes come out, so memory stays
    bounded by one chunk whatever the environment's size."""

    def __init__(self) -> None:
        self._partial = b""
        self._skipping = False  # inside an entry already longer than _MAX_ENTRY

    def feed(self, chunk: bytes) -> Iterator[bytes]:
        *complete, last = chunk.split(b"\0")
        for piece in complete:
            if self._skipping:
                self._skipping = False
                continue
            entry, self._partial = self._partial + piece, b""
            if len(entry) <= _MAX_ENTRY:
                yield entry
        if not self._skipping:
            self._partial += last
            if len(self._partial) > _MAX_ENTRY:
                self._partial, self._skipping = b"", True

    def finish(self) -> Iterator[bytes]:
        if self._partial and not self._skipping:
            yield self._partial
        self._partial = b""


def _keep(entry: bytes, found: dict[str, str]) -> None:
    name, sep, value = entry.partition(b"=")
    if not sep:
        return
    key = name.decode("ascii", "replace")
    if key not in LAUNCH_VARIABLES:
        return
    text = value.decode("ascii", "replace")
    if _SAFE.fullmatch(text):
        found[key] = text


def parse_environ(raw: bytes) -> dict[str, str]:
    """The launcher variables of a NUL-separated environment; unsafe or overlong values are dropped."""
    found: dict[str, str] = {}
    entries = _Entries()
    for entry in (*entries.feed(raw), *entries.finish()):
        _keep(entry, found)
    return found


def read_environ(
    path: Path, deadline_s: float = ENVIRON_DEADLINE_S, clock: Callable[[], float] = time.monotonic
) -> dict[str, str] | None:
    """The launcher variables of /proc/PID/environ, scanned in chunks to its end or the deadline; None where this
    process may not read it (another user's process: the same UID or CAP_SYS_PTRACE is needed)."""
    found: dict[str, str] = {}
    entries = _Entries()
    started = clock()
    try:
        with path.open("rb", buffering=0) as handle:
            while chunk := handle.read(ENVIRON_CHUNK):
                for entry in entries.feed(chunk):
                    _keep(entry, found)
                if clock() - started > deadline_s:
                    break
    except PermissionError:
        return None
    except OSError:
        pass  # gone while read: what was found stands
    for entry in entries.finish():
        _keep(entry, found)
    return found


def launch_from(variables: Variables, where: Where | None = None) -> Launch:
    """The job key, rank and world size from the first launcher row that applies."""
    where = where or Where()
    row = next((row for row in LAUNCHERS if row.applies(variables, where)), None)
    if row is None:
        rank, world = _first_rank(variables, ("RANK",)), _first_world(variables, ("WORLD_SIZE",))
        return Launch("", UNKNOWN if rank is None else str(rank), world, "")
    rank = _first_rank(variables, row.rank)
    key = row.key(variables, where)[: _MAX_VALUE * 2]
    return Launch(
        key, UNKNOWN if rank is None else str(rank), _first_world(variables, row.world), row.name if key else ""
    )
