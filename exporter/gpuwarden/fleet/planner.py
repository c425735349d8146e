"""Training-memory planner: bytes per GPU for a model, precision, optimizer and sharding strategy.

Model states follow the ZeRO paper's accounting (Rajbhandari et al., 2020): mixed-precision Adam keeps 16-bit
weights (2 B/param) and gradients (2 B/param) plus an fp32 master copy, momentum and variance (12 B/param):
16 B/param, so a 7B model needs 112 GB (104 GiB) of model states before activations. ZeRO-1 shards the optimizer
states over the data-parallel GPUs, ZeRO-2 also the gradients, ZeRO-3 / FSDP full-shard also the weights.
Activations per layer follow Korthikanti et al. (2022), 16-bit, no tensor parallelism:
s·b·h·(34 + 5·a·s/h) bytes (the second term is the attention-score matrix, which FlashAttention never stores),
or 2·s·b·h with full activation checkpointing (only each layer's input is kept).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Precision = Literal["fp32", "tf32", "bf16", "fp16", "int8", "int4"]
Optimizer = Literal["adam", "adamw", "adam8bit", "sgd", "sgd_momentum", "adafactor", "lion"]
Sharding = Literal["none", "zero1", "zero2", "zero3", "fsdp"]
Mode = Literal["training", "inference"]

GIB = 1024**3
BYTES_PER_PARAM: dict[str, float] = {"fp32": 4, "tf32": 4, "bf16": 2, "fp16": 2, "int8": 1, "int4": 0.5}
# Optimizer state in bytes per parameter, kept in fp32 (adam8bit: two 8-bit moments; adafactor: factored second
# moment, ~0 per parameter for matrices, counted as 4 B/param to stay on the safe side for vectors and momentum).
OPTIMIZER_STATE: dict[str, float] = {
    "adam": 8,
    "adamw": 8,
    "adam8bit": 2,
    "sgd": 0,
    "sgd_momentum": 4,
    "adafactor": 4,
    "lion": 4,
}
FP32_MASTER_COPY = 4  # mixed precision keeps an fp32 copy of the weights for the optimizer step
USABLE_MEMORY_RATIO = 0.92  # CUDA context, NCCL buffers and allocator fragmentation take the rest


class PlanError(ValueError):
    """An impossible combination, phrased for the caller (becomes a 422)."""


@dataclass(frozen=True)
class ActivationShape:
    """What the activation estimate needs; all per data-parallel GPU."""

    layers: int
    hidden_size: int
    heads: int
    sequence_length: int
    micro_batch_size: int
    checkpointing: bool = False
    flash_attention: bool = True  # FlashAttention never stores the s×s attention scores: no 5·a·s/h term


@dataclass(frozen=True)
class Plan:
    parameters: float
    precision: str
    optimizer: str
    sharding: str
    gpus: int
    mode: str
    weights_bytes: float
    gradients_bytes: float
    optimizer_bytes: float
    activations_bytes: float
    activations_source: str

    @property
    def per_gpu_bytes(self) -> float:
        return self.weights_bytes + self.gradients_bytes + self.optimizer_bytes + self.activations_bytes

    @property
    def model_states_unsharded_bytes(self) -> float:
        shards = self._shards()
        return (
            self.weights_bytes * shards["weights"]
            + self.gradients_bytes * shards["gradients"]
            + self.optimizer_bytes * shards["optimizer"]
        )

    def _shards(self) -> dict[str, int]:
        n = self.gpus
        return {
            "weights": n if self.sharding in ("zero3", "fsdp") else 1,
            "gradients": n if self.sharding in ("zero2", "zero3", "fsdp") else 1,
            "optimizer": n if self.sharding != "none" else 1,
        }

    def fits(self, memory_bytes: float) -> bool:
        return self.per_gpu_bytes <= memory_bytes * USABLE_MEMORY_RATIO


def activation_bytes(shape: ActivationShape) -> float:
    s, b, h, a, layers = (shape.sequence_length, shape.micro_batch_size, shape.hidden_size, shape.heads, shape.layers)
    if shape.checkpointing:
        return 2.0 * s * b * h * layers
    quadratic = 0.0 if shape.flash_attention else 5.0 * a * s / h
    return s * b * h * (34.0 + quadratic) * layers


def plan(
    parameters: float,
    precision: Precision = "bf16",
    optimizer: Optimizer = "adamw",
    sharding: Sharding = "none",
    gpus: int = 1,
    mode: Mode = "training",
    activations: ActivationShape | None = None,
    activations_gib: float | None = None,
) -> Plan:
    """Memory per GPU. `activations_gib` (measured or known) wins over the `activations` shape estimate."""
    if parameters <= 0:
        raise PlanError("parameters must be > 0 (e.g. 7e9 for a 7B model)")
    if gpus < 1:
        raise PlanError("gpus must be >= 1")
    if sharding != "none" and gpus == 1:
        sharding = "none"  # one GPU has nothing to shard over
    width = BYTES_PER_PARAM[precision]
    if mode == "inference":
        weights, gradients, state = parameters * width, 0.0, 0.0
        if sharding in ("zero3", "fsdp"):
            weights /= gpus
    else:
        if precision in ("int8", "int4"):
            raise PlanError(
                f"precision {precision} is for inference (quantized weights do not train): use "
                "mode=inference, or bf16/fp16/fp32 for training"
            )
        mixed = precision in ("bf16", "fp16")
        weights = parameters * width
        gradients = parameters * width
        state = parameters * (OPTIMIZER_STATE[optimizer] + (FP32_MASTER_COPY if mixed else 0))
        if sharding != "none":
            state /= gpus
        if sharding in ("zero2", "zero3", "fsdp"):
            gradients /= gpus
        if sharding in ("zero3", "fsdp"):
            weights /= gpus
    if activations_gib is not None:
        act, source = activations_gib * GIB, "given"
    elif activations is not None:
        act, source = activation_bytes(activations), "estimated"
    else:
        act, source = 0.0, "not included"
    return Plan(
        parameters,
        precision,
        optimizer if mode == "training" else "none",
        sharding,
        gpus,
        mode,
        weights,
        gradients,
        state,
        act,
        source,
    )
