"""The health stage of the pipeline: each draft judged by the evaluator, its memory handed to the state file.

The health stage of the pipeline: each assembled draft judged by the evaluator the composition root built, and
the evaluator's memory handed to the state file's keeper (health/state_file.py), where one is kept."""

from __future__ import annotations

from gpuwarden.health.evaluator import HealthEvaluator
from gpuwarden.health.state_file import StateKeeper
from gpuwarden.model.draft import Draft


class HealthStep:
    """Health verdicts from the exporter's own history (only while NVML is up)."""

    def __init__(self, evaluator: HealthEvaluator, keeper: StateKeeper | None = None) -> None:
        self.evaluator = evaluator
        self.keeper = keeper

    def __call__(self, draft: Draft) -> None:
        if draft.nvml_up:
            draft.health = self.evaluator.evaluate(draft.gpus, draft.xid, draft.taken_at, draft.jobs, draft.kernel)
            if self.keeper is not None:
                self.keeper.offer(self.evaluator.memory(), draft.taken_at)
