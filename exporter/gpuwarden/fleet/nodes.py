"""Which label names a node in the fleet's answers: `--node-label` (default `node`), or `instance` where no gpuwarden
series carries that label.

The chart's ServiceMonitor and PodMonitor, deploy/prometheus/prometheus.yml and the demo put the node's name in a
`node` label; the pages and the cordon findings name the node by it too (health.rules: `node`, else the instance).
Grouping by `instance` instead split one node in two (its inventory under `10.0.0.7:10045`, its cordon finding under
`gpu-node-07`) and printed `kubectl cordon 10.0.0.7` (issue 48). A plain static scrape config gives no `node` label:
grouping by it would make one nameless node of the whole fleet, so there the instance names the node. Targets of a
fleet that has the label where some lack it are counted and logged: they are listed under an empty node name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from gpuwarden.fleet.prometheus import PrometheusClient

log = logging.getLogger("gpuwarden.fleet")
FALLBACK = "instance"


@dataclass
class NodeLabel:
    """The label in use, asked of Prometheus before each view is computed (one cached query)."""

    configured: str
    current: str = ""
    _said: tuple[str, int] = field(default=("", 0), repr=False)

    def __post_init__(self) -> None:
        self.current = self.current or self.configured

    async def resolve(self, client: PrometheusClient, selector: str) -> str:
        """`configured` where any target's `up` carries it, else `instance`; logged when it changes."""
        if self.configured == FALLBACK:
            return self.current
        has = f'label_replace(up{{{selector}}}, "has_node_label", "yes", "{self.configured}", ".+")'
        counts = {row.labels.get("has_node_label", ""): int(row.value) for row in await client.query(
            f"count by (has_node_label) ({has})"
        )}  # fmt: skip
        with_label, without = counts.get("yes", 0), counts.get("", 0)
        self.current = self.configured if with_label or not without else FALLBACK
        self._tell(with_label, without)
        return self.current

    def _tell(self, with_label: int, without: int) -> None:
        said = (self.current, without if with_label else 0)
        if said == self._said:
            return
        self._said = said
        if self.current == FALLBACK:
            log.info(
                "no gpuwarden target carries a %r label: nodes are named by their instance (relabel the scrape to "
                "add it, as deploy/prometheus/prometheus.yml does, or set --node-label instance)",
                self.configured,
            )
        elif without:
            log.warning(
                "%d gpuwarden target(s) have no %r label (%d have it): they are listed under an empty node name; "
                "relabel their scrape config",
                without,
                self.configured,
                with_label,
            )
