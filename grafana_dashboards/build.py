"""Generate the Grafana dashboards (`python grafana_dashboards/build.py` rewrites the JSON beside it).

Plain Python dicts in Grafana's dashboard JSON model (schemaVersion 39, Grafana 11): one function per dashboard row,
each panel a `Layout.add` call with keyword arguments. The committed JSON is checked against this output by
tests/test_dashboards.py, which also runs every panel's queries against a real Prometheus. Thresholds come from
exporter/gpuwarden/health/thresholds.toml, the same definition as the alert rules. Run it with gpuwarden installed.

grafana-foundation-sdk (Grafana's typed builders, on PyPI) was considered and not adopted: its Python package is
published as one version per Grafana release line with date-stamped version numbers and, by its own README, as
experimental; the schema check it would add covers the JSON's shape, while the failures seen in practice here were
empty or wrong queries, which only running them against Prometheus catches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from gpuwarden.health.thresholds import DEFAULT as LIMITS

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
# Node by name (the `node` label the chart's scrape config adds; ".*" lets series without one through), then the
# scrape instance (pod IP or host:port), then the GPU by index.
NODE_SELECTOR = 'job=~"$job",node=~"$node",instance=~"$instance"'
GPU_SELECTOR = NODE_SELECTOR + ',gpu=~"$gpu"'
RATE_INTERVAL = "$__rate_interval"
# Average watts: the energy counter's increase over the time between the reads it came from (the slow tier's
# timestamp), right at any scrape interval; a plain rate over $__rate_interval misread by up to a read interval's
# energy (the counter is read every 15 s). The compat rules' formula (alert_rules/dcgm_compat.average_power; a test
# keeps them equal).
AVERAGE_POWER = (
    f"increase(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}]) / on (job, instance) group_left () "
    f'(delta(gpuwarden_last_collect_timestamp_seconds{{{NODE_SELECTOR},tier="slow"}}[{RATE_INTERVAL}]) > 0)'
)
JOIN = [
    {"id": "merge", "options": {}},
    {"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True, "job": True}}},
]
RUNBOOKS = "https://github.com/gpuwarden/gpuwarden/blob/main/docs/runbooks.md"
RUNBOOK_LINK = {"title": "Runbooks: what each check and alert means, what to do", "url": RUNBOOKS, "targetBlank": True}
NODE_DRILLDOWN = {
    "title": "Open this node's dashboard",
    "url": "/d/gpuwarden-node/gpuwarden-gpu-node?var-instance=${__data.fields.instance}&${__url_time_range}",
}


def _steps(*pairs: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in pairs]}


def target(expr: str, legend: str = "", fmt: str = "time_series", instant: bool = False) -> dict:
    """One query; its refId (A, B, ...) is given by its place in the panel (Layout.add)."""
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "format": fmt}
    if instant:
        t["instant"] = True
        t["range"] = False
    return t


def xid_events(selector: str) -> str:
    """Events per interval, a new (GPU, XID) series counted at its first value: increase() sees a counter born at 1
    as no increase (XID 79 showed 0 for 15 minutes)."""
    errors = f"gpuwarden_xid_errors_total{{{selector}}}"
    return f"clamp_min({errors} - ({errors} offset $__interval or {errors} * 0), 0)"


def critical_xids_in_range(selector: str) -> str:
    """Seconds since each GPU's last critical XID in the dashboard's range, over Prometheus' history."""
    critical = "|".join(str(x) for x in sorted(LIMITS.xid_critical))
    last = f'gpuwarden_xid_last_timestamp_seconds{{{selector},xid=~"{critical}"}}'
    return f"time() - max_over_time({last}[$__range])"


