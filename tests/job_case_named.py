"""The job diagnosis cases with something to name (issue 49): hangs, stragglers of every cause, two at once, one
that moves, co-tenants; and every case of the suite (`all_cases`). The builders and the cases with nothing to name:
tests/job_case_list.py.
"""

from __future__ import annotations

from typing import Any

from tests.helpers.job_cases import ASLEEP, IDLE, RUNNING, SPIN, Case, Expect, Host, Proc, Values, slower
from tests.job_case_list import (
    END,
    HEAVY,
    NVLINK_NONE,
    NVSWITCH_8,
    ONSET,
    QUIET_LINKS,
    gpus,
    grouping,
    negatives,
    onset_host,
    ranks,
    straggle,
)


def hangs() -> list[Case]:
    stopped = {2: IDLE, -1: SPIN}
    stop_host = {2: ((0.0, RUNNING), (ONSET, ASLEEP))}
    pcie_quiet = {
        g: {
            "pcie_rx_bytes_per_second": {"steps": [[0, 4e9], [ONSET, 3e5]]},
            "pcie_tx_bytes_per_second": {"steps": [[0, 4e9], [ONSET, 3e5]]},
        }
        for g in range(4)
    }
    return [
        # rank 2 stops in its host code; the others spin in the all-reduce and nothing moves
        Case(
            "hung-rank",
            "hung rank",
            gpus(4, (ONSET, stopped)),
            ranks(host=stop_host),
            expect=(Expect("collective_hang", 2, ONSET, within=100),),
            seconds=240,
            links=QUIET_LINKS,
        ),
        Case(
            "hung-job",
            "hung rank",
            gpus(4, (ONSET, {-1: SPIN})),
            ranks(),
            expect=(Expect("collective_hang", None, ONSET, within=100),),
            seconds=240,
            links=QUIET_LINKS,
        ),
        # no NVLink: PCIe goes quiet, the positive evidence of no progress
        Case(
            "hung-rank-pcie",
            "hung rank",
            gpus(4, (ONSET, stopped)),
            ranks(host=stop_host),
            node=NVLINK_NONE,
            extra=pcie_quiet,
            expect=(Expect("collective_hang", 2, ONSET, within=100),),
            seconds=240,
        ),
        # an RDMA NIC on the host, quiet too: still a hang
        Case(
            "hung-rank-rdma-quiet",
            "hung rank",
            gpus(4, (ONSET, stopped)),
            ranks(host=stop_host),
            nic=((0.0, 2e9), (ONSET, 0.0)),
            links=QUIET_LINKS,
            seconds=240,
            expect=(Expect("collective_hang", 2, ONSET, within=100),),
        ),
        # the same stop, but the host's RDMA NIC still carries 2 GB/s: no proof that nothing moves, so no hang;
        # the stopped rank is named as the straggler
        Case(
            "stopped-rank-rdma-busy",
            "hung rank",
            gpus(4, (ONSET, stopped)),
            ranks(host=stop_host),
            nic=((0.0, 2e9),),
            links=QUIET_LINKS,
            seconds=240,
            expect=(Expect("straggler", 2, ONSET, cause="unknown"),),
        ),
    ]


def slower_gpu(name: str, label: str, rank: int, k: float, condition: dict[str, Any]) -> Case:
    """One of four ranks on a GPU `k` times slower from ONSET to END, for the reason `condition` shows (its clocks,
    clock-event reasons, power limit): named the straggler, its cause the slower GPU."""
    slow, peers = slower(k)
    return Case(
        name,
        label,
        straggle(4, {rank: slow}, peers, HEAVY),
        ranks(),
        extra={rank: condition},
        expect=(Expect("straggler", rank, ONSET, END, "slower_gpu"),),
        seconds=260,
    )


