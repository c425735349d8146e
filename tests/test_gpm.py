"""Profiling-class activity from GPM, through the real pynvml over the simulator's GPM: counters whose rates are the
scenario's activity, GPUs without GPM, NO_PERMISSION, a failing sample, a GPU reset, the bottleneck classes."""

from __future__ import annotations

import logging

import pytest

from gpuwarden.health.bottleneck import WindowActivity, bottleneck_class
from gpuwarden.health.diagnosis import diagnose
from gpuwarden.health.thresholds import DEFAULT
from tests.helpers.common import poll_series, sweep, values, write_yaml


def run(sim, scenario, seconds: int = 12, tmp_path=None, **sections):
    if tmp_path is not None:
        sections["health"] = {"thresholds_file": str(write_yaml(tmp_path / "t.yaml", {"bottleneck_window_s": 6}))}
    return poll_series(sim, scenario, seconds, **sections)


def share(series, name: str, gpu: str = "0", **labels: str) -> float:
    """Mean activity over the run from the counters, as rate(x) / rate(window) would give it."""
    first, last = series[1], series[-1]
    window = (
        values(last, "gpuwarden_gpm_window_seconds_total", gpu=gpu)[0]
        - values(first, "gpuwarden_gpm_window_seconds_total", gpu=gpu)[0]
    )
    return (values(last, name, gpu=gpu, **labels)[0] - values(first, name, gpu=gpu, **labels)[0]) / window


def test_counters_average_to_the_scenarios_activity(sim):
    _, series = run(sim, "training")
    # training: utilization 100/35 at 92 % duty (≈ 94.8 %), tensor 72/5 at 92 % (≈ 66.6 %), SM = 0.9 × utilization
    assert share(series, "gpuwarden_gpm_pipe_active_seconds_total", pipe="tensor") == pytest.approx(0.666, abs=0.03)
    assert share(series, "gpuwarden_gpm_sm_active_seconds_total") == pytest.approx(0.9 * 0.948, abs=0.03)
    assert share(series, "gpuwarden_gpm_graphics_active_seconds_total") == pytest.approx(0.948, abs=0.03)
    nvlink = share(series, "gpuwarden_nvlink_bytes_total", direction="tx")
    assert nvlink == pytest.approx(4.0e10, rel=0.1)  # bytes per second of window
    pcie = share(series, "gpuwarden_pcie_bytes_total", direction="rx")  # from GPM on a GPU that has it
    assert pcie == pytest.approx(3.5e9, rel=0.15)
    # every counter only grows
    for name in ("gpuwarden_gpm_window_seconds_total", "gpuwarden_gpm_sm_active_seconds_total"):
        readings = [values(s, name, gpu="3")[0] for s in series[1:]]
        assert readings == sorted(readings)


def test_a_gpu_without_gpm_has_no_profiling_series_and_the_others_keep_theirs(sim):
    pipeline, series = run(
        sim,
        {
            "node": {"count": 2},
            "faults": [{"kind": "not_supported", "gpu": 1, "call": "nvmlGpmQueryDeviceSupport", "at": 0}],
        },
        seconds=4,
    )
    last = series[-1]
    assert values(last, "gpuwarden_gpm_window_seconds_total", gpu="0")
    assert values(last, "gpuwarden_gpm_window_seconds_total", gpu="1") == []
    assert values(last, "gpuwarden_gpm_unavailable_info", gpu="1") == []  # no GPM is not a fault
    errors = {k: v for k, v in pipeline.snapshot.collect_errors.items() if k[0] == "nvmlGpmQueryDeviceSupport"}
    assert errors == {("nvmlGpmQueryDeviceSupport", "not_supported"): 1}


def test_pre_hopper_gpus_have_no_profiling_series(sim):
    _, series = run(sim, "legacy-pcie", seconds=3)
    assert not [key for key in series[-1] if key[0].startswith("gpuwarden_gpm_")]


def test_no_permission_is_one_line_and_a_gauge(sim, caplog):
    caplog.set_level(logging.WARNING)
    fault = {"kind": "error", "gpu": 0, "call": "nvmlGpmQueryDeviceSupport", "code": "no_permission", "at": 0}
    _, series = run(sim, {"node": {"count": 2}, "faults": [fault]}, seconds=4)
    assert values(series[-1], "gpuwarden_gpm_unavailable_info", gpu="0", reason="no_permission") == [1]
    assert values(series[-1], "gpuwarden_gpm_window_seconds_total", gpu="0") == []
    assert values(series[-1], "gpuwarden_gpm_window_seconds_total", gpu="1")
    lines = [r.getMessage() for r in caplog.records if "no_permission" in r.getMessage()]
    assert len(lines) == 1 and "RmProfilingAdminOnly" in lines[0] and "NVreg_RestrictProfilingToAdminUsers" in lines[0]


