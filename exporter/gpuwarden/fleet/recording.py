"""Recording rules that pre-aggregate what the fleet's utilization view asks for: the model the view reads its record
names from (`python alert_rules/generate.py` writes alert_rules/gpuwarden.recording.yaml from it; tests/test_fleet.py
fails when the committed file drifts).

Without them every page view scans every GPU's counters over the window and joins them per GPU (75 M samples at
10,000 nodes). With them, Prometheus (or vmalert) evaluates the 5-minute rates once a minute into a series per node
and per namespace, and the view integrates those over the window: `sum_over_time(rate) × interval` is the window's
increase, counted only where the node was seen. Per-GPU series are recorded only for idle and starved GPUs, the
few a list needs; the idle seconds by bottleneck class (GPM) are summed per class. Target labels (job, instance,
node, cluster) are kept with `without (gpu, uuid)`, so the fleet's selector matches the recorded series as it
matches the raw ones.
"""

from __future__ import annotations

from typing import Any

from gpuwarden.health.checks import CHECKS
from gpuwarden.health.rules import build
from gpuwarden.health.thresholds import DEFAULT

# The groups' evaluation intervals. The records the views integrate over a window (sum_over_time(rate) × interval:
# every window is 5 minutes or more) are written every 5 minutes, as often as their 5-minute rates change whole: at
# 10,000 nodes these records were the largest share of all the rules' CPU (issue 38; issue 51, docs/benchmarks.md,
# Rules). The GPUs' non-ok verdicts, which the health view reads at an instant, are written every two minutes: an
# instant read sees a series for 5 minutes (Prometheus' lookback), so a record must come back well within it, and
# those answers are up to two minutes old. The inventory (models, memory, classes) and the cordon findings (which
# re-run the critical pages' expressions: at 10,000 nodes the costliest of these records) are written every 5
# minutes too, and the views read each one's latest record within its interval and a margin (`latest`): an operator
# reviews a cordon candidate before draining, and the pages themselves keep their own groups' intervals.
INTERVAL_S = 300  # the recorded groups' but health's (the fleet's --recording-interval default)
HEALTH_INTERVAL_S = 120
LATEST_MARGIN_S = 60  # past a record's interval: its next evaluation is written (seconds at scale)

SAMPLED = "gpuwarden:node_sampled_seconds:rate5m"
BUSY = "gpuwarden:node_busy_seconds:rate5m"
GPUS = "gpuwarden:node_gpus:count"
NS_SAMPLED = "gpuwarden:namespace_sampled_seconds:rate5m"
NS_IDLE = "gpuwarden:namespace_idle_seconds:rate5m"
GPU_IDLE = "gpuwarden:gpu_idle_ratio:rate5m"
GPU_STARVED = "gpuwarden:gpu_starved_ratio:rate5m"
CLASS_IDLE = "gpuwarden:class_idle_seconds:rate5m"
HEALTH = "gpuwarden:gpu_health:nonzero"
NODE_MODELS = "gpuwarden:node_gpus_by_model:count"
NODE_MEMORY = "gpuwarden:node_memory_bytes_by_model:max"
NODE_CLASSES = "gpuwarden:node_class_gpus:count"
NS_CLASSES = "gpuwarden:namespace_class_gpus:count"
CORDON = "gpuwarden:cordon_finding:active"
UTILIZATION_RECORDS = (BUSY, SAMPLED, GPUS, GPU_IDLE, GPU_STARVED, NS_IDLE, NS_SAMPLED, CLASS_IDLE, NODE_CLASSES,
                       NS_CLASSES)  # fmt: skip
# Three groups, so that no group's evaluation takes more than a small share of its interval at 10,000 nodes (one
# group of everything took 26 %, issue 38; Prometheus and vmalert evaluate groups side by side): name → (records,
# interval). Records that a view compares evaluation by evaluation share a group, which evaluates them at the same
# instants: a GPU is idle "throughout" when its idle record was written at every evaluation of its node's GPU count
# (GPUS with GPU_IDLE and GPU_STARVED; in two groups, one group's extra evaluation in the window dropped a whole node
# from the list).
GROUPS = {
    "gpuwarden-fleet-utilization": ((SAMPLED, BUSY, NS_SAMPLED, NS_IDLE), INTERVAL_S),
    "gpuwarden-fleet-classes": ((GPUS, GPU_IDLE, GPU_STARVED, CLASS_IDLE), INTERVAL_S),
    "gpuwarden-fleet-inventory": ((NODE_MODELS, NODE_MEMORY, NODE_CLASSES, NS_CLASSES, CORDON), INTERVAL_S),
    "gpuwarden-fleet-health": ((HEALTH,), HEALTH_INTERVAL_S),
}
# the records compared evaluation by evaluation (views: the idle and starved lists, and seen minus busy)
EVALUATED_TOGETHER = ((GPUS, GPU_IDLE, GPU_STARVED), (SAMPLED, BUSY))
# the critical alert rules whose findings warrant draining a node (the fleet's cordon candidates)
CORDON_ACTIONS = {"cordon", "rma", "reset_gpu"}
# cordon rules not recorded: their expression scans a day of every GPU (NVLink); the fleet narrows them instead
NOT_RECORDED = {"GpuwardenNvlinkDown"}
# gpuwarden_gpu_info's labels that vary by GPU (the model, `name`, stays)
GPU_IDENTITY = "gpu, uuid, serial, pci_bus_id, vbios_version, compute_capability"
# per namespace: every label of the allocation but the GPU's and the holder's; target labels (job, cluster) stay
PER_GPU = "instance, node, gpu, uuid, pod, container"


