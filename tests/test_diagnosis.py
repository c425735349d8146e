"""The diagnosis findings per scenario: the right check with cause and action, nothing on a healthy node."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.jobs import host_reading
from gpuwarden.jobs.findings import diagnose
from gpuwarden.model.snapshot import HostEvidence
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import ManualClock, settings, sweep, write_yaml
from tests.helpers.thresholds import SHORT


@pytest.fixture
def findings_for(sim, tmp_path):
    pipelines: list[Pipeline] = []

    def run(scenario, seconds: int = 15):
        clock = ManualClock()
        sim(scenario, clock=clock)
        pipeline = Pipeline(
            settings(health={"thresholds_file": str(write_yaml(tmp_path / "t.yaml", SHORT))}), wall_clock=clock
        )
        pipelines.append(pipeline)
        for _ in range(seconds):
            pipeline.poll_once()
            clock.advance(1)
        return diagnose(pipeline.poll_once())

    yield run
    for pipeline in pipelines:
        pipeline.stop(timeout=0.2)


@pytest.fixture
def default_pipeline(sim):
    """A pipeline over `scenario` at the default thresholds, polled once a second of a manual clock: call it with the
    scenario and how many seconds to run; it returns the pipeline and the clock (stopped at the end of the test)."""
    pipelines: list[Pipeline] = []

    def run(scenario: str, seconds: int) -> tuple[Pipeline, ManualClock]:
        clock = ManualClock()
        sim(scenario, clock=clock)
        pipeline = Pipeline(settings(), wall_clock=clock)
        pipelines.append(pipeline)
        advance(pipeline, clock, seconds)
        return pipeline, clock

    yield run
    for pipeline in pipelines:
        pipeline.stop(timeout=0.2)


def advance(pipeline: Pipeline, clock: ManualClock, seconds: int, step: int = 1) -> None:
    """Poll every `step` s of the manual clock for `seconds` (5 s still puts a point in every slot of the health
    history, 15 s at the default thresholds: the long runs poll at 5)."""
    for _ in range(seconds // step):
        pipeline.poll_once()
        clock.advance(step)


def by_check(findings):
    return {(f.check, f.gpu): f for f in findings}


def test_healthy_node_has_no_findings(findings_for):
    assert findings_for("healthy") == []
    assert findings_for("training") == []


@pytest.mark.parametrize(
    ("scenario", "check", "gpu", "severity", "words"),
    sweep(
        [
            (
                "memory-nearly-full",
                "memory_pressure",
                3,
                "warning",
                ["optimizer state", "gradient checkpointing", "ZeRO"],
            ),
            ("ecc-uncorrectable", "ecc", 1, "critical", ["cordon", "replacement"]),
            ("thermal-throttling", "temperature", 2, "critical", ["cooling"]),
            ("thermal-throttling", "thermal_throttling", 5, "warning", ["cooling"]),
            ("data-starvation", "utilization", 0, "warning", ["DataLoader", "pin_memory", "Profile first"]),
            ("nvlink-down", "nvlink", 4, "critical", ["nvidia-smi nvlink"]),
            ("gpu-lost", "gpu_lost", 6, "critical", ["fell off the bus", "RMA"]),
            ("row-remap", "row_remap", 5, "critical", ["RMA"]),
            ("persistence-off", "persistence_mode", 0, "warning", ["nvidia-persistenced"]),
            ("power-capping", "power", 0, "warning", ["nvidia-smi -pl"]),
        ],
        lambda case: case[0] in ("memory-nearly-full", "gpu-lost", "data-starvation"),
    ),
)
def test_scenario_findings(findings_for, scenario, check, gpu, severity, words):
    found = by_check(findings_for(scenario)).get((check, gpu))
    assert found is not None, scenario
    assert found.severity == severity and found.observed and found.threshold
    text = found.likely_cause + " " + found.recommended_action
    assert all(word in text for word in words), text


def test_driver_not_loaded_is_a_node_finding(findings_for):
    findings = findings_for("driver-not-loaded", seconds=2)
    assert [(f.check, f.severity, f.observed) for f in findings] == [("driver", "critical", "driver_not_loaded")]
    assert "NVIDIA runtime" in findings[0].recommended_action


def test_pcie_only_node_reports_missing_nvlink_as_info(findings_for):
    found = by_check(findings_for("legacy-pcie", seconds=3)).get(("nvlink_topology", None))
    assert found is not None and found.severity == "info" and "PHB" in found.likely_cause


def test_diagnosis_endpoints(live_server):
    server = live_server("row-remap")
    body = server.get("/api/v1/diagnosis").json()
    assert body["nvml_up"] is True and "CUDA up to 13.0" in body["driver"]["note"]
    checks = {(f["check"], f["gpu"], f["severity"]) for f in body["findings"]}
    assert ("row_remap", 5, "critical") in checks and ("row_remap", 2, "warning") in checks
    one = server.get("/api/v1/diagnosis/5").json()
    assert [f["gpu"] for f in one["findings"]] == [5]
    assert server.get("/api/v1/diagnosis/9").status_code == 404
    assert server.get("/api/v1/diagnosis/x!").status_code == 422
    gpu = server.get("/api/v1/gpus/5").json()
    assert gpu["health"]["row_remap"]["level"] == 2


@pytest.mark.slow  # a long fault run
def test_a_fault_inside_its_sustain_window_reads_pending_with_how_long_it_was_seen(default_pipeline):
    """Right after a (re)start, a GPU at 92 °C in HW thermal slowdown has not yet been watched for the 2-5 minutes
    its verdicts need: the API says "pending" with the time seen, and findings say what it will be, never "ok"."""
    pipeline, clock = default_pipeline("thermal-throttling", 30)  # default thresholds: 120 s at 90 °C, 300 s slowdown
    early = by_check(diagnose(pipeline.poll_once()))
    temperature, throttling = early[("temperature", 2)], early[("thermal_throttling", 2)]
    assert temperature.severity == "pending" and "92 °C" in temperature.observed[:8], temperature
    assert "seen for 30 s of 120 s" in temperature.observed, temperature.observed
    assert throttling.severity == "pending" and "thermal_slowdown active" in throttling.observed, throttling
    assert temperature.likely_cause and temperature.recommended_action  # what it will be, and what to do
    assert ("temperature", 0) not in early  # the cool GPUs: nothing
    verdicts = {v.check: v for v in pipeline.snapshot.health[pipeline.snapshot.gpus[2].uuid]}
    assert verdicts["temperature"].level == 0  # pending pages nothing and leaves the gauges ok
    advance(pipeline, clock, 330, step=5)
    late = by_check(diagnose(pipeline.poll_once()))
    assert late[("temperature", 2)].severity == "critical"
    assert late[("thermal_throttling", 2)].severity == "warning"


def test_ecc_xid_and_lost_gpu_findings_name_the_jobs_on_the_gpu_and_the_xid(default_pipeline):
    """Whose job just failed or is at risk: the processes (and pods) holding the GPU, as /api/v1/processes knows
    them; the XID by name as well as number; the reset command for this GPU."""
    pipeline, clock = default_pipeline("ecc-uncorrectable", 8)  # its double-bit errors on GPU 1 come at 5 s
    pipeline.poller.xid.record(
        pipeline.snapshot.gpus[1].uuid, 48, clock()
    )  # its XID 48 (events need the watcher thread)
    found = by_check(diagnose(pipeline.poll_once()))
    ecc, xid = found[("ecc", 1)], found[("xid", 1)]
    for finding in (ecc, xid):
        assert finding.holders and all(h["pid"] for h in finding.holders), finding
        assert "held by" in finding.observed
    assert "XID 48 (double-bit ECC error)" in xid.observed


def test_a_lost_gpu_finding_says_which_gpu_to_reset_and_what_held_it(default_pipeline):
    pipeline, _ = default_pipeline("gpu-lost", 40)
    findings = [f for f in diagnose(pipeline.poll_once()) if f.check == "gpu_lost"]
    (lost,) = findings
    bus_id = pipeline.snapshot.gpu(str(lost.gpu)).info.pci_bus_id
    # by PCI bus id, as the runbook says: an index can shift once a GPU has fallen off the bus (issue 36)
    assert bus_id and f"nvidia-smi -r -i {bus_id}" in lost.recommended_action, lost.recommended_action
    assert lost.holders, lost  # the processes last seen on it: the job that died with it
    # said as the last holders, not as holding a GPU that answers nothing
    assert "held before the loss by" in lost.observed and "; held by" not in lost.observed, lost.observed


def test_pending_page_retirement_is_not_called_a_row_remap(default_pipeline):
    """Pre-Ampere GPUs (the legacy-pcie scenario) retire pages: the finding says so, with the driver-reload action,
    not the row-remap one."""
    pipeline, _ = default_pipeline("legacy-pcie", 3)
    finding = by_check(diagnose(pipeline.poll_once()))[("row_remap", 1)]
    assert finding.observed == "page retirement pending", finding
    assert "retire pages" in finding.likely_cause and "reload the driver" in finding.recommended_action
    assert "row" not in finding.recommended_action.lower()


def test_a_holder_without_a_pod_is_named_by_its_pid_once():
    from gpuwarden.health.diagnosis import _describe

    holder = {"pid": 4242, "name": "python", "namespace": "", "pod": "", "container": "",
              "used_memory_bytes": 2 * 1024**3, "memory_share": 0.5}  # fmt: skip
    text = _describe((holder,))
    assert text.count("4242") == 1 and "python" in text, text
    in_pod = {**holder, "namespace": "ml", "pod": "train-0", "container": "main"}
    assert "ml/train-0/main pid 4242 2.0 GiB (50%)" in _describe((in_pod,))


def fake_proc(root: Path, pid: int, main: str, others: str = "S", workers: str = "") -> Path:
    """A /proc with `pid` (main thread in state `main`, a second thread in `others`) and worker children in the
    states of `workers` (one letter each)."""
    (root / "self").mkdir(parents=True, exist_ok=True)
    task = root / str(pid) / "task"
    for tid, state in ((pid, main), (pid + 1, others)):
        (task / str(tid)).mkdir(parents=True, exist_ok=True)
        (task / str(tid) / "stat").write_text(f"{tid} (py thon) {state} 1 2 3\n")
    children = [pid + 100 + i for i in range(len(workers))]
    (task / str(pid) / "children").write_text(" ".join(map(str, children)) + " ")
    for child, state in zip(children, workers, strict=True):
        (root / str(child)).mkdir(parents=True, exist_ok=True)
        (root / str(child) / "stat").write_text(f"{child} (pt_data_worker) {state} 1\n")
    return root


def test_a_thread_sample_reads_states_and_worker_children(tmp_path):
    from gpuwarden.jobs.activity import list_threads, sample

    root = fake_proc(tmp_path / "proc", 4242, main="R", others="D", workers="RRS")
    seen = sample(root, 4242, tids=list_threads(root, 4242) or ())
    assert seen is not None and seen.main_running and seen.disk_wait == 1 and seen.running == 1
    assert (seen.workers, seen.workers_running) == (3, 2)
    assert sample(root, 999) is None  # not visible: no evidence, not a crash


@pytest.mark.parametrize(
    ("main", "others", "workers", "cause"),
    sweep(
        [
            ("S", "D", "", "I/O stall"),  # a checkpoint being written
            ("S", "S", "RRRR", "Input-bound"),  # a slow DataLoader: its workers always running
            ("R", "S", "", "Host-bound"),  # a Python loop the GPU waits on
            ("S", "S", "SS", "An idle holder"),  # every thread asleep and no peers: a notebook, a stuck job
            ("S", "S", "SS+job", "Waiting on others"),  # every thread asleep, with ranks elsewhere: peers
        ],
        lambda case: case[3] in ("I/O stall", "Host-bound"),
    ),
)
def test_a_waiting_gpu_gets_its_cause_from_the_host(sim, tmp_path, main, others, workers, cause):
    """Three idle causes that look the same from the GPU get three different causes and actions from /proc."""
    clock = ManualClock()
    sim("data-starvation", clock=clock)
    thresholds = write_yaml(tmp_path / "t.yaml", {"bottleneck_window_s": 5})
    pipeline = Pipeline(
        settings(health={"thresholds_file": str(thresholds)}, processes={"proc_root": str(tmp_path / "proc")}),
        wall_clock=clock,
    )
    try:
        advance(pipeline, clock, 1)
        in_job = workers.endswith("+job")
        workers = workers.removesuffix("+job")
        for views in pipeline.snapshot.processes.values():
            fake_proc(tmp_path / "proc", views[0].pid, main, others, workers)
            if in_job:  # a rank of a two-node job whose other ranks run elsewhere (torchrun's variables)
                variables = b"MASTER_ADDR=10.0.0.9\0MASTER_PORT=29500\0RANK=3\0WORLD_SIZE=16\0"
                (tmp_path / "proc" / str(views[0].pid) / "environ").write_bytes(variables)
        advance(pipeline, clock, 20)
        finding = by_check(diagnose(pipeline.poll_once()))[("bottleneck", 0)]
    finally:
        pipeline.stop(timeout=0.2)
    assert finding.observed.startswith("waiting"), finding
    assert finding.likely_cause.startswith(cause) and "Host evidence (PID" in finding.likely_cause, finding
    others_actions = {"I/O stall": "DataLoader", "Input-bound": "checkpoint", "Host-bound": "checkpoint"}
    if cause in others_actions:
        assert others_actions[cause] not in finding.recommended_action  # not the advice for another cause


def test_without_the_hosts_proc_a_waiting_gpu_says_what_could_not_be_seen(sim, tmp_path):
    clock = ManualClock()
    sim("data-starvation", clock=clock)
    thresholds = write_yaml(tmp_path / "t.yaml", {"bottleneck_window_s": 5})
    pipeline = Pipeline(settings(health={"thresholds_file": str(thresholds)}), wall_clock=clock)
    try:
        advance(pipeline, clock, 20)
        finding = by_check(diagnose(pipeline.poll_once()))[("bottleneck", 0)]
    finally:
        pipeline.stop(timeout=0.2)
    assert "Host evidence: none" in finding.likely_cause


# (main thread running, I/O wait, all asleep, MB/s written) → what the host evidence says; the first two are real
# readings from a lent 2x H200 (docs/validation/2026-11-28-h200x2-jobs and issue 37's hidden checkpoint job)
@pytest.mark.parametrize(
    ("main", "io_wait", "asleep", "written_mb", "expected"),
    [
        (0.88, 0.0, 0.0, 111, "main_running"),  # a CPU-bound rank that saved one checkpoint in the window
        (0.75, 0.25, 0.0, 300, "checkpoint"),  # a loop that checkpoints every 5 steps
        (0.40, 0.0, 0.55, 200, "checkpoint"),  # writes to the page cache while the loop waits on them
        (0.88, 0.0, 0.0, 10, "main_running"),
        (0.10, 0.0, 0.90, 0, "asleep"),
    ],
)
def test_a_checkpoint_is_the_cause_only_where_the_writes_hold_the_loop(main, io_wait, asleep, written_mb, expected):
    evidence = HostEvidence(
        pid=1, samples=8, main_running=main, io_wait=io_wait, workers_running=0.0, asleep=asleep, workers=4,
        write_bytes_per_second=written_mb * 1e6,
    )  # fmt: skip
    assert host_reading.dominant(evidence) == expected


# --- one GPU, as measured on a lent H200 (issue 49) ------------------------------------------------------------

TRAINING = {"utilization": 97, "sm_active": 80, "tensor_active": 38, "fp32_active": 2, "dram_active": 40}


def one_gpu(values: dict[str, float], processes: list[dict]) -> dict:
    return {"node": {"model": "h100-sxm-80gb", "count": 1}, "values": {"memory_used_ratio": 0.5, **values},
            "processes": processes}  # fmt: skip


@pytest.mark.parametrize(
    ("values", "second", "cls", "cause", "action"),
    [
        # a pageable device-to-host copy loop: PCIe tx 16.7 GB/s, SM 0 %
        ({"utilization": 60, "sm_active": 0, "tensor_active": 0, "pcie_tx_bytes_per_second": 16.7e9}, None,
         "host_transfer_bound", "either direction", "pinned"),
        # a tiny-batch decode loop: busy 15 %, SM 2 %
        ({"utilization": 15, "sm_active": 2, "tensor_active": 0}, None, "launch_bound", "tiny kernels",
         "CUDA graphs"),
        # a training job and a second process computing on its GPU (60 % of the SMs): named, with its share
        (TRAINING, {"pid": 6001, "name": "bench", "sm": 60}, "tensor_bound", "Another process computes",
         "MIG slice"),
        # the same process, holding memory without computing: not named, a healthy GPU has no finding
        (TRAINING, {"pid": 6001, "name": "bench", "sm": 0}, None, None, None),
    ],
)  # fmt: skip
def test_one_gpu_gets_a_class_and_advice_that_agree(sim, tmp_path, values, second, cls, cause, action):
    processes = [{"gpu": 0, "pid": 5001, "memory_gib": {"constant": 30}, "sm": {"constant": values["sm_active"]}}]
    if second:
        processes.append({"gpu": 0, "memory_gib": {"constant": 4}, "at": 5, **second,
                          "sm": {"constant": second["sm"]}})  # fmt: skip
    clock = ManualClock()
    sim(one_gpu(values, processes), clock=clock)
    thresholds = write_yaml(tmp_path / "t.yaml", {"bottleneck_window_s": 20})
    pipeline = Pipeline(settings(health={"thresholds_file": str(thresholds)}), wall_clock=clock)
    try:
        advance(pipeline, clock, 30)
        found = [f for f in diagnose(pipeline.poll_once()) if f.check == "bottleneck"]
    finally:
        pipeline.stop(timeout=0.2)
    if cls is None:
        assert found == [], found
        return
    (finding,) = found
    assert finding.observed.startswith(cls), finding.observed
    assert cause in finding.likely_cause and action in finding.recommended_action, finding
    if second:
        assert "shared with pid 6001 (unknown, SM 60%)" in finding.observed, finding.observed  # no /proc: no name
