"""Where the first poll cycle's time goes on a GPU host: NVML's init, discovery with the static tier, the fast tier
and the publication (health, assembly), each reader timed on its own, for the first cycle and the second. Runs the
real pipeline in this process with nothing else competing for the GIL, so the figures are the cycle's own cost.

    python3 bench/first_cycle.py OUT.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpuwarden.config.settings import load_settings  # noqa: E402
from gpuwarden.model.snapshot import Tier  # noqa: E402
from gpuwarden.nvml.session import start_init  # noqa: E402
from gpuwarden.runtime.pipeline import Pipeline  # noqa: E402
from gpuwarden.workers import WorkerPool  # noqa: E402


def timed_readers(pipeline: Pipeline, spent: dict[str, list[float]]) -> None:
    """Wrap every selected reader so that each run of it on a GPU adds its seconds to `spent`."""

    def wrap(reader):  # type: ignore[no-untyped-def]
        def read(dev, out):  # type: ignore[no-untyped-def]
            began = time.perf_counter()
            try:
                reader.read(dev, out)
            finally:
                spent[f"{reader.tier.value}/{reader.name}"].append(round(1000 * (time.perf_counter() - began), 3))

        return dataclasses.replace(reader, read=read)

    pipeline.poller.readers = {
        tier: [wrap(reader) for reader in readers] for tier, readers in pipeline.poller.readers.items()
    }


def cycle(pipeline: Pipeline) -> dict[str, float]:
    phases: dict[str, float] = {}
    deadline = pipeline.settings.poll.call_deadline
    began = time.perf_counter()
    pipeline.poller.nvml.ensure_up()
    phases["init_discovery_static_ms"] = 1000 * (time.perf_counter() - began)
    began = time.perf_counter()
    pipeline.poller.nvml.rediscover_lost()
    pipeline.poller._tier_cycle(Tier.FAST, deadline)
    phases["fast_tier_ms"] = 1000 * (time.perf_counter() - began)
    began = time.perf_counter()
    pipeline.poller._publish()
    phases["publish_ms"] = 1000 * (time.perf_counter() - began)
    return {key: round(value, 2) for key, value in phases.items()}


def main() -> None:
    out = Path(sys.argv[1])
    spent: dict[str, list[float]] = defaultdict(list)
    pool = WorkerPool()
    began = time.perf_counter()
    started = start_init(pool)
    pipeline = Pipeline(load_settings(None, environ={}), pool=pool, started_init=started)
    timed_readers(pipeline, spent)
    results = {"poller_built_ms": round(1000 * (time.perf_counter() - began), 2)}
    results["first"] = cycle(pipeline)
    first = {name: values[:] for name, values in spent.items()}
    spent.clear()
    results["second"] = cycle(pipeline)
    results["readers_first_ms"] = dict(sorted(first.items(), key=lambda kv: -sum(kv[1])))
    results["readers_second_ms"] = dict(sorted(spent.items(), key=lambda kv: -sum(kv[1])))
    results["gpus"] = len(pipeline.snapshot.gpus)
    pipeline.stop(timeout=0.5)
    out.write_text(json.dumps(results, indent=1))
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
