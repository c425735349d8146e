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

from exporter.health.thresholds import DEFAULT as LIMITS  # noqa: E402

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
    L = Layout()
    gpu_legend = "{{instance}} gpu {{gpu}}"
    L.row("Health at a glance")
    L.add(
        "stat",
        "Health status per GPU",
        "Worst health verdict of each GPU (gpuwarden_health_status): 0 ok, 1 warning, 2 critical.",
        [target(f"gpuwarden_health_status{{{GPU_SELECTOR}}}", gpu_legend, instant=True)],
        "none",
        w=8,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
    )
    L.add(
        "table",
        "Failing checks",
        "Checks that are not ok, per GPU.",
        [target(f"gpuwarden_health{{{GPU_SELECTOR}}} > 0", fmt="table", instant=True)],
        "none",
        w=8,
        thresholds=_steps((None, "green"), (1, "orange"), (2, "red")),
        mappings=HEALTH_MAPPING,
    )
    L.add(
        "table",
        "Firing alerts",
        "gpuwarden alerts firing for the selected nodes (Prometheus' ALERTS series).",
        [target(f'ALERTS{{alertname=~"Gpuwarden.*",alertstate="firing",{NODE_SELECTOR}}}', fmt="table", instant=True)],
        "none",
        w=8,
    )
    L.add(
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
    L.row("Utilization")
    L.add(
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
    L.add(
        "timeseries",
        "Memory bandwidth busy",
        "Share of the last sample period in which device memory was read or written (not occupancy).",
        [target(f"gpuwarden_memory_bandwidth_utilization_ratio{{{GPU_SELECTOR}}}", gpu_legend)],
        "percentunit",
        minmax=(0, 1),
    )
    L.row("Memory")
    L.add(
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
    L.add(
        "timeseries",
        "Memory used, reserved",
        "Bytes used by processes and reserved by the driver (v2).",
        [
            target(f"gpuwarden_memory_used_bytes{{{GPU_SELECTOR}}}", "used " + gpu_legend),
            target(f"gpuwarden_memory_reserved_bytes{{{GPU_SELECTOR}}}", "reserved " + gpu_legend),
        ],
        "bytes",
    )
    L.row("Thermals")
    L.add(
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
    L.add(
        "timeseries",
        "Memory temperature and slowdown threshold",
        "HBM temperature, and each GPU's own slowdown threshold from NVML.",
        [
            target(f"gpuwarden_memory_temperature_celsius{{{GPU_SELECTOR}}}", "HBM " + gpu_legend),
            target(
                f'gpuwarden_temperature_threshold_celsius{{{GPU_SELECTOR},threshold="slowdown"}}',
                "slowdown " + gpu_legend,
            ),
        ],
        "celsius",
    )
    L.row("Power")
    L.add(
        "timeseries",
        "Power draw / limit",
        "Draw as a share of the enforced limit: below 30 % is idle, 60-90 % "
        "healthy, 100 % sustained is power throttling.",
        [
            target(
                f"gpuwarden_power_usage_watts{{{GPU_SELECTOR}}} / gpuwarden_power_limit_watts{{{GPU_SELECTOR}}}",
                gpu_legend,
            )
        ],
        "percentunit",
        thresholds=_steps((None, "blue"), (0.3, "green"), (0.9, "orange")),
        custom=threshold_lines(),
        minmax=(0, 1.1),
    )
    L.add(
        "timeseries",
        "Power draw and limit (W), average from energy",
        "Instant draw, enforced limit, and the true average from the energy counter.",
        [
            target(f"gpuwarden_power_usage_watts{{{GPU_SELECTOR}}}", "draw " + gpu_legend),
            target(f"gpuwarden_power_limit_watts{{{GPU_SELECTOR}}}", "limit " + gpu_legend),
            target(f"rate(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "average " + gpu_legend),
        ],
        "watt",
    )
    L.add(
        "stat",
        "Energy over the range",
        "Energy used by the selected GPUs over the dashboard's time range.",
        [target(f"sum(increase(gpuwarden_energy_joules_total{{{GPU_SELECTOR}}}[$__range]))", instant=True)],
        "joule",
        w=6,
        thresholds=_steps((None, "blue")),
    )
    L.row("Clocks and throttling")
    L.add(
        "state-timeline",
        "Clock-event reasons",
        "Why the clocks are held down, per GPU and reason (1 = active). "
        "gpu_idle is normal when idle; sw_power_cap is normal at full load.",
        [target(f'gpuwarden_clock_event_active{{{GPU_SELECTOR},reason!="gpu_idle"}} == 1', "{{gpu}} {{reason}}")],
        "none",
        w=12,
        thresholds=_steps((None, "transparent"), (1, "orange")),
        mappings=[{"type": "value", "options": {"1": {"text": "active", "color": "orange"}}}],
    )
    L.add(
        "timeseries",
        "Throttle time share",
        "Share of time the driver held the clocks down, per reason (cumulative counters, not point samples).",
        [target(f"rate(gpuwarden_throttle_seconds_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} {{reason}}")],
        "percentunit",
        thresholds=_steps((None, "green"), (LIMITS.thermal_slowdown_ratio, "orange")),
        custom=threshold_lines(),
    )
    L.add(
        "timeseries",
        "SM clock / max",
        "SM clock against the GPU's maximum.",
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
    L.add(
        "state-timeline",
        "P-state",
        "Performance state (0 = P0, maximum). Idle datacenter GPUs sit in P0 too.",
        [target(f"gpuwarden_performance_state{{{GPU_SELECTOR}}}", gpu_legend)],
        "none",
        thresholds=_steps((None, "green"), (LIMITS.pstate_degraded_min, "orange")),
    )
    L.row("Errors")
    L.add(
        "timeseries",
        "ECC errors",
        "New ECC errors per interval (volatile counters); any uncorrected error pages (GpuwardenEccUncorrectable).",
        [target(f"increase(gpuwarden_ecc_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} {{type}}")],
        "none",
        thresholds=_steps((None, "green"), (1, "red")),
    )
    L.add(
        "table",
        "Remapped rows",
        "Remapped rows by cause, and pending / failed flags (failed = RMA).",
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
    L.add(
        "timeseries",
        "XID events",
        "XID events per GPU and code over the rate interval (counts since gpuwarden started).",
        [target(f"increase(gpuwarden_xid_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "{{gpu}} XID {{xid}}")],
        "none",
    )
    L.add(
        "timeseries",
        "PCIe replays and NVLink errors",
        "PCIe replays per second, and NVLink errors per second by link and type.",
        [
            target(f"rate(gpuwarden_pcie_replay_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}])", "PCIe {{gpu}}"),
            target(
                f"sum by (instance, gpu, type) "
                f"(rate(gpuwarden_nvlink_errors_total{{{GPU_SELECTOR}}}[{RATE_INTERVAL}]))",
                "NVLink {{gpu}} {{type}}",
            ),
        ],
        "ops",
    )
    L.row("Topology and NVLink")
    L.add(
        "stat",
        "Active NVLinks per GPU",
        "Links up per GPU (18 on H100/H200 SXM).",
        [target(f"sum by (instance, gpu) (gpuwarden_nvlink_up{{{GPU_SELECTOR}}})", gpu_legend, instant=True)],
        "none",
        thresholds=_steps((None, "red"), (1, "green")),
    )
    L.add(
        "table",
        "Topology (nvidia-smi topo -m)",
        "Connection from each GPU to each peer.",
        [target(f"gpuwarden_topology_info{{{GPU_SELECTOR}}}", fmt="table", instant=True)],
        "none",
    )
    L.row("Exporter")
    L.add(
        "timeseries",
        "Poll duration",
        "Wall time of each tier's last poll.",
        [target(f"gpuwarden_collect_duration_seconds{{{NODE_SELECTOR}}}", "{{instance}} {{tier}}")],
        "s",
    )
    L.add(
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
        L,
        variables,
    )


def fleet_dashboard() -> dict[str, Any]:
    L = Layout()
    L.row("Fleet health")
    L.add(
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
    L.add(
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
    L.row("Idle and starved GPUs")
    L.add(
        "table",
        "Least busy GPUs over the range",
        "GPU busy share over the dashboard's range; below "
        f"{LIMITS.utilization_low_ratio:.0%} while a job runs is starvation.",
        [target(f"bottomk(20, {busy('$__range', NODE_SELECTOR)})", fmt="table", instant=True)],
        "percentunit",
        thresholds=_steps((None, "red"), (LIMITS.utilization_low_ratio, "green")),
    )
    L.add(
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
    L.add(
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
    L.row("Hot, failing and disconnected")
    L.add(
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
    L.add(
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
    L.add(
        "table",
        "NVLink problems",
        "Links that are down, or GPUs reaching peers over fewer links than usual.",
        [
            target(f"gpuwarden_nvlink_up{{{NODE_SELECTOR}}} == 0", fmt="table", instant=True),
            target(
                f"gpuwarden_nvlink_peer_links{{{NODE_SELECTOR}}} < on (instance) group_left "
                f"max by (instance) (gpuwarden_nvlink_peer_links{{{NODE_SELECTOR}}})",
                fmt="table",
                instant=True,
            ),
        ],
        "none",
        w=8,
    )
    L.row("Versions")
    L.add(
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
    L.add(
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
        L,
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
