"""The training-memory planner against the worked examples of the ZeRO paper and operations guides."""

from __future__ import annotations

import pytest

from gpuwarden.fleet.planner import GIB, ActivationShape, PlanError, activation_bytes, plan

SEVEN_B = 7e9


def test_mixed_precision_adam_is_16_bytes_per_parameter() -> None:
    result = plan(SEVEN_B, "fp16", "adam")
    assert result.weights_bytes == 2 * SEVEN_B and result.gradients_bytes == 2 * SEVEN_B
    assert result.optimizer_bytes == 12 * SEVEN_B  # fp32 master + momentum + variance
    assert result.per_gpu_bytes == 112e9
    assert result.per_gpu_bytes / GIB == pytest.approx(104.31, abs=0.01)
    assert not result.fits(80 * GIB) and result.fits(141e9)  # an H200 holds the model states, an H100 does not


@pytest.mark.parametrize(
    ("sharding", "expected_gb"),
    [
        ("none", 112.0),
        ("zero1", 4 * 7 + 12 * 7 / 8),  # 38.5: optimizer states sharded
        ("zero2", 2 * 7 + (2 + 12) * 7 / 8),  # 26.25: + gradients
        ("zero3", 16 * 7 / 8),  # 14.0: + weights
        ("fsdp", 16 * 7 / 8),
    ],
)
def test_zero_stages_over_eight_gpus(sharding: str, expected_gb: float) -> None:
    result = plan(SEVEN_B, "bf16", "adamw", sharding, gpus=8)
    assert result.per_gpu_bytes / 1e9 == pytest.approx(expected_gb)
    assert result.model_states_unsharded_bytes == pytest.approx(112e9)


def test_zero3_over_eight_is_within_the_guides_11_to_13_gib_and_fits_an_h100() -> None:
    result = plan(SEVEN_B, "bf16", "adamw", "zero3", gpus=8)
    assert 11 <= result.per_gpu_bytes / GIB <= 13.1
    assert result.fits(85520809984)


def test_full_precision_has_no_master_copy() -> None:
    result = plan(SEVEN_B, "fp32", "adam")
    assert result.per_gpu_bytes == (4 + 4 + 8) * SEVEN_B


def test_optimizers_and_inference() -> None:
    assert plan(1e9, "bf16", "sgd").optimizer_bytes == 4e9  # master copy only
    assert plan(1e9, "bf16", "adam8bit").optimizer_bytes == (2 + 4) * 1e9
    inference = plan(SEVEN_B, "int4", mode="inference")
    assert inference.per_gpu_bytes == 3.5e9 and inference.gradients_bytes == 0
    assert plan(70e9, "fp16", mode="inference", sharding="fsdp", gpus=2).weights_bytes == 70e9


def test_activation_estimates() -> None:
    shape = ActivationShape(
        layers=32, hidden_size=4096, heads=32, sequence_length=4096, micro_batch_size=1, checkpointing=True
    )
    assert activation_bytes(shape) == 2 * 4096 * 4096 * 32  # 1 GiB
    full = ActivationShape(32, 4096, 32, 2048, 1, checkpointing=False, flash_attention=False)
    assert activation_bytes(full) == 2048 * 4096 * (34 + 5 * 32 * 2048 / 4096) * 32
    flash = ActivationShape(32, 4096, 32, 2048, 1, checkpointing=False, flash_attention=True)
    assert activation_bytes(flash) == 2048 * 4096 * 34 * 32
    given = plan(SEVEN_B, activations=shape, activations_gib=5)
    assert given.activations_bytes == 5 * GIB and given.activations_source == "given"


def test_impossible_requests_say_why() -> None:
    with pytest.raises(PlanError, match="inference"):
        plan(SEVEN_B, "int8")
    with pytest.raises(PlanError, match="parameters"):
        plan(0)
    assert plan(SEVEN_B, sharding="zero3", gpus=1).sharding == "none"  # nothing to shard over
