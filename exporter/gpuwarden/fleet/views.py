"""What each fleet endpoint answers, built from instant queries that Prometheus aggregates.

Every query is bounded: aggregated by node (a series per node, not per GPU), or filtered to the GPUs that are
unhealthy, idle or starved. Nothing pulls raw per-GPU series or ranges. The hardware findings behind cordon
candidates are the alert rules' own expressions (exporter/gpuwarden/health/rules.py), so the fleet view and the pages
agree.
"""

from __future__ import annotations

import asyncio
import re
import shlex
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import recording, stragglers
from gpuwarden.fleet.planner import USABLE_MEMORY_RATIO, Plan
from gpuwarden.fleet.prometheus import PrometheusClient, Series, promql_string
from gpuwarden.fleet.settings import FleetSettings
from gpuwarden.health.rules import RUNBOOK_BASE, Rule, anchor, build

CORDON_ACTIONS = recording.CORDON_ACTIONS
# Rules whose expression scans a long range of many series (NVLink: every GPU's active links over 1 d, to tell a
# GPU that lost all its links from one that never had any). The rule's own first condition, an instant
# comparison, finds the nodes that can match at all; the rule's expression then runs with the selector narrowed to
# them: the same answer, without scanning every GPU's day. (The spread max_over_time − min_over_time over 6 h
# narrowed before: 115 M samples at 10,000 nodes scraped every 15 s. `changes()` before that: VictoriaMetrics
# counts a series' first sample as a change, so there it matched every GPU.)
NARROWING = {"GpuwardenNvlinkDown": "gpuwarden_nvlink_active_links{{{sel}}} < gpuwarden_nvlink_links{{{sel}}}"}
MAX_NARROWED_INSTANCES = 200
ACTION_ORDER = {"rma": 0, "cordon": 1, "reset_gpu": 2}


@dataclass(frozen=True)
class FleetQueries:
    """What every view needs: the Prometheus client, the selector and node label, concurrent evaluation."""

    client: PrometheusClient
    settings: FleetSettings

    @property
    def selector(self) -> str:
        return self.settings.selector

    @property
    def node_label(self) -> str:
        return self.settings.node_label

    async def many(self, *exprs: str, at: float | None = None) -> list[list[Series]]:
        """Evaluate the queries of one answer concurrently, at one instant (default: the current evaluation time)."""
        at = self.client.evaluation_time() if at is None else at
        return list(await asyncio.gather(*(self.client.query(e, at) for e in exprs)))

    def node(self, series: Series) -> str:
        """The series' node; a page for a lasting fault has no `instance` but always a `node` (the instance where
        the scrape gave none: health.rules.held), whatever --node-label names."""
        return series.labels.get(self.node_label) or series.labels.get("node", "")

    async def _recorded(self, *records: str) -> Recorded:
        """Whether this release's recording rules (alert_rules/gpuwarden.recording.yaml) can answer for `records`:
        their per-node model counts exist where we ask (an older rule file lacks them, and its absent health series
        would read as a healthy fleet), and the backend does not report any rule recording them as failing (a
        series limit can fail the health or cordon rules alone: their absent series would read as "healthy" too).
        Each view asks for the records it reads, so one failing rule sends only its views to the raw series."""
        if self.settings.recording_rules == "off":
            return Recorded(False)
        (found,) = await self.many(f"count({recording.NODE_MODELS}{{{self.selector}}})")
        if not (found and found[0].value > 0):
            return Recorded(False)
        health = await self.client.rule_health()
        if health is None:
            return Recorded(True, "rule health not listed by the backend")
        failing = {name: health[name] for name in records if health.get(name)}
        if failing:
            name, error = next(iter(sorted(failing.items())))
            return Recorded(False, f"recording rule {name} is failing on the backend ({error})")
        return Recorded(True)


@dataclass(frozen=True)
class Recorded:
    """Whether a view reads recorded series, and why not (or what is unknown), for its `source`."""

    use: bool
    note: str = ""

    def __bool__(self) -> bool:
        return self.use


