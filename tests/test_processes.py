"""Who holds the GPU: per-process readings through the real pynvml over the simulator, attributed to containers
through a host /proc and pod log directory built in a temporary folder (the host's own cannot be staged here),
per-container series bounded under process churn, the per-PID opt-in, the API and the OOM diagnosis."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpuwarden.attribution.host import HostProcesses, parse_cgroup
from gpuwarden.health.diagnosis import diagnose
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import ManualClock, poll_series, series_of, settings, values, wait_for

GIB = 1024**3
UID_A = "0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
UID_B = "1c2d3e4f-5061-7283-94a5-b6c7d8e9f0a1"
CID_A = "a" * 64
CID_B = "b" * 64


def stage_host(tmp_path: Path, processes: dict[int, tuple[str, str]], pods: dict[str, tuple[str, str, list[str]]]):
    """A host /proc (pid → comm, cgroup text) and a /var/log/pods (uid → namespace, pod, containers)."""
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)  # what marks a /proc
    for pid, (comm, cgroup) in processes.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "comm").write_text(comm + "\n")
        (proc / str(pid) / "cgroup").write_text(cgroup)
    logs = tmp_path / "pods"
    for uid, (namespace, pod, containers) in pods.items():
        for container in containers:
            (logs / f"{namespace}_{pod}_{uid}" / container).mkdir(parents=True)
    return proc, logs


def systemd_cgroup(uid: str, cid: str) -> str:
    slice_uid = uid.replace("-", "_")
    return (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{slice_uid}.slice/"
        f"cri-containerd-{cid}.scope\n"
    )


def two_pods(tmp_path: Path, second_pod: str) -> dict[str, str]:
    """A host where pid 4101 is ml/trainer-0/worker (python3) and pid 4102 research/<second_pod>/notebook
    (jupyter); the `processes` settings that read it."""
    proc, logs = stage_host(
        tmp_path,
        {4101: ("python3", systemd_cgroup(UID_A, CID_A)), 4102: ("jupyter", systemd_cgroup(UID_B, CID_B))},
        {UID_A: ("ml", "trainer-0", ["worker"]), UID_B: ("research", second_pod, ["notebook"])},
    )
    return {"proc_root": str(proc), "pod_logs_root": str(logs)}


def poll(sim, scenario: dict[str, Any], seconds: int, **sections: Any) -> tuple[Pipeline, list[dict]]:
    return poll_series(sim, scenario, seconds, **sections)


def _labelled(series: dict, name: str) -> list[tuple[dict[str, str], float]]:
    return [(dict(labels), value) for (n, labels), value in series.items() if n == name]


SHARED = {
    "name": "shared",
    "node": {"count": 2},
    "processes": [
        {"gpu": 0, "pid": 4101, "name": "train", "memory_gib": {"constant": 20}, "sm": {"constant": 60}},
        {"gpu": 0, "pid": 4102, "name": "notebook", "memory_gib": {"constant": 10}, "sm": {"constant": 20}},
        {"gpu": 1, "pid": 4201, "name": "stray", "memory_gib": {"constant": 4}, "sm": {"constant": 0}},
    ],
}


# 79 of the H100's 79.2 GiB held by two processes: memory pressure, with two containers sharing the GPU
FULL_GPU = {
    "name": "full",
    "node": {"count": 1},
    "processes": [
        {"gpu": 0, "pid": 4101, "memory_gib": {"constant": 60}},
        {"gpu": 0, "pid": 4102, "memory_gib": {"constant": 19}},
    ],
}


def test_cgroup_text_of_each_driver_gives_the_pod_and_container() -> None:
    assert parse_cgroup(systemd_cgroup(UID_A, CID_A)) == (UID_A, CID_A)
    cgroupfs = f"12:memory:/kubepods/besteffort/pod{UID_B}/{CID_B}\n"
    assert parse_cgroup(cgroupfs) == (UID_B, CID_B)
    assert parse_cgroup("0::/user.slice/user-1000.slice/session-3.scope\n") == (None, None)


def test_processes_are_attributed_to_their_containers_through_cgroups(sim, tmp_path: Path) -> None:
    hosted = two_pods(tmp_path, "nb-alice")
    pipeline, series = poll(sim, SHARED, 6, processes=hosted)
    last = series[-1]
    assert values(last, "gpuwarden_container_gpu_memory_used_bytes", gpu="0", pod="trainer-0") == [20 * GIB]
    assert values(last, "gpuwarden_container_gpu_memory_used_bytes", gpu="0", pod="nb-alice") == [10 * GIB]
    # GPU 1's process has no cgroup to read: unattributed, not dropped
    assert values(last, "gpuwarden_container_gpu_memory_used_bytes", gpu="1", namespace="", pod="") == [4 * GIB]

    # SM shares as counters: rate() gives 0.6 and 0.2
    def rate(pod: str) -> float:
        first, final = (values(s, "gpuwarden_container_sm_active_seconds_total", pod=pod)[0] for s in (series[2], last))
        return (final - first) / (len(series) - 3)

    assert rate("trainer-0") == pytest.approx(0.6, abs=0.01)
    assert rate("nb-alice") == pytest.approx(0.2, abs=0.01)
    # the memory the GPU reports is the processes' sum: the holders account for all of it
    assert values(last, "gpuwarden_memory_used_bytes", gpu="0") == [30 * GIB]
    views = pipeline.snapshot.processes[pipeline.snapshot.gpus[0].uuid]
    assert [(v.pid, v.name, v.container, v.attributed_by) for v in views] == [
        (4101, "python3", "worker", "cgroup"),
        (4102, "jupyter", "notebook", "cgroup"),
    ]
    # no per-PID series unless asked for
    assert not values(last, "gpuwarden_process_gpu_memory_used_bytes")


def test_without_host_proc_an_exclusive_gpu_charges_its_allocated_container(sim, kubelet, tmp_path: Path) -> None:
    clock = ManualClock()
    fake = sim(SHARED, clock=clock)
    kubelet.pods = [("ml", "trainer-0", [("worker", [("nvidia.com/gpu", [fake.uuid(1)])])])]
    pipeline = Pipeline(
        settings(pods={"resources_socket": str(kubelet.socket_path), "refresh_interval": 1}), wall_clock=clock
    )
    try:
        pipeline.pods.refresh()  # type: ignore[union-attr]
        pipeline.poll_once()
        views = pipeline.snapshot.processes[fake.uuid(1)]
        assert [(v.pod, v.container, v.attributed_by) for v in views] == [("trainer-0", "worker", "allocation")]
        # GPU 0 is allocated to nobody here: its two processes stay unattributed
        assert {v.attributed_by for v in pipeline.snapshot.processes[fake.uuid(0)]} == {""}
    finally:
        pipeline.stop(0.5)


def test_two_hundred_short_lived_processes_keep_the_series_count_flat(sim, tmp_path: Path) -> None:
    scenario = {
        "name": "churn",
        "node": {"count": 1},
        "processes": [
            {"gpu": 0, "pid": 5000, "memory_gib": {"constant": 8}, "sm": {"constant": 50}},
            {
                "gpu": 0,
                "pid": 7000,
                "name": "eval",
                "memory_gib": {"constant": 1},
                "sm": {"constant": 30},
                "at": 0.5,
                "until": 1.0,
                "respawn_every": 1.0,
                "respawns": 200,
            },
        ],
    }
    proc, logs = stage_host(
        tmp_path,
        {5000: ("python3", systemd_cgroup(UID_A, CID_A))}
        | {7000 + k: ("eval", systemd_cgroup(UID_B, CID_B)) for k in range(201)},
        {UID_A: ("ml", "trainer-0", ["worker"]), UID_B: ("ml", "eval-job", ["eval"])},
    )
    clock = ManualClock()
    sim(scenario, clock=clock)
    pipeline = Pipeline(settings(processes={"proc_root": str(proc), "pod_logs_root": str(logs)}), wall_clock=clock)
    counts = []
    try:
        for step in range(400):  # 200 s at 0.5 s: each short-lived process is seen once, then gone
            pipeline.poll_once()
            if step % 20 == 0:
                counts.append(len(series_of(pipeline.snapshot)))
            clock.advance(0.5)
        pids_seen = pipeline.snapshot.processes
    finally:
        pipeline.stop(0.5)
    assert max(counts[1:]) - min(counts[1:]) <= 3, counts  # the eval container's series exist or not; never per PID
    assert len(pids_seen) == 1


def test_per_pid_series_are_opt_in_and_capped(sim) -> None:
    scenario = {
        "name": "many",
        "node": {"count": 1},
        "processes": [{"gpu": 0, "pid": 6000 + k, "memory_gib": {"constant": 1 + k}} for k in range(10)],
    }
    _, series = poll(sim, scenario, 3, processes={"per_pid_series": True, "max_pid_series": 4})
    per_pid = {
        dict(labels)["pid"]: value
        for (name, labels), value in series[-1].items()
        if name == "gpuwarden_process_gpu_memory_used_bytes"
    }
    assert per_pid == {str(6009 - k): (10 - k) * GIB for k in range(4)}  # the four largest holders


def test_an_exit_from_a_full_gpu_is_diagnosed_with_the_holders(sim, tmp_path: Path) -> None:
    scenario = {
        "name": "oom",
        "node": {"count": 1},
        "processes": [
            {"gpu": 0, "pid": 4101, "name": "train", "memory_gib": {"constant": 60}},
            {"gpu": 0, "pid": 4102, "name": "greedy", "memory_gib": {"constant": 18.5}, "until": 6},
        ],
    }
    hosted = two_pods(tmp_path, "nb-bob")
    pipeline, _ = poll(sim, scenario, 10, processes=hosted)
    snap = pipeline.snapshot
    assert [(e.pid, e.pod) for e in snap.process_exits] == [(4102, "nb-bob")]
    findings = [f for f in diagnose(snap) if f.check == "process_exit"]
    assert len(findings) == 1
    text = findings[0].observed
    assert "4102" in text and "research/nb-bob" in text and "ml/trainer-0" in text


def test_a_gpu_whose_driver_lacks_process_utilization_keeps_its_memory_readings(sim) -> None:
    scenario = dict(SHARED, driver={"missing_symbols": ["nvmlDeviceGetProcessesUtilizationInfo"]})
    pipeline, series = poll(sim, scenario, 4)
    assert values(series[-1], "gpuwarden_container_gpu_memory_used_bytes", gpu="0") == [30 * GIB]
    assert values(series[-1], "gpuwarden_container_sm_active_seconds_total", gpu="0") == [0.0]
    views = pipeline.snapshot.processes[pipeline.snapshot.gpus[0].uuid]
    assert all(v.sm_ratio is None for v in views)


def test_a_proc_root_that_is_not_a_proc_is_said_in_one_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    HostProcesses(tmp_path / "host-proc-not-mounted", None)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "gpuwarden.attribution.host"]
    assert "host-proc-not-mounted" in line and "processes.hostProc" in line


def test_a_pid_reused_by_another_process_is_looked_up_afresh(tmp_path: Path) -> None:
    proc, logs = stage_host(tmp_path, {42: ("first", systemd_cgroup(UID_A, CID_A))}, {})
    host = HostProcesses(proc, logs)
    assert host.process(42).name == "first"
    (proc / "42" / "comm").write_text("second\n")
    assert host.process(42).name == "first"  # cached while the PID holds the GPU
    host.retain(set())
    assert host.process(42).name == "second"


def test_memory_pressure_names_the_holders_and_the_sharing(sim, tmp_path: Path) -> None:
    hosted = two_pods(tmp_path, "nb-bob")
    pipeline, _ = poll(sim, FULL_GPU, 3, processes=hosted)
    (finding,) = [f for f in diagnose(pipeline.snapshot) if f.check == "memory_pressure"]
    assert finding.severity == "warning"  # a full GPU is the job's to fix: as the alert, never a page
    assert "held by ml/trainer-0/worker pid 4101 60.0 GiB" in finding.observed
    assert "research/nb-bob/notebook pid 4102 19.0 GiB" in finding.observed
    assert finding.observed.endswith("shared by 2 containers")
    assert [h["pid"] for h in finding.holders] == [4101, 4102]


def test_the_api_lists_each_process_with_its_pod_largest_first(live_server, tmp_path: Path) -> None:
    hosted = two_pods(tmp_path, "nb-alice")
    server = live_server(SHARED, processes=hosted)
    # pods are listed on the lookup thread, so the first snapshots may hold the PIDs before their pods
    wait_for(
        lambda: [r["pod"] for r in server.get("/api/v1/processes").json()["processes"]][:2] == ["trainer-0", "nb-alice"]
    )
    rows = server.get("/api/v1/processes").json()["processes"]
    assert [(r["gpu"], r["pid"], r["pod"]) for r in rows] == [
        (0, 4101, "trainer-0"),
        (0, 4102, "nb-alice"),
        (1, 4201, ""),
    ]
    assert rows[0]["used_memory_bytes"] == 20 * GIB and rows[0]["memory_share"] == pytest.approx(20 / 80, rel=0.01)
    gpu0 = server.get("/api/v1/gpus/0").json()
    assert [(p["pid"], p["name"], p["container"]) for p in gpu0["processes"]] == [
        (4101, "python3", "worker"),
        (4102, "jupyter", "notebook"),
    ]
    assert server.get("/openapi.json").json()["paths"]["/api/v1/processes"]


# GPU 0 split in two 1g.10gb slices: 9 GiB in GPU instance 7 (two processes), 9 GiB in 8
MIG_PROCESSES = [
    {"gpu": 0, "pid": 4301, "memory_gib": {"constant": 6}, "gpu_instance": 7},
    {"gpu": 0, "pid": 4302, "memory_gib": {"constant": 3}, "gpu_instance": 7},
    {"gpu": 0, "pid": 4303, "memory_gib": {"constant": 9}, "gpu_instance": 8},
]


def test_mig_processes_are_summed_per_gpu_instance_in_the_api(live_server) -> None:
    scenario = {"name": "mig-procs", "node": {"count": 1, "mig_instances": {0: 2}}, "processes": MIG_PROCESSES}
    server = live_server(scenario)
    wait_for(lambda: len(server.get("/api/v1/gpus/0").json()["processes"]) == 3)
    gpu = server.get("/api/v1/gpus/0").json()
    assert gpu["memory_by_gpu_instance"] == {"7": 9 * GIB, "8": 9 * GIB}
    assert {p["pid"]: p["gpu_instance"] for p in gpu["processes"]} == {4301: 7, 4302: 7, 4303: 8}


def test_each_mig_slice_reports_its_own_memory_and_profile(sim) -> None:
    """A slice runs out of memory at its own total: 9 of 9.75 GiB in GPU instance 7 is nearly full while the GPU
    is at 18 of 80. Each slice's profile is named as nvidia-smi names it (the by-ID profile call)."""
    scenario = {
        "name": "mig-memory",
        "node": {"count": 2, "mig_instances": {0: 2}},
        "processes": [*MIG_PROCESSES, {"gpu": 1, "pid": 4304, "memory_gib": {"constant": 9}}],
    }
    _, series = poll(sim, scenario, 2)
    last = series[-1]
    used = {labels["gpu_instance"]: v for labels, v in _labelled(last, "gpuwarden_mig_memory_used_bytes")}
    total = {labels["gpu_instance"]: v for labels, v in _labelled(last, "gpuwarden_mig_memory_total_bytes")}
    assert used == {"7": 9 * GIB, "8": 9 * GIB}
    assert total == {"7": 9984 * 2**20, "8": 9984 * 2**20}
    info = [labels for labels, _ in _labelled(last, "gpuwarden_mig_instance_info")]
    assert {(i["gpu"], i["gpu_instance"], i["profile"], i["profile_id"]) for i in info} == {
        ("0", "7", "1g.10gb", "19"),
        ("0", "8", "1g.10gb", "19"),
    }
    assert all(i["mig_uuid"].startswith("MIG-") for i in info)
    assert values(last, "gpuwarden_memory_used_bytes", gpu="0") == [18 * GIB]  # the GPU's own reading is unchanged


