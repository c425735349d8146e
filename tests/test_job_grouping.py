"""Grouping GPUs into jobs from evidence that cannot be faked by accident or on purpose (issue 49), over host /proc
trees: the recorded launchers' fixtures (tests/data/proc, README there says which entries were recorded and which
written), and trees written here for what cannot be staged on this machine (Slurm's cgroups, pods, a user's
delegated cgroup subtree). The same reads run against real processes of another user in
tests/test_jobs_unprivileged.py."""

from __future__ import annotations

import base64
import json
import logging
import shutil
from pathlib import Path

import pytest

from gpuwarden.jobs import agents, launchers, procfs, sources
from gpuwarden.jobs.grouping import JobsStep, identify, where_of
from gpuwarden.jobs.identity import IdentityReader
from gpuwarden.jobs.launchers import Where
from gpuwarden.model.snapshot import ProcessView

FIXTURES = Path(__file__).resolve().parent / "data" / "proc"
POD_A = "3f1c2a4e-8b7d-4c1e-9a55-2d6f0e7b1c90"
POD_B = "5e0d9b2c-8b7d-4c1e-9a55-2d6f0e7b1c91"


def _proc_from(fixture: str, root: Path) -> Path:
    (root / "self").mkdir(parents=True, exist_ok=True)
    for pid in (FIXTURES / fixture).iterdir():
        shutil.copytree(pid, root / pid.name)
    return root


def view(pid: int, namespace: str = "") -> ProcessView:
    """A GPU's main process as the processes step shows it; `namespace`: its pod's, found through its cgroup."""
    return ProcessView(pid, "python", "compute", 1 << 30, None, None, None, None, namespace,
                       "pod" if namespace else "", "c" if namespace else "", "cgroup" if namespace else "")  # fmt: skip


def placed(root: Path, pid: int, namespace: str = "") -> tuple[str, str, int | None]:
    """(job key, rank, world size) the job view gives the process, "" where it names no job."""
    identity = IdentityReader(root, sources.SourceStates()).read(pid)
    assert identity is not None, pid
    found = identify(identity, where_of(identity, view(pid, namespace)))
    return ("", "unknown", None) if found is None else (found.job, found.rank, found.world_size)


def write_process(
    root: Path, pid: int, ppid: int, *, environ: dict[str, str] | None = None, cgroup: str = "0::/\n",
    argv: list[str] | None = None, comm: str = "python", uid: int = 1000, children: list[int] | None = None,
) -> None:  # fmt: skip
    """One /proc/PID entry: stat, cgroup, status, cmdline, environ, and the children of its main thread."""
    base = root / str(pid)
    (base / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
    (root / "self").mkdir(exist_ok=True)
    (base / "stat").write_text(f"{pid} ({comm}) S {ppid} {pid} {pid} 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 {pid} 0 0\n")
    (base / "cgroup").write_text(cgroup)
    (base / "status").write_text(f"Name:\t{comm}\nPPid:\t{ppid}\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n")
    (base / "cmdline").write_bytes(b"".join(a.encode() + b"\0" for a in (argv or [comm])))
    (base / "environ").write_bytes(b"".join(f"{k}={v}\0".encode() for k, v in (environ or {}).items()))
    (base / "task" / str(pid) / "children").write_text(" ".join(map(str, children or [])) + " ")


def pod_cgroup(uid: str, container: str) -> str:
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid.replace('-', '_')}.slice/"
        f"cri-containerd-{container * 64}.scope\n"
    )