def test_a_failing_sample_loses_one_window_not_the_counters(sim):
    fault = {"kind": "error", "gpu": 0, "call": "nvmlGpmSampleGet", "code": "unknown", "at": 4, "until": 6}
    pipeline, series = run(sim, {"node": {"count": 1}, "faults": [fault]}, seconds=12)
    windows = [values(s, "gpuwarden_gpm_window_seconds_total", gpu="0")[0] for s in series[1:]]
    assert windows == sorted(windows) and windows[-1] > windows[4]
    assert windows[-1] < 11  # the failed seconds are not counted as activity windows
    assert values(series[-1], "gpuwarden_gpu_up", gpu="0") == [1]


def test_a_gpu_reset_reseeds_the_window(sim):
    fault = {"kind": "gpu_lost", "gpu": 0, "at": 4, "until": 6}
    _, series = run(sim, {"node": {"count": 2}, "faults": [fault]}, seconds=16)
    windows = [values(s, "gpuwarden_gpm_window_seconds_total", gpu="0") for s in series[1:]]
    seen = [w[0] for w in windows if w]
    assert seen == sorted(seen)  # the counter never goes back
    steps = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert max(steps) <= 1.01  # no window spans the reset: it was reseeded when the GPU came back


@pytest.mark.parametrize(
    ("activity", "expected"),
    [
        (WindowActivity(False, sm=0.0, busy=0.0), "idle"),
        (WindowActivity(True, sm=0.96, tensor=0.94, dram=0.24, busy=0.99), "tensor_bound"),
        # the bf16 transformer measured on H100: the tensor pipe dominates FP32 (22 % vs 2 %): never "use bf16"
        (WindowActivity(True, sm=0.86, tensor=0.22, fp32=0.02, dram=0.51, busy=0.97), "tensor_bound"),
        (WindowActivity(True, sm=0.99, fp32=0.10, dram=0.90, busy=0.99), "memory_bound"),
        # FP32 matmul with TF32 off on H100: the FP32 pipe carries the math
        (WindowActivity(True, sm=0.96, fp32=0.77, dram=0.07, busy=0.99), "compute_without_tensor"),
        # busy SMs off the math pipes (element-wise, reductions, softmax): fusion, never bf16
        (WindowActivity(True, sm=0.97, dram=0.07, busy=0.99), "sm_bound_non_matmul"),
        # bf16 LayerNorm + softmax on H100 (issue 37): SM 99 %, FP32 22 %, tensor 2 %, DRAM 37 %: not FP32 training
        (WindowActivity(True, sm=0.99, tensor=0.02, fp32=0.22, dram=0.37, busy=0.99), "sm_bound_non_matmul"),
        # DDP with 2 GB of gradients a step on 2x H200: NCCL's kernels keep the SMs 46-48 % busy
        (
            WindowActivity(True, sm=0.47, fp32=0.01, dram=0.1, nvlink_bytes_per_second=120e9, busy=0.5),
            "communication_bound",
        ),
        # balanced bf16 DDP on 2x H200: tensor 11-12 %, SM 38-47 %, NVLink 19-25 GB/s
        (
            WindowActivity(True, sm=0.42, tensor=0.115, fp32=0.02, dram=0.2, nvlink_bytes_per_second=22e9, busy=0.53),
            "tensor_bound",
        ),
        # all-reduce only: NVLink 600-676 GB/s
        (WindowActivity(True, sm=0.17, dram=0.05, nvlink_bytes_per_second=640e9, busy=0.97), "communication_bound"),
        (WindowActivity(True, sm=0.10, dram=0.05, nvlink_bytes_per_second=50e9, busy=0.5), "communication_bound"),
        (WindowActivity(True, sm=0.0, dram=0.01, pcie_rx_bytes_per_second=52e9, busy=0.3), "host_transfer_bound"),
        # a Python loop of tiny kernels on H100: the driver counts 31 % busy, the SMs barely work
        (WindowActivity(True, sm=0.0, busy=0.31), "launch_bound"),
        # a tiny-batch decode loop on a lent H200 (issue 49): busy 15 %, SM 2 %: launch overhead, not waiting
        (WindowActivity(True, sm=0.02, dram=0.01, busy=0.15), "launch_bound"),
        (WindowActivity(True, sm=0.02, dram=0.01, pcie_rx_bytes_per_second=0.1e9, busy=0.03), "waiting"),
        (
            WindowActivity(True, sm=0.02, dram=0.01, pcie_rx_bytes_per_second=0.1e9),
            "waiting",
        ),  # no busy ratio yet: not called launch-bound
        (WindowActivity(True, sm=0.40, tensor=0.1, fp32=0.2, dram=0.2, busy=0.5), "mixed"),
    ],
)
def test_bottleneck_classes(activity: WindowActivity, expected: str) -> None:
    assert bottleneck_class(DEFAULT, activity) == expected
    # a GPU whose job has other ranks is read the same way, except for a collective's spin (below)
    assert bottleneck_class(DEFAULT, activity, peers=3) == expected