def test_the_simulated_profile_call_is_as_strict_as_the_header(sim) -> None:
    """The v2 structure with its version unset is refused (nvml.h: the caller sets nvmlGpuInstanceProfileInfo_v2;
    pynvml's structure does it in its constructor), and one passed by value fails loudly, as it would corrupt the
    real library's memory."""
    import ctypes

    import pynvml

    from gpuwarden.sim.fakecommon import SimulatedMemoryCorruption

    sim({"name": "mig-version", "node": {"count": 1, "mig_instances": {0: 1}}})
    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        assert pynvml.nvmlDeviceGetGpuInstanceProfileInfoById(handle, 19).name == "MIG 1g.10gb"  # pynvml decodes
        function = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetGpuInstanceProfileInfoByIdV")
        unset = pynvml.c_nvmlGpuInstanceProfileInfo_v2_t()
        unset.version = 0
        assert function(handle, 19, ctypes.byref(unset)) == pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        with pytest.raises(SimulatedMemoryCorruption):
            function(handle, 19, pynvml.c_nvmlGpuInstanceProfileInfo_v2_t())
    finally:
        pynvml.nvmlShutdown()


def test_a_driver_that_cannot_list_processes_loses_only_the_process_series(sim) -> None:
    scenario = dict(
        SHARED,
        faults=[{"kind": "not_supported", "call": "nvmlDeviceGetComputeRunningProcesses_v3", "gpu": 0}],
        driver={"missing_symbols": ["nvmlDeviceGetComputeRunningProcesses_v2"]},
    )
    pipeline, series = poll(sim, scenario, 3)
    last = series[-1]
    assert not values(last, "gpuwarden_processes", gpu="0") and values(last, "gpuwarden_processes", gpu="1") == [1]
    assert not values(last, "gpuwarden_container_gpu_memory_used_bytes", gpu="0")
    assert values(last, "gpuwarden_memory_used_bytes", gpu="0")  # the GPU's other readings stay
    assert pipeline.snapshot.gpus[0].uuid not in pipeline.snapshot.processes