class Layout:
    """Places panels left to right, 24 columns wide, and hands out panel ids."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1
        self.panels: list[dict[str, Any]] = []

    def row(self, title: str) -> None:
        if self.x:
            self.y += self.row_h
            self.x = self.row_h = 0
        self.panels.append(
            {
                "type": "row",
                "title": title,
                "id": self.next_id,
                "collapsed": False,
                "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y},
                "panels": [],
            }
        )
        self.next_id += 1
        self.y += 1

    def add(
        self,
        *,
        kind: str,
        title: str,
        description: str,
        targets: list[dict],
        unit: str,
        w: int = 12,
        h: int = 8,
        thresholds: dict | None = None,
        options: dict | None = None,
        custom: dict | None = None,
        mappings: list | None = None,
        minmax: tuple[float | None, float | None] = (None, None),
        links: list[dict] | None = None,
        field_links: list[dict] | None = None,
    ) -> None:
        """One panel. A table of several queries gets them merged into one table by their labels, with the
        bookkeeping columns (Time, __name__, job) hidden: Grafana otherwise shows a frame picker and raw columns."""
        if self.x + w > 24:
            self.y += self.row_h
            self.x = self.row_h = 0
        defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "palette-classic"}}
        if thresholds:
            defaults["thresholds"] = thresholds
            if kind in ("stat", "gauge", "table", "state-timeline"):
                defaults["color"] = {"mode": "thresholds"}
        if custom:
            defaults["custom"] = custom
        if mappings:
            defaults["mappings"] = mappings
        if field_links:
            defaults["links"] = field_links
        if minmax[0] is not None:
            defaults["min"] = minmax[0]
        if minmax[1] is not None:
            defaults["max"] = minmax[1]
        for i, t in enumerate(targets):
            t["refId"] = chr(ord("A") + i)
        self.panels.append(
            {
                "type": kind,
                "title": title,
                "description": description,
                "id": self.next_id,
                "datasource": DATASOURCE,
                "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
                "targets": targets,
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": options or {},
                **({"links": links} if links else {}),
                **({"transformations": JOIN} if kind == "table" and len(targets) > 1 else {}),
            }
        )
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)


def threshold_lines() -> dict[str, Any]:
    return {"thresholdsStyle": {"mode": "line"}}


HEALTH_MAPPING = [
    {
        "type": "value",
        "options": {
            "0": {"text": "ok", "color": "green"},
            "1": {"text": "warning", "color": "orange"},
            "2": {"text": "critical", "color": "red"},
        },
    }
]


def variable(
    name: str, label: str, query: str, multi: bool = True, all_value: str = ".+", include_all: bool = True
) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"var-{name}"},
        "definition": query,
        "refresh": 2,
        "multi": multi,
        "includeAll": include_all,
        "allValue": all_value,
        "current": {},
        "sort": 1,
    }


def dashboard(uid: str, title: str, description: str, layout: Layout, variables: list[dict]) -> dict[str, Any]:
    return {
        "uid": uid,
        "id": None,
        "title": title,
        "description": description,
        "tags": ["gpuwarden", "gpu", "nvidia"],
        "schemaVersion": 39,
        "version": 1,
        "editable": False,
        "graphTooltip": 1,
        "timezone": "browser",
        "time": {"from": "now-6h", "to": "now"},
        "refresh": "30s",
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data Source",
                    "type": "datasource",
                    "query": "prometheus",
                    "current": {},
                    "hide": 0,
                },
                *variables,
            ]
        },
        "annotations": {"list": []},
        "links": [
            {
                "title": "gpuwarden dashboards",
                "type": "dashboards",
                "tags": ["gpuwarden"],
                "asDropdown": True,
                "includeVars": True,
                "keepTime": True,
            },
            {"title": "Runbooks", "type": "link", "url": RUNBOOKS, "targetBlank": True},
        ],
        "panels": layout.panels,
    }


NODE_VARIABLES = [
    variable("job", "Job", "label_values(gpuwarden_nvml_up, job)"),
    variable("node", "Node", 'label_values(gpuwarden_nvml_up{job=~"$job"}, node)', all_value=".*"),
    variable(
        "instance",
        "Instance (pod or host:port)",
        'label_values(gpuwarden_nvml_up{job=~"$job",node=~"$node"}, instance)',
    ),
]
# The node board opens on one node (the first), not on the whole fleet: single-select node and instance. Where the
# scrape sets no `node` label (systemd hosts) the node list is empty, `node=~""` matches, and the instance picks
# the host.
ONE_NODE_VARIABLES = [
    NODE_VARIABLES[0],
    variable("node", "Node", 'label_values(gpuwarden_nvml_up{job=~"$job"}, node)', multi=False, include_all=False),
    variable(
        "instance",
        "Instance (pod or host:port)",
        'label_values(gpuwarden_nvml_up{job=~"$job",node=~"$node"}, instance)',
        multi=False,
        include_all=False,
    ),
]


def busy(window: str = RATE_INTERVAL, sel: str = GPU_SELECTOR) -> str:
    return (
        f"rate(gpuwarden_busy_seconds_total{{{sel}}}[{window}]) / "
        f"rate(gpuwarden_utilization_sampled_seconds_total{{{sel}}}[{window}])"
    )


def _node_health_at_a_glance(layout: Layout, gpu_legend: str) -> None:
    """The "Health at a glance" row."""
    layout.row("Health at a glance")
    layout.add(
        kind="stat",
        title="Health status per GPU",
        description="Worst health verdict of each GPU (gpuwarden_health_status): 0 ok, 1 warning, 2 critical.",
        targets=[target(f"gpuwarden_health_status{{{GPU_SELECTOR}}}", gpu_legend, instant=True)],
        unit="none",
        w=8,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
        links=[RUNBOOK_LINK],
    )
    layout.add(
        kind="table",
        title="Failing checks",
        description="Checks that are not ok, per GPU.",
        targets=[target(f"gpuwarden_health{{{GPU_SELECTOR}}} > 0", fmt="table", instant=True)],
        unit="none",
        w=8,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
        links=[RUNBOOK_LINK],
    )
    layout.add(
        kind="table",
        title="Firing alerts",
        description="gpuwarden alerts firing for the selected nodes (Prometheus' ALERTS series). Pages for lasting "
        "faults name the node and no instance (they outlive an exporter restart): the second query lists them.",
        targets=[
            # a held page (health/rules_model.py, held) has no `instance`: by node alone, or the board missed it
            target(
                f'ALERTS{{alertname=~"Gpuwarden.*",alertstate="firing",{NODE_SELECTOR}}} or '
                'ALERTS{alertname=~"Gpuwarden.*",alertstate="firing",job=~"$job",node=~"$node",instance=""}',
                fmt="table",
                instant=True,
            )
        ],
        unit="none",
        w=8,
        links=[RUNBOOK_LINK],
    )
    layout.add(
        kind="table",
        title="Pods on these GPUs",
        description="Containers on each GPU: the kubelet's allocations (the chart's podResources.enabled, which runs "
        "as UID 0: the kubelet's socket is root-only), or, without root, the containers whose processes hold it "
        "(processes.hostProc: their /proc cgroups). Join any panel's query with * on(uuid) "
        "group_left(namespace, pod) gpuwarden_gpu_allocation.",
        targets=[
            target(
                f"max by (instance, gpu, uuid, namespace, pod, container) (gpuwarden_gpu_allocation{{{GPU_SELECTOR}}})"
                " or max by (instance, gpu, uuid, namespace, pod, container) "
                f'(gpuwarden_container_gpu_memory_used_bytes{{{GPU_SELECTOR},pod!=""}} * 0 + 1)',
                fmt="table",
                instant=True,
            )
        ],
        unit="none",
        w=24,
        h=6,
    )


def _node_utilization(layout: Layout, gpu_legend: str) -> None:
    """The "Utilization" row."""
    layout.row("Utilization")
    layout.add(
        kind="timeseries",
        title="GPU busy (time average)",
        description="Share of time a kernel ran, from the driver's sample buffer: "
        "rate(busy seconds) / rate(sampled seconds). The dashed line is the starvation threshold.",
        targets=[target(busy(), gpu_legend)],
        unit="percentunit",
        thresholds=_steps((None, "red"), (LIMITS.utilization_low_ratio, "green")),
        custom=threshold_lines(),
        minmax=(0, 1),
    )


def _node_memory(layout: Layout, gpu_legend: str) -> None:
    """The "Memory" row."""
    layout.row("Memory")
    layout.add(
        kind="timeseries",
        title="Memory used / total",
        description="Device memory occupancy; 70-95 % is healthy for training, above "
        f"{LIMITS.memory_warning_ratio:.0%} risks OOM.",
        targets=[
            target(
                f"gpuwarden_memory_used_bytes{{{GPU_SELECTOR}}} / gpuwarden_memory_total_bytes{{{GPU_SELECTOR}}}",
                gpu_legend,
            )
        ],
        unit="percentunit",
        thresholds=_steps(
            (None, "green"),
            (0.7, "green"),
            (LIMITS.memory_warning_ratio, "orange"),
            (LIMITS.memory_critical_ratio, "red"),
        ),
        custom=threshold_lines(),
        minmax=(0, 1),
    )
    layout.add(
        kind="timeseries",
        title="Memory used and total",
        description="Bytes used by processes (NVML memory v2) and each GPU's total.",
        targets=[
            target(f"gpuwarden_memory_used_bytes{{{GPU_SELECTOR}}}", "used " + gpu_legend),
            target(f"gpuwarden_memory_total_bytes{{{GPU_SELECTOR}}}", "total " + gpu_legend),
        ],
        unit="bytes",
    )
    holder = "{{namespace}}/{{pod}}/{{container}}"
    layout.add(
        kind="timeseries",
        title="GPU memory by container",
        description="Who holds each GPU's memory: the processes of each container (namespace/pod/container; empty: "
        "processes no "
        "container was found for). Two holders on one GPU is the first thing to check on an OOM. Per process: "
        "/api/v1/processes.",
        targets=[target(f"gpuwarden_container_gpu_memory_used_bytes{{{GPU_SELECTOR}}}", gpu_legend + " " + holder)],
        unit="bytes",
        custom={"stacking": {"mode": "normal", "group": "A"}},
    )
    layout.add(
        kind="timeseries",
        title="SM share by container",
        description="Each container's share of its GPU's SMs (per-process SM utilization, averaged over the interval).",
        targets=[
            target(
                f"rate(gpuwarden_container_sm_active_seconds_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                gpu_legend + " " + holder,
            )
        ],
        unit="percentunit",
        minmax=(0, 1),
    )


def _node_thermals(layout: Layout, gpu_legend: str) -> None:
    """The "Thermals" row."""
    layout.row("Thermals")
    layout.add(
        kind="timeseries",
        title="GPU temperature",
        description=f"Die temperature with the {LIMITS.temperature_warning_celsius:g} °C warning "
        f"and {LIMITS.temperature_critical_celsius:g} °C critical lines of the alert rules.",
        targets=[target(f"gpuwarden_temperature_celsius{{{GPU_SELECTOR}}}", gpu_legend)],
        unit="celsius",
        thresholds=_steps(
            (None, "green"),
            (LIMITS.temperature_warning_celsius, "orange"),
            (LIMITS.temperature_critical_celsius, "red"),
        ),
        custom=threshold_lines(),
    )
    layout.add(
        kind="timeseries",
        title="Memory temperature and its maximum",
        description="HBM temperature, and each GPU's own HBM maximum from NVML (the other thresholds: static_detail "
        "group).",
        targets=[
            target(f"gpuwarden_memory_temperature_celsius{{{GPU_SELECTOR}}}", "HBM " + gpu_legend),
            target(
                f'gpuwarden_temperature_threshold_celsius{{{GPU_SELECTOR},threshold="memory_max"}}',
                "HBM max " + gpu_legend,
            ),
        ],
        unit="celsius",
    )


def _node_power(layout: Layout, gpu_legend: str) -> None:
    """The "Power" row."""
    layout.row("Power")
    layout.add(
        kind="timeseries",
        title="Power draw / limit",
        description="Average draw (from the energy counter, over the time between its reads) as a share of the "
        "enforced limit: below 30 % is idle, 60-90 % healthy, 100 % sustained is power throttling.",
        targets=[target(f"({AVERAGE_POWER}) / gpuwarden_power_limit_watts{{{GPU_SELECTOR}}}", gpu_legend)],
        unit="percentunit",
        thresholds=_steps((None, "blue"), (0.3, "green"), (0.9, "orange")),
        custom=threshold_lines(),
        minmax=(0, 1.1),
    )
    layout.add(
        kind="timeseries",
        title="Power draw and limit (W), average from energy",
        description="The true average draw from the energy counter (its increase over the time between the reads "
        "it came from, right at any scrape interval) and the enforced limit (the instant draw: point_samples group).",
        targets=[
            target(AVERAGE_POWER, "average " + gpu_legend),
            target(f"gpuwarden_power_limit_watts{{{GPU_SELECTOR}}}", "limit " + gpu_legend),
        ],
        unit="watt",
    )
    layout.add(
        kind="stat",
        title="Energy over the range",
        description="Energy used by the selected GPUs over the dashboard's time range.",
        targets=[target(f"sum(increase(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[$__range]))", instant=True)],
        unit="joule",
        w=6,
        thresholds=_steps((None, "blue")),
    )


def _node_clocks_and_throttling(layout: Layout, gpu_legend: str) -> None:
    """The "Clocks and throttling" row."""
    layout.row("Clocks and throttling")
    layout.add(
        kind="timeseries",
        title="Throttle time share",
        description="Share of time the driver held the clocks down, per reason (cumulative counters, not point "
        "samples).",
        targets=[
            target(f"rate(gpuwarden_throttle_seconds_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} {{reason}}")
        ],
        unit="percentunit",
        thresholds=_steps((None, "green"), (LIMITS.thermal_slowdown_ratio, "orange")),
        custom=threshold_lines(),
    )
    layout.add(
        kind="timeseries",
        title="SM clock",
        description="SM clock per GPU: a busy GPU far below its boost clock (1,980 MHz on H100 SXM) is held down; "
        "Throttle time share says why.",
        targets=[target(f'gpuwarden_clock_hertz{{{GPU_SELECTOR},clock="sm"}}', gpu_legend)],
        unit="hertz",
    )
    layout.add(
        kind="state-timeline",
        title="P-state",
        description="Performance state (0 = P0, maximum). Idle datacenter GPUs sit in P0 too.",
        targets=[target(f"gpuwarden_performance_state{{{GPU_SELECTOR}}}", gpu_legend)],
        unit="none",
        thresholds=_steps((None, "green"), (LIMITS.pstate_degraded_min, "orange")),
    )


def _node_errors(layout: Layout) -> None:
    """The "Errors" row."""
    layout.row("Errors")
    layout.add(
        kind="timeseries",
        title="ECC errors",
        description="New ECC errors per interval (volatile counters); any uncorrected error pages "
        "(GpuwardenEccUncorrectable).",
        targets=[
            target(f"increase(gpuwarden_ecc_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} {{type}}")
        ],
        unit="none",
        thresholds=_steps((None, "green"), (1, "red")),
    )
    layout.add(
        kind="table",
        title="Row remapping: pending and failed",
        description="1: a row remap is pending (applied at the next GPU reset); 2: a remap failed (no spare rows: "
        "RMA); 3: both. Remapped rows by cause: the memory_detail group.",
        targets=[
            target(
                f"gpuwarden_remapped_rows_pending{{{GPU_SELECTOR}}} + 2 * "
                f"gpuwarden_remapped_rows_failed{{{GPU_SELECTOR}}}",
                fmt="table",
                instant=True,
            ),
        ],
        unit="none",
    )
    layout.add(
        kind="timeseries",
        title="XID events",
        description="XID events per GPU and code in each interval, the first one included (a code's series is born "
        "at 1, which increase() reads as 0); counts since gpuwarden started.",
        targets=[target(xid_events(GPU_SELECTOR), "{{gpu}} XID {{xid}}")],
        unit="none",
    )
    layout.add(
        kind="timeseries",
        title="PCIe replays and NVLink errors",
        description="PCIe replays per second, and NVLink errors per second by type, all links of the GPU together "
        "(per link: "
        "the nvlink_links group).",
        targets=[
            target(f"rate(gpuwarden_pcie_replay_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "PCIe {{gpu}}"),
            target(
                f"rate(gpuwarden_nvlink_gpu_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                "NVLink {{gpu}} {{type}}",
            ),
        ],
        unit="ops",
    )


def _node_topology_and_nvlink(layout: Layout, gpu_legend: str) -> None:
    """The "Topology and NVLink" row."""
    layout.row("Topology and NVLink")
    layout.add(
        kind="stat",
        title="Active NVLinks of the GPU's links",
        description="Active NVLinks as a share of the links the GPU has (18 on H100/H200 SXM): anything below 100 % "
        "is a link down (GpuwardenNvlinkDown pages). The GPU-to-GPU matrix: /api/v1/topology.",
        targets=[
            target(
                f"gpuwarden_nvlink_active_links{{{GPU_SELECTOR}}} / gpuwarden_nvlink_links{{{GPU_SELECTOR}}}",
                gpu_legend,
                instant=True,
            )
        ],
        unit="percentunit",
        w=24,
        thresholds=_steps((None, "red"), (1, "green")),
    )


def _node_exporter(layout: Layout) -> None:
    """The "Exporter" row."""
    layout.row("Exporter")
    layout.add(
        kind="timeseries",
        title="Poll duration",
        description="Wall time of each tier's last poll.",
        targets=[target(f"gpuwarden_collect_duration_seconds{{{NODE_SELECTOR}}}", "{{tier}}")],
        unit="s",
    )
    layout.add(
        kind="timeseries",
        title="Data age and errors",
        description="Seconds since each tier's last poll, and NVML errors per second.",
        targets=[
            target(f"time() - gpuwarden_last_collect_timestamp_seconds{{{NODE_SELECTOR}}}", "age {{tier}}"),
            target(
                f"sum by (instance, call, error) "
                f"(rate(gpuwarden_collect_errors_total{{{NODE_SELECTOR}}}[{RATE_INTERVAL}]))",
                "errors {{call}} {{error}}",
            ),
        ],
        unit="s",
    )


def node_dashboard() -> dict[str, Any]:
    layout = Layout()
    gpu_legend = "gpu {{gpu}}"  # one node on the board: its name is in the picker, not a pod IP in every legend
    _node_health_at_a_glance(layout, gpu_legend)
    _node_utilization(layout, gpu_legend)
    profiling_row(layout, gpu_legend)
    _node_memory(layout, gpu_legend)
    _node_thermals(layout, gpu_legend)
    _node_power(layout, gpu_legend)
    _node_clocks_and_throttling(layout, gpu_legend)
    _node_errors(layout)
    _node_topology_and_nvlink(layout, gpu_legend)
    _node_exporter(layout)
    variables = [
        *ONE_NODE_VARIABLES,
        variable("gpu", "GPU", f"label_values(gpuwarden_gpu_info{{{NODE_SELECTOR}}}, gpu)"),
    ]
    return dashboard(
        "gpuwarden-node",
        "gpuwarden / GPU node",
        "Every GPU of one node: health, "
        "utilization, memory, thermals, power, throttling, errors, NVLink and the exporter.",
        layout,
        variables,
    )


def gpm_ratio(counter: str, labels: str = "", sel: str = GPU_SELECTOR, window: str = RATE_INTERVAL) -> str:
    """Mean activity over the window from a GPM counter: rate(activity seconds) / rate(window seconds)."""
    inner = f"{sel},{labels}" if labels else sel
    match = "ignoring (pipe) group_left " if "pipe" in counter else ""
    return f"rate({counter}{{{inner}}}[{window}]) / {match}rate(gpuwarden_gpm_window_seconds_total{{{sel}}}[{window}])"


def profiling_row(layout: Layout, gpu_legend: str) -> None:
    """The node dashboard's GPM panels (Hopper and newer; empty on GPUs without GPM or with nvml.gpm off)."""
    layout.row("Profiling (GPM): what the GPU's time goes to")
    layout.add(
        kind="timeseries",
        title="SM activity",
        description="SMs busy (averaged over the SMs, unlike GPU busy), from NVML GPM: rate(activity seconds) / "
        "rate(window seconds); DCGM's SM_ACTIVE. Occupancy: the gpm_detail group.",
        targets=[target(gpm_ratio("gpuwarden_gpm_sm_active_seconds_total"), gpu_legend + " SM active")],
        unit="percentunit",
        minmax=(0, 1),
    )
    layout.add(
        kind="timeseries",
        title="Tensor cores",
        description="Share of time the tensor cores were active (GPM). Mixed-precision training keeps them busy "
        "20-40 % or more; near 0 on a busy GPU is FP32 math (the FP32/FP16/FP64 pipes: the gpm_detail group).",
        targets=[target(gpm_ratio("gpuwarden_gpm_pipe_active_seconds_total", 'pipe="tensor"'), gpu_legend + " tensor")],
        unit="percentunit",
        minmax=(0, 1),
    )
    layout.add(
        kind="timeseries",
        title="Device-memory bandwidth (DRAM active)",
        description="Share of peak device-memory bandwidth in use (GPM DRAM_BW_UTIL); above "
        f"{LIMITS.bottleneck_dram_ratio:.0%} with the tensor cores idle the job is memory-bound.",
        targets=[target(gpm_ratio("gpuwarden_gpm_dram_active_seconds_total"), gpu_legend)],
        unit="percentunit",
        minmax=(0, 1),
    )
    layout.add(
        kind="timeseries",
        title="PCIe and NVLink traffic",
        description="Bytes per second over PCIe (GPM where the GPU has it: link traffic, headers included, 6-7 % "
        "above the payload "
        "copied) and over all NVLinks (GPM).",
        targets=[
            target(
                f"rate(gpuwarden_pcie_bytes_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                gpu_legend + " PCIe {{direction}}",
            ),
            target(
                f"rate(gpuwarden_nvlink_bytes_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                gpu_legend + " NVLink {{direction}}",
            ),
        ],
        unit="Bps",
    )
    layout.add(
        kind="table",
        title="Bottleneck class",
        description="What each GPU's time went to over the bottleneck window (gpuwarden_bottleneck_info): idle, "
        "tensor_bound, "
        "memory_bound, compute_without_tensor, sm_bound_non_matmul, communication_bound, host_transfer_bound, "
        "collective_wait (waits in a collective for another rank of its job), launch_bound, waiting, mixed. "
        "/api/v1/diagnosis gives the numbers and what to do, and names a job's straggler.",
        targets=[
            target(
                f"max by (instance, gpu, class) (gpuwarden_bottleneck_info{{{GPU_SELECTOR}}})",
                fmt="table",
                instant=True,
            )
        ],
        unit="none",
        w=24,
        h=6,
    )


