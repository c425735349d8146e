"""Stragglers, hangs and balanced jobs on a GPU host, with gpuwarden watching from outside (issue 37).

Each run starts a DDP job (bench/workloads/train.py under torchrun, NCCL, one rank per GPU), lets it run balanced,
then injects a straggler at a chosen rank and cause from a known instant (or none, for balanced runs). Meanwhile it
reads gpuwarden's /api/v1/diagnosis every 2 s and records what the exporter said: which GPU it named, the cause, the
waiters, how long after the onset, and every bottleneck class a waiting GPU got. Results: one JSON line per run and
a table (`--md`).

Run from the repository root on the GPU host, gpuwarden importable (bench/source_env.sh):
    python3 bench/straggler_suite.py --gpus 2 --out OUT [--runs cpu:1,input:0,...]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

PORT = 10047
ROOT = Path(__file__).resolve().parents[1]
HOG = """
import sys, time, torch
torch.cuda.set_device(int(sys.argv[1]))
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
end = time.time() + float(sys.argv[2])
while time.time() < end:
    (a @ a).sum().item()
"""


def get(path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=10) as answer:
        return json.loads(answer.read())


def start_exporter(out: Path, window: int | None) -> subprocess.Popen:
    args = [sys.executable, "-m", "gpuwarden", "--web.listen-address", f"127.0.0.1:{PORT}", "--processes.proc-root",
            "/proc"]  # fmt: skip
    if window:
        thresholds = out / "thresholds.yaml"
        thresholds.write_text(f"bottleneck_window_s: {window}\n")
        args += ["--health.thresholds-file", str(thresholds)]
    proc = subprocess.Popen(args, stdout=(out / "exporter.log").open("w"), stderr=subprocess.STDOUT)
    for _ in range(120):
        try:
            get("/api/v1/gpus")
            return proc
        except OSError:
            time.sleep(0.5)
    raise SystemExit("the exporter did not answer")


def run(
    out: Path, gpus: int, kind: str, rank: int | None, balanced_s: float, straggle_s: float, extra: list[str]
) -> dict:
    name = f"{kind}-r{rank}" if rank is not None else kind
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "PYTHONUNBUFFERED": "1"}
    seconds = str(balanced_s + straggle_s + 30)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(gpus),
               str(ROOT / "bench/workloads/train.py"), "--seconds", seconds, *extra]  # fmt: skip
    hog = None
    onset_file = out / f"{name}.onset"
    onset_file.unlink(missing_ok=True)
    if kind in ("cpu", "sleep", "input", "hang"):
        seconds = {"cpu": "0.3", "sleep": "0.3", "input": "0.04", "hang": "0"}[kind]
        command += ["--slow-rank", str(rank), "--slow-kind", kind, "--slow-seconds", seconds, "--onset-file",
                    str(onset_file)]  # fmt: skip
    for _ in range(60):  # the last run's ranks gone from every GPU: a new job never shares a GPU with a dying one
        if not any(g.get("processes") for g in get("/api/v1/gpus")["gpus"]):
            break
        time.sleep(1)
    job_log = (out / f"{name}.job.log").open("w")
    started = time.time()
    job = subprocess.Popen(command, stdout=job_log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    # the onset counts from the first step, not from the launch: wait for the job to hold every GPU
    while time.time() - started < 120:
        held = [g for g in get("/api/v1/gpus")["gpus"] if g.get("processes")]
        if len(held) >= gpus:
            break
        time.sleep(1)
    time.sleep(5)  # NCCL set up, steps running
    onset = time.time() + balanced_s
    onset_file.write_text(str(onset))  # the ranks read it each step: the straggler starts at that instant
    samples = []
    hog_started = False
    while time.time() < onset + straggle_s:
        now = time.time()
        if kind == "gpu" and not hog_started and now >= onset:
            hog = subprocess.Popen([sys.executable, "-c", HOG, str(rank), str(straggle_s + 5)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)  # fmt: skip
            hog_started = True
        try:
            findings = get("/api/v1/diagnosis")["findings"]
        except OSError as error:
            findings = [{"error": str(error)}]
        samples.append({"t": round(now - onset, 1), "findings": findings})
        time.sleep(2)
    os.killpg(job.pid, signal.SIGKILL)
    job.wait()
    if hog is not None:
        hog.kill()
        hog.wait()
    with (out / f"{name}.samples.jsonl").open("w") as handle:  # what the exporter said, every 2 s
        handle.writelines(json.dumps(sample) + "\n" for sample in samples)
    return summarise(name, kind, rank, samples)


def summarise(name: str, kind: str, rank: int | None, samples: list[dict]) -> dict:
    named_at, named, cause, waiters, classes_while_waiting = None, None, None, [], set()
    job_findings_before = 0
    for sample in samples:
        for finding in sample["findings"]:
            check = finding.get("check")
            if check == "bottleneck" and sample["t"] > 0 and finding.get("gpu") != rank:
                classes_while_waiting.add(finding["observed"].split(":")[0])
            if check in ("straggler", "collective_hang", "waiting_elsewhere"):
                if sample["t"] < 0:
                    job_findings_before += 1
                elif named_at is None:
                    named_at, named = sample["t"], finding.get("gpu")
                    cause = (finding.get("job") or {}).get("cause")
                    waiters = [w["gpu"] for w in (finding.get("job") or {}).get("waiting", [])]
                    kind_found = check
    result = {"run": name, "kind": kind, "rank": rank, "named_at_s": named_at, "named_gpu": named, "cause": cause,
              "waiters": waiters, "findings_before_onset": job_findings_before,
              "waiter_classes": sorted(classes_while_waiting)}  # fmt: skip
    if named_at is not None:
        result["finding"] = kind_found
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--runs", default="cpu:1,cpu:0,input:1,gpu:0,hang:1,balanced:")
    parser.add_argument("--balanced-s", type=float, default=20)
    parser.add_argument("--straggle-s", type=float, default=60)
    parser.add_argument("--window", type=int, default=None, help="bottleneck_window_s (default: the exporter's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    exporter = start_exporter(args.out, args.window)
    results = []
    try:
        for spec in args.runs.split(","):
            kind, rank, seconds = (spec.split(":") + ["", ""])[:3]  # kind:rank[:seconds of straggling]
            extra = ["--checkpoint-every", "100"] if kind == "balanced" else []  # a checkpoint every ~15 s
            straggle = float(seconds) if seconds else args.straggle_s
            result = run(args.out, args.gpus, kind, int(rank) if rank else None, args.balanced_s, straggle, extra)
            results.append(result)
            print(json.dumps(result), flush=True)
            with (args.out / "results.jsonl").open("a") as handle:
                handle.write(json.dumps(result) + "\n")
    finally:
        exporter.terminate()
        exporter.wait(10)


if __name__ == "__main__":
    main()
