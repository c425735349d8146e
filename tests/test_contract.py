"""Contracts: pynvml symbols and constants we rely on, the fake's coverage, and the metric naming rules."""

from __future__ import annotations

import re
from pathlib import Path

import pynvml
import pytest

from gpuwarden.model.families import FAMILIES
from gpuwarden.sim.scenario import shipped_scenarios
from tests.helpers.common import polled, series_of

SOURCE = Path(__file__).resolve().parent.parent / "exporter" / "gpuwarden"


def production_sources() -> list[Path]:
    return [p for p in SOURCE.rglob("*.py") if "sim" not in p.parts]


def test_every_pynvml_name_we_use_exists():
    used = set()
    for path in SOURCE.rglob("*.py"):
        used |= set(re.findall(r"pynvml\.([A-Za-z_][A-Za-z0-9_]*)", path.read_text()))
    missing = sorted(name for name in used if not hasattr(pynvml, name))
    assert not missing


def test_constants_the_logic_depends_on():
    # A MagicMock would hide a wrong constant (one conftest elsewhere set GPU_IS_LOST to 9).
    assert pynvml.NVML_ERROR_GPU_IS_LOST == 15
    assert pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH == 18
    assert pynvml.NVML_FI_DEV_POWER_INSTANT == 186
    assert pynvml.NVML_FI_DEV_GET_GPU_RECOVERY_ACTION == 230
    assert pynvml.NVML_TOPOLOGY_HOSTBRIDGE == 30
    assert pynvml.NVML_FI_DEV_NVLINK_GET_STATE == 165
    assert pynvml.nvmlEventTypeXidCriticalError == 0x8


def test_metric_names_follow_the_conventions():
    base_units = ("bytes", "seconds", "celsius", "watts", "joules", "hertz", "ratio")
    for name, family in FAMILIES.items():
        assert name.startswith("gpuwarden_")
        assert re.fullmatch(r"[a-z_]+", name)
        assert (family.type == "counter") == name.endswith("_total"), name
        if family.per_gpu:
            assert family.all_labels[:2] == ("gpu", "uuid")
        assert not {"hostname", "host", "instance", "node"} & set(family.all_labels)
        if family.unit:
            assert family.unit in base_units
            assert name.removesuffix("_total").endswith(family.unit), name
        assert family.help.strip()


@pytest.mark.slow  # every shipped scenario polled
def test_every_contract_family_appears_in_some_scenario(sim, make_pipeline):
    seen: set[str] = set()
    for name in sorted(shipped_scenarios()):
        pipeline, fake = polled(sim, make_pipeline, name, 10, processes={"per_pid_series": True})
        if name == "ecc-uncorrectable":
            pipeline.poller.xid.record(pipeline.snapshot.gpus[0].uuid, 48, 1.0)  # events need the watcher thread
            pipeline.poll_once()
        seen |= {series[0] for series in series_of(pipeline.snapshot)}
        fake.close()
    # Only under injected faults, covered in test_error_policy: a hardware error and a hung call.
    hardware = {"gpuwarden_gpu_hardware_error_info", "gpuwarden_collect_timeouts_total"}
    # Only with a kubelet answering, covered in test_podresources; the watcher's state only where there could be one
    # (a simulated node watches no default socket that is absent: test_podresources).
    hardware |= {"gpuwarden_gpu_allocation", "gpuwarden_pod_attribution_unmatched_devices", "gpuwarden_mig_allocation"}
    hardware |= {"gpuwarden_pod_attribution_up"}
    # Only where GPM cannot be read for lack of permission, covered in test_gpm.
    hardware |= {"gpuwarden_gpm_unavailable_info"}
    # Only once the bottleneck window (300 s by default) has been watched, covered in test_gpm.
    hardware |= {"gpuwarden_bottleneck_info"}
    # The serving process's own counters, rendered beside the snapshot by the CLI: test_hostile_clients.
    hardware |= {"gpuwarden_http_rejected_total", "gpuwarden_config_reloads_total"}
    # A setting the CLI renders beside the snapshot (nvml.expected_gpus): test_config.
    hardware |= {"gpuwarden_gpus_expected"}
    # Only where processes run inside Slurm job steps (their cgroups on a host /proc), covered in test_processes.
    hardware |= {"gpuwarden_slurm_job_gpu_memory_used_bytes", "gpuwarden_slurm_job_sm_active_seconds_total"}
    # Only once a job's straggler or hang has held for a while (the `jobs` scenario's, after 30 s): test_jobs_scenario.
    hardware |= {"gpuwarden_job_finding"}
    # Only where the kernel log holds a fallen-off-the-bus line for a GPU NVML still lists (a simulated GPU is lost
    # by its fault, not by a log line): test_kernel_log hands the exporter such a log.
    hardware |= {"gpuwarden_kernel_fallen_off_bus_total"}
    # Only with the metrics group video on (its reads are made only then), covered in test_video.
    hardware |= {"gpuwarden_video_busy_seconds_total"}
    missing = set(FAMILIES) - hardware - {n for n in seen} - {n.removesuffix("_total") for n in seen}
    assert not missing, missing


@pytest.mark.parametrize("name", sorted(shipped_scenarios()))
def test_the_fake_implements_every_symbol_the_exporter_asks_for(sim, make_pipeline, name):
    fake = sim(name)
    pipeline = make_pipeline(processes={"per_pid_series": True})
    pipeline.poll_once()
    assert not fake.missing_lookups, dict(fake.missing_lookups)


def test_a_family_registers_where_it_is_defined_and_a_name_defined_twice_fails():
    """No hand-kept list: defining a family registers it; a second definition of a name is a bug found at import."""
    from gpuwarden.model import families

    assert families.FAMILIES[families.POWER_USAGE_WATTS.name] is families.POWER_USAGE_WATTS
    before = dict(families.FAMILIES)
    with pytest.raises(ValueError, match="gpuwarden_power_usage_watts is defined twice"):
        families._f("gpuwarden_power_usage_watts", "gauge", "again")
    assert before == families.FAMILIES
