"""The cordon-candidates view: the critical alert rules' own findings (health/rules.py) by node, and the commands."""

from __future__ import annotations

import re
import shlex
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import recording
from gpuwarden.fleet.prometheus import Series, promql_string
from gpuwarden.fleet.views.queries import FleetQueries, Recorded, source
from gpuwarden.health.rules import RUNBOOK_BASE, Rule, anchor, build

# The hardware findings are the alert rules' own expressions (exporter/gpuwarden/health/rules.py), so the fleet view
# and the pages agree.
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
NOTHING = "vector(0) < 0"  # an empty answer without a scan


def cordon_rules(selector: str) -> list[Rule]:
    """The critical alert rules whose action is cordon, rma or reset_gpu, over `selector`."""
    return [
        r for g in build(selector=selector) for r in g.rules if r.action in CORDON_ACTIONS and r.severity == "critical"
    ]


@dataclass(frozen=True)
class CordonView:
    """Nodes to drain: each critical rule's findings now, whether its alert fires, and the commands to review."""

    queries: FleetQueries

    async def cordon_candidates(self) -> dict[str, Any]:
        """Nodes to drain: the critical rules that name an action, evaluated now (not waiting for `for:`), each
        finding beside whether its alert fires, and the commands to run after review."""
        q = self.queries
        rules = cordon_rules(q.selector)
        recorded = await q.recorded(recording.CORDON)
        exprs, findings = await self._cordon_expressions(rules, recorded)
        names = "|".join(r.alert for r in rules)
        *asked, firing = await q.many(
            *exprs.values(), f'ALERTS{{{q.selector},alertstate="firing",alertname=~"{names}"}}'
        )
        answered = dict(zip(exprs, asked, strict=True))
        answers = [answered[r.alert] if r.alert in answered else findings[r.alert] for r in rules]
        nodes = self._findings_by_node(rules, answers, _fired(firing))
        return {
            "candidates": _drain_entries(nodes),
            "rules": [r.alert for r in rules],
            "source": source(
                recorded, "findings of every rule but NVLink's (up to one evaluation interval and a minute old)"
            ),
            "note": "instant evaluation of the alert expressions, without their `for:` durations; "
            "alert_firing says whether the alert itself fires in this Prometheus (its `for:` has passed; "
            "needs the rules loaded there). Review before draining. The commands are printed, never run.",
        }

    async def _cordon_expressions(
        self, rules: list[Rule], recorded: Recorded
    ) -> tuple[dict[str, str], dict[str, list[Series]]]:
        """What to ask now per alert, and the findings the recording rules already hold for the others.

        Recorded: every rule but the unrecorded ones is answered by its record. Otherwise a rule with a cheap
        narrowing query is evaluated only on the instances that query finds (none: an empty answer, no scan)."""
        q = self.queries
        narrowable = [r.alert for r in rules if r.alert in NARROWING]
        first = await q.many(
            *(NARROWING[alert].format(sel=q.selector) for alert in narrowable),
            # the rules' expressions as the recording rules last evaluated them (up to an evaluation interval old)
            *([recorded.latest(recording.CORDON, q.selector)] if recorded else []),
        )
        narrowed = dict(zip(narrowable, first[: len(narrowable)], strict=True))
        findings: dict[str, list[Series]] = defaultdict(list)
        for row in first[-1] if recorded else []:
            findings[row.labels.get("alertname", "")].append(row)
        exprs: dict[str, str] = {}  # alert → the expression asked now; the others are answered by `findings`
        for rule in rules:
            if recorded and rule.alert not in recording.NOT_RECORDED:
                continue
            exprs[rule.alert] = self._narrowed(rule, narrowed.get(rule.alert))
        return exprs, findings

    def _narrowed(self, rule: Rule, candidates: list[Series] | None) -> str:
        """The rule's expression over the instances its narrowing query found (`candidates`; None: not narrowable)."""
        if candidates is None:
            return rule.finding
        instances = sorted({row.labels.get("instance", "") for row in candidates})
        if not instances:
            return NOTHING
        if len(instances) > MAX_NARROWED_INSTANCES:
            return rule.finding
        regex = "|".join(re.escape(i) for i in instances)
        narrow = f"{self.queries.selector},instance=~{promql_string(regex)}"
        return next(r.finding for r in cordon_rules(narrow) if r.alert == rule.alert)

    def _findings_by_node(
        self, rules: list[Rule], answers: list[list[Series]], fired: set[tuple[str | None, ...]]
    ) -> dict[str, dict[str, Any]]:
        """Each answered row as a finding of its node, with whether its alert fires."""
        nodes: dict[str, dict[str, Any]] = {}
        for rule, rows in zip(rules, answers, strict=True):
            for row in rows:
                node = self.queries.node(row)
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


def node_name(node: str) -> str:
    """A Kubernetes node name from the node label; an `instance` label's host:port loses its port."""
    return re.sub(r":\d+$", "", node)


def _drain_entries(nodes: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per node, worst action first: its findings, its GPUs and the commands to run after review."""
    out = []
    for node, entry in nodes.items():
        entry["findings"].sort(key=lambda f: (ACTION_ORDER.get(f["action"], 9), f["alert"]))
        name = shlex.quote(node_name(node))
        entry["commands"] = [
            f"kubectl cordon {name}",
            f"kubectl drain {name} --ignore-daemonsets --delete-emptydir-data --timeout=15m",
        ]
        entry["gpus"] = sorted({f["labels"].get("gpu", "") for f in entry["findings"]} - {""})
        out.append(entry)
    out.sort(key=lambda e: (min(ACTION_ORDER.get(f["action"], 9) for f in e["findings"]), e["node"]))
    return out