def stragglers() -> list[Case]:
    throttled = {
        "clock_event_reasons": {"steps": [[0, 0], [ONSET, 0x40], [END, 0]]},
        "sm_clock_mhz": {"steps": [[0, 1980], [ONSET, 1100], [END, 1980]]},
        "temperature": 88,
    }
    mild = {
        "clock_event_reasons": {"steps": [[0, 0], [ONSET, 0x20], [END, 0]]},
        "sm_clock_mhz": {"steps": [[0, 1980], [ONSET, 1600], [END, 1980]]},
    }
    capped = {
        "clock_event_reasons": {"steps": [[0, 0], [ONSET, 0x4], [END, 0]]},
        "power_limit_watts": {"steps": [[0, 700], [ONSET, 400], [END, 700]]},
        "sm_clock_mhz": {"steps": [[0, 1980], [ONSET, 1400], [END, 1980]]},
    }
    clock_only = {"sm_clock_mhz": {"steps": [[0, 1980], [ONSET, 1320], [END, 1980]]}}
    return [
        Case(
            "cpu-bound-rank",
            "CPU-bound rank",
            straggle(4, {1: IDLE}, SPIN),
            ranks(host={1: onset_host(RUNNING)}),
            expect=(Expect("straggler", 1, ONSET, END, "cpu"),),
            seconds=260,
        ),
        Case(
            "cpu-bound-rank-pcie",
            "CPU-bound rank",
            straggle(4, {1: IDLE}, SPIN),
            ranks(host={1: onset_host(RUNNING)}),
            node=NVLINK_NONE,
            seconds=260,
            extra={
                g: {
                    "pcie_rx_bytes_per_second": {"steps": [[0, 4e9], [ONSET, 3e8], [END, 4e9]]},
                    "pcie_tx_bytes_per_second": {"steps": [[0, 4e9], [ONSET, 3e8], [END, 4e9]]},
                }
                for g in range(4)
            },
            expect=(Expect("straggler", 1, ONSET, END, "cpu"),),
        ),
        Case(
            "input-bound-rank",
            "CPU-bound rank",
            straggle(4, {2: IDLE}, SPIN),
            ranks(host={2: onset_host(Host("S", 4, 4))}),
            expect=(Expect("straggler", 2, ONSET, END, "input"),),
            seconds=260,
        ),
        Case(
            "checkpoint-rank",
            "CPU-bound rank",
            gpus(4, (ONSET, {0: IDLE, -1: SPIN}), (ONSET + 60, {})),
            ranks(host={0: onset_host(Host("D", write_bytes_per_second=8e8), end=ONSET + 60)}),
            seconds=220,
            expect=(Expect("straggler", 0, ONSET, ONSET + 60, "io"),),
        ),
        Case(
            "sleeping-rank",
            "CPU-bound rank",
            straggle(4, {3: IDLE}, SPIN),
            ranks(host={3: onset_host(ASLEEP)}),
            expect=(Expect("straggler", 3, ONSET, END, "unknown"),),
            seconds=260,
        ),
        Case(
            "eight-ranks-one-slow",
            "CPU-bound rank",
            straggle(8, {5: IDLE}, SPIN),
            ranks(8, host={5: onset_host(RUNNING)}),
            node=NVSWITCH_8,
            expect=(Expect("straggler", 5, ONSET, END, "cpu"),),
            seconds=220,
        ),
        slower_gpu("throttled-1.8x", "throttled rank", 0, 1.8, throttled),
        slower_gpu("throttled-1.25x", "throttled rank", 2, 1.25, mild),
        slower_gpu("power-capped-1.4x", "power-capped rank", 3, 1.4, capped),
        slower_gpu("slower-clock-1.5x", "throttled rank", 1, 1.5, clock_only),
        Case(
            "two-throttled",
            "two stragglers",
            straggle(4, {1: slower(1.6)[0], 3: slower(1.6)[0]}, slower(1.6)[1], HEAVY),
            ranks(),
            extra={1: throttled, 3: throttled},
            seconds=260,
            expect=(Expect("straggler", 1, ONSET, END, "slower_gpu"), Expect("straggler", 3, ONSET, END, "slower_gpu")),
        ),
        Case(
            "two-cpu-bound",
            "two stragglers",
            straggle(4, {1: IDLE, 2: IDLE}, SPIN),
            ranks(host={1: onset_host(RUNNING), 2: onset_host(RUNNING)}),
            seconds=260,
            expect=(Expect("straggler", 1, ONSET, END, "cpu"), Expect("straggler", 2, ONSET, END, "cpu")),
        ),
        moving(),
        *cotenants(),
    ]


def moving() -> Case:
    """A CPU-bound straggler that moves to the next rank every 30 s: each named within 30 s of its onset, each
    cleared within 30 s of its end."""
    changes = [(ONSET + 30 * k, {k % 4: IDLE, -1: SPIN}) for k in range(4)]
    host = {g: ((0.0, RUNNING),) for g in range(4)}
    expect = tuple(Expect("straggler", k % 4, ONSET + 30 * k, ONSET + 30 * (k + 1), "cpu", within=30) for k in range(4))
    return Case(
        "moving-straggler",
        "moving straggler",
        gpus(4, *changes, (END, {})),
        ranks(host=host),
        expect=expect,
        seconds=280,
        clear_within=30,
    )


# a co-located bf16 matmul beside a rank, as measured on 2x H200: the rank's GPU busy 99 %, SM 88 %; its peers wait
# part of each step (busy 77 %, SM 43 %, tensor 9 %)
SHARED: Values = {
    "utilization": 99,
    "sm_active": 88,
    "tensor_active": 52,
    "fp32_active": 1,
    "dram_active": 35,
    "nvlink": 8e9,
}
PARTIAL: Values = {
    "utilization": 77,
    "sm_active": 43,
    "tensor_active": 9,
    "fp32_active": 1,
    "dram_active": 18,
    "nvlink": 8e9,
}


def cotenants() -> list[Case]:
    def tenant(gpu: int, pid: int) -> Proc:
        return Proc(
            pid,
            gpu,
            ppid=1,
            session=pid,
            memory_gib=4,
            sm=((0.0, 60.0),),
            at=ONSET,
            until=END,
            cmdline=("python3", "bench.py"),
            cgroup="0::/user.slice/user-2000.slice/session-9.scope\n",
        )

    return [
        Case(
            "one-cotenant",
            "co-tenant",
            straggle(4, {1: SHARED}, PARTIAL),
            ranks() + (tenant(1, 6001),),
            expect=(Expect("straggler", 1, ONSET, END, "slower_gpu"),),
            seconds=260,
        ),
        Case(
            "two-cotenants",
            "co-tenant",
            straggle(4, {1: SHARED, 3: SHARED}, PARTIAL),
            ranks() + (tenant(1, 6001), tenant(3, 6003)),
            seconds=260,
            expect=(Expect("straggler", 1, ONSET, END, "slower_gpu"), Expect("straggler", 3, ONSET, END, "slower_gpu")),
        ),
    ]


def all_cases() -> list[Case]:
    return negatives() + grouping() + hangs() + stragglers()
