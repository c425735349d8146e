"""The health stage of the pipeline: each assembled draft judged by the evaluator the composition root built."""

from __future__ import annotations

from gpuwarden.health.checks import HealthEvaluator
from gpuwarden.model.draft import Draft


class HealthStep:
    """Health verdicts from the exporter's own history (only while NVML is up)."""

    def __init__(self, evaluator: HealthEvaluator) -> None:
        self.evaluator = evaluator

    def __call__(self, draft: Draft) -> None:
        if draft.nvml_up:
            draft.health = self.evaluator.evaluate(draft.gpus, draft.xid, draft.taken_at, draft.jobs, draft.kernel)
