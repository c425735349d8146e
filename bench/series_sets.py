"""Dump, per shipped scenario, the sorted set of series (name + labels) after 12 s of simulated polling.

`python -m bench.series_sets before.json` on one commit and `after.json` on another, then compare the two files:
a refactor must not change the series set (used for the pipeline split: 14 scenarios, identical).
"""

import json
import sys
from pathlib import Path

from gpuwarden.exposition.render import Renderer
from gpuwarden.nvml import library
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim import install_simulator
from gpuwarden.sim.scenario import load_scenario, shipped_scenarios
from tests.helpers.common import ManualClock, settings


def series_names(text: str) -> list[str]:
    """Each sample's name and labels, without its value."""
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    return sorted(line[: line.rindex("}") + 1] if "{" in line else line.split(" ")[0] for line in lines)


def main(path: str) -> None:
    out = {}
    for name in sorted(shipped_scenarios()):
        clock = ManualClock()
        fake = install_simulator(load_scenario(name), clock=clock)
        pipeline = Pipeline(settings())
        pipeline.poll_once()
        for _ in range(12):
            clock.advance(1.0)
            pipeline.poll_once()
        out[name] = series_names(Renderer(lambda n: True).render(pipeline.snapshot).decode())
        pipeline.stop(0.5)
        fake.close()
        library.install(None)
    Path(path).write_text(json.dumps(out, indent=0))
    print({name: len(series) for name, series in out.items()})


if __name__ == "__main__":
    main(sys.argv[1])
