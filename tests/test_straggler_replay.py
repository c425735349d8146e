"""The recorded 2x H200 straggler runs (docs/validation/2026-11-28-h200x2-*) replayed through this checkout's job
view (bench/straggler_replay.py polls the real CollectiveStep): every straggler the recorded job view named is named
again, on the same GPU, no later, and no other GPU is named meanwhile. A rule change that names one later or wrongly
fails here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bench import straggler_replay
from gpuwarden.health.thresholds import DEFAULT


def replayed(limits=DEFAULT) -> list[dict]:
    """Every injection's replay result (with the recorded time and cause), under `limits`."""
    results = []
    for _, timeline, injections in straggler_replay.recordings():
        node = straggler_replay.Replayed

        class Under(node):  # the replay's node under these thresholds
            def __init__(self, gpus: tuple[int, ...]) -> None:
                super().__init__(gpus, limits)

        straggler_replay.Replayed = Under
        try:
            results += straggler_replay.replay(timeline, injections)
        finally:
            straggler_replay.Replayed = node
    return results


def test_every_recorded_straggler_is_named_again_on_its_gpu_no_later() -> None:
    results = replayed()
    recorded = [r for r in results if r["recorded_s"] is not None]
    assert len(recorded) == 11  # run 4's CPU-bound rank, call A #1-#7, call B #1-#3
    for result in recorded:
        assert result["replayed_s"] is not None, result
        assert result["replayed_s"] <= result["recorded_s"], result
        assert result["other_named"] == [], result


@pytest.mark.parametrize("label", ["call A #5", "call B #2"])
def test_host_corroborated_stragglers_need_the_shorter_confirmation(label: str) -> None:
    """Without the host's corroboration (both confirmations 10 s) these two are named later than recorded: the
    shorter confirmation is what makes the replay no slower."""
    slow = {r["injection"]: r for r in replayed(replace(DEFAULT, collective_straggler_corroborated_for_s=10))}
    assert slow[label]["replayed_s"] > slow[label]["recorded_s"]