def test_the_diagnosis_endpoint_names_the_holders_of_a_full_gpu(live_server, tmp_path: Path) -> None:
    hosted = two_pods(tmp_path, "nb-bob")
    server = live_server(FULL_GPU, processes=hosted)

    def memory_finding() -> dict | None:
        findings = server.get("/api/v1/diagnosis/0").json()["findings"]
        return next((f for f in findings if f["check"] == "memory_pressure" and f["holders"]), None)

    def attributed() -> bool:  # the pod-log listing runs on the lookup thread: a cycle or two after the holders
        finding = memory_finding()
        return finding is not None and all(h["pod"] for h in finding["holders"])

    wait_for(attributed)
    finding = memory_finding()
    assert [(h["pid"], h["namespace"], h["pod"], h["container"]) for h in finding["holders"]] == [
        (4101, "ml", "trainer-0", "worker"),
        (4102, "research", "nb-bob", "notebook"),
    ]
    assert "shared by 2 containers" in finding["observed"] and "expandable_segments" in finding["recommended_action"]


def slurm_cgroup_v2(job: str) -> str:
    return f"0::/system.slice/slurmstepd.scope/job_{job}/step_0/user/task_0\n"


def test_slurm_cgroup_layouts_give_the_job_and_its_user() -> None:
    from gpuwarden.attribution.host import parse_slurm

    assert parse_slurm(slurm_cgroup_v2("4242")) == ("4242", None)
    v1 = "12:memory:/slurm/uid_1000/job_77/step_batch/task_0\n4:devices:/slurm/uid_1000/job_77/step_batch\n"
    assert parse_slurm(v1) == ("77", "1000")
    assert parse_slurm("0::/system.slice/slurmstepd.scope/system\n") == ("", None)  # slurmstepd itself
    assert parse_slurm(systemd_cgroup(UID_A, CID_A)) == ("", None)
    assert parse_slurm("0::/user.slice/user-1000.slice/job_5.scope\n") == ("", None)  # not Slurm's


