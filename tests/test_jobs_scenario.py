"""The shipped `jobs` scenario, as a user tries it (docs/diagnosis.md opens with it): `gpuwarden --sim
--nvml.scenario jobs` with the simulator's own host /proc (its `host_processes`), no proc_root to configure. Three
jobs, balanced until 30 s; then a CPU-bound straggler, a collective hang and a co-tenant's straggler are named, and
the job keys and ranks are those of the scenario's launchers."""

from __future__ import annotations

import pytest

from gpuwarden.jobs.findings import diagnose
from gpuwarden.runtime.pipeline import Pipeline
from tests.helpers.common import ManualClock, settings

ONSET = 30.0


@pytest.mark.slow  # three minutes of an 8-GPU node on the manual clock
def test_the_jobs_scenario_shows_a_straggler_a_hang_and_a_co_tenant(sim):
    clock = ManualClock(0.0)
    sim("jobs", clock=clock)
    pipeline = Pipeline(settings(), wall_clock=clock)
    first: dict[tuple[str, str], float] = {}
    try:
        while clock.now <= ONSET + 120:
            snapshot = pipeline.poll_once()
            for finding in diagnose(snapshot):
                if finding.job is not None:
                    assert clock.now > ONSET, finding.observed  # nothing while every job is balanced
                    first.setdefault((finding.check, finding.job["job"]), clock.now)
                    last = finding
            clock.advance(1)
    finally:
        pipeline.stop(timeout=0.2)
    assert last is not None
    keys = {gpu.index: (snapshot.jobs[gpu.uuid].job, snapshot.jobs[gpu.uuid].rank) for gpu in snapshot.gpus}
    llama, vit = "10.0.0.5:29500/llama-ft", "10.0.0.9:29500/vit"
    bert = keys[4][0]
    assert [keys[g] for g in range(4)] == [(llama, str(rank)) for rank in range(4)]
    assert bert.startswith("local/") and bert.endswith("/torchrun-4490") and keys[5][0] == bert
    assert [keys[6], keys[7]] == [(vit, "0"), (vit, "1")]
    assert snapshot.job_sources == {"cgroup": True, "cmdline": True, "environ": True}
    assert set(first) == {("straggler", llama), ("straggler", vit), ("collective_hang", bert)}, first
    assert first[("straggler", llama)] - ONSET <= 60 and first[("straggler", vit)] - ONSET <= 60, first
    by_job = {f.job["job"]: f for f in diagnose(snapshot) if f.job is not None}
    assert by_job[llama].gpu == 1 and by_job[llama].job["cause"] == "cpu"
    assert by_job[vit].gpu == 7 and by_job[vit].job["cause"] == "slower_gpu"
    assert "pid 6001 (python, SM 60%)" in by_job[vit].observed  # the co-tenant, named (its /proc comm) with its SM
    assert by_job[bert].check == "collective_hang" and by_job[bert].gpu is None
