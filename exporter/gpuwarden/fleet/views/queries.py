"""What every fleet view holds: the Prometheus client, the selector and node label, and whether to read records."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gpuwarden.fleet import recording
from gpuwarden.fleet.nodes import NodeLabel
from gpuwarden.fleet.prometheus import PrometheusClient, Series
from gpuwarden.fleet.settings import FleetSettings


@dataclass(frozen=True)
class Recorded:
    """Whether a view reads recorded series, and why not (or what is unknown), for its `source`."""

    use: bool
    note: str = ""
    interval_s: float = float(recording.INTERVAL_S)  # the inventory and findings records' (latest())

    def __bool__(self) -> bool:
        return self.use

    def latest(self, record: str, selector: str) -> str:
        """`record`'s latest sample: the inventory and findings records, written every few minutes."""
        return recording.latest(record, selector, self.interval_s)


@dataclass(frozen=True)
class FleetQueries:
    """The Prometheus client, the selector and node label, concurrent evaluation: one object every view holds."""

    client: PrometheusClient
    settings: FleetSettings
    nodes: NodeLabel = field(default_factory=lambda: NodeLabel(""))  # resolved before each view (app.Views)

    @property
    def selector(self) -> str:
        return self.settings.selector

    @property
    def node_label(self) -> str:
        return self.nodes.current or self.settings.node_label

    async def many(self, *exprs: str, at: float | None = None) -> list[list[Series]]:
        """Evaluate the queries of one answer concurrently, at one instant (default: the current evaluation time)."""
        at = self.client.evaluation_time() if at is None else at
        return list(await asyncio.gather(*(self.client.query(e, at) for e in exprs)))

    def node(self, series: Series) -> str:
        """The series' node; a page for a lasting fault has no `instance` but always a `node` (the instance where
        the scrape gave none: health.rules.held), whatever --node-label names; a series without either label, its
        instance (as the rules name a node: health.rules.nodeish)."""
        labels = series.labels
        return labels.get(self.node_label) or labels.get("node") or labels.get("instance", "")

    async def recorded(self, *records: str) -> Recorded:
        """Whether this release's recording rules (alert_rules/gpuwarden.recording.yaml) can answer for `records`:
        their per-node model counts exist where we ask (an older rule file lacks them, and its absent health series
        would read as a healthy fleet), and the backend does not report any rule recording them as failing (a
        series limit can fail the health or cordon rules alone: their absent series would read as "healthy" too).
        Each view asks for the records it reads, so one failing rule sends only its views to the raw series."""
        if self.settings.recording_rules == "off":
            return Recorded(False)
        interval_s = await self.recording_step(recording.NODE_MODELS)
        (found,) = await self.many(f"count({recording.latest(recording.NODE_MODELS, self.selector, interval_s)})")
        if not (found and found[0].value > 0):
            return Recorded(False)
        health = await self.client.rule_health()
        if health is None:
            return Recorded(True, "rule health not listed by the backend", interval_s)
        failing = {name: health[name] for name in records if health.get(name)}
        if failing:
            name, error = next(iter(sorted(failing.items())))
            return Recorded(False, f"recording rule {name} is failing on the backend ({error})")
        return Recorded(True, interval_s=interval_s)

    async def recording_step(self, record: str) -> float:
        """The interval of the group recording `record`: as the backend lists it, else --recording-interval."""
        listed = await self.client.record_interval(record)
        return listed if listed is not None else float(self.settings.recording_interval)


def source(recorded: Recorded | bool, what: str) -> str:
    """A view's `source`: the recording rules or the raw series it read `what` from, and why."""
    note = recorded.note if isinstance(recorded, Recorded) else ""
    if recorded:
        return f"recording rules (alert_rules/gpuwarden.recording.yaml): {what}" + (f"; {note}" if note else "")
    if note:
        return f"raw series: {what} ({note})"
    return f"raw series: {what} (load alert_rules/gpuwarden.recording.yaml to make this cheap at scale)"
