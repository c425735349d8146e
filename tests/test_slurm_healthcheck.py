"""`gpuwarden slurm-healthcheck` against a real slurmctld and slurmd on loopback (Debian's slurm-wlm and munge,
started by tests/helpers/slurm.py) and the real exporter over the simulator: a critical verdict drains the node with
gpuwarden's reason; a repair resumes it; an admin's drain is never touched; the cap, the opt-out feature, a person's
resume and dry-run hold; Unknown changes nothing. The last test has slurmd itself run the shipped wrapper."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.common import free_port, wait_for
from tests.helpers.slurm import SlurmCluster, missing

ROOT = Path(__file__).resolve().parent.parent
pytestmark = [
    pytest.mark.slow,
    pytest.mark.serial,  # a real slurmctld, and drains that race each other on purpose: the serial phase
    pytest.mark.skipif(bool(missing()), reason=f"Slurm not installed ({', '.join(missing())}; the test command does)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="slurmctld and slurmd run as root here (CI runs as root)"),
]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):  # noqa: ANN001, ANN201
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm")).start()
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster(slurm: SlurmCluster) -> SlurmCluster:
    slurm.reset()
    return slurm


def healthcheck(cluster: SlurmCluster, url: str, state: Path, *flags: str, node: str = "gpu-1") -> tuple[int, str]:
    done = subprocess.run(
        [sys.executable, "-m", "gpuwarden", "slurm-healthcheck", "--node", node, "--exporter-url", url,
         "--state-dir", str(state), "--settle", "0", *flags],
        env=cluster.env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return done.returncode, done.stdout + done.stderr


def test_a_critical_fault_drains_and_its_repair_resumes(
    cluster: SlurmCluster, scenario_exporter, tmp_path: Path
) -> None:  # noqa: ANN001
    sick = scenario_exporter("ecc-uncorrectable")
    code, out = healthcheck(cluster, sick.url, tmp_path)  # inside slurmd's 60 s: the run's own timeout is 60 s
    state, reason = cluster.node("gpu-1")
    assert code == 1 and "drain" in state, (state, out)
    assert reason.startswith("gpuwarden: GPU1 ecc") or reason.startswith("gpuwarden: GPU1 xid"), reason
    assert healthcheck(cluster, sick.url, tmp_path)[0] == 1 and cluster.node("gpu-1") == (state, reason)  # no churn
    # the exporter down: Unknown, nothing changes (never read as a repair)
    code, out = healthcheck(cluster, f"http://127.0.0.1:{free_port()}", tmp_path)
    assert code == 2 and "nothing changed" in out and "drain" in cluster.node("gpu-1")[0]
    repaired = scenario_exporter("training")
    code, out = healthcheck(cluster, repaired.url, tmp_path)
    deadline = time.monotonic() + 20
    while code == 2 and "not observed" in out and time.monotonic() < deadline:
        # a fresh exporter on a loaded machine may not have read every GPU yet: Unknown until it has (the
        # full suite once ran this before its second slow cycle); the verdict asserted is the one after
        time.sleep(0.5)
        code, out = healthcheck(cluster, repaired.url, tmp_path)
    assert code == 0 and cluster.node("gpu-1")[0] in ("idle", "mixed", "allocated"), out


def test_an_admins_drain_is_never_touched(
    cluster: SlurmCluster,
    scenario_exporter,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    cluster.scontrol("update", "NodeName=gpu-1", "State=DRAIN", "Reason=admin: fan replacement")
    sick = scenario_exporter("ecc-uncorrectable")
    code, out = healthcheck(cluster, sick.url, tmp_path)
    assert code == 1 and "someone else" in out
    assert cluster.node("gpu-1")[1] == "admin: fan replacement"
    healthy = scenario_exporter("training")
    healthcheck(cluster, healthy.url, tmp_path)
    assert cluster.node("gpu-1") == ("drained", "admin: fan replacement")  # healthy GPUs do not resume it


def test_the_cap_counts_gpuwardens_drains_in_the_partition(
    cluster: SlurmCluster, scenario_exporter, tmp_path: Path
) -> None:  # noqa: ANN001
    cluster.scontrol("update", "NodeName=gpu-2", "State=DRAIN", "Reason=gpuwarden: GPU0 xid: XID 79")
    cluster.scontrol("update", "NodeName=gpu-3", "State=DRAIN", "Reason=admin: not counted")
    sick = scenario_exporter("ecc-uncorrectable")
    code, out = healthcheck(cluster, sick.url, tmp_path, "--max-drained", "1")
    assert code == 1 and "--max-drained 1" in out and "gpu-2" in out
    assert "drain" not in cluster.node("gpu-1")[0]
    healthcheck(cluster, sick.url, tmp_path, "--max-drained", "2")
    assert cluster.node("gpu-1")[1].startswith("gpuwarden: ")


# Rounds of five runs at once. The suite runs 15 (each ~1.4 s); the figure in docs/deploy.md is from 100 rounds,
# twice: GPUWARDEN_CAP_ROUNDS=100 pytest tests/test_slurm_healthcheck.py -k cap -s
CAP_ROUNDS = int(os.environ.get("GPUWARDEN_CAP_ROUNDS", "15"))
AT_ONCE = ("gpu-1", "gpu-2", "gpu-3", "gpu-5", "gpu-6")  # gpu-4 opts out


def test_the_cap_holds_when_every_node_checks_at_once(cluster: SlurmCluster, scenario_exporter, tmp_path: Path) -> None:  # noqa: ANN001
    """slurmd runs HealthCheckProgram on every node at once: five nodes with the same critical fault, one cap of 1,
    100 rounds. Drains may exceed the cap only while the runs of a round are still settling; within one more
    health-check interval (a run slower than the settle time) exactly one node is drained, never more, never none.
    The worst overshoot, how long it lasted and how many rounds needed the next interval are printed for docs."""
    sick = scenario_exporter("ecc-uncorrectable")
    worst, longest, second_interval = 0, 0.0, 0

    def check_all_at_once(round_: int) -> list[str]:
        nonlocal worst, longest
        runs = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "gpuwarden",
                    "slurm-healthcheck",
                    "--node",
                    node,
                    "--exporter-url",
                    sick.url,
                    "--state-dir",
                    str(tmp_path / f"{round_}-{node}"),
                    "--max-drained",
                    "1",
                    "--settle",
                    "0.5",
                ],
                env=cluster.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )  # fmt: skip
            for node in AT_ONCE
        ]
        over_since = None
        while any(run.poll() is None for run in runs):
            drained = sum(1 for state, reason in cluster.nodes().values() if "drain" in state)
            now = time.monotonic()
            worst = max(worst, drained - 1)
            if drained > 1:
                over_since = over_since or now
                longest = max(longest, now - over_since)
            else:
                over_since = None
        outputs = [run.communicate()[0] for run in runs]
        assert [run.returncode for run in runs] == [1] * len(runs), outputs
        return outputs

    for round_ in range(CAP_ROUNDS):
        cluster.reset()
        outputs = check_all_at_once(round_)
        ours = sorted(name for name, (state, reason) in cluster.nodes().items() if reason.startswith("gpuwarden:"))
        if len(ours) > 1:  # a run slower than the settle time: the next health-check interval converges
            second_interval += 1
            outputs += check_all_at_once(round_)
            ours = sorted(name for name, (_, reason) in cluster.nodes().items() if reason.startswith("gpuwarden:"))
        assert len(ours) == 1, (round_, ours, outputs)  # never more than the cap, never none: the fault is real
        assert all("drain" in cluster.nodes()[name][0] for name in ours)
    print(
        f"cap 1, {len(AT_ONCE)} nodes at once, {CAP_ROUNDS} rounds: worst +{worst}, longest {longest:.2f} s, "
        f"{second_interval} round(s) converged at the next interval"
    )


def test_dry_run_only_logs(
    cluster: SlurmCluster,
    scenario_exporter,  # noqa: ANN001
    tmp_path: Path,
) -> None:
    sick = scenario_exporter("ecc-uncorrectable")
    code, out = healthcheck(cluster, sick.url, tmp_path, "--dry-run")
    assert code == 1 and "dry-run: would run: scontrol update NodeName=gpu-1 State=DRAIN Reason=gpuwarden: GPU1" in out
    assert "drain" not in cluster.node("gpu-1")[0]
    cluster.scontrol("update", "NodeName=gpu-1", "State=DRAIN", "Reason=gpuwarden: earlier")
    healthy = scenario_exporter("training")
    code, out = healthcheck(cluster, healthy.url, tmp_path, "--dry-run")
    assert "would run: scontrol update NodeName=gpu-1 State=UNDRAIN" in out
    assert cluster.node("gpu-1")[0] == "drained"


def test_a_persons_resume_and_the_opt_out_feature_are_honoured(
    cluster: SlurmCluster, scenario_exporter, tmp_path: Path
) -> None:  # noqa: ANN001
    sick = scenario_exporter("ecc-uncorrectable")
    healthcheck(cluster, sick.url, tmp_path)
    assert "drain" in cluster.node("gpu-1")[0]
    cluster.scontrol("update", "NodeName=gpu-1", "State=UNDRAIN")  # a person puts it back, fault and all
    code, out = healthcheck(cluster, sick.url, tmp_path)
    assert "resumed by a person" in out and "drain" not in cluster.node("gpu-1")[0]
    healthy = scenario_exporter("training")
    healthcheck(cluster, healthy.url, tmp_path)  # the fault clears: the memory of the resume goes
    sick = scenario_exporter("ecc-uncorrectable")
    healthcheck(cluster, sick.url, tmp_path)  # and when it comes back, it drains again
    assert "drain" in cluster.node("gpu-1")[0]
    code, out = healthcheck(cluster, sick.url, tmp_path, "--max-drained", "5", node="gpu-4")
    assert "gpuwarden-no-drain" in out and "drain" not in cluster.node("gpu-4")[0]


def test_bad_flags_and_unknown_nodes_are_one_line_and_change_nothing(cluster: SlurmCluster, tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "gpuwarden", "slurm-healthcheck", "--max-drained", "0"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "--max-drained" in done.stderr and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "gpuwarden", "slurm-healthcheck", "--conditions", "gpu"],
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "--conditions" in done.stderr


def test_slurmd_runs_the_shipped_wrapper_and_it_drains(scenario_exporter, tmp_path: Path) -> None:  # noqa: ANN001
    """slurmd runs the HealthCheckProgram at start and every HealthCheckInterval, as root, with no arguments and an
    empty environment: the shipped wrapper must find gpuwarden, sinfo and scontrol by itself."""
    sick = scenario_exporter("ecc-uncorrectable")
    defaults = tmp_path / "defaults"
    gpuwarden = Path(sys.executable).parent / "gpuwarden"
    defaults.write_text(
        f'FLAGS="--exporter-url {sick.url} --state-dir {tmp_path / "state"}"\nGPUWARDEN={gpuwarden}\n'
        f"SLURM_CONF={tmp_path / 'slurm' / 'slurm.conf'}\nexport SLURM_CONF\n"  # a slurm.conf not in /etc/slurm
    )
    wrapper = tmp_path / "gpuwarden-healthcheck"
    text = (ROOT / "deploy" / "slurm" / "gpuwarden-healthcheck").read_text()
    wrapper.write_text(text.replace("DEFAULTS=/etc/default/gpuwarden-healthcheck", f"DEFAULTS={defaults}"))
    wrapper.chmod(0o755)
    own = SlurmCluster(tmp_path / "slurm", health_check=wrapper, interval=2).start()
    try:
        wait_for(lambda: own.node("gpu-1")[1].startswith("gpuwarden: GPU1"), timeout=40, step=0.5)
        assert "drain" in own.node("gpu-1")[0]
    finally:
        own.stop()


def test_the_wrapper_finds_the_documented_install_or_says_so_and_fails(tmp_path: Path) -> None:
    """docs/deploy.md installs into the venv /opt/gpuwarden; slurmd runs the wrapper with an empty environment, so
    `gpuwarden` was not on its PATH: exit 127, "gpuwarden: not found", unseen in dry-run (issue 36). The wrapper
    looks in that venv, and where gpuwarden is nowhere it says so, naming the fix, and fails."""
    text = (ROOT / "deploy" / "slurm" / "gpuwarden-healthcheck").read_text()
    venv = tmp_path / "opt" / "gpuwarden"  # the documented /opt/gpuwarden, under tmp_path
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "gpuwarden"
    fake.write_text('#!/bin/sh\necho "ran: $*"\n')
    fake.chmod(0o755)
    defaults = tmp_path / "defaults"  # present and empty: nothing set, as after a plain install
    defaults.write_text("")
    wrapper = tmp_path / "gpuwarden-healthcheck"
    wrapper.write_text(
        text.replace("DEFAULTS=/etc/default/gpuwarden-healthcheck", f"DEFAULTS={defaults}").replace(
            "/opt/gpuwarden/bin", str(venv / "bin")
        )
    )
    wrapper.chmod(0o755)
    done = subprocess.run([str(wrapper)], env={}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0 and done.stdout.strip() == "ran: slurm-healthcheck --dry-run", done
    fake.unlink()  # installed nowhere the wrapper looks
    done = subprocess.run([str(wrapper)], env={}, capture_output=True, text=True, timeout=30)
    assert done.returncode == 1 and "cannot run 'gpuwarden'" in done.stderr and "GPUWARDEN=" in done.stderr, done
