"""What a reader is: its name, tier, the families it writes and the function that reads a GPU.

What a reader is: its name, tier, the families it writes and the function that reads a GPU (the readers in
collect/readers/ each declare theirs; the poller and the tiers run them). A module of its own so that the readers and
the list of them in collect/readers/__init__.py do not import each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from gpuwarden.model.families import Family
from gpuwarden.model.snapshot import SampleWriter, Tier
from gpuwarden.nvml.device import GpuDevice


@dataclass(frozen=True)
class Reader:
    """One reader: its name, tier, the families it fills and the function that reads a GPU."""

    name: str
    tier: Tier
    families: tuple[Family, ...]  # every family `read` may write (SampleWriter enforces it)
    read: Callable[[GpuDevice, SampleWriter], None]
    # A costly reader may run less often than its tier: the PollSettings field holding its interval. Between
    # runs the poller serves the reader's last samples (they are counters: nothing is lost, only delayed).
    every: str | None = None
