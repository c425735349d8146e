"""The job view's evidence, part by part (issue 49): the host's RDMA counters read from a sysfs tree written here (the
kernel's layout: class/infiniband/<device>/ports/<port>/counters, data in units of four octets), the proof of no
progress over every path, and a job's usual waits. The case suite (tests/test_job_cases.py) runs them together."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.health.thresholds import DEFAULT
from gpuwarden.jobs.onset import UsualWaits
from gpuwarden.jobs.progress import evidence
from gpuwarden.jobs.rdma import NO_PORTS, RdmaCounters, RdmaRate


def write_ports(root: Path, units: int, ports: int = 2) -> None:
    for port in range(1, ports + 1):
        counters = root / "class" / "infiniband" / "mlx5_0" / "ports" / str(port) / "counters"
        counters.mkdir(parents=True, exist_ok=True)
        (counters / "port_xmit_data").write_text(f"{units}\n")
        (counters / "port_rcv_data").write_text(f"{units}\n")


def test_rdma_counters_count_four_octets_per_unit_over_every_port(tmp_path: Path) -> None:
    counters = RdmaCounters(tmp_path)
    for t in range(0, 31, 5):
        write_ports(tmp_path, 250_000 * t)  # each of 4 counters: 1 MB/s
        counters.sample(float(t), 30)
    assert counters.rate(30.0, 20) == RdmaRate(2, pytest.approx(4e6))
    assert counters.rate(30.0, 60) == RdmaRate(2, None)  # not watched that long: no evidence


def test_a_host_without_rdma_has_no_such_path_and_an_unreadable_counter_is_no_evidence(tmp_path: Path) -> None:
    none = RdmaCounters(tmp_path)
    none.sample(0.0, 30)
    assert none.rate(30.0, 20) == NO_PORTS and RdmaCounters(None).rate(0.0, 20) == NO_PORTS
    broken = RdmaCounters(tmp_path / "b")
    write_ports(tmp_path / "b", 7)
    for t in range(0, 31, 5):
        if t == 20:
            (tmp_path / "b" / "class/infiniband/mlx5_0/ports/1/counters/port_rcv_data").write_text("gone\n")
        broken.sample(float(t), 40)
    assert broken.rate(30.0, 20) == RdmaRate(2, None)


def window(
    nvlink: float = 0.0, pcie: float = 3e5, paths: frozenset[str] = frozenset({"nvlink", "pcie"})
) -> WindowActivity:
    return WindowActivity(True, 0.2, nvlink_bytes_per_second=nvlink, pcie_rx_bytes_per_second=pcie / 2,
                          busy=0.99, pcie_tx_bytes_per_second=pcie / 2, paths=paths)  # fmt: skip


@pytest.mark.parametrize(
    ("gpus", "rdma", "across", "stopped", "words"),
    [
        ([(window(), True), (window(), True)], NO_PORTS, False, True, "NVLink 0.0 MB/s"),
        # no NVLink: PCIe carries the all-reduce; quiet there too is a stop, moving is none
        ([(window(), False)] * 2, NO_PORTS, False, True, "PCIe 0.3 MB/s"),
        ([(window(pcie=6e7), False)] * 2, NO_PORTS, False, False, "PCIe 60.0 MB/s"),
        # NVLink's counters not read over the window: no evidence, whatever the rest says
        ([(window(paths=frozenset({"pcie"})), True)] * 2, NO_PORTS, False, False, "not read"),
        # the host's RDMA ports: quiet, a stop; busy, none; a job across nodes needs them read
        ([(window(), True)] * 2, RdmaRate(2, 0.0), False, True, "RDMA 0.0 MB/s"),
        ([(window(), True)] * 2, RdmaRate(2, 2e9), False, False, "RDMA 2000.0 MB/s"),
        ([(window(), True)] * 2, NO_PORTS, True, False, "RDMA (no port)"),
        ([(window(), True)] * 2, RdmaRate(1, None), False, False, "not read over the window: RDMA"),
    ],
)
def test_no_progress_needs_every_path_read_and_quiet(gpus, rdma, across, stopped, words) -> None:
    found = evidence(DEFAULT, gpus, rdma, across)
    assert found.stopped is stopped and words in found.detail, found


def test_usual_waits_learn_from_windows_in_which_the_job_computed_only() -> None:
    usual = UsualWaits()
    usual.add(0.0, {"a": 0.4, "b": 0.0}, True, 1.0, 3600, {"b"})  # a pipeline's light stage waits 40 %
    usual.add(1.0, {"a": 0.0, "b": 0.0}, False, 1.0, 3600, set())  # a checkpoint: every GPU idle, says nothing
    assert usual.usual("a", 0.0) == 0.4 and usual.never_computed("a") and not usual.never_computed("b")
    assert not usual.onset({"a": 0.45}, 0.0, 0.15)  # as usual: no onset
    assert usual.onset({"a": 0.7}, 0.0, 0.15)
    assert UsualWaits().usual("a", 0.0) is None and not UsualWaits().onset({"a": 1.0}, 0.0, 0.15)
    usual.add(4000.0, {"a": 0.9, "b": 0.0}, True, 1.0, 3600, {"a", "b"})  # the first window left the baseline
    assert usual.usual("a", 0.0) == 0.9
