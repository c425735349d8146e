"""The job diagnosis cases (issue 49), one family after another: what runs on the simulated node, what its host
/proc shows, and what a right diagnosis names. The numbers are mixes of the signatures measured on 2x and 4x H200
(tests/helpers/job_cases.py); each case's comment says what it probes. Here: the builders and the cases with nothing
to name (balanced, no NVLink, pipelines, warm-ups, all ranks alike, the grouping families); the cases with a
straggler or a hang: tests/job_case_named.py.
"""

from __future__ import annotations

from tests.helpers.job_cases import (
    ASLEEP,
    BALANCED,
    COMPUTE,
    DECODE,
    IDLE,
    RUNNING,
    SPIN,
    Case,
    Expect,
    Host,
    Proc,
    Values,
    mix,
    slower,
)

ONSET, END = 120.0, 240.0
PIDS = (5001, 5002, 5003, 5004, 5005, 5006, 5007, 5008)
# a GPU-bound bf16 job, balanced: each rank computes 95 % of the time and waits a little in each all-reduce
HEAVY = mix((COMPUTE, 0.95), (SPIN, 0.05))
QUIET_LINKS = ((0.0, 18e9), (ONSET, 0.0))  # NVLink, both ways: a job's traffic, then nothing moves
NVLINK_NONE = {"model": "h100-sxm-80gb", "count": 4, "nvlink": "none"}
NVSWITCH_8 = {"model": "h100-sxm-80gb", "count": 8, "nvlink": "nvswitch"}
SLURM_CGROUP = "0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_{task}\n"
POD_CGROUP = (
    "0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{uid}.slice/cri-containerd-{container}.scope\n"
)


def one_slower(rank: int, k: float) -> dict[int, Values]:
    """Per-rank activity of a job in which `rank` is `k` times slower than the others (-1: every other rank)."""
    slow, peers = slower(k)
    return {rank: slow, -1: peers}


def pcie_both_ways(rate: float, gpus: int = 4) -> dict[int, dict[str, float]]:
    """Each GPU's PCIe traffic, `rate` bytes per second each way: an all-reduce over PCIe."""
    return {g: {"pcie_rx_bytes_per_second": rate, "pcie_tx_bytes_per_second": rate} for g in range(gpus)}


def torchrun(rank: int, world: int = 4, addr: str = "10.1.2.3", port: int = 29500, run: str = "bert") -> dict:
    return {
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": run,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
    }


def ranks(count: int = 4, host: dict[int, tuple] | None = None, env=torchrun, **extra) -> tuple[Proc, ...]:  # noqa: ANN001
    """`count` ranks of one torchrun job, one per GPU, children of one agent; `host`: rank → host timeline."""
    return tuple(
        Proc(PIDS[g], g, environ=env(g, count) if env else None, host=(host or {}).get(g, ((0.0, RUNNING),)), **extra)
        for g in range(count)
    )


def gpus(count: int, *changes: tuple[float, dict[int, Values]], start: Values = BALANCED) -> dict:
    """Every GPU at `start`, then at each (t, {gpu: readings}) those GPUs change; GPUs not named go back to
    `start`'s signature (a rank that stops straggling)."""
    timeline: dict[int, list[tuple[float, Values]]] = {g: [(0.0, start)] for g in range(count)}
    for t, values in changes:
        for g in range(count):
            if timeline[g][-1][0] >= t:  # a change at the start replaces the starting signature
                timeline[g].pop()
            timeline[g].append((t, values.get(g, values.get(-1, start))))
    return {g: tuple(segments) for g, segments in timeline.items()}


def straggle(count: int, straggler: dict[int, Values], peers: Values, base: Values = BALANCED) -> dict:
    """Balanced until ONSET; from then the stragglers' readings and every other GPU's `peers`, until END."""
    return gpus(count, (ONSET, {**straggler, -1: peers}), (END, {}), start=base)


def onset_host(host: Host, start: float = ONSET, end: float = END) -> tuple:
    return ((0.0, RUNNING), (start, host), (end, RUNNING))


