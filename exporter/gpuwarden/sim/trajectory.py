"""A scenario's value over time: constant, ramp, square wave or steps, plus deterministic bounded noise."""

from __future__ import annotations

import hashlib
import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator


class StrictModel(BaseModel):
    """A frozen section of a scenario file that refuses unknown keys (a typo is an error, not a default)."""

    model_config = ConfigDict(extra="forbid", frozen=True)


class Square(StrictModel):
    low: float
    high: float
    period: float = Field(gt=0, description="seconds")
    duty: float = Field(ge=0, le=1, description="share of each period at `high`")
    phase: float = 0.0


class Ramp(StrictModel):
    start: float
    end: float
    duration: float = Field(gt=0)
    begin: float = 0.0


class Trajectory(StrictModel):
    """A value over time: constant, ramp, square wave or steps, plus optional bounded noise."""

    constant: float | None = None
    ramp: Ramp | None = None
    square: Square | None = None
    steps: tuple[tuple[float, float], ...] | None = Field(
        None, description="[[t, value], ...]: each value from its time on (the first from the start), times rising"
    )
    noise: float = Field(0.0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _bare_number(cls, data: Any) -> Any:
        if isinstance(data, int | float) and not isinstance(data, bool):
            return {"constant": data}
        return data

    @model_validator(mode="after")
    def _exactly_one(self) -> Trajectory:
        if sum(x is not None for x in (self.constant, self.ramp, self.square, self.steps)) != 1:
            raise ValueError("give exactly one of constant, ramp, square, steps (or a bare number)")
        if self.steps is not None and (
            not self.steps or any(b[0] <= a[0] for a, b in zip(self.steps, self.steps[1:], strict=False))
        ):
            raise ValueError("steps: give [[t, value], ...] with rising times, e.g. [[0, 40], [120, 95]]")
        return self

    def steady_between(self, start: float, end: float) -> bool:
        """The same value at every instant of [start, end]: a constant, or a ramp before it begins or after it
        ends (so a window's mean is one reading: a job's scenario ramps once and is flat for minutes)."""
        if self.noise:
            return False
        if self.constant is not None:
            return True
        if self.steps is not None:  # no step inside (start, end]
            return not any(start < t <= end for t, _ in self.steps[1:])
        r = self.ramp
        return r is not None and (end <= r.begin or start >= r.begin + r.duration)

    def at(self, t: float, seed: str) -> float:
        if self.constant is not None:
            value = self.constant
        elif self.steps is not None:
            value = next((v for at, v in reversed(self.steps) if t >= at), self.steps[0][1])
        elif self.ramp is not None:
            r = self.ramp
            progress = min(max((t - r.begin) / r.duration, 0.0), 1.0)
            value = r.start + (r.end - r.start) * progress
        else:
            s = self.square
            assert s is not None
            position = ((t + s.phase) % s.period) / s.period
            value = s.high if position < s.duty else s.low
        if self.noise:
            # Deterministic noise: the same scenario, GPU and time give the same reading.
            digest = hashlib.blake2b(f"{seed}:{math.floor(t * 5)}".encode(), digest_size=4).digest()
            value += (int.from_bytes(digest, "big") / 0xFFFFFFFF * 2 - 1) * self.noise
        return value
