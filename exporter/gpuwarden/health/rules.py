"""The alert rules' model, from the thresholds: every rule's expression, severity, action and words.

One definition of every threshold and duration (exporter/gpuwarden/health/thresholds.py) feeds both these rules and
the exporter's health gauges. The fleet service evaluates the cordon rules' expressions from here; the rule file is
written by a development tool outside the package (`python alert_rules/generate.py`), and
tests/test_alert_rules.py fails when the committed file differs from its output.
Severity: critical pages, warning opens a ticket, info is for dashboards (docs/alerting.md, Severities).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwarden.health.checks import FABRIC_DEGRADED, FABRIC_FAULTS
from gpuwarden.health.thresholds import DEFAULT, Thresholds

RUNBOOK_BASE = "https://github.com/gpuwarden/gpuwarden/blob/main/docs/runbooks.md"
SELECTOR = 'job="gpuwarden"'
HOLD_MARGIN_S = 60  # past a finding's own warm-up after a restart: the new target found and scraped, a rule evaluated


@dataclass(frozen=True)
class Rule:
    alert: str
    expr: str
    severity: str
    summary: str
    description: str
    for_s: int = 0
    action: str | None = None  # cordon, reset_gpu, reboot, rma: for automation on the receiving side
    keep_firing_s: int = 0  # `keep_firing_for`: how long it holds with no reading (see `held`)
    # what makes the node a cordon candidate (the fleet view), where that outlasts the page: default `expr`
    finding_expr: str | None = None

    @property
    def finding(self) -> str:
        return self.finding_expr or self.expr


@dataclass(frozen=True)
class Record:
    """A recording rule that an alert reads instead of a day of raw samples."""

    record: str
    expr: str


@dataclass
class Group:
    name: str
    rules: list[Rule] = field(default_factory=list)
    records: list[Record] = field(default_factory=list)
    interval_s: int | None = None  # None: the Prometheus server's global evaluation interval


# The day-long windows read recorded maxima, not raw samples: at 10,000 nodes the raw [1d] of every GPU's active
# NVLinks was 461 M samples an evaluation, and every node's GPU count over [24h] 58 M (issue 38,
# docs/benchmarks.md, Rules). Each record keeps the most seen over HISTORY_WINDOW, written every
# HISTORY_INTERVAL_S: consecutive windows overlap, so no sample falls between two records, and an alert over the
# records sees the day as the raw series did, up to one interval late at its newest end and HISTORY_WINDOW longer
# at its oldest.
HISTORY_GROUP = "gpuwarden-history"
HISTORY_INTERVAL_S = 600
HISTORY_WINDOW = "15m"
NVLINK_ACTIVE_MAX = "gpuwarden:gpu_nvlink_active_links:max15m"
NODE_GPUS_MAX = "gpuwarden:node_gpus:max15m"
# Tickets and information over windows of 15-30 minutes need no evaluation every minute: a fault they report lasts
# the window, so one evaluation in 5 minutes sees it (up to 5 minutes later than a minute's would).
SUSTAINED_GROUP = "gpuwarden-sustained"
SUSTAINED_INTERVAL_S = 300


def sustained_interval(*condition_s: int) -> int | None:
    """SUSTAINED_INTERVAL_S for a group whose conditions all last 10 minutes or more (windows and `for:`: two
    evaluations fit in the shortest), else None, the server's interval: a threshold tuned shorter is evaluated as
    often as the other alerts."""
    return SUSTAINED_INTERVAL_S if min(condition_s) >= 2 * SUSTAINED_INTERVAL_S else None


def duration(seconds: int) -> str:
    """300 → '5m', 3600 → '1h', 90 → '90s' (Prometheus duration syntax)."""
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"


def _xids(xids: tuple[int, ...]) -> str:
    return "|".join(str(x) for x in sorted(xids))


# Pages name the node: the `node` label where the scrape config adds it (the chart does; `instance` is then a pod
# IP), else the instance.
NODE = "{{ with $labels.node }}{{ . }}{{ else }}{{ $labels.instance }}{{ end }}"


def nodeish(series: str) -> str:
    """`series` with a `node` label everywhere: kept where the scrape config set it, the instance where it did not.
    Rules that must outlive an exporter restart group by it: a restarted pod has a new instance, not a new node."""
    return f'(label_replace({series[:-1]},node=""}}, "node", "$1", "instance", "(.*)") or {series[:-1]},node!=""}})'


def nodeish_over(series: str, window: str) -> str:
    """max_over_time(`series`[window]) with a `node` label everywhere, as nodeish(): the range read from the raw
    series (a range over label_replace needs a subquery, which evaluates the relabelling at every step)."""
    return (
        f'(label_replace(max_over_time({series[:-1]},node=""}}[{window}]), "node", "$1", "instance", "(.*)") '
        f'or max_over_time({series[:-1]},node!=""}}[{window}]))'
    )


def held(expr: str) -> str:
    """`expr` as a page for a lasting fault: the same alert across an exporter restart.

    A restarted pod has a new `pod` and a new `instance`. The alert keeps `node` (the instance where the scrape
    gives no `node` label: a host's address, which a restart keeps) and drops both, aggregating over them, so the
    new series continue the firing alert rather than resolving it and opening another (aggregation, unlike a
    relabelled vector, cannot fail on two series that now look alike while old and new overlap).
    `keep_firing_for` (Thresholds.page_hold_s) bridges the scrapes between the two."""
    joined = f'label_join({expr}, "node_or_instance", "@", "node", "instance")'
    named = f'label_replace({joined}, "node", "$1", "node_or_instance", "@(.+)")'
    return f"max without (pod, instance, node_or_instance) ({named})"


def build(t: Thresholds = DEFAULT, selector: str = SELECTOR) -> list[Group]:
    s = selector
    gpu = f"GPU {{{{ $labels.gpu }}}} ({{{{ $labels.uuid }}}}) on {NODE}"

    def nvlink_down(most_active_in_a_day: str) -> str:
        """Fewer links active than the GPU has, on a GPU with some active in the last day (by UUID)."""
        return held(
            f"gpuwarden_nvlink_active_links{{{s}}} < gpuwarden_nvlink_links{{{s}}} and on (uuid) "
            f"({most_active_in_a_day} > 0)"
        )

    def busy(window: int) -> str:
        w = duration(window)
        return (
            f"rate(gpuwarden_busy_seconds_total{{{s}}}[{w}]) "
            f"/ rate(gpuwarden_utilization_sampled_seconds_total{{{s}}}[{w}])"
        )

    def xid_since(window: int) -> str:
        """A critical XID within `window` s, over Prometheus' history of it."""
        last = f'gpuwarden_xid_last_timestamp_seconds{{{s},xid=~"{_xids(t.xid_critical)}"}}'
        return f"time() - max_over_time({last}[{duration(window)}]) < {window}"

    def throttle(reason: str, window: int) -> str:
        return f'rate(gpuwarden_throttle_seconds_total{{{s},reason="{reason}"}}[{duration(window)}])'

    return [
        Group(
            "gpuwarden-exporter",
            [
                Rule(
                    "GpuwardenExporterDown",
                    f"up{{{s}}} == 0",
                    "warning",
                    "A gpuwarden exporter is down.",
                    f"gpuwarden on {NODE} has not answered scrapes for 5 minutes, so its GPUs are "
                    "unmonitored; check the pod or service and its logs.",
                    t.exporter_down_for_s,
                ),
                Rule(
                    "GpuwardenExporterAbsent",
                    f"absent(up{{{s}}})",
                    "warning",
                    "No gpuwarden exporter is scraped.",
                    "Prometheus has no gpuwarden target at all, so every GPU rule evaluates to nothing and looks "
                    "healthy; check the ServiceMonitor or scrape config and the DaemonSet.",
                    t.exporter_absent_for_s,
                ),
                Rule(
                    "GpuwardenNvmlDown",
                    f"gpuwarden_nvml_up{{{s}}} == 0",
                    "critical",
                    "NVML is down on a GPU node.",
                    f"gpuwarden on {NODE} cannot use NVML (see gpuwarden_nvml_error_info): the driver "
                    "is not loaded, the library is missing or was upgraded; check the driver with nvidia-smi and "
                    "reload or reboot.",
                    t.nvml_down_for_s,
                    "cordon",
                ),
                Rule(
                    "GpuwardenCollectionStale",
                    f'time() - gpuwarden_last_collect_timestamp_seconds{{{s},tier="fast"}} > {t.collection_stale_s}',
                    "warning",
                    "GPU collection has stalled.",
                    f"gpuwarden on {NODE} has not finished a poll for {{{{ $value | humanizeDuration }}}}: "
                    "NVML is probably wedged in the driver (often a hung GPU, XID 119/120); check dmesg and "
                    "nvidia-smi.",
                ),
            ],
        ),
        Group(
            "gpuwarden-availability",
            [
                Rule(
                    "GpuwardenGpuLost",
                    held(f"gpuwarden_gpu_up{{{s}}} == 0"),
                    "critical",
                    "A GPU has fallen off the bus.",
                    f"{gpu} does not answer NVML (lost or reset required); drain and cordon the node, then reset or "
                    "power-cycle the GPU; RMA if it recurs.",
                    t.gpu_lost_for_s,
                    "cordon",
                    t.page_hold_s,
                ),
                Rule(
                    "GpuwardenRecoveryActionNeeded",
                    held(f"gpuwarden_recovery_action{{{s}}} > 0"),
                    "critical",
                    "The driver asks for a GPU recovery action.",
                    f"The driver recommends recovery action {{{{ $value }}}} for {gpu} (1 reset GPU, 2 reboot node, "
                    "3 drain P2P, 4 drain and reset); drain the node and carry it out.",
                    0,
                    "reset_gpu",
                    t.page_hold_s,
                ),
                Rule(
                    "GpuwardenXidCritical",
                    # over Prometheus' history, not only the running exporter's memory: a restarted exporter (which
                    # starts with no XID history) must not resolve the page; the page lasts the exporter's verdict
                    # window, the cordon finding the hold
                    xid_since(t.xid_window_s),
                    "critical",
                    "A GPU reported a critical XID.",
                    f"{gpu} raised XID {{{{ $labels.xid }}}}; drain the node, reset the GPU and follow the runbook "
                    "for that XID (the node stays a cordon candidate for a day).",
                    t.xid_critical_for_s,
                    "reset_gpu",
                    finding_expr=xid_since(t.xid_critical_hold_s),
                ),
                Rule(
                    "GpuwardenXidWarning",
                    f'time() - gpuwarden_xid_last_timestamp_seconds{{{s},xid=~"{_xids(t.xid_warning)}"}} '
                    f"< {t.xid_window_s}",
                    "warning",
                    "A GPU reported a contained XID.",
                    f"{gpu} raised XID {{{{ $labels.xid }}}}; restart the affected application and reset the GPU at "
                    "the next maintenance window.",
                ),
            ],
        ),
        Group(
            "gpuwarden-memory-health",
            [
                Rule(
                    "GpuwardenEccUncorrectable",
                    held(f'gpuwarden_ecc_errors_total{{{s},type="uncorrected"}} > 0'),
                    "critical",
                    "A GPU has uncorrectable ECC errors.",
                    f"{gpu} has {{{{ $value }}}} uncorrectable ECC error(s) since the driver loaded; stop its "
                    "workloads, cordon the node, reset the GPU, and request a replacement if it recurs.",
                    0,
                    "cordon",
                    t.page_hold_s,
                ),
                Rule(
                    "GpuwardenRowRemapFailure",
                    held(f"gpuwarden_remapped_rows_failed{{{s}}} == 1"),
                    "critical",
                    "A GPU failed to remap a memory row.",
                    f"{gpu} has no spare rows left for a failing memory row; drain it, run the NVIDIA field "
                    "diagnostic and open an RMA.",
                    0,
                    "rma",
                    t.page_hold_s,
                ),
                Rule(
                    "GpuwardenRowRemapPending",
                    f"gpuwarden_remapped_rows_pending{{{s}}} == 1",
                    "warning",
                    "A GPU has a memory row remap pending.",
                    f"{gpu} has a row remap that takes effect at the next GPU reset; reset it at the next "
                    "maintenance window.",
                    0,
                    "reset_gpu",
                ),
                Rule(
                    "GpuwardenRetiredPagesPending",
                    f"gpuwarden_retired_pages_pending{{{s}}} == 1",
                    "warning",
                    "A GPU has a page retirement pending.",
                    f"{gpu} retired memory pages that take effect at the next driver reload; reload the driver or "
                    "reboot at the next maintenance window.",
                ),
                Rule(
                    "GpuwardenRetiredPagesLimit",
                    f"sum without (cause) (gpuwarden_retired_pages{{{s}}}) >= {t.retired_pages_limit}",
                    "critical",
                    "A GPU reached the retired-page limit.",
                    f"{gpu} has {{{{ $value }}}} retired pages; drain it, run the field diagnostic and open an RMA.",
                    0,
                    "rma",
                ),
            ],
        ),
        Group(
            "gpuwarden-thermal-power",
            [
                Rule(
                    "GpuwardenTemperatureHigh",
                    f"gpuwarden_temperature_celsius{{{s}}} > {t.temperature_warning_celsius:g}",
                    "warning",
                    "A GPU is running hot.",
                    f"{gpu} is at {{{{ $value }}}} °C; check airflow, fans and inlet temperature before it throttles.",
                    t.temperature_warning_for_s,
                ),
                Rule(
                    "GpuwardenTemperatureCritical",
                    f"gpuwarden_temperature_celsius{{{s}}} > {t.temperature_critical_celsius:g}",
                    "critical",
                    "A GPU is in the thermal danger zone.",
                    f"{gpu} is at {{{{ $value }}}} °C, past its slowdown point; drain the node and fix the cooling "
                    "before the GPU shuts down.",
                    t.temperature_critical_for_s,
                    "cordon",
                ),
                Rule(
                    "GpuwardenMemoryTemperatureHigh",
                    f"gpuwarden_memory_temperature_celsius{{{s}}} >= ignoring(threshold) "
                    f'(gpuwarden_temperature_threshold_celsius{{{s},threshold="memory_max"}} '
                    f"- {t.memory_temperature_margin_celsius:g})",
                    "warning",
                    "A GPU's memory is running hot.",
                    f"The HBM of {gpu} is at {{{{ $value }}}} °C, within {t.memory_temperature_margin_celsius:g} °C of "
                    "its limit; check airflow and cooling.",
                    t.memory_temperature_for_s,
                ),
                Rule(
                    "GpuwardenHwThermalSlowdown",
                    f"{throttle('hw_thermal_slowdown', t.thermal_slowdown_for_s)} > {t.thermal_slowdown_ratio:g}",
                    "warning",
                    "A GPU is throttled for heat.",
                    f"{gpu} spent {{{{ $value | humanizePercentage }}}} of the time in hardware thermal slowdown; "
                    "check cooling and the chassis' fans.",
                    t.thermal_slowdown_for_s,
                ),
                Rule(
                    "GpuwardenSwThermalSlowdown",
                    f"{throttle('sw_thermal_slowdown', t.thermal_slowdown_for_s)} > {t.thermal_slowdown_ratio:g}",
                    "warning",
                    "A GPU is throttled by the driver for heat.",
                    f"{gpu} spent {{{{ $value | humanizePercentage }}}} of the time in software thermal slowdown (the "
                    "driver lowers clocks before the hardware has to); check cooling and the chassis' fans.",
                    t.thermal_slowdown_for_s,
                ),
                Rule(
                    "GpuwardenThermalThrottling",
                    f"max without (reason) (rate(gpuwarden_throttle_seconds_total{{{s},"
                    f'reason=~"hw_thermal_slowdown|sw_thermal_slowdown"}}[{duration(t.thermal_page_window_s)}])) '
                    f"> {t.thermal_page_ratio:g}",
                    "critical",
                    "A GPU is throttled for heat most of the time.",
                    f"{gpu} spent {{{{ $value | humanizePercentage }}}} of the last "
                    f"{duration(t.thermal_page_window_s)} in thermal slowdown (hardware or driver): its jobs run "
                    "slower, and the GPU is at risk; drain the node and fix the cooling (fans, airflow, inlet "
                    "temperature).",
                    t.thermal_page_for_s,
                    "cordon",
                ),
                Rule(
                    "GpuwardenHwPowerBrake",
                    f"{throttle('hw_power_brake_slowdown', t.thermal_slowdown_for_s)} > {t.power_brake_ratio:g}",
                    "warning",
                    "A GPU is held down by the power brake.",
                    f"{gpu} spent {{{{ $value | humanizePercentage }}}} of the time under the external power brake; "
                    "check the PSUs and the rack's power budget.",
                    t.thermal_slowdown_for_s,
                ),
            ],
        ),
        Group(
            "gpuwarden-capacity",
            [
                Rule(
                    "GpuwardenMemoryNearlyFull",
                    f"gpuwarden_memory_used_bytes{{{s}}} / gpuwarden_memory_total_bytes{{{s}}} "
                    f"> {t.memory_warning_ratio:g}",
                    "warning",
                    "A GPU's memory is nearly full.",
                    f"{gpu} uses {{{{ $value | humanizePercentage }}}} of its memory; frameworks preallocate, so "
                    "tell the job's owner: smaller batch, gradient checkpointing, sharding (ZeRO/FSDP) or bf16.",
                    t.memory_for_s,
                ),
            ],
            interval_s=sustained_interval(t.memory_for_s),
        ),
        Group(
            "gpuwarden-interconnect",
            [
                Rule(
                    "GpuwardenNvlinkDown",
                    # against the links the GPU has (static, so a restart does not forget them); a GPU with none
                    # active is a fault only if some were active in the last day (a PCIe card without a bridge has
                    # links and none active), under any exporter instance: joined on the GPU's UUID, so a GPU whose
                    # every link went down still pages after the exporter restarted (the new instance has seen none
                    # active; joined on the instance too, the page resolved)
                    # (the day from the recorded maxima, HISTORY_GROUP: 144 points a GPU, not 5,760)
                    nvlink_down(f"max_over_time({NVLINK_ACTIVE_MAX}[1d])"),
                    "critical",
                    "An NVLink link is down.",
                    f"{gpu} has {{{{ $value }}}} active NVLinks, fewer than it has (gpuwarden_nvlink_links): a link is "
                    "down, which cripples multi-GPU training; drain the node, check nvidia-smi nvlink -s (which link: "
                    "/api/v1/gpus or the nvlink_links group), reset or reboot, and replace the baseboard if it recurs.",
                    t.nvlink_down_for_s,
                    "cordon",
                    t.page_hold_s,
                    # the fleet view evaluates it on the few instances it narrowed to, from the raw series: it then
                    # works on a Prometheus that loads the fleet's recording rules without these
                    finding_expr=nvlink_down(
                        f"max by (uuid) (max_over_time(gpuwarden_nvlink_active_links{{{s}}}[1d]))"
                    ),
                ),
                Rule(
                    "GpuwardenFabricNotReady",
                    # one page per node: Fabric Manager sets up the whole node's fabric, so eight GPUs not ready were
                    # eight incidents for one cause (seen in the restart test with real Alertmanager)
                    held(f'count without (gpu, uuid) (gpuwarden_fabric_state{{{s},state!="completed"}} == 1)'),
                    "critical",
                    "A node's NVSwitch fabric is not set up: CUDA cannot start on its GPUs.",
                    f"{{{{ $value }}}} GPU(s) on {NODE}: their NVSwitch fabric is {{{{ $labels.state }}}}, so no CUDA "
                    "job can start there, though every other reading looks healthy (which GPUs: /api/v1/health, "
                    "check fabric). Check `systemctl status nvidia-fabricmanager` and /var/log/fabricmanager.log; "
                    "start or restart Fabric Manager (its version must match the driver's); drain the node if the "
                    "fabric does not complete.",
                    t.fabric_setup_for_s,
                    "cordon",
                    t.page_hold_s,
                ),
                Rule(
                    "GpuwardenFabricUnhealthy",
                    held(f'gpuwarden_fabric_health{{{s},condition=~"{"|".join(FABRIC_FAULTS)}"}} == 1'),
                    "critical",
                    "A GPU's NVSwitch fabric is unhealthy: jobs that use it fail.",
                    f"{gpu}: fabric {{{{ $labels.condition }}}} (route_unhealthy, incorrect_configuration or a failed "
                    "registration with Fabric Manager). Drain the node, read /var/log/fabricmanager.log and "
                    "`nvidia-smi -q` (Fabric), restart Fabric Manager, then reboot if it persists; an NVSwitch or "
                    "baseboard fault needs the vendor.",
                    0,
                    "cordon",
                    t.page_hold_s,
                ),
                Rule(
                    "GpuwardenFabricDegraded",
                    f'gpuwarden_fabric_health{{{s},condition=~"{"|".join(FABRIC_DEGRADED)}"}} == 1',
                    "warning",
                    "A GPU's NVSwitch fabric runs degraded.",
                    f"{gpu}: fabric {{{{ $labels.condition }}}}: all-reduce over NVSwitch runs slower (degraded "
                    "bandwidth: a trunk link lost) or recovers routes. Check /var/log/fabricmanager.log and "
                    "`nvidia-smi nvlink -s`; plan a drain and an NVSwitch check at the next window.",
                    t.fabric_degraded_for_s,
                ),
                Rule(
                    "GpuwardenNvswitchSxid",
                    # the kernel log's record time, so an SXid from before the exporter started counts, and a
                    # restart neither repeats nor resolves it; as the fabric verdict, for xid_window_s
                    f"time() - gpuwarden_kernel_sxid_last_timestamp_seconds{{{s}}} < {t.xid_window_s}",
                    "warning",
                    "An NVSwitch logged an SXid error.",
                    f"NVSwitch {{{{ $labels.switch }}}} on {NODE} logged SXid {{{{ $labels.sxid }}}} (kernel log: "
                    "`dmesg | grep SXid`). A non-fatal SXid is corrected by the switch; a fatal one makes Fabric "
                    "Manager degrade or tear down the fabric, and GpuwardenFabricUnhealthy or "
                    "GpuwardenFabricNotReady then pages. Read /var/log/fabricmanager.log and `nvidia-smi -q` "
                    "(Fabric); the same SXid recurring on one switch needs the vendor at the next window.",
                ),
            ],
        ),
        Group(
            "gpuwarden-jobs",
            [
                Rule(
                    "GpuwardenCollectiveHang",
                    # held across an exporter restart: the new exporter needs the window and the hang's duration
                    # again before it can say so (collective_window_s + collective_hang_for_s), plus a scrape or two
                    held(f'gpuwarden_job_finding{{{s},kind="collective_hang"}} == 1'),
                    "warning",
                    "A training job is hung in a collective.",
                    f"Job {{{{ $labels.job_id }}}} on {NODE} spins in a collective and nothing has moved over its "
                    "links for collective_hang_for_s{{ if $labels.gpu }}; GPU {{ $labels.gpu }} (rank "
                    "{{ $labels.rank }}) stopped first{{ end }}. Tell the job's owner: dump every rank's stacks "
                    "(py-spy dump), the odd one out first, and restart from the last checkpoint. The GPUs are fine.",
                    keep_firing_s=t.collective_window_s + t.collective_hang_for_s + HOLD_MARGIN_S,
                ),
            ],
        ),
        Group(
            # tickets and information over windows or `for:` of 10 minutes or more: evaluated every 5 minutes, not
            # every minute (at 10,000 nodes they were a fifth of the alert rules' CPU; issue 38, docs/benchmarks.md)
            SUSTAINED_GROUP,
            [
                Rule(
                    "GpuwardenPowerCapSustained",
                    f"{throttle('sw_power_cap', t.power_cap_for_s)} > {t.power_cap_ratio:g}",
                    "info",
                    "A GPU runs at its power cap.",
                    f"{gpu} was power-capped {{{{ $value | humanizePercentage }}}} of the time; normal at full load, "
                    "worth a look if the limit was lowered.",
                    0,
                ),
                Rule(
                    "GpuwardenPerformanceStateDegraded",
                    f"min_over_time(gpuwarden_performance_state{{{s}}}[{duration(t.pstate_for_s)}]) "
                    f">= {t.pstate_degraded_min} and on (instance, uuid) {busy(t.pstate_for_s)} "
                    f"> {t.pstate_busy_ratio:g} and on (instance, uuid) "
                    f'gpuwarden_gpu_info{{{s},name!~"{t.pstate_exempt_name_regex}"}}',
                    "warning",
                    "A busy GPU is stuck in a low performance state.",
                    f"{gpu} has been in P{{{{ $value }}}} or lower while busy; check clock-event reasons, power and "
                    "thermals, and application clocks.",
                    300,
                ),
                Rule(
                    "GpuwardenUnderutilized",
                    f"{busy(t.utilization_for_s)} < {t.utilization_low_ratio:g} "
                    f"and on (instance, uuid) gpuwarden_processes{{{s}}} > 0",
                    "info",
                    "A GPU holding a job is mostly idle.",
                    f"{gpu} ran kernels only {{{{ $value | humanizePercentage }}}} of the time while a job held it; "
                    "the job starves on input (DataLoader workers, pin_memory, local caching), communication or "
                    "checkpoints: profile it.",
                    300,
                ),
                Rule(
                    "GpuwardenNvlinkReplayRecovery",
                    f'increase(gpuwarden_nvlink_gpu_errors_total{{{s},type=~"replay|recovery"}}[15m]) > 0',
                    "warning",
                    "A GPU's NVLinks needed replays or recovery.",
                    f"The NVLinks of {gpu} logged {{{{ $labels.type }}}} errors; watch them and reset the GPU at the "
                    "next maintenance window if they continue.",
                ),
                Rule(
                    "GpuwardenGpuCountDropped",
                    # against the node's expected count where it is set (a fact that survives restarts), else
                    # against the most GPUs the node showed in gpu_count_memory_s, grouped by node so that a
                    # restarted exporter (a new instance) does not forget the GPUs it never saw
                    # (the most seen: max_over_time of the raw series, then the node label, not a [24h:1m] subquery
                    # of the relabelled one: 2.2x less CPU and 426x fewer points held at 1,000 nodes, issue 38)
                    # (and over the recorded maxima, HISTORY_GROUP: 144 points a node a day, not 5,760)
                    f"(gpuwarden_gpus_expected{{{s}}} - gpuwarden_gpus{{{s}}} > 0) or on (node) ("
                    f"max by (node) (max_over_time({NODE_GPUS_MAX}[{duration(t.gpu_count_memory_s)}]))"
                    f" - max by (node) ({nodeish(f'gpuwarden_gpus{{{s}}}')}) "
                    f"> 0 unless on (node) {nodeish(f'gpuwarden_gpus_expected{{{s}}}')})",
                    "warning",
                    "A GPU disappeared from a node.",
                    f"{{{{ $value }}}} GPU(s) fewer are visible on {NODE} than it should have "
                    f"(gpuwarden_gpus_expected, or the most seen in the last {duration(t.gpu_count_memory_s)}); check "
                    "nvidia-smi and dmesg for a GPU that fell off the bus, then cordon and reseat it.",
                    600,
                ),
                Rule(
                    "GpuwardenPowerLimitReduced",
                    f"gpuwarden_power_limit_watts{{{s}}} < gpuwarden_power_default_limit_watts{{{s}}}",
                    "warning",
                    "A GPU's power limit is below its default.",
                    f"{gpu} is limited to {{{{ $value }}}} W, below its default; restore it with nvidia-smi -pl or "
                    "find the out-of-band limiter (BMC).",
                    t.power_limit_reduced_for_s,
                ),
                Rule(
                    "GpuwardenNvlinkCrcErrorsHigh",
                    f'rate(gpuwarden_nvlink_gpu_errors_total{{{s},type="crc_flit"}}[5m]) > {t.nvlink_crc_per_second:g}',
                    "warning",
                    "A GPU's NVLinks have a high CRC error rate.",
                    f"The NVLinks of {gpu} have {{{{ $value }}}} CRC errors/s together; find the link (/api/v1/gpus "
                    "or the nvlink_links group), schedule a reset and check it at the next maintenance window.",
                    t.nvlink_crc_for_s,
                ),
                Rule(
                    "GpuwardenPcieReplaysHigh",
                    f"rate(gpuwarden_pcie_replay_errors_total{{{s}}}[5m]) * 60 > {t.pcie_replays_per_minute:g}",
                    "warning",
                    "A GPU's PCIe link is replaying packets.",
                    f"{gpu} replays {{{{ $value | humanize }}}} PCIe packets per minute; check seating, risers and "
                    "cables.",
                    t.pcie_replays_for_s,
                ),
            ],
            interval_s=sustained_interval(
                t.power_cap_for_s,
                t.pstate_for_s,
                t.utilization_for_s,
                900,
                600,
                t.power_limit_reduced_for_s,
                t.nvlink_crc_for_s,
                t.pcie_replays_for_s,
            ),
        ),
        Group(
            HISTORY_GROUP,
            records=[
                Record(
                    NVLINK_ACTIVE_MAX,
                    f"max by (uuid) (max_over_time(gpuwarden_nvlink_active_links{{{s}}}[{HISTORY_WINDOW}]))",
                ),
                Record(NODE_GPUS_MAX, f"max by (node) ({nodeish_over(f'gpuwarden_gpus{{{s}}}', HISTORY_WINDOW)})"),
            ],
            interval_s=HISTORY_INTERVAL_S,
        ),
        Group(
            "gpuwarden-configuration",
            [
                Rule(
                    "GpuwardenPersistenceModeOff",
                    f"gpuwarden_persistence_mode_enabled{{{s}}} == 0",
                    "warning",
                    "A GPU runs without persistence mode.",
                    f"{gpu} has persistence mode off, so driver state is torn down between jobs; enable "
                    "nvidia-persistenced (or nvidia-smi -pm 1).",
                    t.persistence_off_for_s,
                ),
            ],
            interval_s=sustained_interval(t.persistence_off_for_s),
        ),
    ]


def anchor(alert: str) -> str:
    """The docs/runbooks.md heading anchor of an alert ('## GpuwardenGpuLost' → 'gpuwardengpulost')."""
    return alert.lower()
