"""Every fleet view composed in `Fleet`: one object per view (a module each here), all holding one FleetQueries."""

from __future__ import annotations

from gpuwarden.fleet.nodes import NodeLabel
from gpuwarden.fleet.prometheus import PrometheusClient
from gpuwarden.fleet.settings import FleetSettings
from gpuwarden.fleet.views.cordon import CordonView
from gpuwarden.fleet.views.fit import FitView
from gpuwarden.fleet.views.health import HealthView
from gpuwarden.fleet.views.inventory import InventoryView
from gpuwarden.fleet.views.jobs import JobsView
from gpuwarden.fleet.views.queries import FleetQueries
from gpuwarden.fleet.views.utilization import UtilizationView


class Fleet:
    """Every fleet view, for one selector and node label (what the HTTP app calls): each view's answer is a method
    of the view object held here, over the one FleetQueries they share.

    Every query is bounded: aggregated by node (a series per node, not per GPU), or filtered to the GPUs that are
    unhealthy, idle or starved. Nothing pulls raw per-GPU series or ranges."""

    def __init__(self, client: PrometheusClient, settings: FleetSettings, nodes: NodeLabel | None = None) -> None:
        self.queries = FleetQueries(client, settings, nodes or NodeLabel(""))
        self.inventory = InventoryView(self.queries).inventory
        self.health = HealthView(self.queries).health
        self.cordon_candidates = CordonView(self.queries).cordon_candidates
        self.utilization = UtilizationView(self.queries).utilization
        self.jobs = JobsView(self.queries).jobs
        self.fit = FitView(self.queries).fit

    @property
    def client(self) -> PrometheusClient:
        return self.queries.client

    @property
    def nodes(self) -> NodeLabel:
        return self.queries.nodes

    @property
    def selector(self) -> str:
        return self.queries.selector


__all__ = ["Fleet", "FleetQueries"]
