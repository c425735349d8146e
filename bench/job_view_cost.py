"""The job view's CPU per poll on the simulator: the training scenario (8x H100, a process per GPU) with and without
a host /proc showing the eight processes as one torchrun job (61 threads each). docs/benchmarks.md records it.
    python -m bench.job_view_cost
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from gpuwarden.nvml import library
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.sim import install_simulator
from gpuwarden.sim.scenario import load_scenario
from tests.helpers.common import ManualClock, settings

THREADS = 60  # besides the main thread: a training process has dozens (loader pins, NCCL, autograd)


def proc_tree(root: Path) -> Path:
    """The eight simulated processes as the ranks of one torchrun job."""
    (root / "self").mkdir(parents=True)
    for rank in range(8):
        pid = 4000 + 100 * rank  # the simulator's PIDs on the training scenario
        base = root / str(pid)
        (base / "task" / str(pid)).mkdir(parents=True)
        for tid in range(pid + 1, pid + 1 + THREADS):
            (base / "task" / str(tid)).mkdir()
            (base / "task" / str(tid) / "stat").write_text(f"{tid} (python) S 1 2 3\n")
        (base / "environ").write_text(f"MASTER_ADDR=10.0.0.1\0MASTER_PORT=29500\0RANK={rank}\0WORLD_SIZE=8\0")
        (base / "stat").write_text(f"{pid} (python) S 3999 3999 3999 0 -1\n")
        (base / "task" / str(pid) / "stat").write_text(f"{pid} (python) R 1 2 3\n")
        (base / "task" / str(pid) / "children").write_text("")
        (base / "io").write_text("write_bytes: 0\n")
    return root


def cpu_per_poll(proc_root: Path | None) -> float:
    """Milliseconds of CPU per poll, best of 3 runs of 200 polls, after 40 polls to fill the windows."""
    clock = ManualClock(1_800_000_000.0)
    fake = install_simulator(load_scenario("training"), clock=clock)
    extra = {} if proc_root is None else {"processes": {"proc_root": str(proc_root)}}
    pipeline = Pipeline(settings(**extra), wall_clock=clock)
    try:
        for _ in range(40):
            pipeline.poll_once()
            clock.advance(1)
        best = float("inf")
        for _ in range(3):
            began = time.process_time()
            for _ in range(200):
                pipeline.poll_once()
                clock.advance(1)
            best = min(best, (time.process_time() - began) / 200 * 1000)
        return best
    finally:
        pipeline.stop(0.2)
        fake.close()
        library.install(None)


if __name__ == "__main__":
    print(f"no /proc: {cpu_per_poll(None):.2f} ms CPU per poll")
    with tempfile.TemporaryDirectory() as tmp:
        print(f"one 8-rank job, {THREADS + 1} threads each: {cpu_per_poll(proc_tree(Path(tmp) / 'proc')):.2f} ms")