class InventoryView(FleetQueries):
    """Nodes, GPUs, models, drivers and exporter versions; which exporters are stale."""

    async def inventory(self) -> dict[str, Any]:
        sel, node_label = self.selector, self.node_label
        recorded = await self._recorded(recording.NODE_MODELS, recording.NODE_MEMORY)
        up, models, memory, drivers, versions, nvml, age, visible = await self.many(
            f"max by ({node_label}) (up{{{sel}}})",
            f"sum by ({node_label}, name) ({recording.NODE_MODELS}{{{sel}}})"
            if recorded
            else f"count by ({node_label}, name) (gpuwarden_gpu_info{{{sel}}})",
            f"max by ({node_label}, name) ({recording.NODE_MEMORY}{{{sel}}})"
            if recorded
            else f"max by ({node_label}, name) (gpuwarden_memory_total_bytes{{{sel}}} "
            f"* on (instance, uuid) group_left (name) gpuwarden_gpu_info{{{sel}}})",
            f"max by ({node_label}, driver_version, cuda_driver_version) (gpuwarden_driver_info{{{sel}}})",
            f"max by ({node_label}, version) (gpuwarden_build_info{{{sel}}})",
            f"max by ({node_label}) (gpuwarden_nvml_up{{{sel}}})",
            f'time() - max by ({node_label}) (gpuwarden_last_collect_timestamp_seconds{{{sel},tier="fast"}})',
            f"max by ({node_label}) (gpuwarden_gpus{{{sel}}})",
        )
        nodes: dict[str, dict[str, Any]] = defaultdict(
            lambda: {
                "gpus": 0,
                "models": {},
                "memory_bytes": {},
                "driver_version": None,
                "cuda_driver_version": None,
                "exporter_version": None,
                "exporter_up": False,
                "nvml_up": None,
                "last_poll_age_seconds": None,
                "gpus_visible": None,
            }
        )
        for row in up:
            nodes[self.node(row)]["exporter_up"] = row.value == 1
        for row in models:
            entry = nodes[self.node(row)]
            entry["models"][row.labels.get("name", "")] = int(row.value)
            entry["gpus"] += int(row.value)
        for row in memory:
            nodes[self.node(row)]["memory_bytes"][row.labels.get("name", "")] = row.value
        for row in drivers:
            nodes[self.node(row)].update(
                driver_version=row.labels.get("driver_version"),
                cuda_driver_version=row.labels.get("cuda_driver_version"),
            )
        for row in versions:
            nodes[self.node(row)]["exporter_version"] = row.labels.get("version")
        for row in nvml:
            nodes[self.node(row)]["nvml_up"] = row.value == 1
        for row in age:
            nodes[self.node(row)]["last_poll_age_seconds"] = round(row.value, 1)
        for row in visible:
            nodes[self.node(row)]["gpus_visible"] = int(row.value)
        stale = []
        for name, entry in nodes.items():
            reason = self._staleness(entry)
            entry["state"] = reason or "ok"
            if reason:
                stale.append({"node": name, "reason": reason, "last_poll_age_seconds": entry["last_poll_age_seconds"]})
        by_model: dict[str, dict[str, Any]] = {}
        for entry in nodes.values():
            for model, count in entry["models"].items():
                item = by_model.setdefault(model, {"gpus": 0, "nodes": 0, "memory_bytes": 0.0})
                item["gpus"] += count
                item["nodes"] += 1
                item["memory_bytes"] = max(item["memory_bytes"], entry["memory_bytes"].get(model, 0.0))
        return {
            "nodes": [{"node": name, **entry} for name, entry in sorted(nodes.items())],
            "totals": {
                "nodes": len(nodes),
                "gpus": sum(e["gpus"] for e in nodes.values()),
                "models": dict(sorted(by_model.items())),
                "driver_versions": _tally(e["driver_version"] for e in nodes.values()),
                "exporter_versions": _tally(e["exporter_version"] for e in nodes.values()),
            },
            "stale_exporters": sorted(stale, key=lambda x: x["node"]),
            "source": _source(recorded, "models and memory"),
        }

    def _staleness(self, entry: dict[str, Any]) -> str | None:
        if not entry["exporter_up"]:
            return "exporter down (scrape failing)"
        if entry["nvml_up"] is False:
            return "nvml down on the node"
        age = entry["last_poll_age_seconds"]
        if age is not None and age > self.settings.stale_after:
            return f"last fast poll {age:.0f} s ago"
        return None