def _fleet_fleet_health(layout: Layout) -> None:
    """The "Fleet health" row."""
    layout.row("Fleet health")
    layout.add(
        kind="stat",
        title="GPUs by health status",
        description="How many GPUs are ok (0), warning (1) or critical (2).",
        targets=[
            target(f"count(gpuwarden_health_status{{{NODE_SELECTOR}}} == 0) or vector(0)", "ok", instant=True),
            target(f"count(gpuwarden_health_status{{{NODE_SELECTOR}}} == 1) or vector(0)", "warning", instant=True),
            target(f"count(gpuwarden_health_status{{{NODE_SELECTOR}}} == 2) or vector(0)", "critical", instant=True),
        ],
        unit="none",
        w=8,
        thresholds=_steps((None, "green")),
    )
    layout.add(
        kind="table",
        title="Unhealthy GPUs",
        description="GPUs whose health is not ok, with the model and the failing checks.",
        targets=[
            target(
                f"gpuwarden_health{{{NODE_SELECTOR}}} > 0 and on (instance, uuid) "
                f"gpuwarden_health_status{{{NODE_SELECTOR}}} > 0",
                fmt="table",
                instant=True,
            ),
            target(
                f"gpuwarden_gpu_info{{{NODE_SELECTOR}}} and on (instance, uuid) "
                f"gpuwarden_health_status{{{NODE_SELECTOR}}} > 0",
                fmt="table",
                instant=True,
            ),
        ],
        unit="none",
        w=16,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
        links=[RUNBOOK_LINK],
        field_links=[NODE_DRILLDOWN],
    )


