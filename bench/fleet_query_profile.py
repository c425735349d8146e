"""Which of the fleet's queries cost what, on a loaded backend: every query each view sends, timed one at a time.

Usage: python3 bench/fleet_query_profile.py URL [--node-label node] [--json OUT]
Runs the views (inventory, health, cordon candidates, utilization over 1 h) with one query in flight, the cache
off, and prints each query's time, series returned and its share of the view, slowest first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpuwarden.fleet.prometheus import PrometheusClient, Series  # noqa: E402
from gpuwarden.fleet.settings import parse  # noqa: E402
from gpuwarden.fleet.views import Fleet  # noqa: E402


class TimedClient(PrometheusClient):
    """The fleet's client, noting each query's time and answer size."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.timings: list[dict[str, object]] = []

    async def _fetch(self, expr: str, at: float | None) -> list[Series]:
        started = time.perf_counter()
        result = await super()._fetch(expr, at)
        self.timings.append({"seconds": round(time.perf_counter() - started, 3), "series": len(result), "query": expr})
        return result


async def profile(url: str, node_label: str) -> dict[str, object]:
    settings = parse(["--prometheus-url", url, "--node-label", node_label, "--cache-ttl", "0", "--query-timeout", "60",
                      "--max-concurrent-queries", "1"])  # fmt: skip
    out: dict[str, object] = {}
    for view in ("inventory", "health", "cordon_candidates", "utilization"):
        client = TimedClient(url, 60, 0, max_concurrent=1)
        await client.calibrate()
        fleet = Fleet(client, settings)
        started = time.perf_counter()
        await (fleet.utilization("1h", 20) if view == "utilization" else getattr(fleet, view)())
        out[view] = {
            "seconds": round(time.perf_counter() - started, 3),
            "queries": sorted(client.timings, key=lambda t: -float(t["seconds"])),  # type: ignore[arg-type]
        }
        await client.close()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("--node-label", default="node")
    parser.add_argument("--json")
    args = parser.parse_args()
    result = asyncio.run(profile(args.url, args.node_label))
    for view, entry in result.items():
        print(f"{view}: {entry['seconds']} s, one query at a time")  # type: ignore[index]
        for timing in entry["queries"][:8]:  # type: ignore[index]
            print(f"  {timing['seconds']:>7} s {timing['series']:>7} series  {str(timing['query'])[:150]}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
