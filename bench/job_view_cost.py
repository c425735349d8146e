"""The job view's CPU per poll on the simulator: the training scenario (8x H100, a process per GPU) with and without
a host /proc showing the eight processes as one torchrun job (61 threads each). docs/benchmarks.md records it.
    python bench/job_view_cost.py
"""

import sys, time, tempfile, pathlib

sys.path.insert(0, ".")
sys.path.insert(0, "exporter")
from tests.helpers.common import settings
from gpuwarden.sim import install_simulator
from gpuwarden.sim.scenario import load_scenario
from gpuwarden.runtime.pipeline import Pipeline
from gpuwarden.nvml import library


def proc_tree(root):
    (root / "self").mkdir(parents=True)
    for rank in range(8):
        pid = 4000 + 100 * rank
        base = root / str(pid)
        (base / "task" / str(pid)).mkdir(parents=True)
        for t in range(60):  # a training process has dozens of threads
            (base / "task" / str(pid + 1 + t)).mkdir()
            (base / "task" / str(pid + 1 + t) / "stat").write_text(f"{pid + 1 + t} (python) S 1 2 3\n")
        (base / "environ").write_text(f"MASTER_ADDR=10.0.0.1\0MASTER_PORT=29500\0RANK={rank}\0WORLD_SIZE=8\0")
        (base / "stat").write_text(f"{pid} (python) S 3999 3999 3999 0 -1\n")
        (base / "task" / str(pid) / "stat").write_text(f"{pid} (python) R 1 2 3\n")
        (base / "task" / str(pid) / "children").write_text("")
        (base / "io").write_text("write_bytes: 0\n")
    return root


for label in ("no /proc", "job view: 8 ranks, 61 threads each"):
    now = [1_800_000_000.0]
    fake = install_simulator(load_scenario("training"), clock=lambda: now[0])
    extra = (
        {}
        if label == "no /proc"
        else {"processes": {"proc_root": str(proc_tree(pathlib.Path(tempfile.mkdtemp()) / "proc"))}}
    )
    p = Pipeline(settings(**extra), wall_clock=lambda: now[0])
    for _ in range(40):
        p.poll_once()
        now[0] += 1
    best = []
    for rep in range(3):
        c = time.process_time()
        for _ in range(200):
            p.poll_once()
            now[0] += 1
        best.append((time.process_time() - c) / 200 * 1000)
    print(f"{label}: {min(best):.2f} ms CPU per poll (best of 3 x 200 polls), jobs={len(p.snapshot.jobs)}")
    p.stop(0.2)
    fake.close()
    library.install(None)