def _fleet_idle_and_starved_gpus(layout: Layout) -> None:
    """The "Idle and starved GPUs" row."""
    layout.row("Idle and starved GPUs")
    layout.add(
        kind="table",
        title="Least busy GPUs over the range",
        description="GPU busy share over the dashboard's range; below "
        f"{LIMITS.utilization_low_ratio:.0%} while a job runs is starvation.",
        targets=[target(f"bottomk(20, {busy('$__range', NODE_SELECTOR)})", fmt="table", instant=True)],
        unit="percentunit",
        thresholds=_steps((None, "red"), (LIMITS.utilization_low_ratio, "green")),
    )
    layout.add(
        kind="stat",
        title="Idle GPU-hours and their cost",
        description="GPU-hours not spent running kernels over the range, and their cost at $price per GPU-hour.",
        targets=[
            target(
                f"sum(increase(gpuwarden_utilization_sampled_seconds_total{{{NODE_SELECTOR}}}[$__range]) - "
                f"increase(gpuwarden_busy_seconds_total{{{NODE_SELECTOR}}}[$__range])) / 3600",
                "idle GPU-hours",
                instant=True,
            ),
            target(
                f"sum(increase(gpuwarden_utilization_sampled_seconds_total{{{NODE_SELECTOR}}}[$__range]) - "
                f"increase(gpuwarden_busy_seconds_total{{{NODE_SELECTOR}}}[$__range])) / 3600 * $price",
                "cost",
                instant=True,
            ),
        ],
        unit="none",
        thresholds=_steps((None, "blue")),
    )
    alloc = f"max_over_time(gpuwarden_gpu_allocation{{{NODE_SELECTOR}}}[$__range])"
    share = f"({alloc} / on (instance, uuid) group_left () count by (instance, uuid) ({alloc}))"
    idle_seconds = (
        f"clamp_min(increase(gpuwarden_utilization_sampled_seconds_total{{{NODE_SELECTOR}}}[$__range]) - "
        f"increase(gpuwarden_busy_seconds_total{{{NODE_SELECTOR}}}[$__range]), 0)"
    )
    layout.add(
        kind="table",
        title="Idle GPU-hours by namespace",
        description="GPU-hours in which no kernel ran over the range, charged to the "
        "namespaces whose pods held the GPU (pod attribution; a GPU shared by n containers counts 1/n to each), "
        "and their cost at $price per GPU-hour.",
        targets=[
            target(
                f"sum by (namespace) ({idle_seconds} * on (instance, uuid) group_right () {share}) / 3600",
                fmt="table",
                instant=True,
            ),
            target(
                f"sum by (namespace) ({idle_seconds} * on (instance, uuid) group_right () {share}) / 3600 * $price",
                fmt="table",
                instant=True,
            ),
        ],
        unit="none",
        w=24,
        h=6,
    )