def negatives() -> list[Case]:
    return [
        Case("balanced-4", "balanced with jitter", gpus(4), ranks(), seconds=220),
        Case(
            "balanced-8",
            "balanced with jitter",
            gpus(8),
            ranks(8),
            seconds=220,
            node=NVSWITCH_8,
        ),
        # a GPU-bound job whose ranks differ by 5 % (the normal spread), never a straggler
        Case(
            "heavy-jitter",
            "balanced with jitter",
            gpus(4, (0.0, one_slower(1, 1.05)), start=HEAVY),
            ranks(),
            seconds=220,
        ),
        # no NVLink: the all-reduce crosses PCIe; every rank alike: busy, SMs near NCCL's, 6 GB/s each way
        Case(
            "pcie-comm-bound",
            "no NVLink",
            gpus(4, start={"utilization": 93, "sm_active": 18, "tensor_active": 2, "fp32_active": 0, "dram_active": 8}),
            ranks(),
            seconds=220,
            node=NVLINK_NONE,
            extra=pcie_both_ways(6e9),
        ),
        # no NVLink, a light all-reduce (60 MB/s): the ranks spin-like, the data still moves: never a hang
        Case(
            "pcie-light-comm",
            "no NVLink",
            gpus(4, start=SPIN),
            ranks(),
            seconds=220,
            node=NVLINK_NONE,
            extra=pcie_both_ways(6e7),
        ),
        # pipeline parallelism, a heavy last stage from the job's start: the others wait 40 % of each step, always
        Case(
            "pipeline-last-heavy",
            "pipeline imbalance",
            gpus(4, (0.0, one_slower(3, 1.7)), start=HEAVY),
            ranks(),
            seconds=240,
        ),
        # light stages that compute 10 % of each step and spin the rest (the spin signature), from the start
        Case(
            "pipeline-light-stages",
            "pipeline imbalance",
            gpus(4, (0.0, {3: HEAVY, -1: mix((COMPUTE, 0.1), (SPIN, 0.9))}), start=HEAVY),
            ranks(),
            seconds=240,
        ),
        Case(
            "pipeline-first-heavy-8",
            "pipeline imbalance",
            gpus(8, (0.0, one_slower(0, 1.4)), start=HEAVY),
            ranks(8),
            seconds=240,
            node=NVSWITCH_8,
        ),
        # torch.compile on rank 0 takes 90 s longer (its GPU idles, its main thread compiles) while the others
        # wait in the first all-reduce; then the job runs balanced
        Case(
            "warmup-compile",
            "warm-up skew",
            gpus(4, (0.0, {0: IDLE, -1: SPIN}), (90.0, {})),
            ranks(host={0: ((0.0, RUNNING),)}),
            seconds=220,
        ),
        # autotuning on rank 2's GPU for 60 s before the first step
        Case(
            "warmup-autotune", "warm-up skew", gpus(4, (0.0, {2: COMPUTE, -1: SPIN}), (60.0, {})), ranks(), seconds=200
        ),
        # every rank writes its shard of a checkpoint for 40 s: all GPUs idle alike
        Case(
            "all-checkpoint",
            "all ranks checkpointing",
            gpus(4, (ONSET, {-1: IDLE}), (ONSET + 40, {})),
            ranks(host={g: onset_host(Host("D", write_bytes_per_second=6e8), end=ONSET + 40) for g in range(4)}),
            seconds=220,
        ),
        # every rank's loader falls behind: the GPUs wait alike
        Case(
            "all-input-bound",
            "all ranks input-bound",
            gpus(4, (ONSET, {-1: mix((BALANCED, 0.4), (IDLE, 0.6))})),
            ranks(host={g: onset_host(Host("S", 4, 4), end=400) for g in range(4)}),
            seconds=220,
        ),
        # rank 0 saves a checkpoint for 8 s each minute while the others wait: shorter than a straggler
        Case(
            "rank0-short-checkpoints",
            "balanced with jitter",
            gpus(4, *[(t + d, ({0: IDLE, -1: SPIN} if d == 0 else {})) for t in (100, 160) for d in (0, 8)]),
            ranks(
                host={
                    0: (
                        (0.0, RUNNING),
                        (100, Host("D", write_bytes_per_second=8e8)),
                        (108, RUNNING),
                        (160, Host("D", write_bytes_per_second=8e8)),
                        (168, RUNNING),
                    )
                }
            ),
            seconds=220,
        ),
    ]


def replicas(node: dict, name: str) -> Case:
    """Four inference replicas started by one supervisor (one parent, one session), no launcher variables:
    three serve requests (decode, memory-bound), the fourth idles."""
    procs = tuple(
        Proc(
            PIDS[g],
            g,
            ppid=4000,
            session=4000,
            cmdline=("python", "-m", "vllm.entrypoints"),
            host=((0.0, ASLEEP if g == 3 else RUNNING),),
        )
        for g in range(4)
    )
    return Case(
        name,
        "inference replicas",
        gpus(4, (0.0, {3: IDLE, -1: DECODE})),
        procs,
        seconds=200,
        node=node,
        groups=((0,), (1,), (2,), (3,)),
        grouping=True,
    )