@pytest.mark.parametrize(
    ("rx", "tx", "expected"),
    [
        # a pageable device-to-host copy loop on a lent H200 (issue 49): PCIe tx 16.7 GB/s, SM 0 %
        (0.1e9, 16.7e9, "host_transfer_bound"),
        (16.7e9, 0.1e9, "host_transfer_bound"),
        (0.1e9, 0.1e9, "launch_bound"),
    ],
)
def test_copies_either_way_over_pcie_are_host_transfers(rx: float, tx: float, expected: str) -> None:
    activity = WindowActivity(True, 0.0, 0.0, 0.0, 0.0, 0.01, 0.0, rx, 0.6, pcie_tx_bytes_per_second=tx)
    assert bottleneck_class(DEFAULT, activity) == expected


@pytest.mark.parametrize(
    ("dram", "pcie", "spins"),
    [
        (0.04, 0.0, True),  # ranks waiting in the all-reduce on H200: DRAM 4-10 %
        (0.55, 0.0, False),  # decode replicas: busy, few tensor cycles, device memory read at 40-70 %
        (0.08, 12e9, False),  # an all-reduce crossing PCIe (no NVLink): data moves, nothing waits
    ],
)
def test_a_spin_leaves_device_memory_and_pcie_quiet(dram: float, pcie: float, spins: bool) -> None:
    activity = WindowActivity(True, 0.22, 0.02, 0.0, 0.0, dram, 2e9, pcie / 2, 0.95, pcie_tx_bytes_per_second=pcie / 2)
    assert (bottleneck_class(DEFAULT, activity, peers=3) == "collective_wait") is spins


@pytest.mark.parametrize(
    ("busy", "sm", "tensor", "fp16", "nvlink", "alone", "in_a_job"),
    [
        # ranks waiting in the all-reduce for a CPU-bound rank 1 (4x H200): busy 90-94 %, SM 21-23 %, tensor 2 %
        (0.92, 0.22, 0.02, 0.0, 3.8e9, "launch_bound", "collective_wait"),
        # 2 GPUs, run twice: busy 90-98 %, SM 20-23 %
        (0.98, 0.20, 0.02, 0.0, 2e9, "launch_bound", "collective_wait"),
        # NCCL_MAX_NCHANNELS=4: SM 3 % (4 of 132 SMs), busy 96 %
        (0.96, 0.03, 0.0, 0.0, 0.3e9, "launch_bound", "collective_wait"),
        # single-GPU tiny kernels from Python: busy 28-31 %, SM 0.3 %: launch-bound with or without peers
        (0.28, 0.003, 0.0, 0.0, 0.0, "launch_bound", "launch_bound"),
        # a rank whose half-precision pipe is active computes, it does not wait
        (0.92, 0.22, 0.0, 0.08, 0.0, "launch_bound", "launch_bound"),
    ],
)
def test_a_collective_wait_is_never_launch_bound_where_the_gpu_has_peers(
    busy, sm, tensor, fp16, nvlink, alone, in_a_job
):
    activity = WindowActivity(True, sm, tensor, 0.0, fp16, 0.1, nvlink, 0.0, busy)
    assert bottleneck_class(DEFAULT, activity) == alone
    assert bottleneck_class(DEFAULT, activity, peers=1) == in_a_job


@pytest.mark.parametrize(
    "scenario", sweep(["training", "thermal-throttling", "nvlink-down", "shared-gpu"], lambda name: name == "training")
)
def test_training_like_scenarios_are_never_told_to_use_bf16(sim, tmp_path, scenario):
    """Their default activity is the measured bf16 job's: tensor_bound, and no advice that contradicts it."""
    pipeline, _ = run(sim, scenario, seconds=10, tmp_path=tmp_path)
    from gpuwarden.health.diagnosis import diagnose

    for finding in diagnose(pipeline.snapshot):
        assert "bf16" not in finding.recommended_action or finding.check == "memory_pressure", finding
    classes = {v.detail for gpu in pipeline.snapshot.gpus for v in pipeline.snapshot.health[gpu.uuid] if v.detail}
    assert "compute_without_tensor" not in classes, classes


