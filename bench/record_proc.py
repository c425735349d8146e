"""Record what the host's /proc shows of a launcher's ranks, as a fixture for tests/test_jobs.py.

Run inside each rank (a launcher's worker command), e.g.:
    torchrun --nproc-per-node 2 -m bench.record_proc OUT/torchrun
    srun -n 2 python -m bench.record_proc OUT/srun
Each rank copies its own /proc/self/{environ,stat,cgroup,comm} to OUT/<name>/<pid>/, with the environment kept to the
variables gpuwarden reads plus PATH and HOME (a recorded environment may carry secrets: nothing else is kept),
and waits a moment so its siblings are alive when they record (their parent and session are then the launcher's).
For torch.multiprocessing.spawn, `--spawn N` starts N ranks the way mp.spawn does (the ranks are set inside).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from gpuwarden.jobs.launchers import LAUNCH_VARIABLES

KEPT = LAUNCH_VARIABLES | {"PATH", "HOME"}


def record(out: Path) -> None:
    pid = os.getpid()
    target = out / str(pid)
    target.mkdir(parents=True, exist_ok=True)
    raw = Path("/proc/self/environ").read_bytes()
    kept = [entry for entry in raw.split(b"\0") if entry.partition(b"=")[0].decode("ascii", "replace") in KEPT]
    (target / "environ").write_bytes(b"\0".join(kept) + b"\0")
    for name in ("stat", "cgroup", "comm"):
        (target / name).write_bytes(Path(f"/proc/self/{name}").read_bytes())
    time.sleep(2)


def _spawned(rank: int, out: str) -> None:
    record(Path(out))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[2] == "--spawn":
        import torch.multiprocessing as mp  # the GPU hosts have torch; mp.spawn is what ML engineers call

        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "localhost", "12355"  # as PyTorch's DDP tutorial
        mp.spawn(_spawned, args=(sys.argv[1],), nprocs=int(sys.argv[3]), join=True)
    else:
        record(Path(sys.argv[1]))
