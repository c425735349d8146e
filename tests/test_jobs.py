"""Jobs across GPUs, found from the host without hooks, and judged as one (issue 37).

- Which GPUs form a job, from the host's /proc: tests/test_job_grouping.py (and, unprivileged, against real
  processes of another user: tests/test_jobs_unprivileged.py).
- The job view on the simulator, beneath the real pynvml, with a /proc written for the simulated ranks: a straggler
  named with its cause and its waiters within 60 s of the onset, a hang, a slower GPU, and a balanced job that never
  gets a finding. The GPU-side numbers are the ones measured on 2x and 4x H200 (docs/diagnosis.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from gpuwarden.exposition.render import Renderer
from gpuwarden.jobs.findings import diagnose
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import ManualClock, settings

# --- the job view on the simulator -------------------------------------------------------------------------------

BALANCED = {"utilization": 53, "sm_active": 42, "tensor_active": 11.5, "fp32_active": 2, "dram_active": 30}
WAITER = {"utilization": 92, "sm_active": 22, "tensor_active": 2, "fp32_active": 1, "dram_active": 2}
CPU_BOUND = {"utilization": 6, "sm_active": 5, "tensor_active": 2, "fp32_active": 1, "dram_active": 1}
SLOWER = {"utilization": 97, "sm_active": 80, "tensor_active": 35, "fp32_active": 3, "dram_active": 40}
HUNG = {"utilization": 99, "sm_active": 17, "tensor_active": 0, "fp32_active": 0, "dram_active": 0}
ONSET = 120.0
PIDS = (5001, 5002, 5003, 5004)


def _switch(before: float, after: float) -> dict[str, Any]:
    return {"ramp": {"start": before, "end": after, "duration": 1, "begin": ONSET}}


def job_scenario(after: dict[int, dict[str, float]], nvlink_after: float = 1.9e9) -> dict[str, Any]:
    """Four ranks of one job on 4x H100, balanced until ONSET, then each GPU's `after` values."""
    gpus: dict[int, dict[str, Any]] = {}
    for gpu in range(4):
        values = after.get(gpu, BALANCED)
        gpus[gpu] = {key: _switch(BALANCED[key], values[key]) for key in BALANCED}
        gpus[gpu]["nvlink_rx_bytes_per_second"] = _switch(11e9, nvlink_after)
        gpus[gpu]["nvlink_tx_bytes_per_second"] = _switch(11e9, nvlink_after)
        gpus[gpu]["fp16_active"] = {"constant": 0}
        gpus[gpu]["fp64_active"] = {"constant": 0}
    return {
        "node": {"model": "h100-sxm-80gb", "count": 4, "nvlink": "nvswitch"},
        "values": {"memory_used_ratio": 0.6, "sm_clock_mhz": 1980},
        "gpus": gpus,
        "processes": [{"gpu": g, "pid": PIDS[g], "name": "python", "memory_gib": {"constant": 40}} for g in range(4)],
    }


