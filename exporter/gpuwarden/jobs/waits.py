"""How much each rank of a job waits for its peers over the window, read from its GPU and compared with theirs.

- a rank *spins* when its whole window is a collective's spin (health/bottleneck.py `collective_wait`): it waited all of
  it;
- a rank *waits partially* when it is busy (at least half `collective_busy_ratio`: the driver's busy ratio swings by
  30-50 points between the balanced ranks of one job on H200) while its math pipes carry at least
  `collective_partial_wait_ratio` less
  than the busiest rank's: ranks in lockstep do the same work each step, so the rank that computes longest sets the
  step and each other waits the difference (a rank k times slower leaves its peers 1 - 1/k of each step), spinning
  in the collective meanwhile (busy);
- a rank *computes* when its math pipes or SMs work beyond a spin's; a rank that neither spins nor computes is idle
  on its GPU (its process works on the CPU, reads input, writes a checkpoint or sleeps).
The job *steps* over the window when some rank computes: only such windows teach the job's usual waits
(jobs/onset.py); a window in which every GPU idles (a checkpoint, a stall) says nothing about them.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuwarden.health.bottleneck import WindowActivity, collective_wait
from gpuwarden.health.thresholds import Thresholds


@dataclass(frozen=True)
class RankWindow:
    """One rank's GPU over the window, as the job view reads it."""

    activity: WindowActivity
    spins: bool
    wait: float  # share of the window spent waiting for a peer: 1 for a spin, the math deficit for a partial wait
    computes: bool
    math: float = 0.0  # the rank's own share of its GPU's math pipes (the GPU's, less a co-located process's part)

    @property
    def waits(self) -> bool:
        return self.wait > 0


def computes(limits: Thresholds, activity: WindowActivity) -> bool:
    """Busy with its math pipes or SMs at work beyond a collective's spin."""
    busy = activity.busy or 0.0
    return busy >= limits.collective_busy_ratio / 2 and (
        activity.math >= limits.collective_math_ratio or activity.sm > limits.collective_sm_ratio
    )


def read(
    limits: Thresholds, activity: dict[str, WindowActivity], own: dict[str, float] | None = None
) -> dict[str, RankWindow]:
    """Each rank's window: whether it spins, computes, and the share of the window it waited. `own`: the rank's
    share of its GPU's work where another process computes on it too (its SM share over theirs; 1 elsewhere): the
    math pipes count the other's work as well."""
    math = {u: a.math * (own or {}).get(u, 1.0) for u, a in activity.items()}
    top = max(math.values(), default=0.0)
    ranks = {}
    for uuid, mine in activity.items():
        spins = collective_wait(limits, mine)
        wait = 1.0 if spins else partial_wait(limits, mine, math[uuid], top)
        ranks[uuid] = RankWindow(mine, spins, wait, not spins and computes(limits, mine), math[uuid])
    return ranks


def partial_wait(limits: Thresholds, mine: WindowActivity, math: float, top: float) -> float:
    """The share of the window a busy rank waited for the busiest one, from their math pipes; 0 below the noise."""
    if top < limits.collective_partial_math_ratio or (mine.busy or 0.0) < limits.collective_busy_ratio / 2:
        return 0.0
    deficit = 1.0 - math / top
    return round(deficit, 3) if deficit >= limits.collective_partial_wait_ratio else 0.0


def steps(ranks: dict[str, RankWindow]) -> bool:
    """Whether the job computed over the window (some rank's math pipes or SMs at work beyond a spin's)."""
    return any(r.computes for r in ranks.values())