@pytest.mark.parametrize(
    ("scenario", "expected"),
    sweep(
        [
            ("training", "tensor_bound"),
            ("data-starvation", "waiting"),
            ("healthy", "idle"),
            ("memory-bound", "memory_bound"),
            ("fp32-training", "compute_without_tensor"),
            ("communication-bound", "communication_bound"),
            ("host-transfer-bound", "host_transfer_bound"),
        ],
        lambda case: case[0] in ("training", "data-starvation", "communication-bound"),
    ),
)
def test_scenarios_get_their_class_in_metrics_and_diagnosis(sim, tmp_path, scenario, expected):
    pipeline, series = run(sim, scenario, seconds=10, tmp_path=tmp_path)
    assert values(series[-1], "gpuwarden_bottleneck_info", gpu="0") == [1]
    classes = {dict(labels)["class"] for name, labels in series[-1] if name == "gpuwarden_bottleneck_info"}
    assert classes == {expected}
    findings = [f for f in diagnose(pipeline.snapshot) if f.check == "bottleneck" and f.gpu == 0]
    if expected in ("idle", "tensor_bound"):  # healthy: said by the gauge and the GPU's health, not as a finding
        assert pipeline.snapshot.health[pipeline.snapshot.gpus[0].uuid][-1].detail == expected
        assert findings == []
        return
    assert len(findings) == 1 and findings[0].observed.startswith(expected) and findings[0].severity == "info"
    assert findings[0].recommended_action


def test_profiling_can_be_turned_off(sim):
    _, series = run(sim, "training", seconds=3, nvml={"gpm": False})
    assert not [key for key in series[-1] if key[0].startswith("gpuwarden_gpm_")]
    assert values(series[-1], "gpuwarden_pcie_bytes_total", gpu="0", direction="rx")  # from the driver's counters


def test_each_mig_slice_is_sampled_on_its_own_window(sim):
    scenario = {
        "name": "mig-gpm",
        "node": {"count": 2, "mig_instances": {1: 3}, "mig_activity": {1: [1.0, 0.5, 0.0]}},
        "values": {"utilization": 80},
    }
    _, series = run(sim, scenario)
    last = series[-1]
    slices = values(last, "gpuwarden_mig_gpm_window_seconds_total", gpu="1")
    assert len(slices) == 3 and not values(last, "gpuwarden_mig_gpm_window_seconds_total", gpu="0")

    def slice_share(gpu_instance: str) -> float:
        first, final = series[2], series[-1]
        window = [
            values(s, "gpuwarden_mig_gpm_window_seconds_total", gpu="1", gpu_instance=gpu_instance)[0]
            for s in (first, final)
        ]
        active = [
            values(s, "gpuwarden_mig_gpm_sm_active_seconds_total", gpu="1", gpu_instance=gpu_instance)[0]
            for s in (first, final)
        ]
        return (active[1] - active[0]) / (window[1] - window[0])

    # GPU instance IDs 7, 8, 9 (as an H100 numbers them); SM = 0.9 × utilization × the slice's share
    assert slice_share("7") == pytest.approx(0.72, abs=0.02)
    assert slice_share("8") == pytest.approx(0.36, abs=0.02)
    assert slice_share("9") == pytest.approx(0.0, abs=0.001)
    mig_uuids = {labels["mig_uuid"] for labels, _ in _labelled(last, "gpuwarden_mig_gpm_window_seconds_total")}
    assert len(mig_uuids) == 3 and all(u.startswith("MIG-") for u in mig_uuids)
    # the whole GPU keeps its own series beside its slices'
    assert values(last, "gpuwarden_gpm_sm_active_seconds_total", gpu="1")


def test_a_slice_that_cannot_be_sampled_loses_only_its_own_series(sim):
    scenario = {
        "name": "mig-gpm-fault",
        "node": {"count": 1, "mig_instances": {0: 2}},
        "faults": [
            {"kind": "error", "code": "unknown", "call": "nvmlGpmMigSampleGet", "gpu": 0, "at": 3, "until": 5},
            {"kind": "not_supported", "call": "nvmlGpmMigSampleGet", "gpu": 0, "at": 8},
        ],
    }
    pipeline, series = run(sim, scenario)
    # a transient error (t 3-5) restarts the slices' windows; the counters stay and never go back
    readings = [sum(values(s, "gpuwarden_mig_gpm_window_seconds_total", gpu="0")) for s in series[2:8]]
    assert readings == sorted(readings) and readings[-1] > readings[0]
    assert len(values(series[7], "gpuwarden_mig_gpm_window_seconds_total", gpu="0")) == 2
    # a slice that answers not_supported: its series go, the whole GPU keeps its own, counted as a collect error
    assert not values(series[-1], "gpuwarden_mig_gpm_window_seconds_total", gpu="0")
    assert values(series[-1], "gpuwarden_gpm_window_seconds_total", gpu="0")
    assert values(series[-1], "gpuwarden_collect_errors_total")


def _labelled(series, name: str):
    return [(dict(labels), value) for (n, labels), value in series.items() if n == name]