def write_ranks(root: Path, environ: bool = True, running: tuple[str, ...] = ("R", "R", "R", "R")) -> Path:
    """The host's /proc for the four ranks: torchrun's variables (or none, as mp.spawn's ranks), one parent, the
    main thread's state per rank (a waiting rank spins a core, so R, as measured)."""
    (root / "self").mkdir(parents=True, exist_ok=True)
    for rank, pid in enumerate(PIDS):
        base = root / str(pid)
        (base / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
        variables = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "bert",
                     "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "4"}  # fmt: skip
        body = b"".join(f"{k}={v}\0".encode() for k, v in variables.items()) if environ else b"HOME=/root\0"
        (base / "environ").write_bytes(body)
        (base / "stat").write_text(f"{pid} (python) S 4990 4990 4990 0 -1\n")
        (base / "task" / str(pid) / "stat").write_text(f"{pid} (python) {running[rank]} 4990 1 2\n")
        (base / "task" / str(pid) / "children").write_text("")
        (base / "io").write_text("rchar: 1\nwchar: 1\nwrite_bytes: 4096\n")
    return root


def run_job(
    sim, tmp_path: Path, scenario: dict[str, Any], seconds: float, health: dict[str, Any] | None = None, **proc: Any
) -> tuple[Pipeline, list]:
    """Poll every second of the manual clock; return the pipeline and (t, findings) after each poll. `health`:
    thresholds to set (a thresholds file)."""
    clock = ManualClock(0.0)
    sim(scenario, clock=clock)
    root = write_ranks(tmp_path / "proc", **proc)
    sections: dict[str, Any] = {"processes": {"proc_root": str(root)}}
    if health:
        (tmp_path / "thresholds.yaml").write_text(yaml.safe_dump(health))
        sections["health"] = {"thresholds_file": str(tmp_path / "thresholds.yaml")}
    pipeline = Pipeline(settings(**sections), wall_clock=clock)
    timeline = []
    try:
        while clock.now <= seconds:
            snapshot = pipeline.poll_once()
            timeline.append((clock.now, [f for f in diagnose(snapshot) if f.job is not None], snapshot))
            clock.advance(1)
    finally:
        pipeline.stop(timeout=0.2)
    return pipeline, timeline


def first(timeline: list, check: str) -> float | None:
    return next((t for t, findings, _ in timeline if any(f.check == check for f in findings)), None)


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_a_cpu_bound_rank_is_named_with_its_cause_and_waiters_within_60_s(sim, tmp_path):
    pipeline, timeline = run_job(
        sim, tmp_path, job_scenario({0: WAITER, 1: CPU_BOUND, 2: WAITER, 3: WAITER}), ONSET + 90
    )
    assert all(not findings for t, findings, _ in timeline if t < ONSET)  # balanced until the onset
    named = first(timeline, "straggler")
    assert named is not None and named - ONSET <= 60, named
    _, findings, snapshot = timeline[-1]
    (finding,) = findings
    uuids = [gpu.uuid for gpu in snapshot.gpus]
    assert finding.gpu == 1 and finding.uuid == uuids[1] and finding.severity == "warning"
    job = finding.job
    assert job["job"] == "10.1.2.3:29500/bert" and job["cause"] == "cpu"
    assert job["straggler"]["pid"] == PIDS[1] and job["straggler"]["rank"] == "1"
    assert [w["gpu"] for w in job["waiting"]] == [0, 2, 3]
    assert all(w["wait_share"] > 0.5 for w in job["waiting"]), job["waiting"]
    assert "main thread running 100%" in finding.observed and "CPU-bound rank" in finding.likely_cause
    # every waiter reads collective_wait over the bottleneck window, never launch_bound
    classes = {
        gpu.index: v.detail for gpu in snapshot.gpus for v in snapshot.health[gpu.uuid] if v.check == "bottleneck"
    }
    assert all(classes[g] != "launch_bound" for g in (0, 2, 3)), classes
    from gpuwarden.web.health_document import node_health

    (job_health,) = node_health(snapshot, 0)["jobs"]
    assert job_health["straggler"] == uuids[1] and job_health["cause"] == "cpu"
    assert [w["uuid"] for w in job_health["waiting"]] == [uuids[0], uuids[2], uuids[3]]
    text = Renderer(pipeline.settings.metrics.selection()).render(snapshot).decode()
    samples = [s for family in text_string_to_metric_families(text) for s in family.samples]
    found = [s.labels for s in samples if s.name == "gpuwarden_job_finding"]
    assert found == [{"job_id": "10.1.2.3:29500/bert", "kind": "straggler", "gpu": "1", "uuid": uuids[1],
                      "rank": "1", "cause": "cpu"}]  # fmt: skip
    waited = {s.labels["gpu"]: s.value for s in samples if s.name == "gpuwarden_job_collective_wait_seconds_total"}
    assert waited["1"] == 0 and min(waited[g] for g in "023") > 30, waited


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_a_balanced_job_never_gets_a_job_finding(sim, tmp_path):
    _, timeline = run_job(sim, tmp_path, job_scenario({}, nvlink_after=11e9), ONSET + 120)
    assert not [findings for _, findings, _ in timeline if findings]
    _, _, snapshot = timeline[-1]
    assert {m.job for m in snapshot.jobs.values()} == {"10.1.2.3:29500/bert"}
    assert sorted(m.rank for m in snapshot.jobs.values()) == ["0", "1", "2", "3"]


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_a_whole_job_spinning_with_quiet_links_is_a_hang_after_60_s(sim, tmp_path):
    _, timeline = run_job(sim, tmp_path, job_scenario({g: HUNG for g in range(4)}, nvlink_after=0), ONSET + 120)
    hang = first(timeline, "collective_hang")
    assert hang is not None and 60 <= hang - ONSET <= 100, hang
    assert first(timeline, "straggler") is None
    _, findings, _ = timeline[-1]
    (finding,) = findings
    assert finding.gpu is None and len(finding.job["waiting"]) == 4 and "py-spy dump" in finding.recommended_action


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_a_slower_gpu_is_named_with_its_clock(sim, tmp_path):
    scenario = job_scenario({0: WAITER, 1: WAITER, 2: SLOWER, 3: WAITER})
    scenario["gpus"][2]["sm_clock_mhz"] = {"constant": 1200}
    _, timeline = run_job(sim, tmp_path, scenario, ONSET + 70)
    _, findings, _ = timeline[-1]
    (finding,) = findings
    assert finding.gpu == 2 and finding.job["cause"] == "slower_gpu"
    assert "SM clock 1200 MHz against 1980 MHz" in finding.observed, finding.observed


# a co-located bf16 matmul on rank 1's GPU, as measured on 2x H200 (docs/validation/2026-11-28-h200x2-stragglers):
# the other rank only half waits (busy 77 %, SM 43 %, tensor 9 %), so the spin signature alone never fired
PARTIAL_WAITER = {"utilization": 77, "sm_active": 43, "tensor_active": 9, "fp32_active": 1, "dram_active": 18}
SHARED = {"utilization": 99, "sm_active": 88, "tensor_active": 52, "fp32_active": 1, "dram_active": 35}


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
@pytest.mark.parametrize(("hog_sm", "same_slurm_job"), [(60, False), (0, False), (60, True)])
def test_a_process_computing_on_a_ranks_gpu_makes_it_the_straggler(sim, tmp_path, hog_sm, same_slurm_job):
    """Another process that computes on rank 1's GPU: rank 1 is the straggler, cause a slower GPU, with that process
    named and the others' wait measured against rank 1's own share of its GPU's work. One that only holds memory (SM
    0) is not named, nor one of the job's own (in its Slurm job: an asynchronous checkpoint writer): the others still
    wait for rank 1 since the onset, so rank 1 is named, with no co-located process."""
    scenario = job_scenario({0: PARTIAL_WAITER, 1: SHARED, 2: PARTIAL_WAITER, 3: PARTIAL_WAITER})
    scenario["processes"].append(
        {
            "gpu": 1,
            "pid": 6001,
            "name": "bench",
            "memory_gib": {"constant": 4},
            "sm": {"constant": hog_sm},
            "at": ONSET,
        }  # fmt: skip
    )
    for process in scenario["processes"][:4]:
        process["sm"] = {"constant": 40}
    if same_slurm_job:  # the ranks and the other process in one Slurm job's cgroup
        root = write_ranks(tmp_path / "proc")
        for pid in (*PIDS, 6001):
            (root / str(pid) / "task" / str(pid)).mkdir(parents=True, exist_ok=True)
            (root / str(pid) / "cgroup").write_text("0::/system.slice/slurmstepd.scope/job_812/step_0/user/task_0\n")
        (root / "6001" / "stat").write_text("6001 (python) S 5001 4990 4990 0 -1\n")
        (root / "6001" / "task" / "6001" / "stat").write_text("6001 (python) S 5001 1 2\n")
        (root / "6001" / "environ").write_bytes(b"HOME=/root\0")
    _, timeline = run_job(sim, tmp_path, scenario, ONSET + 60)
    named = first(timeline, "straggler")
    assert named is not None and named - ONSET <= 60, named
    assert first(timeline, "collective_hang") is None
    _, findings, _ = timeline[-1]
    (finding,) = findings
    assert finding.gpu == 1 and finding.job["cause"] == "slower_gpu", finding.observed
    assert [w["gpu"] for w in finding.job["waiting"]] == [0, 2, 3]
    if hog_sm == 0 or same_slurm_job:
        assert "pid 6001" not in finding.observed and "no clock, power or co-located" in finding.observed
        return
    assert "pid 6001 (unknown, SM 60%)" in finding.observed, finding.observed  # no /proc entry written for it
    # rank 1's own math: 40 of the 100 SM points of GPU 1's 52 % tensor (20.8 %); the others' 9 %: 57 % waited
    assert all(0.5 <= w["wait_share"] <= 0.65 for w in finding.job["waiting"]), finding.job["waiting"]


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_ranks_sharing_only_a_parent_are_no_job_and_get_no_finding(sim, tmp_path):
    """mp.spawn's ranks where their environment cannot be read (its rendezvous is there), or replicas under one
    supervisor: one parent alone is no evidence of one job, so no GPU is named a straggler against the others."""
    _, timeline = run_job(sim, tmp_path, job_scenario({0: WAITER, 1: CPU_BOUND, 2: WAITER, 3: WAITER}),
                          ONSET + 70, environ=False)  # fmt: skip
    _, findings, snapshot = timeline[-1]
    assert {m.job for m in snapshot.jobs.values()} == {f"local/pid-{pid}" for pid in PIDS}
    assert all(m.peers == 0 for m in snapshot.jobs.values()) and not findings


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_lone_processes_have_no_peers_and_get_no_job_finding(sim, tmp_path):
    scenario = job_scenario({0: WAITER, 1: CPU_BOUND, 2: WAITER, 3: WAITER})
    clock = ManualClock(0.0)
    sim(scenario, clock=clock)
    root = tmp_path / "proc"
    (root / "self").mkdir(parents=True)
    for pid in PIDS:  # four unrelated processes: own parent, own session, no launcher variables
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(f"{pid} (python) S {pid - 1000} {pid} {pid} 0 -1\n")
    pipeline = Pipeline(settings(processes={"proc_root": str(root)}), wall_clock=clock)
    try:
        while clock.now <= ONSET + 70:
            snapshot = pipeline.poll_once()
            clock.advance(1)
    finally:
        pipeline.stop(timeout=0.2)
    assert all(m.peers == 0 for m in snapshot.jobs.values()) and not snapshot.collective
    assert {m.job for m in snapshot.jobs.values()} == {f"local/pid-{pid}" for pid in PIDS}


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_a_rank_that_stops_is_a_straggler_first_and_then_the_hang_names_it(sim, tmp_path):
    stopped = {"utilization": 0, "sm_active": 0, "tensor_active": 0, "fp32_active": 0, "dram_active": 0}
    scenario = job_scenario({0: HUNG, 1: HUNG, 2: stopped, 3: HUNG}, nvlink_after=0)
    _, timeline = run_job(sim, tmp_path, scenario, ONSET + 110, running=("R", "R", "S", "R"))
    named, hang = first(timeline, "straggler"), first(timeline, "collective_hang")
    assert named is not None and hang is not None and named - ONSET <= 60 and 60 <= hang - ONSET <= 100, (named, hang)
    assert all(not any(f.check == "straggler" for f in findings) for t, findings, _ in timeline if t >= hang)
    _, findings, _ = timeline[-1]
    (finding,) = findings
    assert finding.gpu == 2 and finding.job["straggler"]["rank"] == "2" and finding.check == "collective_hang"


@pytest.mark.slow  # minutes of a 4-GPU job on the manual clock
def test_a_sleeping_straggler_is_never_told_it_waits_on_its_peers(sim, tmp_path):
    """Its GPU reads `waiting` and every thread sleeps, which alone reads "waiting on others: find the slowest
    rank"; but it is the slowest rank, as the job finding says: its own advice must not contradict that."""
    scenario = job_scenario({0: WAITER, 1: CPU_BOUND, 2: WAITER, 3: WAITER})
    _, timeline = run_job(sim, tmp_path, scenario, ONSET + 60, health={"bottleneck_window_s": 20},
                          running=("R", "S", "R", "R"))  # fmt: skip
    _, _, snapshot = timeline[-1]
    findings = diagnose(snapshot)
    (straggler,) = [f for f in findings if f.check == "straggler"]
    assert straggler.gpu == 1 and straggler.job["cause"] == "unknown"  # asleep: no CPU, input or I/O cause
    (own,) = [f for f in findings if f.check == "bottleneck" and f.gpu == 1]
    assert own.observed.startswith("waiting") and own.likely_cause.startswith("Asleep while the other ranks")
    assert "slowest rank" not in own.recommended_action, own.recommended_action
