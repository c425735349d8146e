"""The parts of `gpuwarden validate` that read nvidia-smi output, on real captures from an H100 host."""

from __future__ import annotations

from pathlib import Path

from gpuwarden.cli.validate import Comparison, active_nvlinks, parse_topology

VALIDATION = Path(__file__).resolve().parent.parent / "docs" / "validation" / "2026-11-26-h200x2-core-smoke"


def test_parse_topology_of_a_real_nvlink_pair():
    text = (VALIDATION / "nvidia-smi-topo.txt").read_text()
    assert parse_topology(text) == {(0, 0): "X", (0, 1): "NV18", (1, 0): "NV18", (1, 1): "X"}


def test_parse_topology_with_pcie_levels():
    text = (
        "\tGPU0\tGPU1\tGPU2\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tPIX\tSYS\t0-15\t0\nGPU1\tPIX\t X \tSYS\t0-15\t0\nGPU2\tSYS\tSYS\t X \t16-31\t1\n"
    )
    matrix = parse_topology(text)
    assert matrix[(0, 1)] == "PIX" and matrix[(2, 0)] == "SYS" and matrix[(2, 2)] == "X"


def test_active_nvlinks_counts_links_with_a_speed():
    text = (VALIDATION / "nvidia-smi-nvlink.txt").read_text()
    assert active_nvlinks(text) == {0: 18, 1: 18}
    assert active_nvlinks("GPU 0: NVIDIA H100 (UUID: x)\n\t Link 0: <inactive>\n\t Link 1: 26.562 GB/s\n") == {0: 1}


def test_comparison_tolerances():
    cmp = Comparison()
    cmp.near("0", "t", 40, 42, 3)
    cmp.near("0", "t", 40, 44, 3)
    cmp.near("0", "fan", None, None, 2)
    cmp.near("0", "fan", 0.5, None, 2)
    cmp.equal("0", "name", "NVIDIA H200", "NVIDIA H200")
    assert [row.match for row in cmp.rows] == [True, False, True, False, True]
