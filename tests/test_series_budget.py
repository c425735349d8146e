"""The series budget: the simulated 8x H100 NVSwitch node at the default collector groups, with profiling,
processes and pod attribution, stays within docs.series_budget.BUDGET; what the alerts and the fleet
service query is in the default set; the groups switch what they say."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from docs.series_budget import BUDGET, JOB_SERIES, KERNEL_LOG_SERIES, POD_SERIES, default_series
from gpuwarden.commandline import ConfigError
from gpuwarden.config.settings import load_settings
from gpuwarden.health import rules
from gpuwarden.model.families import GROUPS, Selection
from tests.helpers.kubelet import FakeKubelet


@pytest.mark.slow  # every scenario on an 8-GPU node
def test_the_default_set_of_an_8_gpu_nvswitch_node_fits_the_budget(kubelet: FakeKubelet) -> None:
    from gpuwarden.sim.fake_device import gpu_uuid
    from gpuwarden.sim.scenario import load_scenario

    # every GPU allocated to one container, as a training job holds them: allocation series counted too
    scenario = load_scenario("training")
    uuids = [gpu_uuid(scenario, i) for i in range(scenario.node.count)]
    kubelet.pods = [("ml", f"trainer-{i}", [("worker", [("nvidia.com/gpu", [u])])]) for i, u in enumerate(uuids)]
    # and the host's /proc showing the eight processes as the ranks of one torchrun job (the job view's series)
    proc = kubelet.socket_path.parent / "proc"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    for rank in range(8):
        pid = 4000 + 100 * rank  # the simulator's PIDs on the training scenario
        (proc / str(pid)).mkdir()
        variables = f"MASTER_ADDR=10.0.0.1\0MASTER_PORT=29500\0RANK={rank}\0WORLD_SIZE=8\0"
        (proc / str(pid) / "environ").write_text(variables)
        (proc / str(pid) / "stat").write_text(f"{pid} (python) S 3999 3999 3999 0 -1\n")
    counts = default_series(
        pods={"resources_socket": str(kubelet.socket_path), "refresh_interval": 1},
        processes={"proc_root": str(proc)},
    )
    total = sum(counts.values())
    assert counts["gpuwarden_gpu_allocation"] == 8  # the pods were seen: their series are inside the budget
    assert counts["gpuwarden_bottleneck_info"] == 8 and counts["gpuwarden_container_gpu_memory_used_bytes"] == 8
    assert counts["gpuwarden_nvlink_active_links"] == 8 and "gpuwarden_nvlink_up" not in counts
    assert total + KERNEL_LOG_SERIES <= BUDGET, (total, counts.most_common(10))  # a real node reads its kernel log
    # what docs/metrics.md says pod attribution adds, to its figure without it (test_docs holds that figure to the code)
    readme = (Path(__file__).resolve().parents[1] / "docs" / "metrics.md").read_text()
    job_view = ("gpuwarden_job_collective_wait_seconds_total", "gpuwarden_job_identity_source_up")
    assert sum(counts[name] for name in job_view) == JOB_SERIES
    assert total == int(re.search(r"\*\*(\d+)\*\* of the budget", readme).group(1)) + POD_SERIES + JOB_SERIES


def _referenced(expr: str) -> set[str]:
    return set(re.findall(r"\b(gpuwarden_[a-z_]+)\b", expr))


def test_every_alert_and_fleet_query_reads_default_series() -> None:
    import importlib
    import pkgutil

    from gpuwarden.fleet import views
    from gpuwarden.fleet.views import cordon

    opt_in = {m.family.name: g.name for g in GROUPS.values() for m in g.members if m.label is None and not m.zero_rows}
    exprs = [r.expr for g in rules.build() for r in g.rules]
    for module in (
        views,
        *(importlib.import_module(m.name) for m in pkgutil.iter_modules(views.__path__, "gpuwarden.fleet.views.")),
    ):
        exprs += [text for text in vars(module).values() if isinstance(text, str)]
    exprs += list(cordon.NARROWING.values())
    used = set().union(*(_referenced(e) for e in exprs))
    assert "gpuwarden_nvlink_active_links" in used
    assert not {name: opt_in[name] for name in used if name in opt_in}


def test_groups_select_rows_and_families() -> None:
    default, everything = Selection(), Selection(enable=tuple(GROUPS))
    assert not default("gpuwarden_nvlink_up") and everything("gpuwarden_nvlink_up")
    keep = default.rows("gpuwarden_throttle_seconds_total")
    labels = lambda reason: ["0", "GPU-x", reason]  # noqa: E731
    assert keep is not None and keep(labels("hw_thermal_slowdown"), 1.0) and not keep(labels("sync_boost"), 1.0)
    health = default.rows("gpuwarden_health")
    assert health is not None and health(["0", "GPU-x", "ecc"], 2) and not health(["0", "GPU-x", "ecc"], 0)
    thresholds = default.rows("gpuwarden_temperature_threshold_celsius")
    assert thresholds(["0", "GPU-x", "memory_max"], 95) and not thresholds(["0", "GPU-x", "slowdown"], 87)
    assert everything.rows("gpuwarden_health") is None


def test_an_unknown_group_is_one_line_naming_the_field() -> None:
    with pytest.raises(ConfigError, match="metrics.enable_groups.*unknown group 'nvlink'; known: nvlink_links"):
        load_settings(None, environ={}, flags={"metrics.enable_groups": ["nvlink"]})
    assert load_settings(None, environ={}, flags={"metrics.enable_groups": ["all"]}).metrics.enable_groups == tuple(
        GROUPS
    )