class HealthView(FleetQueries):
    """Unhealthy GPUs with their checks and since when; nodes whose alerts warrant a cordon."""

    async def health(self) -> dict[str, Any]:
        sel = self.selector
        # Durations are as of the instant the queries describe, not the moment of answering: a cached answer
        # repeated a second later must say the same (it said 15 s, then 16 s, before).
        now = self.client.evaluation_time()
        # with the recording rules, the non-ok verdicts are already a series each (up to an evaluation interval
        # old); without them, one query per check, as the rules do it (recording.check_partitions: VictoriaMetrics'
        # series limit)
        recorded = await self._recorded(recording.HEALTH)
        verdicts = (
            [f"{recording.HEALTH}{{{sel}}}"]
            if recorded
            else [f"gpuwarden_health{{{sel},{part}}} > 0" for _, part in recording.check_partitions()]
        )
        down, since, *per_check = await self.many(
            f"up{{{sel}}} == 0",
            # present only while a check is not ok: a handful of series, whatever the fleet's size
            f"gpuwarden_health_since_timestamp_seconds{{{sel}}}",
            *verdicts,
            at=now,
        )
        unhealthy = [row for rows in per_check for row in rows]
        began = {(self.node(r), r.labels.get("uuid"), r.labels.get("check")): r.value for r in since}
        gpus: dict[tuple[str, str], dict[str, Any]] = {}
        for row in unhealthy:
            node, uuid = self.node(row), row.labels.get("uuid", "")
            gpu = gpus.setdefault(
                (node, uuid),
                {"node": node, "gpu": row.labels.get("gpu"), "uuid": uuid, "severity": "warning", "checks": []},
            )
            level = int(row.value)
            started = began.get((node, uuid, row.labels.get("check")))
            gpu["checks"].append(
                {
                    "check": row.labels.get("check"),
                    "level": level,
                    "severity": "critical" if level >= 2 else "warning",
                    "since": started,
                    "for_seconds": round(now - started, 0) if started else None,
                }
            )
            if level >= 2:
                gpu["severity"] = "critical"
        for gpu in gpus.values():
            gpu["checks"].sort(key=lambda c: (-c["level"], c["check"]))
            known = [c["since"] for c in gpu["checks"] if c["since"]]
            gpu["since"] = min(known) if known else None
        ordered = sorted(gpus.values(), key=lambda g: (g["severity"] != "critical", g["node"], g["gpu"] or ""))
        return {
            "unhealthy_gpus": ordered,
            "counts": {
                "critical": sum(g["severity"] == "critical" for g in ordered),
                "warning": sum(g["severity"] == "warning" for g in ordered),
            },
            "unknown_nodes": sorted({self.node(r) for r in down}),
            "source": _source(recorded, "verdicts (up to one evaluation interval old)"),
            "note": "since: when the exporter first judged the current level (restarts with the exporter)",
        }

    # -- cordon candidates ----------------------------------------------------------------------------------------

    async def cordon_candidates(self) -> dict[str, Any]:
        """Nodes to drain: the critical rules that name an action, evaluated now (not waiting for `for:`), each
        finding beside whether its alert fires, and the commands to run after review."""
        rules = self._cordon_rules()
        recorded = await self._recorded(recording.CORDON)
        exprs, findings = await self._cordon_expressions(rules, recorded)
        names = "|".join(r.alert for r in rules)
        *asked, firing = await self.many(
            *exprs.values(), f'ALERTS{{{self.selector},alertstate="firing",alertname=~"{names}"}}'
        )
        answered = dict(zip(exprs, asked, strict=True))
        answers = [answered[r.alert] if r.alert in answered else findings[r.alert] for r in rules]
        nodes = self._findings_by_node(rules, answers, _fired(firing))
        return {
            "candidates": _drain_entries(nodes),
            "rules": [r.alert for r in rules],
            "source": _source(recorded, "findings of every rule but NVLink's (up to one evaluation interval old)"),
            "note": "instant evaluation of the alert expressions, without their `for:` durations; "
            "alert_firing says whether the alert itself fires in this Prometheus (its `for:` has passed; "
            "needs the rules loaded there). Review before draining. The commands are printed, never run.",
        }

    def _cordon_rules(self, selector: str | None = None) -> list[Rule]:
        """The critical alert rules whose action is cordon, rma or reset_gpu, over `selector` (default: the fleet's)."""
        return [
            r
            for g in build(selector=selector or self.selector)
            for r in g.rules
            if r.action in CORDON_ACTIONS and r.severity == "critical"
        ]

    async def _cordon_expressions(
        self, rules: list[Rule], recorded: Recorded
    ) -> tuple[dict[str, str], dict[str, list[Series]]]:
        """What to ask now per alert, and the findings the recording rules already hold for the others.

        Recorded: every rule but the unrecorded ones is answered by its record. Otherwise a rule with a cheap
        narrowing query is evaluated only on the instances that query finds (none: an empty answer, no scan)."""
        narrowable = [r.alert for r in rules if r.alert in NARROWING]
        first = await self.many(
            *(NARROWING[alert].format(sel=self.selector) for alert in narrowable),
            # the rules' expressions as the recording rules last evaluated them (up to an evaluation interval old)
            *([f"{recording.CORDON}{{{self.selector}}}"] if recorded else []),
        )
        narrowed = dict(zip(narrowable, first[: len(narrowable)], strict=True))
        findings: dict[str, list[Series]] = defaultdict(list)
        for row in first[-1] if recorded else []:
            findings[row.labels.get("alertname", "")].append(row)
        exprs: dict[str, str] = {}  # alert → the expression asked now; the others are answered by `findings`
        for rule in rules:
            if recorded and rule.alert not in recording.NOT_RECORDED:
                continue
            if rule.alert not in narrowed:
                exprs[rule.alert] = rule.finding
                continue
            instances = sorted({row.labels.get("instance", "") for row in narrowed[rule.alert]})
            if not instances:
                exprs[rule.alert] = "vector(0) < 0"  # nothing can match: an empty answer without a scan
            elif len(instances) > MAX_NARROWED_INSTANCES:
                exprs[rule.alert] = rule.finding
            else:
                regex = "|".join(re.escape(i) for i in instances)
                narrow = f"{self.selector},instance=~{promql_string(regex)}"
                exprs[rule.alert] = next(r.finding for r in self._cordon_rules(narrow) if r.alert == rule.alert)
        return exprs, findings

    def _findings_by_node(
        self, rules: list[Rule], answers: list[list[Series]], fired: set[tuple[str | None, ...]]
    ) -> dict[str, dict[str, Any]]:
        """Each answered row as a finding of its node, with whether its alert fires."""
        nodes: dict[str, dict[str, Any]] = {}
        for rule, rows in zip(rules, answers, strict=True):
            for row in rows:
                node = self.node(row)
                entry = nodes.setdefault(node, {"node": node, "findings": []})
                labels = {k: v for k, v in row.labels.items() if k in ("gpu", "uuid", "xid", "link", "type")}
                entry["findings"].append(
                    {
                        "alert": rule.alert,
                        "summary": rule.summary,
                        "action": rule.action,
                        "labels": labels,
                        "value": row.value,
                        "query": rule.finding,
                        "alert_firing": _alert_key(rule.alert, row) in fired,
                        "runbook_url": f"{RUNBOOK_BASE}#{anchor(rule.alert)}",
                    }
                )
        return nodes


