"""A job's usual waits, and an onset against them: what tells a straggler from an imbalance built into the job.

Each rank's usual wait is the lowest share of a window it waited, over the windows in which the job computed, for
the last `collective_baseline_s`. A pipeline's light stages wait for its heavy one in every window (their usual
wait is that share); a warm-up's skew has no balanced window before it (no usual yet); a straggler that starts
after the job ran balanced makes its peers wait more than they usually do: an onset. Kept as one minimum per rank
per BUCKET_S, so the memory is bounded by the baseline's length, not the poll rate.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

BUCKET_S = 60.0


@dataclass
class UsualWaits:
    """One job's usual waits on this node."""

    buckets: deque[tuple[float, dict[str, float]]] = field(default_factory=deque)  # (start, rank → lowest wait)
    stepped_s: float = 0.0  # seconds of windows in which the job computed
    computed: set[str] = field(default_factory=set)  # ranks seen computing while the job did

    def add(
        self, now: float, waits: dict[str, float], stepped: bool, elapsed: float, horizon: float, computing: set[str]
    ) -> None:
        """Learn from one window (only one in which the job computed); `computing`: the ranks that computed in it."""
        while self.buckets and self.buckets[0][0] < now - horizon:
            self.buckets.popleft()
        if not stepped:
            return
        self.stepped_s += elapsed
        self.computed |= computing
        start = now - now % BUCKET_S
        if not self.buckets or self.buckets[-1][0] != start:
            self.buckets.append((start, {}))
        lowest = self.buckets[-1][1]
        for uuid, wait in waits.items():
            lowest[uuid] = min(wait, lowest.get(uuid, wait))

    def usual(self, uuid: str, known_after_s: float) -> float | None:
        """The rank's usual wait; None until the job has computed for `known_after_s` (a window) with it."""
        if self.stepped_s < known_after_s:
            return None
        found = [lowest[uuid] for _, lowest in self.buckets if uuid in lowest]
        return min(found) if found else None

    def never_computed(self, uuid: str) -> bool:
        """A rank idle on its GPU in every window in which the job computed: it holds no one back (a process that
        only holds memory, a replica without requests, a process that joined the job by its environment alone)."""
        return self.stepped_s > 0 and uuid not in self.computed

    def onset(self, waits: dict[str, float], known_after_s: float, margin: float) -> bool:
        """Whether most ranks in `waits` (the waiters, with this window's shares) wait at least `margin` more than
        they usually do."""
        usual = {uuid: self.usual(uuid, known_after_s) for uuid in waits}
        risen = sum(u is not None and waits[k] - u >= margin for k, u in usual.items())
        return bool(waits) and 2 * risen >= len(waits)
