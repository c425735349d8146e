"""Input series for generated promtool tests: a selector from a name and labels, and samples as runs written in
promtool's expanding notation (`a+bxn` is n+1 values, `_xn` n missing ones, `stale` a staleness marker).

`samples` expands the runs as promtool does (each value the previous plus the step), so a judge given the same
runs in Python (the exporter's evaluator, tests/test_verdict_agreement.py) reads exactly promtool's numbers."""

from __future__ import annotations

from dataclasses import dataclass

STALE = "stale"


@dataclass(frozen=True)
class Run:
    """`count` samples from `start`, each `step` more than the one before; a run of None is `count` missing samples
    (a failed or absent scrape), STALE one staleness marker (the scrape that failed first, or the target gone)."""

    count: int
    start: float | str | None
    step: float = 0.0


def selector(name: str, labels: dict[str, str]) -> str:
    inner = ",".join(f'{key}="{value}"' for key, value in labels.items())
    return f"{name}{{{inner}}}"


def _number(value: float) -> str:
    return repr(int(value)) if float(value).is_integer() and abs(value) < 1e15 else repr(float(value))


def expanding(runs: list[Run]) -> str:
    parts = []
    for run in runs:
        if run.count <= 0:
            continue
        if run.start is None:
            parts.append(f"_x{run.count}")
        elif run.start == STALE:
            parts.extend([STALE] * run.count)
        elif run.count == 1:
            parts.append(_number(run.start))  # type: ignore[arg-type]
        elif run.step == 0:
            parts.append(f"{_number(run.start)}x{run.count - 1}")  # type: ignore[arg-type]
        else:
            sign = "+" if run.step > 0 else "-"
            parts.append(f"{_number(run.start)}{sign}{_number(abs(run.step))}x{run.count - 1}")  # type: ignore[arg-type]
    return " ".join(parts)


def samples(runs: list[Run]) -> list[float | str | None]:
    """The values promtool reads from `expanding(runs)`, one per interval."""
    out: list[float | str | None] = []
    for run in runs:
        value = run.start
        for _ in range(run.count):
            out.append(value)
            if isinstance(value, int | float):
                value = value + run.step
    return out