def latest(record: str, selector: str, interval_s: float) -> str:
    """`record`'s latest sample within its group's interval and a margin: Prometheus' 5-minute lookback does not
    bridge a record written every 5 minutes while its next evaluation is under way. A series that stopped being
    recorded is read for up to that margin after its last record."""
    return f"last_over_time({record}{{{selector}}}[{round(interval_s + LATEST_MARGIN_S)}s])"


def rules(
    selector: str = 'job="gpuwarden"', idle_ratio: float = DEFAULT.utilization_low_ratio, rate_window: str = "5m"
) -> list[dict[str, Any]]:
    """The recording rules, over the series `selector` matches. `rate_window` is 5m as shipped (and in the names);
    a test with minutes of history uses a shorter one, since rate() over 5 m of 40 s of data divides by 300 s."""
    sampled = f"rate(gpuwarden_utilization_sampled_seconds_total{{{selector}}}[{rate_window}])"
    busy = f"rate(gpuwarden_busy_seconds_total{{{selector}}}[{rate_window}])"
    idle = f"clamp_min({sampled} - on (instance, uuid) {busy}, 0)"
    allocation = f"gpuwarden_gpu_allocation{{{selector}}}"
    share = f"({allocation} / on (instance, uuid) group_left () count by (instance, uuid) ({allocation}))"
    # a GPU whose sampled seconds did not move in 5 m (the first evaluations after a start) is at 0, not NaN: a NaN
    # would drop it from the idle series for one evaluation while its node was counted, and "idle throughout" fail
    util = f"clamp_max({busy} / clamp_min({sampled}, 1e-9), 1)"
    return [
        {"record": SAMPLED, "expr": f"sum without (gpu, uuid) ({sampled})"},
        {"record": BUSY, "expr": f"sum without (gpu, uuid) ({busy})"},
        {"record": GPUS, "expr": f"count without (gpu, uuid) ({sampled})"},
        {
            "record": NS_SAMPLED,
            "expr": f"sum without ({PER_GPU}) ({sampled} * on (instance, uuid) group_right () {share})",
        },
        {"record": NS_IDLE, "expr": f"sum without ({PER_GPU}) ({idle} * on (instance, uuid) group_right () {share})"},
        {
            # seconds no kernel ran, by the bottleneck class (GPM) each GPU was in at each evaluation
            "record": CLASS_IDLE,
            # the info series on the left keeps the target labels: a one-to-one match `on` keeps only its labels
            "expr": f"sum without (instance, node, gpu, uuid) (gpuwarden_bottleneck_info{{{selector}}} "
            f"* on (instance, uuid) group_left () {idle})",
        },
        # what the overview reads at an instant, a series per node (or per unhealthy GPU) instead of per GPU: at
        # 10,000 nodes each per-GPU selection is 80,000 series (~0.5 s of Prometheus' CPU), the page read 2.6 M
        {"record": NODE_MODELS, "expr": f"count without ({GPU_IDENTITY}) (gpuwarden_gpu_info{{{selector}}})"},
        {
            "record": NODE_MEMORY,
            "expr": f"max without (gpu, uuid) (gpuwarden_memory_total_bytes{{{selector}}} "
            f"* on (instance, uuid) group_left (name) gpuwarden_gpu_info{{{selector}}})",
        },
        {"record": NODE_CLASSES, "expr": f"count without (gpu, uuid) (gpuwarden_bottleneck_info{{{selector}}})"},
        {
            "record": NS_CLASSES,
            "expr": f"count without (instance, node, gpu, uuid) (gpuwarden_bottleneck_info{{{selector}}} "
            f"* on (instance, uuid) group_left (namespace) max by (instance, uuid, namespace) ({allocation}))",
        },
        *health_rules(selector),
        *cordon_rules(selector),
        {
            "record": GPU_IDLE,
            "expr": f"{util} < {idle_ratio:g} and on (instance, uuid) gpuwarden_processes{{{selector}}} == 0",
        },
        {
            "record": GPU_STARVED,
            "expr": f"{util} < {idle_ratio:g} and on (instance, uuid) gpuwarden_processes{{{selector}}} > 0",
        },
    ]


def check_partitions() -> list[tuple[str, str]]:
    """(name, matcher) for each health check, and one for the checks this release does not know: what selects
    gpuwarden_health one check at a time. A selection over every check is 14 series per GPU, past VictoriaMetrics'
    default series limit (300,000) at ~2,700 nodes; a check alone is one series per GPU. Check names are plain
    identifiers (exporter/gpuwarden/health/checks.py), so they need no quoting beyond the double quotes."""
    known = "|".join(CHECKS)
    return [(check, f'check="{check}"') for check in CHECKS] + [("other", f'check!~"{known}"')]


def health_rules(selector: str) -> list[dict[str, Any]]:
    """The GPUs' non-ok verdicts, one rule per check partition (check_partitions: vmalert's query for one rule over
    every check would hit VictoriaMetrics' series limit)."""
    # the static label tells the rules apart for promtool's lint (same name, same labels is "duplicate")
    return [
        {"record": HEALTH, "expr": f"gpuwarden_health{{{selector},{part}}} > 0", "labels": {"health_rule": name}}
        for name, part in check_partitions()
    ]


def cordon_rules(selector: str) -> list[dict[str, Any]]:
    """The critical hardware alert rules' findings (their expressions without `for:`, or the longer hold a finding
    has, as a critical XID's day), recorded with the alert's name: the
    cordon candidates read a few series instead of evaluating ~730,000 at 10,000 nodes on each view."""
    return [
        {"record": CORDON, "expr": rule.finding, "labels": {"alertname": rule.alert}}
        for group in build(selector=selector)
        for rule in group.rules
        if rule.action in CORDON_ACTIONS and rule.severity == "critical" and rule.alert not in NOT_RECORDED
    ]