# --- the recorded launchers -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fixture", "namespace", "expected"),
    [
        # srun -n 2 on a one-node Slurm cluster, recorded; proctrack/linuxproc leaves no Slurm cgroup, so the job is
        # the one root's slurmstepd parent names (`slurmstepd: [1.0]`, a written entry); ranks from SLURM_PROCID
        ("srun", "", {"29713": ("slurm/1", "0", 2), "29714": ("slurm/1", "1", 2)}),
        # a PyTorchJob's master pod running torchrun: the rendezvous, qualified by the namespace; torchrun's run id
        # is "none" under the static rendezvous, so it is not part of the key
        (
            "kubeflow-pytorchjob",
            "ml",
            {"41207": ("ml/llama-ft-master-0:23456", "0", 4), "41208": ("ml/llama-ft-master-0:23456", "1", 4)},
        ),
        # an Indexed Job's pod 1: RANK from the completion index, the rendezvous at pod 0's stable name
        ("indexed-job", "ml", {"7315": ("ml/train-0.train:29500", "1", 2)}),
        # torchrun on one node, recorded, with its agent (written from the recorded command line): the agent's
        # rendezvous endpoint and id, loopback, so kept to the ranks' cgroup
        (
            "torchrun-c10d",
            "",
            {
                "733": ("local/cgroup/29e3146a3eb5029e777a23ec55dee91f/127.0.0.1:29411/llama7b-ft", "0", 2),
                "734": ("local/cgroup/29e3146a3eb5029e777a23ec55dee91f/127.0.0.1:29411/llama7b-ft", "1", 2),
            },
        ),
        # --standalone: one node's job, named by its agent (its random rendezvous is in no command line)
        (
            "torchrun-standalone",
            "",
            {
                "684": ("local/cgroup/29e3146a3eb5029e777a23ec55dee91f/torchrun-642", "0", 2),
                "685": ("local/cgroup/29e3146a3eb5029e777a23ec55dee91f/torchrun-642", "1", 2),
            },
        ),
        # mp.spawn, recorded: the rendezvous set inside the program reaches the children's environment, the ranks
        # do not: one job, ranks unknown
        (
            "mp-spawn",
            "",
            {
                "769": ("local/cgroup/29e3146a3eb5029e777a23ec55dee91f/localhost:12355", "unknown", None),
                "770": ("local/cgroup/29e3146a3eb5029e777a23ec55dee91f/localhost:12355", "unknown", None),
            },
        ),
    ],
)
def test_each_launcher_gives_the_job_key_and_rank_it_set(tmp_path, fixture, namespace, expected):
    root = _proc_from(fixture, tmp_path / "proc")
    for pid, want in expected.items():
        assert placed(root, int(pid), namespace) == want, pid


def test_without_the_environment_the_agents_give_the_same_keys_and_ranks(tmp_path):
    """What an unprivileged exporter reads of the recorded torchrun jobs: the agent alone gives what root got."""
    for fixture in ("torchrun-c10d", "torchrun-standalone"):
        root = _proc_from(fixture, tmp_path / fixture)
        as_root = {pid.name: placed(root, int(pid.name)) for pid in root.iterdir() if (pid / "environ").exists()}
        for pid in as_root:
            (root / pid / "environ").unlink()  # no variables, as for a user that may not read them
        assert {pid: placed(root, int(pid)) for pid in as_root} == as_root, fixture


def test_only_the_launch_variables_are_read_and_unsafe_values_are_dropped():
    raw = (FIXTURES / "kubeflow-pytorchjob" / "41207" / "environ").read_bytes()
    assert b"AWS_SECRET_ACCESS_KEY" in raw  # the fixture carries a secret, as a real pod's environment may
    found = launchers.parse_environ(raw)
    assert "AWS_SECRET_ACCESS_KEY" not in found and "PATH" not in found and found["RANK"] == "0"
    hostile = (
        b"MASTER_ADDR=a b\0MASTER_PORT=29500\0RANK=" + b"9" * 200 + b"\0WORLD_SIZE=\xff\0SLURM_JOB_ID=" + b"x" * 500
    )
    assert launchers.parse_environ(hostile) == {"MASTER_PORT": "29500"}  # spaces, overlong, non-ASCII: dropped
    assert launchers.launch_from(launchers.parse_environ(hostile)).job == ""  # no address: no key, never a guess
    assert launchers.launch_from({"RANK": "9" * 50}).rank == "unknown"  # not a rank: unknown, not exported


@pytest.mark.parametrize(
    ("variables", "expected"),
    [
        # DeepSpeed's launcher: RANK and WORLD_SIZE, else the node rank × processes per node + the local rank
        (
            {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "CROSS_RANK": "1", "CROSS_SIZE": "2",
             "LOCAL_SIZE": "4", "LOCAL_RANK": "3"},
            ("10.0.0.5:29500", "7", 8, "deepspeed"),
        ),
        # Open MPI under a launch script that set the rendezvous; the MPI rank where RANK is not set
        (
            {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "OMPI_COMM_WORLD_RANK": "5",
             "OMPI_COMM_WORLD_SIZE": "16"},
            ("10.0.0.5:29500", "5", 16, "mpi"),
        ),
        # MPICH's Hydra under a PMIx-less launch: no key from MPI alone, the rank still read
        ({"PMI_RANK": "2", "PMI_SIZE": "4"}, ("", "2", 4, "")),
        # any PMIx launcher (Open MPI 5's prterun, srun --mpi=pmix): the namespace is the job's, on every node
        ({"PMIX_RANK": "3", "PMIX_NAMESPACE": "prterun-node1-4242@1"}, ("mpi/prterun-node1-4242@1", "3", None, "mpi")),
        # torchrun: a restart is a new key
        (
            {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29400", "TORCHELASTIC_RUN_ID": "llama7b", "RANK": "9",
             "TORCHELASTIC_RESTART_COUNT": "2"},
            ("10.0.0.5:29400/llama7b#2", "9", None, "torchrun"),
        ),
        # SLURM_JOB_ID alone names no job: any process can set it
        ({"SLURM_JOB_ID": "77", "SLURM_PROCID": "0"}, ("", "unknown", None, "")),
    ],
)  # fmt: skip
def test_each_launcher_row_reads_its_own_variables(variables, expected):
    found = launchers.launch_from(variables)
    assert (found.job, found.rank, found.world_size, found.source) == expected