def grouping() -> list[Case]:
    # two single-GPU jobs started from one shell (`python a.py & python b.py &`): one computes, one waits on data
    shell = (
        Proc(PIDS[0], 0, ppid=3000, session=3000, host=((0.0, RUNNING),)),
        Proc(PIDS[1], 1, ppid=3000, session=3000, host=((0.0, Host("S", 2, 2)),)),
    )
    two = {"model": "h100-sxm-80gb", "count": 2, "nvlink": "nvswitch"}
    uid_a, uid_b = "3f1c2a4e_8b7d_4c1e_9a55_2d6f0e7b1c90", "7a2b9c1d_1111_4e2f_8a3b_5c6d7e8f9a0b"
    loopback = tuple(
        Proc(
            PIDS[g],
            g,
            ppid=4100 + g // 2,
            session=4100 + g // 2,
            environ={"MASTER_ADDR": "localhost", "MASTER_PORT": "29500", "RANK": str(g % 2), "WORLD_SIZE": "2"},
            cgroup=POD_CGROUP.format(uid=uid_a if g < 2 else uid_b, container=("a" if g < 2 else "b") * 64),
            host=((0.0, RUNNING if g < 2 else ASLEEP),),
        )
        for g in range(4)
    )
    slurm = tuple(
        Proc(
            PIDS[g],
            g,
            ppid=4200,
            session=4200,
            cgroup=SLURM_CGROUP.format(job=812, task=g),
            environ={"SLURM_JOB_ID": "812", "SLURM_PROCID": str(g), "SLURM_NTASKS": "3"},
            host=onset_host(Host("R")) if g == 1 else ((0.0, RUNNING),),
        )
        for g in range(3)
    ) + (
        Proc(
            PIDS[3],
            3,
            ppid=4300,
            session=4300,
            environ={"SLURM_JOB_ID": "812", "SLURM_PROCID": "1"},
            host=((0.0, ASLEEP),),
        ),
    )
    big = tuple(
        Proc(
            PIDS[g],
            g,
            environ=torchrun(g, 2),
            environ_padding=300 * 1024 if g == 1 else 0,
            host=onset_host(Host("R")) if g == 1 else ((0.0, RUNNING),),
        )
        for g in range(2)
    )
    return [
        replicas({"model": "h100-sxm-80gb", "count": 4, "nvlink": "nvswitch"}, "replicas-one-supervisor"),
        replicas(NVLINK_NONE, "replicas-pcie"),
        Case(
            "two-jobs-one-shell",
            "unrelated jobs, one shell",
            gpus(2, (0.0, {1: IDLE, -1: COMPUTE})),
            shell,
            seconds=200,
            node=two,
            groups=((0,), (1,)),
            grouping=True,
        ),
        Case(
            "loopback-two-namespaces",
            "loopback rendezvous across namespaces",
            gpus(4, (0.0, {2: IDLE, 3: IDLE, -1: BALANCED})),
            loopback,
            seconds=200,
            groups=((0, 1), (2, 3)),
            grouping=True,
            pod_logs=(f"team-a_train-a-0_{uid_a.replace('_', '-')}", f"team-b_train-b-0_{uid_b.replace('_', '-')}"),
        ),
        # rank 1 of Slurm job 812 turns CPU-bound; a process outside the job sets SLURM_JOB_ID=812 and idles
        Case(
            "spoofed-slurm-env",
            "spoofed launcher environment",
            gpus(4, (0.0, {3: IDLE, -1: BALANCED}), (ONSET, {1: IDLE, 3: IDLE, -1: SPIN}), (END, {3: IDLE})),
            slurm,
            expect=(Expect("straggler", 1, ONSET, END, "cpu"),),
            groups=((0, 1, 2), (3,)),
            grouping=True,
        ),
        # 300 KiB of other variables before torchrun's: the rank must still be found in its job
        Case(
            "large-environment",
            "spoofed launcher environment",
            straggle(2, {1: IDLE}, SPIN),
            big,
            seconds=200,
            node=two,
            expect=(Expect("straggler", 1, ONSET, END, "cpu"),),
            groups=((0, 1),),
            grouping=True,
        ),
    ]
