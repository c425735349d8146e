"""The planner's fleet side: which of the fleet's GPU models a plan fits, and whether there are enough of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpuwarden.fleet import recording
from gpuwarden.fleet.planner import USABLE_MEMORY_RATIO, Plan
from gpuwarden.fleet.views.inventory import memory_query, models_query
from gpuwarden.fleet.views.queries import FleetQueries


@dataclass(frozen=True)
class FitView:
    """Each GPU model of the fleet beside a plan's memory per GPU (GET /api/v1/plan's `fleet`)."""

    queries: FleetQueries

    async def fit(self, plan: Plan) -> list[dict[str, Any]]:
        q = self.queries
        recorded = await q.recorded(recording.NODE_MODELS, recording.NODE_MEMORY)
        memory, counts = await q.many(
            memory_query(q.selector, "name", recorded), models_query(q.selector, "name", recorded)
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
