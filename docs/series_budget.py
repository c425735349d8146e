"""The series budget: what the default collector groups cost on the simulated 8x H100 NVSwitch node. A development
tool beside docs/references.py (which writes its table into the README), not part of the package.

Prometheus pays for every series of every node for as long as it keeps them; the default set is sized so that an
8-GPU node with profiling, processes and pod attribution stays within BUDGET. tests/test_series_budget.py enforces
it, and the README's table is generated from `default_series()` (`python docs/references.py`).
"""

from __future__ import annotations

from collections import Counter

BUDGET = 400
BUDGET_SCENARIO = "training"  # 8x H100 SXM on NVSwitch, every GPU busy with one process: GPM and processes on
POD_SERIES = 8 + 1  # pod attribution on the budget node: an allocation per GPU, and the unmatched-devices gauge
# the job view on the budget node, its eight GPUs one torchrun job: a wait counter per GPU, and the node's three
# sources of job identity (gpuwarden_job_identity_source_up: cgroup, cmdline, environ)
JOB_SERIES = 8 + 3
# the kernel log, read by default under the real driver (the simulator's budget node has none): its status series;
# gpuwarden_kernel_log_lines_ignored_total has no series until a line naming the driver is ignored
KERNEL_LOG_SERIES = 1
BUDGET_SECONDS = 320  # past the 300 s bottleneck window, so gpuwarden_bottleneck_info is counted too
POLL_STEP_S = 5  # simulated seconds between polls: every family is read at least this often at the defaults


def default_series(scenario: str = BUDGET_SCENARIO, seconds: int = BUDGET_SECONDS, **sections: dict) -> Counter[str]:
    """Series per family that /metrics serves at the default settings on the simulated node, after `seconds` of
    simulated polling, a poll every POLL_STEP_S (a manual clock: a few seconds). `sections` override settings (e.g.
    pods)."""
    from gpuwarden.config.settings import load_settings
    from gpuwarden.exposition.render import Renderer
    from gpuwarden.nvml import library
    from gpuwarden.runtime.pipeline import Pipeline
    from gpuwarden.sim import install_simulator
    from gpuwarden.sim.scenario import load_scenario

    now = [1_800_000_000.0]
    fake = install_simulator(load_scenario(scenario), clock=lambda: now[0])
    settings = load_settings(
        None, environ={}, flags={f"{k}.{o}": v for k, opts in sections.items() for o, v in opts.items()}
    )
    pipeline = Pipeline(settings, wall_clock=lambda: now[0])
    try:
        if pipeline.pods is not None:
            pipeline.pods.refresh()  # the background refresher is not running here: one List before the polls
        for _ in range(0, seconds, POLL_STEP_S):
            pipeline.poll_once()
            now[0] += POLL_STEP_S
        text = Renderer(settings.metrics.selection()).render(pipeline.snapshot).decode()
    finally:
        pipeline.stop(0.5)
        fake.close()
        library.install(None)
    return Counter(line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#"))


def budget_table(counts: Counter[str]) -> str:
    real_node = sum(counts.values()) + POD_SERIES + JOB_SERIES + KERNEL_LOG_SERIES
    lines = [
        f"Default series of the simulated 8x H100 NVSwitch node (`{BUDGET_SCENARIO}` scenario, after "
        f"{BUDGET_SECONDS} s): **{sum(counts.values())}** of the budget of {BUDGET}, without pod attribution. With it "
        f"(`pods.resources_socket`), each allocated GPU adds one `gpuwarden_gpu_allocation` series and the node one "
        f"`gpuwarden_pod_attribution_unmatched_devices`: **{sum(counts.values()) + POD_SERIES}** with every GPU "
        f"allocated; with the host's /proc showing one 8-rank job on the node, each GPU adds one "
        f"`gpuwarden_job_collective_wait_seconds_total` and the node three `gpuwarden_job_identity_source_up`: "
        f"**{sum(counts.values()) + POD_SERIES + JOB_SERIES}** "
        "(tests/test_series_budget.py counts that case). Where the kernel log is read (the real driver's default), "
        f"the node adds `gpuwarden_kernel_log_up`: **{real_node}**; and one "
        "`gpuwarden_kernel_log_lines_ignored_total` per reason a line naming the driver was ignored for (six at most).",
        "",
        "| family | series |",
        "|---|---|",
    ]
    lines += [f"| `{name}` | {count} |" for name, count in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]
    return "\n".join(lines)