def _alert_key(alert: str | None, row: Series) -> tuple[str | None, ...]:
    """What tells one firing alert from another of the same rule: its instance, GPU, link and XID."""
    return (alert, *(row.labels.get(k) for k in ("instance", "uuid", "link", "xid")))


def _fired(firing: list[Series]) -> set[tuple[str | None, ...]]:
    """The alerts' own state where this Prometheus evaluates the rules: firing = past its `for:` duration."""
    return {_alert_key(row.labels.get("alertname"), row) for row in firing}


def _drain_entries(nodes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per node, worst action first: its findings, its GPUs and the commands to run after review."""
    out = []
    for node, entry in nodes.items():
        entry["findings"].sort(key=lambda f: (ACTION_ORDER.get(f["action"], 9), f["alert"]))
        name = shlex.quote(_node_name(node))
        entry["commands"] = [
            f"kubectl cordon {name}",
            f"kubectl drain {name} --ignore-daemonsets --delete-emptydir-data --timeout=15m",
        ]
        entry["gpus"] = sorted({f["labels"].get("gpu", "") for f in entry["findings"]} - {""})
        out.append(entry)
    out.sort(key=lambda e: (min(ACTION_ORDER.get(f["action"], 9) for f in e["findings"]), e["node"]))
    return out


class UtilizationView(FleetQueries):
    """Idle and starved GPUs, GPU-hours seen and wasted by node and namespace; which GPUs fit a plan."""

    def _util(self, window: str) -> str:
        sel = self.selector
        return (
            f"clamp_max(rate(gpuwarden_busy_seconds_total{{{sel}}}[{window}]) "
            f"/ rate(gpuwarden_utilization_sampled_seconds_total{{{sel}}}[{window}]), 1)"
        )

    def _raw_queries(self, window: str, limit: int) -> tuple[list[str], str]:
        """The utilization queries over the raw per-GPU counters: exact, and what costs at scale."""
        sel, node_label, util = self.selector, self.node_label, self._util(window)
        idle_ratio = self.settings.idle_ratio
        sampled = f"increase(gpuwarden_utilization_sampled_seconds_total{{{sel}}}[{window}])"
        idle_s = f"clamp_min({sampled} - increase(gpuwarden_busy_seconds_total{{{sel}}}[{window}]), 0)"
        alloc = f"max_over_time(gpuwarden_gpu_allocation{{{sel}}}[{window}])"
        share = f"({alloc} / on (instance, uuid) group_left () count by (instance, uuid) ({alloc}))"
        idle_expr = (
            f"{util} < {idle_ratio:g} and on (instance, uuid) "
            f"max_over_time(gpuwarden_processes{{{sel}}}[{window}]) == 0"
        )
        starved_expr = (
            f"{util} < {idle_ratio:g} and on (instance, uuid) min_over_time(gpuwarden_processes{{{sel}}}[{window}]) > 0"
        )
        return [
            f"sum by ({node_label}) ({sampled})",
            f"sum by ({node_label}) ({idle_s})",
            f"count by ({node_label}) ({util})",
            f"avg by ({node_label}) ({util})",
            f"bottomk({limit}, {idle_expr})",
            f"bottomk({limit}, {starved_expr})",
            f"count({idle_expr})",
            f"count({starved_expr})",
            f"sum by (namespace) ({idle_s} * on (instance, uuid) group_right () {share})",
            f"sum by (namespace) ({sampled} * on (instance, uuid) group_right () {share})",
        ], idle_s

    async def recording_step(self, record: str) -> float:
        """The interval of the group recording `record`: as the backend lists it, else --recording-interval."""
        listed = await self.client.record_interval(record)
        return listed if listed is not None else float(self.settings.recording_interval)

    def _recorded_queries(self, window: str, limit: int, step: float) -> list[str]:
        """The same answers from the recording rules: sums of recorded rates times the rules' interval (`step`) are
        the window's increases; a GPU is idle (starved) when it was so at every evaluation its node was recorded."""
        sel, node_label = self.selector, self.node_label

        def total(name: str) -> str:
            return f"sum_over_time({name}{{{sel}}}[{window}])"

        seen, busy = total(recording.SAMPLED), total(recording.BUSY)
        evaluations = f"count_over_time({recording.GPUS}{{{sel}}}[{window}])"

        def throughout(name: str) -> str:
            return (
                f"avg_over_time({name}{{{sel}}}[{window}]) and on (instance, uuid) "
                f"(count_over_time({name}{{{sel}}}[{window}]) >= on (instance) group_left () {evaluations})"
            )

        def by_namespace(name: str) -> str:
            return f"sum by (namespace) (sum_over_time({name}{{{sel}}}[{window}])) * {step:g}"

        return [
            f"sum by ({node_label}) ({seen}) * {step:g}",
            f"sum by ({node_label}) (clamp_min({seen} - {busy}, 0)) * {step:g}",
            f"max by ({node_label}) (max_over_time({recording.GPUS}{{{sel}}}[{window}]))",
            f"sum by ({node_label}) ({busy}) / sum by ({node_label}) ({seen})",
            f"bottomk({limit}, {throughout(recording.GPU_IDLE)})",
            f"bottomk({limit}, {throughout(recording.GPU_STARVED)})",
            f"count({throughout(recording.GPU_IDLE)})",
            f"count({throughout(recording.GPU_STARVED)})",
            by_namespace(recording.NS_IDLE),
            by_namespace(recording.NS_SAMPLED),
        ]

    async def utilization(self, window: str, limit: int) -> dict[str, Any]:
        """Hours come from the utilization counters themselves (seconds sampled, seconds busy), so a GPU seen for
        part of the window counts only the part it was seen. From the recording rules where they are loaded."""
        recorded = await self._recorded(*recording.UTILIZATION_RECORDS)
        step = await self.recording_step(recording.SAMPLED) if recorded else 0.0  # and NS_*: the same group
        raw, idle_s = self._raw_queries(window, limit)
        (
            (
                observed,
                wasted_s,
                gpu_count,
                average,
                idle,
                starved,
                idle_count,
                starved_count,
                ns_wasted,
                ns_allocated,
            ),
            bottlenecks,
        ) = await asyncio.gather(
            self.many(*(self._recorded_queries(window, limit, step) if recorded else raw)),
            self.bottlenecks(window, idle_s, recorded),
        )
        idle_ratio = self.settings.idle_ratio
        price = self.settings.price_per_gpu_hour

        def hours(seconds: float) -> float:
            return round(seconds / 3600, 4)

        nodes: dict[str, dict[str, Any]] = {}

        def node_entry(row: Series) -> dict[str, Any]:
            return nodes.setdefault(self.node(row), {"node": self.node(row)})

        for row in gpu_count:
            node_entry(row)["gpus"] = int(row.value)
        for row in average:
            node_entry(row)["utilization"] = round(row.value, 4)
        for row in observed:
            node_entry(row)["gpu_hours"] = hours(row.value)
        for row in wasted_s:
            entry = node_entry(row)
            entry["wasted_gpu_hours"] = hours(row.value)
            entry["wasted_cost"] = round(row.value / 3600 * price, 2)

        def gpu_rows(rows: list[Series]) -> list[dict[str, Any]]:
            return sorted(
                (
                    {
                        "node": self.node(r),
                        "gpu": r.labels.get("gpu"),
                        "uuid": r.labels.get("uuid"),
                        "utilization": round(r.value, 4),
                    }
                    for r in rows
                ),
                key=lambda x: (x["node"], x["gpu"] or ""),
            )

        namespaces: dict[str, dict[str, Any]] = {}
        for row in ns_allocated:
            name = row.labels.get("namespace", "")
            namespaces.setdefault(name, {"namespace": name})["allocated_gpu_hours"] = hours(row.value)
        for row in ns_wasted:
            entry = namespaces.setdefault(row.labels.get("namespace", ""), {"namespace": row.labels.get("namespace")})
            entry["wasted_gpu_hours"] = hours(row.value)
            entry["wasted_cost"] = round(row.value / 3600 * price, 2)
        wasted = sum(r.value for r in wasted_s) / 3600
        ordered_nodes = sorted(nodes.values(), key=lambda e: -e.get("wasted_gpu_hours", 0.0))
        return {
            "source": "recording rules (alert_rules/gpuwarden.recording.yaml)"
            + (f"; {recorded.note}" if recorded.note else "")
            if recorded
            else f"raw series: {recorded.note}; every view scans every GPU's counters over the window"
            if recorded.note
            else "raw series: the recording rules (alert_rules/gpuwarden.recording.yaml) are not loaded in this "
            "Prometheus; every view scans every GPU's counters over the window (slow past ~1,000 nodes)",
            "bottlenecks": bottlenecks,
            "window": window,
            "idle_ratio": idle_ratio,
            "price_per_gpu_hour": price,
            "currency": self.settings.currency,
            "totals": {
                "gpus": sum(e.get("gpus", 0) for e in nodes.values()),
                "gpu_hours": hours(sum(r.value for r in observed)),
                "wasted_gpu_hours": round(wasted, 4),
                "wasted_cost": round(wasted * price, 2),
                "idle_gpus": int(idle_count[0].value) if idle_count else 0,
                "starved_gpus": int(starved_count[0].value) if starved_count else 0,
            },
            "listed": f"the {limit} least utilized idle and starved GPUs (?limit=)",
            "idle_gpus": gpu_rows(idle),
            "starved_gpus": gpu_rows(starved),
            "by_node": ordered_nodes[:limit],
            "by_namespace": sorted(namespaces.values(), key=lambda e: -e.get("wasted_gpu_hours", 0.0)),
            "definitions": {
                "utilization": "share of the window in which a kernel ran (busy / sampled seconds)",
                "idle": f"utilization < {idle_ratio:g} and no process on the GPU during the window",
                "starved": f"utilization < {idle_ratio:g} while a process held the GPU the whole window",
                "gpu_hours": "hours the driver sampled utilization in the window (a GPU seen for part of it counts "
                "that part)",
                "wasted_gpu_hours": "sampled minus busy hours: time no kernel ran",
                "by_namespace": "from gpuwarden_gpu_allocation (pod attribution): a GPU's hours go to the namespaces "
                "that held it during the window; a GPU shared by n containers counts 1/n to each",
            },
        }

    async def bottlenecks(self, window: str, idle_s: str, recorded: bool = False) -> dict[str, Any]:
        """GPUs per bottleneck class (GPM) now, by node and namespace, and the GPU-hours in the window in which no
        kernel ran by class: from the recording rules, each minute by the class the GPU was in then; from the raw
        series, the whole window by the class the GPU is in now (a scan of every GPU's counters)."""
        sel, node_label = self.selector, self.node_label
        info = f"gpuwarden_bottleneck_info{{{sel}}}"
        allocation = f"max by (instance, uuid, namespace) (gpuwarden_gpu_allocation{{{sel}}})"
        step = await self.recording_step(recording.CLASS_IDLE) if recorded else 0.0
        wasted_by_class = (
            f"sum by (class) (sum_over_time({recording.CLASS_IDLE}{{{sel}}}[{window}])) * {step:g}"
            if recorded
            else f"sum by (class) ({idle_s} * on (instance, uuid) group_left (class) {info})"
        )
        counts = (
            [
                f"sum by (class) ({recording.NODE_CLASSES}{{{sel}}})",
                f"sum by ({node_label}, class) ({recording.NODE_CLASSES}{{{sel}}})",
                f"sum by (namespace, class) ({recording.NS_CLASSES}{{{sel}}})",
            ]
            if recorded
            else [
                f"count by (class) ({info})",
                f"count by ({node_label}, class) ({info})",
                f"count by (namespace, class) ({info} * on (instance, uuid) group_left (namespace) {allocation})",
            ]
        )
        totals, by_node, by_namespace, wasted = await self.many(*counts, wasted_by_class)
        per_node: dict[str, dict[str, int]] = defaultdict(dict)
        for row in by_node:
            per_node[self.node(row)][row.labels.get("class", "")] = int(row.value)
        per_namespace: dict[str, dict[str, int]] = defaultdict(dict)
        for row in by_namespace:
            per_namespace[row.labels.get("namespace", "")][row.labels.get("class", "")] = int(row.value)
        return {
            "gpus_by_class": {row.labels.get("class", ""): int(row.value) for row in totals},
            "wasted_gpu_hours_by_class": {row.labels.get("class", ""): round(row.value / 3600, 4) for row in wasted},
            "by_node": [{"node": node, "classes": classes} for node, classes in sorted(per_node.items())],
            "by_namespace": [{"namespace": ns, "classes": classes} for ns, classes in sorted(per_namespace.items())],
            "definition": "gpuwarden_bottleneck_info (GPM, Hopper and newer): what each GPU's time went to over the "
            "exporter's bottleneck window; wasted hours are the window's hours with no kernel running, by the class "
            + ("the GPU was in at each minute (recording rules)" if recorded else "the GPU is in now (raw series)"),
        }

    # -- planner's fleet side ---------------------------------------------------------------------------------------

    async def fit(self, plan: Plan) -> list[dict[str, Any]]:
        sel = self.selector
        recorded = await self._recorded(recording.NODE_MODELS, recording.NODE_MEMORY)
        memory, counts = await self.many(
            f"max by (name) ({recording.NODE_MEMORY}{{{sel}}})"
            if recorded
            else f"max by (name) (gpuwarden_memory_total_bytes{{{sel}}} "
            f"* on (instance, uuid) group_left (name) gpuwarden_gpu_info{{{sel}}})",
            f"sum by (name) ({recording.NODE_MODELS}{{{sel}}})"
            if recorded
            else f"count by (name) (gpuwarden_gpu_info{{{sel}}})",
        )
        count = {r.labels.get("name", ""): int(r.value) for r in counts}
        out = []
        for row in memory:
            model = row.labels.get("name", "")
            usable = row.value * USABLE_MEMORY_RATIO
            out.append(
                {
                    "model": model,
                    "memory_bytes": row.value,
                    "usable_bytes": round(usable),
                    "gpus_in_fleet": count.get(model, 0),
                    "fits": plan.fits(row.value),
                    "enough_gpus": count.get(model, 0) >= plan.gpus,
                    "headroom_bytes": round(usable - plan.per_gpu_bytes),
                }
            )
        return sorted(out, key=lambda x: (not x["fits"], x["memory_bytes"]))


class JobsView(FleetQueries):
    """Multi-node jobs, joined by the job key every node's exporter derives alike (gpuwarden_job_* series), and the
    stragglers among them (fleet/stragglers.py: each node's own judgement, compared across nodes). Jobs keyed
    `local/...` are one node's only and are left out."""

    async def jobs(self, at: float | None = None) -> dict[str, Any]:
        """`at`: the evaluation time (default: now)."""
        sel, node_label = self.selector, self.node_label
        job_sel = f'{sel}, job_id!~"local/.*"' if sel else 'job_id!~"local/.*"'
        counter = f"gpuwarden_job_collective_wait_seconds_total{{{job_sel}}}"
        waits, now, found = await self.many(
            f"max by ({node_label}, gpu, uuid, job_id, rank) (rate({counter}[{stragglers.JOB_WINDOW}]))",
            f"max by ({node_label}, uuid, job_id) (irate({counter}[{stragglers.JOB_WINDOW}]))",
            f"max by ({node_label}, job_id, kind, uuid, cause) (gpuwarden_job_finding{{{job_sel}, "
            f'kind=~"{"|".join((*stragglers.NAMED_KINDS, stragglers.ELSEWHERE))}"}})',
            at=at,
        )
        now_of = {(self.node(s), s.labels.get("uuid", ""), s.labels.get("job_id", "")): s.value for s in now}
        members: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for row in waits:
            node, uuid, job = self.node(row), row.labels.get("uuid", ""), row.labels.get("job_id", "")
            members[job].append(
                {
                    "node": node,
                    "gpu": row.labels.get("gpu", ""),
                    "uuid": uuid,
                    "rank": row.labels.get("rank", "unknown"),
                    "wait_share": _share(row.value),
                    "now_share": _share(now_of.get((node, uuid, job), 0.0)),
                }
            )
        findings: dict[str, list[dict[str, Any]]] = defaultdict(list)
        for series in found:
            labels = series.labels
            findings[labels.get("job_id", "")].append(
                {
                    "node": self.node(series),
                    "kind": labels.get("kind", ""),
                    "uuid": labels.get("uuid", ""),
                    "cause": labels.get("cause", ""),
                }  # fmt: skip
            )
        jobs = []
        for job, gpus in sorted(members.items()):
            gpus.sort(key=lambda g: (g["node"], g["gpu"]))
            named = stragglers.stragglers_of(gpus, findings.get(job, []))
            nodes = sorted({g["node"] for g in gpus})
            jobs.append({"job_id": job, "nodes": nodes, "gpus": gpus, "straggler": (named or [None])[0],
                         "stragglers": named})  # fmt: skip
        jobs.sort(key=lambda j: (j["straggler"] is None, -len(j["gpus"]), j["job_id"]))
        return {
            "window": stragglers.JOB_WINDOW,
            "jobs": jobs,
            "source": "raw series: gpuwarden_job_collective_wait_seconds_total and gpuwarden_job_finding",
        }


def _share(value: float) -> float:
    return round(min(max(value, 0.0), 1.0), 3)


@dataclass(frozen=True)
class Fleet(InventoryView, HealthView, UtilizationView, JobsView):
    """Every fleet view, for one selector and node label (what the HTTP app calls)."""


def _source(recorded: Recorded | bool, what: str) -> str:
    note = recorded.note if isinstance(recorded, Recorded) else ""
    if recorded:
        return f"recording rules (alert_rules/gpuwarden.recording.yaml): {what}" + (f"; {note}" if note else "")
    if note:
        return f"raw series: {what} ({note})"
    return f"raw series: {what} (load alert_rules/gpuwarden.recording.yaml to make this cheap at scale)"


def _tally(values: Any) -> dict[str, int]:
    counts: dict[str, int] = {}
    for value in values:
        if value:
            counts[value] = counts.get(value, 0) + 1
    return dict(sorted(counts.items()))


def _node_name(node: str) -> str:
    """A Kubernetes node name from the node label; an `instance` label's host:port loses its port."""
    return re.sub(r":\d+$", "", node)


PAGE_ROWS = {"cordon": 20, "health_nodes": 50, "stale": 20}  # the page's sections; the JSON endpoints list all


def health_by_node(unhealthy_gpus: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Unhealthy GPUs grouped by node and check: a row per node ("xid: GPU 1, 3"), critical nodes first, so a
    thousand failing GPUs read as the few hundred nodes and handful of checks they are."""
    nodes: dict[str, dict[str, Any]] = {}
    for gpu in unhealthy_gpus:
        entry = nodes.setdefault(gpu["node"], {"node": gpu["node"], "severity": "warning", "checks": {}})
        for check in gpu["checks"]:
            item = entry["checks"].setdefault(check["check"], {"level": 0, "gpus": []})
            item["level"] = max(item["level"], check["level"])
            item["gpus"].append(gpu["gpu"])
        if gpu["severity"] == "critical":
            entry["severity"] = "critical"
    for entry in nodes.values():
        entry["checks"] = dict(sorted(entry["checks"].items(), key=lambda kv: (-kv[1]["level"], kv[0])))
    return sorted(nodes.values(), key=lambda e: (e["severity"] != "critical", e["node"]))