# --- a loopback rendezvous is its scope's only ---------------------------------------------------------------------


def test_a_loopback_rendezvous_is_kept_to_its_pod_container_or_cgroup(tmp_path):
    """Two namespaces' pods both at localhost:29500: two jobs; two ranks of one pod: one."""
    root = tmp_path / "proc"
    rendezvous = {"MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "WORLD_SIZE": "2"}
    write_process(root, 101, 100, environ={**rendezvous, "RANK": "0"}, cgroup=pod_cgroup(POD_A, "a"))
    write_process(root, 102, 100, environ={**rendezvous, "RANK": "1"}, cgroup=pod_cgroup(POD_A, "a"))
    write_process(root, 201, 200, environ={**rendezvous, "RANK": "1"}, cgroup=pod_cgroup(POD_B, "b"))
    team_a = {placed(root, pid, "team-a")[0] for pid in (101, 102)}
    team_b = placed(root, 201, "team-b")[0]
    assert team_a == {f"local/pod/{POD_A}/localhost:29500"} and team_b == f"local/pod/{POD_B}/localhost:29500"
    # outside Kubernetes: a docker container, else the cgroup (a login session, a systemd unit)
    write_process(root, 301, 300, environ=rendezvous, cgroup=f"0::/system.slice/docker-{'c' * 64}.scope\n")
    write_process(root, 401, 400, environ=rendezvous, cgroup="0::/user.slice/user-1000.slice/session-4.scope\n")
    assert placed(root, 301)[0] == f"local/container/{'c' * 12}/localhost:29500"
    assert placed(root, 401)[0] == "local/cgroup/session-4.scope/localhost:29500"


def test_a_rendezvous_by_name_in_a_pod_of_unknown_namespace_stays_in_the_pod(tmp_path):
    """Without the pod log directory the namespace is not known: `trainer-master-0` may be any namespace's."""
    root = tmp_path / "proc"
    rendezvous = {"MASTER_ADDR": "trainer-master-0", "MASTER_PORT": "23456", "RANK": "0"}
    write_process(root, 101, 100, environ=rendezvous, cgroup=pod_cgroup(POD_A, "a"))
    write_process(root, 102, 100, environ={**rendezvous, "MASTER_ADDR": "10.4.0.7"}, cgroup=pod_cgroup(POD_A, "a"))
    assert placed(root, 101)[0] == f"local/pod/{POD_A}/trainer-master-0:23456"
    assert placed(root, 101, "ml")[0] == "ml/trainer-master-0:23456"
    assert placed(root, 102)[0] == "10.4.0.7:23456"  # a pod IP names one pod cluster-wide


# --- Slurm: only where slurmstepd vouches ---------------------------------------------------------------------------


def slurm_v2(job: int, step: str = "0", task: int = 0) -> str:
    return f"0::/system.slice/slurmstepd.scope/job_{job}/step_{step}/user/task_{task}\n"


def test_a_slurm_job_counts_only_where_its_cgroup_or_slurmstepd_agrees(tmp_path):
    root = tmp_path / "proc"
    real = {"SLURM_JOB_ID": "812", "SLURM_PROCID": "0", "SLURM_NTASKS": "2"}
    write_process(root, 101, 100, environ=real, cgroup=slurm_v2(812))
    v1 = "12:memory:/slurm/uid_1000/job_812/step_0/task_1\n4:devices:/slurm/uid_1000/job_812/step_0\n0::/\n"
    write_process(root, 102, 100, environ={**real, "SLURM_PROCID": "1"}, cgroup=v1)
    assert placed(root, 101) == ("slurm/812", "0", 2) and placed(root, 102) == ("slurm/812", "1", 2)
    # a spoofer: SLURM_JOB_ID=812 in a login session; the same in a look-alike path below its own delegated subtree
    write_process(root, 201, 200, environ=real, cgroup="0::/user.slice/user-1000.slice/session-9.scope\n")
    delegated = (
        "0::/user.slice/user-1000.slice/user@1000.service/app.slice/slurmstepd.scope/job_812/step_0/user/task_0\n"
    )
    write_process(root, 202, 200, environ=real, cgroup=delegated)
    assert placed(root, 201)[0] == "" and placed(root, 202)[0] == ""
    # inside a real job 900, claiming 812: the cgroup's job
    write_process(root, 301, 300, environ=real, cgroup=slurm_v2(900))
    assert placed(root, 301)[0] == "slurm/900"


def test_without_slurm_cgroups_root_s_slurmstepd_parent_names_the_job(tmp_path):
    """proctrack/linuxproc: no cgroup; a slurmstepd parent owned by root vouches, one owned by a user does not."""
    root = tmp_path / "proc"
    write_process(root, 50, 1, argv=["slurmstepd: [41.0]"], comm="slurmstepd", uid=0)
    write_process(root, 51, 50, environ={"SLURM_PROCID": "3", "SLURM_NTASKS": "4"})
    write_process(root, 60, 1, argv=["slurmstepd: [41.0]"], comm="slurmstepd", uid=1000)
    write_process(root, 61, 60, environ={"SLURM_JOB_ID": "41", "SLURM_PROCID": "3"})
    write_process(root, 70, 50, argv=["bash", "job.sh"], comm="bash")  # the task's shell, then the program
    write_process(root, 71, 70)
    assert placed(root, 51) == ("slurm/41", "3", 4)
    assert placed(root, 61)[0] == "" and placed(root, 71)[0] == "slurm/41"


# --- parents, sessions and agents -----------------------------------------------------------------------------------


def test_a_shared_parent_or_session_alone_never_makes_a_job(tmp_path):
    """Eight inference replicas under one supervisor, in one session: eight GPUs, no job; two torchrun jobs started
    from one shell: two jobs."""
    root = tmp_path / "proc"
    write_process(root, 10, 1, argv=["python", "supervisor.py"], children=list(range(11, 19)))
    for pid in range(11, 19):
        write_process(root, pid, 10, argv=["python", "serve.py", "--gpu", str(pid - 11)])
    step = JobsStep(root)
    assert all(step._key(view(pid), 1).source == "lone" for pid in range(11, 19))
    for agent, rdzv, workers in ((20, "29500", (21, 22)), (30, "29600", (31, 32))):
        argv = ["/usr/bin/python3", "/usr/bin/torchrun", "--nnodes=1", "--nproc-per-node=2", "--master-port", rdzv,
                "--master-addr", "127.0.0.1", "train.py"]  # fmt: skip
        write_process(root, agent, 5, argv=argv, children=list(workers))
        for worker in workers:
            write_process(root, worker, agent)
    jobs = {pid: placed(root, pid) for pid in (21, 22, 31, 32)}
    assert jobs[21][0] == jobs[22][0] != jobs[31][0] == jobs[32][0]
    assert [jobs[pid][1] for pid in (21, 22, 31, 32)] == ["0", "1", "0", "1"]


@pytest.mark.parametrize(
    ("argv", "key", "first_rank", "world"),
    [
        # static rendezvous (torchrun's default backend): --node-rank counts
        ("torchrun --nnodes 2 --node_rank=1 --nproc-per-node 4 --master-addr 10.0.0.5 --master-port 29500 "
         "--rdzv-id run42 train.py --nnodes 9", "10.0.0.5:29500/run42", 4, 8),
        # c10d: the nodes are ranked as they join, --node-rank is not used
        ("python -u -m torch.distributed.run --nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint "
         "10.0.0.5 --rdzv-id j --nproc-per-node 2 t.py", "10.0.0.5:29400/j", None, 4),
        # the options come from PET_ variables (Kubeflow): none on the command line, no key from it
        ("torchrun train.py", "", None, None),
        # not an agent
        ("python train.py --master-addr 10.0.0.5", None, None, None),
    ],
)  # fmt: skip
def test_torchrun_agents_are_read_from_their_command_lines(argv, key, first_rank, world):
    agent = agents.parse_agent(argv.split(), 77)
    if key is None:
        assert agent is None
        return
    assert agent is not None and (agent.key(Where()), agent.first_rank, agent.world_size) == (key, first_rank, world)


def test_deepspeed_s_launcher_gives_the_rendezvous_and_each_node_s_first_rank():
    world_info = base64.urlsafe_b64encode(json.dumps({"node-a": [0, 1, 2, 3], "node-b": [0, 1]}).encode()).decode()
    argv = ["/usr/bin/python", "-u", "-m", "deepspeed.launcher.launch", f"--world_info={world_info}", "--node_rank=1",
            "--master_addr=10.0.0.5", "--master_port=29500", "train.py"]  # fmt: skip
    agent = agents.parse_agent(argv, 3)
    assert agent is not None and (agent.key(Where()), agent.rank(1), agent.world_size) == ("10.0.0.5:29500", 5, 6)
    assert agents.parse_agent([*argv[:4], "--world_info=not-base64!", "t.py"], 3).world_size is None


# --- the environment, however large --------------------------------------------------------------------------------


def test_launcher_variables_are_found_at_the_end_of_a_large_environment(tmp_path):
    """4 MiB of other variables (and one overlong entry) before torchrun's: all found; nothing overlong kept."""
    path = tmp_path / "environ"
    filler = b"".join(b"X%d=%s\0" % (i, b"y" * 200) for i in range(20_000))
    path.write_bytes(filler + b"BLOB=" + b"z" * 300_000 + b"\0MASTER_ADDR=10.0.0.5\0MASTER_PORT=29500\0RANK=3")
    assert path.stat().st_size > 4 * 1024 * 1024
    assert launchers.read_environ(path) == {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500", "RANK": "3"}


def test_a_scan_past_its_deadline_keeps_what_it_found(tmp_path):
    path = tmp_path / "environ"
    path.write_bytes(b"RANK=1\0" + b"X=" + b"y" * (3 * launchers.ENVIRON_CHUNK) + b"\0MASTER_PORT=29500\0")
    ticks = iter(range(100))
    found = launchers.read_environ(path, deadline_s=0.5, clock=lambda: next(ticks))  # one second per look
    assert found == {"RANK": "1"}


# --- which sources work ---------------------------------------------------------------------------------------------


def test_the_start_line_says_which_sources_work(tmp_path, caplog):
    """Read as root here, every source works; a /proc that shows no other user's process (ProtectProc=invisible)
    none. What an unprivileged exporter reads: tests/test_jobs_unprivileged.py."""
    root = tmp_path / "proc"
    write_process(root, 1, 0, argv=["/sbin/init"], environ={"HOME": "/"})
    with caplog.at_level(logging.INFO, logger="gpuwarden.jobs.sources"):
        step = JobsStep(root)
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == "job identity sources: cgroup ok, cmdline ok, environ ok", line
    assert step._states.snapshot() == {"cgroup": True, "cmdline": True, "environ": True}
    hidden = tmp_path / "hidden"
    (hidden / "self").mkdir(parents=True)  # ProtectProc=invisible: no other user's PID
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="gpuwarden.jobs.sources"):
        assert JobsStep(hidden)._states.snapshot() == {"cgroup": False, "cmdline": False, "environ": False}
    assert "ProtectProc=default" in caplog.records[0].getMessage()


def test_stat_is_read_past_a_command_name_with_parentheses():
    assert procfs.parse_stat("4242 (py (thon) x) S 17 4242 4200 0 -1") == procfs.Stat("py (thon) x", 17, 4200, 0)
    assert procfs.parse_stat("garbage") is None


# --- the pod API's answer ------------------------------------------------------------------------------------------


def test_a_pods_spec_gives_only_literal_launcher_variables_and_its_labels_a_job():
    from gpuwarden.jobs.pod_api import parse_pod

    pod = parse_pod({
        "metadata": {"uid": POD_A, "namespace": "ml", "labels": {"leaderworkerset.sigs.k8s.io/name": "llama-serve",
                                                                 "leaderworkerset.sigs.k8s.io/group-index": "3"}},
        "spec": {"containers": [
            {"name": "main", "env": [{"name": "MASTER_ADDR", "value": "10.0.0.5"},
                                     {"name": "MASTER_PORT", "value": "29500"},
                                     {"name": "RANK", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                                     {"name": "HF_TOKEN", "value": "hf_secret"}, "not a dict"]},
            {"name": "sidecar"},
        ]},
        "status": {"containerStatuses": [{"name": "main", "containerID": "containerd://" + "a" * 64}]},
    })  # fmt: skip
    assert pod.variables("a" * 64) == {"MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "29500"}  # no secret, no reference
    assert pod.variables("b" * 64) == {}  # two containers, none of them the process's: nothing guessed
    assert pod.job_key() == "ml/lws/llama-serve/3"  # each LeaderWorkerSet group is a job of its own
    assert parse_pod({"metadata": None, "spec": {"containers": None}}).job_key() == ""  # odd fields: no crash
