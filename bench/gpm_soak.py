"""Real-workload soak: the exporter at its defaults (GPM on) through real training jobs that start and stop.

Run on a GPU host with 2 GPUs, from the repository root, with nothing else on the GPUs (`bench/source_env.sh`
makes the checkout importable as gpuwarden, with the dependencies from .whl/):
  . bench/source_env.sh && python3 -m bench.gpm_soak --seconds 600 --out /tmp/soak
The schedule repeats until `--seconds` of jobs have run (bench/workloads/train.py, each started fresh):
  ddp-bf16         2-rank DistributedDataParallel over NCCL, bf16 autocast, checkpoints, ends by itself;
  single+fill      single-GPU bf16 training on GPU 0 while another job fills 95 % of GPU 1's memory;
  ddp-killed       2-rank DDP killed with SIGKILL mid-step (no NCCL teardown);
  ddp-fp32         2-rank DDP in FP32;
  ddp-slow-rank    2-rank DDP whose rank 1 is late every step.
Throughout, /metrics and /readyz are requested every second; the run fails if the exporter exits, a scrape fails,
/readyz is not 200, or a GPU's GPM counters stop advancing for more than 10 s. RSS of the exporter and of its GPM
child process is sampled. `--dry-run` runs the same harness over the simulator with sleeping jobs (no GPU).
Writes OUT/summary.json, OUT/exporter.log and each job's log.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from tests.helpers.daemon import start_daemon

ROOT = Path(__file__).resolve().parent.parent
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
TRAIN = "bench/workloads/train.py"
DDP = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", TRAIN]
STALE = re.compile(r"^gpuwarden_gpu_stale\{.*\} 1$", re.M)
WINDOW = re.compile(r'^gpuwarden_gpm_window_seconds_total\{gpu="(\d+)".*\} (\S+)$', re.M)


def schedule() -> list[tuple[str, list[list[str]], float, bool]]:
    """(name, commands run side by side, seconds, killed mid-step)."""
    one = [sys.executable, TRAIN]
    return [
        ("ddp-bf16", [DDP + ["--seconds", "80"]], 80, False),
        (
            "single+fill",
            [one + ["--gpu", "0", "--seconds", "50"], one + ["--job", "fill", "--gpu", "1", "--seconds", "50"]],
            50,
            False,
        ),
        ("ddp-killed", [DDP + ["--seconds", "600"]], 40, True),
        ("ddp-fp32", [DDP + ["--precision", "fp32", "--seconds", "50"]], 50, False),
        ("ddp-slow-rank", [DDP + ["--slow-rank", "1", "--seconds", "50"]], 50, False),
    ]


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def descendants(pid: int) -> list[int]:
    """Every process below `pid`: torchrun's ranks and their DataLoader workers are not all in its process group
    (the first soak's SIGKILL of the group left ranks running)."""
    found, queue = [], [pid]
    while queue:
        for child in children(queue.pop()):
            found.append(child)
            queue.append(child)
    return found


def kill_tree(pid: int) -> None:
    for victim in [pid, *descendants(pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            found += [int(p) for p in (task / "children").read_text().split()]
    return found


class Watch:
    """Scrapes every second and keeps what the run is judged on."""

    def __init__(self, port: int, pid: int) -> None:
        self.base, self.pid = f"http://127.0.0.1:{port}", pid
        self.scrapes = self.scrape_failures = self.ready_failures = self.stale_scrapes = 0
        self.failures: list[str] = []
        self.last_advance: dict[str, float] = {}
        self.last_window: dict[str, float] = {}
        self.longest_gpm_gap = 0.0
        self.rss: list[tuple[float, float | None, float | None]] = []
        self.sampler_lines: set[str] = set()
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.base + path, timeout=2) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, ""
        except Exception as exc:  # noqa: BLE001 - a failed request is what is counted
            return 0, repr(exc)

    def run(self) -> None:
        while not self.stop.wait(1.0):
            now = time.monotonic() - self.t0
            status, body = self.get("/metrics")
            self.scrapes += 1
            if status != 200:
                self.scrape_failures += 1
                self.failures.append(f"{now:.0f}s /metrics {status} {body[:100]}")
            else:
                if STALE.search(body):  # a GPU's reads overran the call deadline (a GPM wait once did this)
                    self.stale_scrapes += 1
                for gpu, value in WINDOW.findall(body):
                    if float(value) > self.last_window.get(gpu, -1):
                        self.last_window[gpu], self.last_advance[gpu] = float(value), now
                    self.longest_gpm_gap = max(self.longest_gpm_gap, now - self.last_advance.get(gpu, now))
                self.sampler_lines |= {
                    line for line in body.splitlines() if "gpm_sampler" in line or "gpm_unavailable_info{" in line
                }
            ready, text = self.get("/readyz")
            if ready != 200:
                self.ready_failures += 1
                self.failures.append(f"{now:.0f}s /readyz {ready} {text[:100]}")
            if int(now) % 10 == 0:
                kids = children(self.pid)
                self.rss.append((round(now), rss_mib(self.pid), rss_mib(kids[0]) if kids else None))


def summarise(watch: Watch, exporter: subprocess.Popen, alive: bool, started: float, jobs: list[dict]) -> dict:
    return {
        "passed": alive and not watch.scrape_failures and not watch.ready_failures and watch.longest_gpm_gap <= 10,
        "exporter_alive_throughout": alive,
        "exporter_returncode": exporter.returncode,
        "seconds_of_jobs": round(time.monotonic() - started),
        "scrapes": watch.scrapes,
        "scrape_failures": watch.scrape_failures,
        "readyz_failures": watch.ready_failures,
        "scrapes_with_a_stale_gpu": watch.stale_scrapes,
        "failures": watch.failures[:50],
        "gpm_window_seconds_total": watch.last_window,
        "longest_gpm_gap_s": round(watch.longest_gpm_gap, 1),
        "gpm_sampler_lines": sorted(watch.sampler_lines),
        "rss_mib_exporter_child": watch.rss,
        "jobs": jobs,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=600)
    parser.add_argument("--out", required=True)
    parser.add_argument("--port", type=int, default=10045)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    unbuffered = {**NCCL_ENV, "PYTHONUNBUFFERED": "1"}
    env = {**os.environ, **unbuffered}
    sim = ["--sim", "--nvml.scenario", "healthy"] if args.dry_run else []
    daemon = start_daemon(
        *sim, port=args.port, python_flags=("-X", "faulthandler"), env=unbuffered, log=out / "exporter.log", cwd=ROOT
    )
    exporter = daemon.proc
    watch = Watch(args.port, exporter.pid)
    thread = threading.Thread(target=watch.run, daemon=True)
    thread.start()
    jobs, started = [], time.monotonic()
    n = 0
    while time.monotonic() - started < args.seconds and exporter.poll() is None:
        name, commands, seconds, killed = schedule()[n % len(schedule())]
        seconds = min(seconds, args.seconds - (time.monotonic() - started))
        if args.dry_run:
            commands = [[sys.executable, "-c", f"import time; time.sleep({seconds})"] for _ in commands]
        t = time.monotonic() - watch.t0
        procs = [
            subprocess.Popen(
                c,
                cwd=ROOT,
                env=env,
                stdout=open(out / f"job{n:02d}-{name}-{i}.log", "w"),  # noqa: SIM115
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            for i, c in enumerate(commands)
        ]
        deadline = time.monotonic() + seconds + (0 if killed else 120)
        while time.monotonic() < deadline and any(p.poll() is None for p in procs):
            time.sleep(0.5)
            if killed and time.monotonic() >= deadline:
                break
        for p in procs:
            kill_tree(p.pid)  # also a job that ended: ranks stuck in teardown would hold the GPUs
            p.wait()
        jobs.append(
            {
                "job": name,
                "at_s": round(t),
                "ran_s": round(time.monotonic() - watch.t0 - t),
                "returncodes": [p.returncode for p in procs],
                "killed": killed or any(p.returncode for p in procs),
            }
        )
        n += 1
        partial = summarise(watch, exporter, exporter.poll() is None, started, jobs)
        (out / "summary.json").write_text(json.dumps(partial, indent=1))  # kept if the run is cut short
        time.sleep(3)
    time.sleep(5)
    watch.stop.set()
    thread.join(5)
    alive = exporter.poll() is None
    daemon.stop(timeout=15)
    summary = summarise(watch, exporter, alive, started, jobs)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k not in ("rss_mib_exporter_child", "jobs")}, indent=1))
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