def _fleet_profiling_gpm_useful_work(layout: Layout) -> None:
    """The "Profiling (GPM): useful work" row."""
    layout.row("Profiling (GPM): useful work")
    tensor = gpm_ratio("gpuwarden_gpm_pipe_active_seconds_total", 'pipe="tensor"', NODE_SELECTOR, "$__range")
    allocation = f"max by (instance, uuid, namespace) (gpuwarden_gpu_allocation{{{NODE_SELECTOR}}})"
    layout.add(
        kind="table",
        title="Tensor-core use by namespace",
        description="Mean share of time the tensor cores were active over the dashboard's range, per namespace "
        "holding the "
        "GPUs (pod attribution), and how many GPUs: low tensor use on GPUs a team holds is the cheapest "
        "throughput to win (bf16 mixed precision, TF32).",
        targets=[
            target(
                f"avg by (namespace) (({tensor}) * on (instance, uuid) group_left (namespace) {allocation})",
                fmt="table",
                instant=True,
            ),
            target(f"count by (namespace) ({allocation})", fmt="table", instant=True),
        ],
        unit="percentunit",
        w=12,
    )
    layout.add(
        kind="table",
        title="Bottleneck classes by node",
        description="How many GPUs of each node are in each bottleneck class now (gpuwarden_bottleneck_info): "
        "tensor_bound is "
        "healthy; waiting, collective_wait, launch_bound, host_transfer_bound and communication_bound GPUs wait; idle "
        "GPUs have no process.",
        targets=[
            target(
                f"count by (instance, class) (gpuwarden_bottleneck_info{{{NODE_SELECTOR}}})", fmt="table", instant=True
            )
        ],
        unit="none",
        w=12,
    )
    layout.add(
        kind="table",
        title="Top GPU-memory holders by namespace",
        description="GPU memory held by each namespace's containers across the selected nodes (their processes, "
        "attributed "
        "through cgroups or the GPU allocation), largest first.",
        targets=[
            target(
                f"topk(10, sum by (namespace) (gpuwarden_container_gpu_memory_used_bytes{{{NODE_SELECTOR}, "
                f'namespace!=""}}))',
                fmt="table",
                instant=True,
            )
        ],
        unit="bytes",
        w=12,
    )
    layout.add(
        kind="table",
        title="Top GPU-memory holders by pod",
        description="The ten pods holding the most GPU memory, with the node.",
        targets=[
            target(
                f"topk(10, sum by (instance, namespace, pod) (gpuwarden_container_gpu_memory_used_bytes"
                f'{{{NODE_SELECTOR}, pod!=""}}))',
                fmt="table",
                instant=True,
            )
        ],
        unit="bytes",
        w=12,
    )
    layout.add(
        kind="timeseries",
        title="GPUs per bottleneck class",
        description="GPUs of the selected nodes in each class over time.",
        targets=[target(f"count by (class) (gpuwarden_bottleneck_info{{{NODE_SELECTOR}}})", "{{class}}")],
        unit="none",
        w=24,
    )