def test_processes_of_slurm_jobs_get_per_job_series_and_memory_findings(sim, tmp_path: Path) -> None:
    """A Slurm node: the processes' cgroups name the job; per-job series in the manner of the per-container ones,
    the job's user from /proc/PID/status, and the memory finding naming the job."""
    proc, _ = stage_host(
        tmp_path, {4101: ("python3", slurm_cgroup_v2("4242")), 4102: ("python3", slurm_cgroup_v2("4243"))}, {}
    )
    (proc / "4101" / "status").write_text("Name:\tpython3\nUid:\t0\t0\t0\t0\n")
    (proc / "4102" / "status").write_text("Name:\tpython3\nUid:\t64999\t64999\t64999\t64999\n")  # no passwd entry
    pipeline, series = poll(sim, FULL_GPU, 6, processes={"proc_root": str(proc)})
    last = series[-1]
    assert values(last, "gpuwarden_slurm_job_gpu_memory_used_bytes", gpu="0", job="4242", user="root") == [60 * GIB]
    assert values(last, "gpuwarden_slurm_job_gpu_memory_used_bytes", gpu="0", job="4243", user="64999") == [19 * GIB]
    (finding,) = [f for f in diagnose(pipeline.snapshot) if f.check == "memory_pressure"]
    assert "held by Slurm job 4242 (root, pid 4101) 60.0 GiB" in finding.observed, finding.observed
    assert finding.holders[0]["slurm_job"] == "4242"
    # no job series where processes are not in a Slurm job (a Kubernetes node)
    hosted = two_pods(tmp_path / "k8s", "nb")
    _, k8s = poll(sim, FULL_GPU, 2, processes=hosted)
    assert not values(k8s[-1], "gpuwarden_slurm_job_gpu_memory_used_bytes")


