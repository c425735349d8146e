"""Generate the Grafana dashboards (`python grafana_dashboards/build.py` rewrites the JSON beside it).

Plain Python dicts in Grafana's dashboard JSON model (schemaVersion 39, Grafana 11): no extra dependency, and the
committed JSON is checked against this output by tests/test_dashboards.py. Thresholds come from
exporter/health/thresholds.py, the same definition as the alert rules.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwarden.health.thresholds import DEFAULT as LIMITS  # noqa: E402

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
NODE_SELECTOR = 'job=~"$job",instance=~"$instance"'
GPU_SELECTOR = NODE_SELECTOR + ',uuid=~"$gpu"'
RATE_INTERVAL = "$__rate_interval"


def _steps(*pairs: tuple[float | None, str]) -> dict[str, Any]:
    return {"mode": "absolute", "steps": [{"color": color, "value": value} for value, color in pairs]}


def target(expr: str, legend: str = "", ref: str = "A", fmt: str = "time_series", instant: bool = False) -> dict:
    t: dict[str, Any] = {"datasource": DATASOURCE, "expr": expr, "legendFormat": legend, "refId": ref, "format": fmt}
    if instant:
        t["instant"] = True
        t["range"] = False
    return t


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
        panel_type: str,
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
    ) -> None:
        if self.x + w > 24:
            self.y += self.row_h
            self.x = self.row_h = 0
        defaults: dict[str, Any] = {"unit": unit, "color": {"mode": "palette-classic"}}
        if thresholds:
            defaults["thresholds"] = thresholds
            if panel_type in ("stat", "gauge", "table", "state-timeline"):
                defaults["color"] = {"mode": "thresholds"}
        if custom:
            defaults["custom"] = custom
        if mappings:
            defaults["mappings"] = mappings
        if minmax[0] is not None:
            defaults["min"] = minmax[0]
        if minmax[1] is not None:
            defaults["max"] = minmax[1]
        for i, t in enumerate(targets):
            t["refId"] = chr(ord("A") + i)
        self.panels.append(
            {
                "type": panel_type,
                "title": title,
                "description": description,
                "id": self.next_id,
                "datasource": DATASOURCE,
                "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
                "targets": targets,
                "fieldConfig": {"defaults": defaults, "overrides": []},
                "options": options or {},
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


def variable(name: str, label: str, query: str, multi: bool = True) -> dict[str, Any]:
    return {
        "name": name,
        "label": label,
        "type": "query",
        "datasource": DATASOURCE,
        "query": {"query": query, "refId": f"var-{name}"},
        "definition": query,
        "refresh": 2,
        "multi": multi,
        "includeAll": True,
        "allValue": ".+",
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
        "links": [],
        "panels": layout.panels,
    }


def busy(window: str = RATE_INTERVAL, sel: str = GPU_SELECTOR) -> str:
    return (
        f"rate(gpuwarden_busy_seconds_total{{{sel}}}[{window}]) / "
        f"rate(gpuwarden_utilization_sampled_seconds_total{{{sel}}}[{window}])"
    )


def node_dashboard() -> dict[str, Any]:
    layout = Layout()
    gpu_legend = "{{instance}} gpu {{gpu}}"
    layout.row("Health at a glance")
    layout.add(
        "stat",
        "Health status per GPU",
        "Worst health verdict of each GPU (gpuwarden_health_status): 0 ok, 1 warning, 2 critical.",
        [target(f"gpuwarden_health_status{{{GPU_SELECTOR}}}", gpu_legend, instant=True)],
        "none",
        w=8,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
    )
    layout.add(
        "table",
        "Failing checks",
        "Checks that are not ok, per GPU.",
        [target(f"gpuwarden_health{{{GPU_SELECTOR}}} > 0", fmt="table", instant=True)],
        "none",
        w=8,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
    )
    layout.add(
        "table",
        "Firing alerts",
        "gpuwarden alerts firing for the selected nodes (Prometheus' ALERTS series).",
        [target(f'ALERTS{{alertname=~"Gpuwarden.*",alertstate="firing",{NODE_SELECTOR}}}', fmt="table", instant=True)],
        "none",
        w=8,
    )
    layout.add(
        "table",
        "Pods on these GPUs",
        "Containers the kubelet allocated each GPU to (pod attribution: the "
        "chart's podResources.enabled). Join any panel's query with * on(uuid) group_left(namespace, pod) "
        "gpuwarden_gpu_allocation.",
        [
            target(
                f"max by (instance, gpu, uuid, namespace, pod, container) (gpuwarden_gpu_allocation{{{GPU_SELECTOR}}})",
                fmt="table",
                instant=True,
            )
        ],
        "none",
        w=24,
        h=6,
    )
    layout.row("Utilization")
    layout.add(
        "timeseries",
        "GPU busy (time average)",
        "Share of time a kernel ran, from the driver's sample buffer: "
        "rate(busy seconds) / rate(sampled seconds). The dashed line is the starvation threshold.",
        [target(busy(), gpu_legend)],
        "percentunit",
        thresholds=_steps((None, "red"), (LIMITS.utilization_low_ratio, "green")),
        custom=threshold_lines(),
        minmax=(0, 1),
    )
    layout.add(
        "timeseries",
        "Memory bandwidth busy",
        "Share of the last sample period in which device memory was read or written (not occupancy). Needs the "
        "point_samples group (--metrics.enable-groups); DRAM active in the profiling row is the default.",
        [target(f"gpuwarden_memory_bandwidth_utilization_ratio{{{GPU_SELECTOR}}}", gpu_legend)],
        "percentunit",
        minmax=(0, 1),
    )
    profiling_row(layout, gpu_legend)
    layout.row("Memory")
    layout.add(
        "timeseries",
        "Memory used / total",
        f"Device memory occupancy; 70-95 % is healthy for training, above {LIMITS.memory_warning_ratio:.0%} risks OOM.",
        [
            target(
                f"gpuwarden_memory_used_bytes{{{GPU_SELECTOR}}} / gpuwarden_memory_total_bytes{{{GPU_SELECTOR}}}",
                gpu_legend,
            )
        ],
        "percentunit",
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
        "timeseries",
        "Memory used, reserved",
        "Bytes used by processes and reserved by the driver (v2; reserved: memory_detail group).",
        [
            target(f"gpuwarden_memory_used_bytes{{{GPU_SELECTOR}}}", "used " + gpu_legend),
            target(f"gpuwarden_memory_reserved_bytes{{{GPU_SELECTOR}}}", "reserved " + gpu_legend),
        ],
        "bytes",
    )
    holder = "{{namespace}}/{{pod}}/{{container}}"
    layout.add(
        "timeseries",
        "GPU memory by container",
        "Who holds each GPU's memory: the processes of each container (namespace/pod/container; empty: processes no "
        "container was found for). Two holders on one GPU is the first thing to check on an OOM. Per process: "
        "/api/v1/processes.",
        [target(f"gpuwarden_container_gpu_memory_used_bytes{{{GPU_SELECTOR}}}", gpu_legend + " " + holder)],
        "bytes",
        custom={"stacking": {"mode": "normal", "group": "A"}},
    )
    layout.add(
        "timeseries",
        "SM share by container",
        "Each container's share of its GPU's SMs (per-process SM utilization, averaged over the interval).",
        [target(f"rate(gpuwarden_container_sm_active_seconds_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                gpu_legend + " " + holder)],
        "percentunit",
        minmax=(0, 1),
    )  # fmt: skip
    layout.row("Thermals")
    layout.add(
        "timeseries",
        "GPU temperature",
        f"Die temperature with the {LIMITS.temperature_warning_celsius:g} °C warning "
        f"and {LIMITS.temperature_critical_celsius:g} °C critical lines of the alert rules.",
        [target(f"gpuwarden_temperature_celsius{{{GPU_SELECTOR}}}", gpu_legend)],
        "celsius",
        thresholds=_steps(
            (None, "green"),
            (LIMITS.temperature_warning_celsius, "orange"),
            (LIMITS.temperature_critical_celsius, "red"),
        ),
        custom=threshold_lines(),
    )
    layout.add(
        "timeseries",
        "Memory temperature and its maximum",
        "HBM temperature, and each GPU's own HBM maximum from NVML (the other thresholds: static_detail group).",
        [
            target(f"gpuwarden_memory_temperature_celsius{{{GPU_SELECTOR}}}", "HBM " + gpu_legend),
            target(
                f'gpuwarden_temperature_threshold_celsius{{{GPU_SELECTOR},threshold="memory_max"}}',
                "HBM max " + gpu_legend,
            ),
        ],
        "celsius",
    )
    layout.row("Power")
    layout.add(
        "timeseries",
        "Power draw / limit",
        "Average draw (from the energy counter) as a share of the enforced limit: below 30 % is idle, 60-90 % "
        "healthy, 100 % sustained is power throttling.",
        [
            target(
                f"rate(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}]) / "
                f"gpuwarden_power_limit_watts{{{GPU_SELECTOR}}}",
                gpu_legend,
            )
        ],
        "percentunit",
        thresholds=_steps((None, "blue"), (0.3, "green"), (0.9, "orange")),
        custom=threshold_lines(),
        minmax=(0, 1.1),
    )
    layout.add(
        "timeseries",
        "Power draw and limit (W), average from energy",
        "The true average draw from the energy counter and the enforced limit (the instant draw: point_samples group).",
        [
            target(f"rate(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "average " + gpu_legend),
            target(f"gpuwarden_power_limit_watts{{{GPU_SELECTOR}}}", "limit " + gpu_legend, ref="B"),
        ],
        "watt",
    )
    layout.add(
        "stat",
        "Energy over the range",
        "Energy used by the selected GPUs over the dashboard's time range.",
        [target(f"sum(increase(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[$__range]))", instant=True)],
        "joule",
        w=6,
        thresholds=_steps((None, "blue")),
    )
    layout.row("Clocks and throttling")
    layout.add(
        "state-timeline",
        "Clock-event reasons",
        "Why the clocks are held down, per GPU and reason (1 = active). "
        "gpu_idle is normal when idle; sw_power_cap is normal at full load. Needs the clocks_detail group; "
        "Throttle time share (default) answers the same from counters.",
        [target(f'gpuwarden_clock_event_active{{{GPU_SELECTOR},reason!="gpu_idle"}} == 1', "{{gpu}} {{reason}}")],
        "none",
        w=12,
        thresholds=_steps((None, "transparent"), (1, "orange")),
        mappings=[{"type": "value", "options": {"1": {"text": "active", "color": "orange"}}}],
    )
    layout.add(
        "timeseries",
        "Throttle time share",
        "Share of time the driver held the clocks down, per reason (cumulative counters, not point samples).",
        [target(f"rate(gpuwarden_throttle_seconds_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} {{reason}}")],
        "percentunit",
        thresholds=_steps((None, "green"), (LIMITS.thermal_slowdown_ratio, "orange")),
        custom=threshold_lines(),
    )
    layout.add(
        "timeseries",
        "SM clock / max",
        "SM clock against the GPU's maximum. Needs the clocks_detail group (maximum clocks).",
        [
            target(
                f'gpuwarden_clock_hertz{{{GPU_SELECTOR},clock="sm"}} / ignoring(clock) group_left '
                f'gpuwarden_clock_max_hertz{{{GPU_SELECTOR},clock="sm"}}',
                gpu_legend,
            )
        ],
        "percentunit",
        minmax=(0, 1),
    )
    layout.add(
        "state-timeline",
        "P-state",
        "Performance state (0 = P0, maximum). Idle datacenter GPUs sit in P0 too.",
        [target(f"gpuwarden_performance_state{{{GPU_SELECTOR}}}", gpu_legend)],
        "none",
        thresholds=_steps((None, "green"), (LIMITS.pstate_degraded_min, "orange")),
    )
    layout.row("Errors")
    layout.add(
        "timeseries",
        "ECC errors",
        "New ECC errors per interval (volatile counters); any uncorrected error pages (GpuwardenEccUncorrectable).",
        [target(f"increase(gpuwarden_ecc_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} {{type}}")],
        "none",
        thresholds=_steps((None, "green"), (1, "red")),
    )
    layout.add(
        "table",
        "Remapped rows",
        "Remapped rows by cause (memory_detail group), and pending / failed flags (failed = RMA; default).",
        [
            target(f"gpuwarden_remapped_rows{{{GPU_SELECTOR}}}", fmt="table", instant=True),
            target(
                f"gpuwarden_remapped_rows_pending{{{GPU_SELECTOR}}} + 2 * "
                f"gpuwarden_remapped_rows_failed{{{GPU_SELECTOR}}}",
                fmt="table",
                instant=True,
            ),
        ],
        "none",
    )
    layout.add(
        "timeseries",
        "XID events",
        "XID events per GPU and code over the rate interval (counts since gpuwarden started).",
        [target(f"increase(gpuwarden_xid_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} XID {{xid}}")],
        "none",
    )
    layout.add(
        "timeseries",
        "PCIe replays and NVLink errors",
        "PCIe replays per second, and NVLink errors per second by type, all links of the GPU together (per link: "
        "the nvlink_links group).",
        [
            target(f"rate(gpuwarden_pcie_replay_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "PCIe {{gpu}}"),
            target(
                f"rate(gpuwarden_nvlink_gpu_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                "NVLink {{gpu}} {{type}}",
                ref="B",
            ),
        ],
        "ops",
    )
    layout.row("Topology and NVLink")
    layout.add(
        "stat",
        "Active NVLinks per GPU",
        "Links up per GPU (18 on H100/H200 SXM).",
        [target(f"gpuwarden_nvlink_active_links{{{GPU_SELECTOR}}}", gpu_legend, instant=True)],
        "none",
        thresholds=_steps((None, "red"), (1, "green")),
    )
    layout.add(
        "table",
        "Topology (nvidia-smi topo -m)",
        "Connection from each GPU to each peer. Needs the topology group (default: /api/v1/topology).",
        [target(f"gpuwarden_topology_info{{{GPU_SELECTOR}}}", fmt="table", instant=True)],
        "none",
    )
    layout.row("Exporter")
    layout.add(
        "timeseries",
        "Poll duration",
        "Wall time of each tier's last poll.",
        [target(f"gpuwarden_collect_duration_seconds{{{NODE_SELECTOR}}}", "{{instance}} {{tier}}")],
        "s",
    )
    layout.add(
        "timeseries",
        "Data age and errors",
        "Seconds since each tier's last poll, and NVML errors per second.",
        [
            target(
                f"time() - gpuwarden_last_collect_timestamp_seconds{{{NODE_SELECTOR}}}", "age {{instance}} {{tier}}"
            ),
            target(
                f"sum by (instance, call, error) "
                f"(rate(gpuwarden_collect_errors_total{{{NODE_SELECTOR}}}[{RATE_INTERVAL}]))",
                "errors {{instance}} {{call}} {{error}}",
            ),
        ],
        "s",
    )
    variables = [
        variable("job", "Job", "label_values(gpuwarden_nvml_up, job)"),
        variable("instance", "Node", 'label_values(gpuwarden_nvml_up{job=~"$job"}, instance)'),
        variable("gpu", "GPU", 'label_values(gpuwarden_gpu_info{job=~"$job",instance=~"$instance"}, uuid)'),
    ]
    return dashboard(
        "gpuwarden-node",
        "gpuwarden / GPU node",
        "Every GPU of the selected nodes: health, "
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
        "timeseries",
        "SM activity and occupancy",
        "SMs busy (averaged over the SMs, unlike GPU busy) and resident warps as a share of the maximum, from "
        "NVML GPM: rate(activity seconds) / rate(window seconds). DCGM's SM_ACTIVE and SM_OCCUPANCY (occupancy: "
        "gpm_detail group).",
        [
            target(gpm_ratio("gpuwarden_gpm_sm_active_seconds_total"), gpu_legend + " SM active"),
            target(gpm_ratio("gpuwarden_gpm_sm_occupancy_seconds_total"), gpu_legend + " occupancy", ref="B"),
        ],
        "percentunit",
        minmax=(0, 1),
    )
    layout.add(
        "timeseries",
        "Tensor cores and FP pipes",
        "Share of time each math pipe was active (GPM). Tensor high is healthy for training; FP32 high with "
        "tensor near 0 means FP32 math: bf16 mixed precision or TF32 would use the tensor cores. FP pipes: "
        "gpm_detail group.",
        [target(gpm_ratio("gpuwarden_gpm_pipe_active_seconds_total", 'pipe=~"tensor|fp32|fp16|fp64"'),
                gpu_legend + " {{pipe}}")],
        "percentunit",
        minmax=(0, 1),
    )  # fmt: skip
    layout.add(
        "timeseries",
        "Device-memory bandwidth (DRAM active)",
        "Share of peak device-memory bandwidth in use (GPM DRAM_BW_UTIL); above "
        f"{LIMITS.bottleneck_dram_ratio:.0%} with the tensor cores idle the job is memory-bound.",
        [target(gpm_ratio("gpuwarden_gpm_dram_active_seconds_total"), gpu_legend)],
        "percentunit",
        minmax=(0, 1),
    )
    layout.add(
        "timeseries",
        "PCIe and NVLink traffic",
        "Bytes per second over PCIe (GPM where the GPU has it: link traffic, headers included, 6-7 % above the payload "
        "copied) and over all NVLinks (GPM).",
        [
            target(f"rate(gpuwarden_pcie_bytes_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                   gpu_legend + " PCIe {{direction}}"),
            target(f"rate(gpuwarden_nvlink_bytes_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])",
                   gpu_legend + " NVLink {{direction}}", ref="B"),
        ],
        "Bps",
    )  # fmt: skip
    layout.add(
        "table",
        "Bottleneck class",
        "What each GPU's time went to over the bottleneck window (gpuwarden_bottleneck_info): idle, tensor_bound, "
        "memory_bound, compute_without_tensor, communication_bound, host_transfer_bound, data_starved, mixed. "
        "/api/v1/diagnosis gives the numbers and what to do.",
        [target(f"max by (instance, gpu, class) (gpuwarden_bottleneck_info{{{GPU_SELECTOR}}})", fmt="table",
                instant=True)],
        "none",
        w=24,
        h=6,
    )  # fmt: skip


def fleet_dashboard() -> dict[str, Any]:
    layout = Layout()
    layout.row("Fleet health")
    layout.add(
        "stat",
        "GPUs by health status",
        "How many GPUs are ok (0), warning (1) or critical (2).",
        [
            target(f"count(gpuwarden_health_status{{{NODE_SELECTOR}}} == 0) or vector(0)", "ok", instant=True),
            target(f"count(gpuwarden_health_status{{{NODE_SELECTOR}}} == 1) or vector(0)", "warning", instant=True),
            target(f"count(gpuwarden_health_status{{{NODE_SELECTOR}}} == 2) or vector(0)", "critical", instant=True),
        ],
        "none",
        w=8,
        thresholds=_steps((None, "green")),
    )
    layout.add(
        "table",
        "Unhealthy GPUs",
        "GPUs whose health is not ok, with the model and the failing checks.",
        [
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
        "none",
        w=16,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
    )
    layout.row("Idle and starved GPUs")
    layout.add(
        "table",
        "Least busy GPUs over the range",
        "GPU busy share over the dashboard's range; below "
        f"{LIMITS.utilization_low_ratio:.0%} while a job runs is starvation.",
        [target(f"bottomk(20, {busy('$__range', NODE_SELECTOR)})", fmt="table", instant=True)],
        "percentunit",
        thresholds=_steps((None, "red"), (LIMITS.utilization_low_ratio, "green")),
    )
    layout.add(
        "stat",
        "Idle GPU-hours and their cost",
        "GPU-hours not spent running kernels over the range, and their cost at $price per GPU-hour.",
        [
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
        "none",
        thresholds=_steps((None, "blue")),
    )
    alloc = f"max_over_time(gpuwarden_gpu_allocation{{{NODE_SELECTOR}}}[$__range])"
    share = f"({alloc} / on (instance, uuid) group_left () count by (instance, uuid) ({alloc}))"
    idle_seconds = (
        f"clamp_min(increase(gpuwarden_utilization_sampled_seconds_total{{{NODE_SELECTOR}}}[$__range]) - "
        f"increase(gpuwarden_busy_seconds_total{{{NODE_SELECTOR}}}[$__range]), 0)"
    )
    layout.add(
        "table",
        "Idle GPU-hours by namespace",
        "GPU-hours in which no kernel ran over the range, charged to the "
        "namespaces whose pods held the GPU (pod attribution; a GPU shared by n containers counts 1/n to each), "
        "and their cost at $price per GPU-hour.",
        [
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
        "none",
        w=24,
        h=6,
    )
    layout.row("Profiling (GPM): useful work")
    tensor = gpm_ratio("gpuwarden_gpm_pipe_active_seconds_total", 'pipe="tensor"', NODE_SELECTOR, "$__range")
    allocation = f"max by (instance, uuid, namespace) (gpuwarden_gpu_allocation{{{NODE_SELECTOR}}})"
    layout.add(
        "table",
        "Tensor-core use by namespace",
        "Mean share of time the tensor cores were active over the dashboard's range, per namespace holding the "
        "GPUs (pod attribution), and how many GPUs: low tensor use on GPUs a team holds is the cheapest "
        "throughput to win (bf16 mixed precision, TF32).",
        [
            target(f"avg by (namespace) (({tensor}) * on (instance, uuid) group_left (namespace) {allocation})",
                   fmt="table", instant=True),
            target(f"count by (namespace) ({allocation})", fmt="table", instant=True, ref="B"),
        ],
        "percentunit",
        w=12,
    )  # fmt: skip
    layout.add(
        "table",
        "Bottleneck classes by node",
        "How many GPUs of each node are in each bottleneck class now (gpuwarden_bottleneck_info): tensor_bound is "
        "healthy; data_starved, host_transfer_bound and communication_bound GPUs wait; idle GPUs have no process.",
        [target(f"count by (instance, class) (gpuwarden_bottleneck_info{{{NODE_SELECTOR}}})", fmt="table",
                instant=True)],
        "none",
        w=12,
    )  # fmt: skip
    layout.add(
        "table",
        "Top GPU-memory holders by namespace",
        "GPU memory held by each namespace's containers across the selected nodes (their processes, attributed "
        "through cgroups or the GPU allocation), largest first.",
        [target(f'topk(10, sum by (namespace) (gpuwarden_container_gpu_memory_used_bytes{{{NODE_SELECTOR}, '
                f'namespace!=""}}))', fmt="table", instant=True)],
        "bytes",
        w=12,
    )  # fmt: skip
    layout.add(
        "table",
        "Top GPU-memory holders by pod",
        "The ten pods holding the most GPU memory, with the node.",
        [target(f'topk(10, sum by (instance, namespace, pod) (gpuwarden_container_gpu_memory_used_bytes'
                f'{{{NODE_SELECTOR}, pod!=""}}))', fmt="table", instant=True)],
        "bytes",
        w=12,
    )  # fmt: skip
    layout.add(
        "timeseries",
        "GPUs per bottleneck class",
        "GPUs of the selected nodes in each class over time.",
        [target(f"count by (class) (gpuwarden_bottleneck_info{{{NODE_SELECTOR}}})", "{{class}}")],
        "none",
        w=24,
    )
    layout.row("Hot, failing and disconnected")
    layout.add(
        "table",
        "Hottest GPUs",
        "The ten hottest GPUs now.",
        [target(f"topk(10, gpuwarden_temperature_celsius{{{NODE_SELECTOR}}})", fmt="table", instant=True)],
        "celsius",
        w=8,
        thresholds=_steps(
            (None, "green"),
            (LIMITS.temperature_warning_celsius, "orange"),
            (LIMITS.temperature_critical_celsius, "red"),
        ),
    )
    layout.add(
        "table",
        "ECC and XID offenders",
        "GPUs with uncorrected ECC errors or critical XIDs in the window.",
        [
            target(f'gpuwarden_ecc_errors_total{{{NODE_SELECTOR},type="uncorrected"}} > 0', fmt="table", instant=True),
            target(f"gpuwarden_xid_errors_total{{{NODE_SELECTOR}}} > 0", fmt="table", instant=True),
        ],
        "none",
        w=8,
    )
    layout.add(
        "table",
        "NVLink problems",
        "GPUs with fewer active NVLinks than the most any GPU of their node has (which link: /api/v1/gpus or "
        "the nvlink_links group).",
        [
            target(
                f"gpuwarden_nvlink_active_links{{{NODE_SELECTOR}}} < on (instance) group_left "
                f"max by (instance) (gpuwarden_nvlink_active_links{{{NODE_SELECTOR}}})",
                fmt="table",
                instant=True,
            ),
        ],
        "none",
        w=8,
    )
    layout.row("Versions")
    layout.add(
        "table",
        "Driver versions in the fleet",
        "Nodes per driver and CUDA driver version.",
        [
            target(
                f"count by (driver_version, cuda_driver_version) (gpuwarden_driver_info{{{NODE_SELECTOR}}})",
                fmt="table",
                instant=True,
            )
        ],
        "none",
        w=12,
    )
    layout.add(
        "table",
        "GPU models",
        "GPUs per model.",
        [target(f"count by (name) (gpuwarden_gpu_info{{{NODE_SELECTOR}}})", fmt="table", instant=True)],
        "none",
        w=12,
    )
    variables = [
        variable("job", "Job", "label_values(gpuwarden_nvml_up, job)"),
        variable("instance", "Node", 'label_values(gpuwarden_nvml_up{job=~"$job"}, instance)'),
        {"name": "price", "label": "Price per GPU-hour", "type": "constant", "query": "2.5", "hide": 0},
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