def _fleet_hot_failing_and_disconnected(layout: Layout) -> None:
    """The "Hot, failing and disconnected" row."""
    layout.row("Hot, failing and disconnected")
    layout.add(
        kind="table",
        title="Hottest GPUs",
        description="The ten hottest GPUs now.",
        targets=[target(f"topk(10, gpuwarden_temperature_celsius{{{NODE_SELECTOR}}})", fmt="table", instant=True)],
        unit="celsius",
        w=8,
        thresholds=_steps(
            (None, "green"),
            (LIMITS.temperature_warning_celsius, "orange"),
            (LIMITS.temperature_critical_celsius, "red"),
        ),
    )
    layout.add(
        kind="table",
        title="ECC and XID offenders",
        description="GPUs with uncorrected ECC errors (value: the count), and GPUs with a critical XID in the "
        "window (value: seconds since the last one, over Prometheus' history, so a restarted exporter keeps them).",
        targets=[
            target(f'gpuwarden_ecc_errors_total{{{NODE_SELECTOR},type="uncorrected"}} > 0', fmt="table", instant=True),
            target(critical_xids_in_range(NODE_SELECTOR), fmt="table", instant=True),
        ],
        unit="none",
        w=8,
    )
    layout.add(
        kind="table",
        title="NVLink problems",
        description="GPUs with fewer active NVLinks than the most any GPU of their node has (which link: /api/v1/gpus "
        "or "
        "the nvlink_links group).",
        targets=[
            target(
                f"gpuwarden_nvlink_active_links{{{NODE_SELECTOR}}} < on (instance) group_left "
                f"max by (instance) (gpuwarden_nvlink_active_links{{{NODE_SELECTOR}}})",
                fmt="table",
                instant=True,
            ),
        ],
        unit="none",
        w=8,
    )
    layout.add(
        kind="table",
        title="NVSwitch fabric problems",
        description="GPUs whose NVSwitch fabric is not set up (state not_started or in_progress: Fabric Manager "
        "down, CUDA cannot start) or has a health condition (condition: route_unhealthy, degraded_bandwidth, ...). "
        "Nodes without NVSwitch never appear. Runbook: GpuwardenFabricNotReady.",
        targets=[
            target(
                f'(gpuwarden_fabric_state{{{NODE_SELECTOR},state!="completed"}} == 1) '
                f"or (gpuwarden_fabric_health{{{NODE_SELECTOR}}} == 1)",
                fmt="table",
                instant=True,
            ),
        ],
        unit="none",
        w=24,
    )
    layout.add(
        kind="table",
        title="Kernel log: SXids, GPUs off the bus, lines not counted, readers down",
        description="Counts since boot from each node's kernel log (nvml.kernel_log; under Helm the kernel-log-relay "
        "container), which NVML's events never report: NVSwitch SXids by switch and SXid, 'GPU has fallen off the "
        "bus' by GPU; lines naming the driver that counted for nothing, by reason (not_driver or user_facility: "
        "text any process can put in the log, e.g. a crash inside a file it named); a 0 of gpuwarden_kernel_log_up: "
        "a node whose kernel log is not read. Empty where nothing was logged. Runbooks: GpuwardenNvswitchSxid, "
        "GpuwardenGpuLost.",
        targets=[
            target(
                f"gpuwarden_kernel_sxid_errors_total{{{NODE_SELECTOR}}} > 0 "
                f"or gpuwarden_kernel_fallen_off_bus_total{{{NODE_SELECTOR}}} > 0 "
                f"or gpuwarden_kernel_log_lines_ignored_total{{{NODE_SELECTOR}}} > 0 "
                f"or gpuwarden_kernel_log_up{{{NODE_SELECTOR}}} == 0",
                fmt="table",
                instant=True,
            ),
        ],
        unit="none",
        w=24,
    )