def test_per_job_sm_seconds_follow_the_jobs_share(sim, tmp_path: Path) -> None:
    proc, _ = stage_host(tmp_path, {4101: ("train", slurm_cgroup_v2("9")), 4102: ("nb", slurm_cgroup_v2("10"))}, {})
    _, series = poll(sim, SHARED, 6, processes={"proc_root": str(proc)})

    def rate(job: str) -> float:
        first, final = (
            values(s, "gpuwarden_slurm_job_sm_active_seconds_total", job=job)[0] for s in (series[2], series[-1])
        )
        return (final - first) / (len(series) - 3)

    assert rate("9") == pytest.approx(0.6, abs=0.01) and rate("10") == pytest.approx(0.2, abs=0.01)


def poll_until_blocked(pipeline: Pipeline, entered) -> object:  # noqa: ANN001 - a threading.Event
    """A poll in a thread of its own, once its host lookup is blocked: then the publication and NVML locks must be
    free (a lookup under them stalled publication and the XID watcher). Returns the poll's thread."""
    import threading

    first = threading.Thread(target=pipeline.poll_once, daemon=True)
    first.start()
    assert entered.wait(30), "the lookup never started"
    for lock in (pipeline.poller.nvml.lock, pipeline.poller._publish_lock):
        assert lock.acquire(timeout=10), "a lock is held while the lookup is blocked"
        lock.release()
    return first


