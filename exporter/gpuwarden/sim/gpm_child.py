"""The GPM child over the simulator: the fake library installed, then gpuwarden.nvml.gpm_child's protocol.

The GPM child over the simulator: `python -m gpuwarden.sim.gpm_child SPEC FD`, started by the GPM sampler where
the parent runs the simulator (its child spec names this module). It installs the fake library with the parent's
scenario and start time, then serves gpuwarden.nvml.gpm_child's protocol, so that nvml/ never imports sim/."""

from __future__ import annotations

import sys
from typing import Any

from gpuwarden.nvml import gpm_child
from gpuwarden.sim import install_simulator


def prepare(spec: dict[str, Any]) -> None:
    install_simulator(spec.get("scenario"), start=float(spec["start"]))


if __name__ == "__main__":
    sys.exit(gpm_child.main(prepare))