def _fleet_versions(layout: Layout) -> None:
    """The "Versions" row."""
    layout.row("Versions")
    layout.add(
        kind="table",
        title="Driver versions in the fleet",
        description="Nodes per driver and CUDA driver version.",
        targets=[
            target(
                f"count by (driver_version, cuda_driver_version) (gpuwarden_driver_info{{{NODE_SELECTOR}}})",
                fmt="table",
                instant=True,
            )
        ],
        unit="none",
        w=12,
    )
    layout.add(
        kind="table",
        title="GPU models",
        description="GPUs per model.",
        targets=[target(f"count by (name) (gpuwarden_gpu_info{{{NODE_SELECTOR}}})", fmt="table", instant=True)],
        unit="none",
        w=12,
    )


def fleet_dashboard() -> dict[str, Any]:
    layout = Layout()
    _fleet_fleet_health(layout)
    _fleet_idle_and_starved_gpus(layout)
    _fleet_profiling_gpm_useful_work(layout)
    _fleet_hot_failing_and_disconnected(layout)
    _fleet_versions(layout)
    variables = [
        *NODE_VARIABLES,
        # what a GPU-hour costs, for the idle-cost panels: set it to yours (a textbox, shown, not a hidden constant)
        {"name": "price", "label": "Price per GPU-hour", "type": "textbox", "query": "2.5", "current": {}, "hide": 0},
    ]
    return dashboard(
        "gpuwarden-fleet",
        "gpuwarden / GPU fleet",
        "Every GPU in the fleet: health, idle and starved GPUs, heat, hardware errors, NVLink and versions.",
        layout,
        variables,
    )


DASHBOARDS = {"gpuwarden-node.json": node_dashboard, "gpuwarden-fleet.json": fleet_dashboard}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=1, ensure_ascii=False) + "\n" for name, build in DASHBOARDS.items()}


def main() -> int:
    for name, text in render().items():
        (HERE / name).write_text(text, encoding="utf-8")
        print(f"wrote {HERE / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