def test_a_slow_user_lookup_never_holds_publication_or_nvml(sim, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """getpwuid goes through NSS (SSSD or LDAP on many Slurm clusters) and can block for as long as the directory
    does. It runs on the lookup thread: while it is blocked, the publication and NVML locks are free and snapshots
    keep coming (the job's series wait for its user's name). The directory service is the one thing mocked here: a
    getpwuid that blocks until released."""
    import pwd
    import threading

    proc, _ = stage_host(tmp_path, {4101: ("python3", slurm_cgroup_v2("4242"))}, {})
    (proc / "4101" / "status").write_text("Name:\tpython3\nUid:\t0\t0\t0\t0\n")
    entered, release = threading.Event(), threading.Event()
    real = pwd.getpwuid

    def slow_directory(uid: int):  # noqa: ANN202
        entered.set()
        release.wait(60)
        return real(uid)

    monkeypatch.setattr(pwd, "getpwuid", slow_directory)
    clock = ManualClock()
    sim(FULL_GPU, clock=clock)
    pipeline = Pipeline(settings(processes={"proc_root": str(proc)}), wall_clock=clock)
    try:
        first = poll_until_blocked(pipeline, entered)
        clock.advance(1.0)
        snapshot = pipeline.poller._publish()  # a publication while the lookup is still blocked
        series = series_of(snapshot)
        assert not values(series, "gpuwarden_slurm_job_gpu_memory_used_bytes")  # not under a UID that would change
        assert values(series, "gpuwarden_gpu_up") == [1.0]
    finally:
        release.set()
    first.join(30)
    assert pipeline.host.lookups.wait_idle(30)
    series = series_of(pipeline.poller._publish())
    assert values(series, "gpuwarden_slurm_job_gpu_memory_used_bytes", job="4242", user="root") == [60 * GIB]
    pipeline.stop()


def test_a_slow_pod_log_listing_never_holds_publication(sim, tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    """The pod-log directory (up to 10,000 entries, on a slow disk) is listed on the lookup thread too."""
    import threading

    hosted = two_pods(tmp_path, "nb")
    entered, release = threading.Event(), threading.Event()
    real_scan = HostProcesses._scan

    def slow_scan(self) -> None:  # noqa: ANN001
        entered.set()
        release.wait(60)
        real_scan(self)

    monkeypatch.setattr(HostProcesses, "_scan", slow_scan)
    clock = ManualClock()
    sim(SHARED, clock=clock)
    pipeline = Pipeline(settings(processes=hosted), wall_clock=clock)
    try:
        first = poll_until_blocked(pipeline, entered)
    finally:
        release.set()
    first.join(30)
    assert pipeline.host.lookups.wait_idle(30)
    pipeline.stop()
