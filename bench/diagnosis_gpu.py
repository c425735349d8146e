"""Issue 49, acceptance 4: on one GPU, with real PyTorch jobs, each job's bottleneck finding from an exporter that
runs as the Helm chart runs it (a plain UID, every capability dropped, the host's /proc): its class and advice, and
whether they agree with what the job does. bench/diagnosis_gpu.sh starts it on a GPU host.

For each case: a fresh exporter (no window left from the last case), the job's processes (as root: another user than
the exporter), `--settle` seconds, then /api/v1/diagnosis every 2 s for `--watch` seconds; GPU 0's bottleneck finding
is kept. Then the processes are stopped and the GPU left free. Written to OUT: diagnosis-gpu.json (every answer's
finding, the classes seen, the last finding) and diagnosis-gpu.md (a table).

With `--sim` each case's job is a simulator scenario carrying its measured numbers instead (a dry run of this script:
no GPU, no PyTorch).
    python3 bench/diagnosis_gpu.py --out OUT --exporter "setpriv ... python3 -m gpuwarden ..." [--sim]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
WORKLOADS = HERE / "workloads"
TRAINING = {"utilization": 97, "sm_active": 80, "tensor_active": 38, "fp32_active": 2, "dram_active": 40}


@dataclass(frozen=True)
class Case:
    name: str
    what: str
    cls: str  # the class a right diagnosis gives
    advice: str  # a phrase its advice must hold
    jobs: tuple[tuple[float, tuple[str, ...]], ...]  # (start after s, argv) of each process
    sim: dict = field(default_factory=dict)  # the simulator's stand-in: values and processes
    shared: bool = False  # the finding must name the second process with its SM share


def _single(job: str, seconds: float) -> tuple[str, ...]:
    return (sys.executable, str(WORKLOADS / "single_gpu.py"), "--job", job, "--seconds", f"{seconds:g}")


def cases(seconds: float) -> list[Case]:
    train = (sys.executable, str(WORKLOADS / "train.py"), "--job", "transformer", "--seconds", f"{seconds:g}")
    return [
        Case("copy-out-pageable", "device-to-host copies into pageable memory (.cpu() each step)",
             "host_transfer_bound", "pinned", ((0, _single("copy-out-pageable", seconds)),),
             {"values": {"utilization": 60, "sm_active": 0, "tensor_active": 0, "pcie_tx_bytes_per_second": 16.7e9}}),
        Case("copy-out-pinned", "device-to-host copies into a pinned buffer (non_blocking, synchronised)",
             "host_transfer_bound", "pinned", ((0, _single("copy-out-pinned", seconds)),),
             {"values": {"utilization": 45, "sm_active": 0, "tensor_active": 0, "pcie_tx_bytes_per_second": 24e9}}),
        Case("training+second-process", "a bf16 transformer training on one GPU, a bf16 matmul loop started 20 s in "
             "on the same GPU", "", "MIG slice", ((0, train), (20, _single("matmul", seconds - 20))),
             {"values": TRAINING, "tenant_sm": 60}, shared=True),
        Case("decode-tiny", "greedy decoding at batch 1 from a Python loop (12 layers, d=768, a KV cache)",
             "launch_bound", "CUDA graphs", ((0, _single("decode-tiny", seconds)),),
             {"values": {"utilization": 15, "sm_active": 2, "tensor_active": 0}}),
    ]  # fmt: skip


def scenario(case: Case, path: Path) -> Path:
    """The simulator's stand-in for a case: one H100, the case's numbers, its processes."""
    processes = [{"gpu": 0, "pid": 5001, "memory_gib": {"constant": 30}, "sm": {"constant": 40}}]
    if "tenant_sm" in case.sim:
        processes.append({"gpu": 0, "pid": 6001, "name": "python3", "memory_gib": {"constant": 4}, "at": 20,
                          "sm": {"constant": case.sim["tenant_sm"]}})  # fmt: skip
    path.write_text(yaml.safe_dump({"name": case.name, "node": {"model": "h100-sxm-80gb", "count": 1},
                                    "values": {"memory_used_ratio": 0.4, **case.sim["values"]},
                                    "processes": processes}))  # fmt: skip
    return path


def get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:  # noqa: S310 - loopback
            return json.load(answer)
    except (OSError, ValueError):
        return None


def run_case(case: Case, args: argparse.Namespace, out: Path) -> dict:
    command = shlex.split(args.exporter)
    if args.sim:
        command += ["--sim", "--nvml.scenario", str(scenario(case, out / f"{case.name}.yaml"))]
    log = (out / f"{case.name}-exporter.log").open("w")
    exporter = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    jobs: list[subprocess.Popen] = []
    answers: list[dict] = []
    try:
        _wait_ready(args.url)
        began = time.monotonic()
        pending = list(case.jobs) if not args.sim else []
        while time.monotonic() - began < args.settle + args.watch:
            elapsed = time.monotonic() - began
            while pending and pending[0][0] <= elapsed:
                _, argv = pending.pop(0)
                jobs.append(subprocess.Popen(argv, stdout=(out / f"{case.name}-job.log").open("a"),
                                             stderr=subprocess.STDOUT, start_new_session=True))  # fmt: skip
            if elapsed >= args.settle:
                found = get(f"{args.url}/api/v1/diagnosis") or {}
                mine = [f for f in found.get("findings", []) if f.get("gpu") == 0 and f.get("check") == "bottleneck"]
                answers.append({"t": round(elapsed, 1), "finding": mine[0] if mine else None,
                                "pids": [j.pid for j in jobs]})  # fmt: skip
            time.sleep(2)
    finally:
        for process in [*jobs, exporter]:
            _stop(process)
        log.close()
    if not args.sim:
        _wait_gpu_free()
    return judge(case, answers, [j.pid for j in jobs] or [5001, 6001])


def judge(case: Case, answers: list[dict], pids: list[int]) -> dict:
    findings = [a["finding"] for a in answers if a["finding"]]
    classes = Counter(f["observed"].split(":")[0] for f in findings)
    last = findings[-1] if findings else {}
    tenant = pids[1] if len(pids) > 1 else None
    agree = bool(last) and case.advice in last.get("recommended_action", "")
    agree = agree and (not case.cls or classes.most_common(1)[0][0] == case.cls)
    if case.shared:
        agree = agree and f"shared with pid {tenant} (" in last.get("observed", "")
    return {"case": case.name, "what": case.what, "expected_class": case.cls or "(any; the other process named)",
            "advice_must_hold": case.advice, "classes": dict(classes), "answers": len(answers),
            "with_finding": len(findings), "last": last, "agree": agree, "samples": answers}  # fmt: skip


def _wait_ready(url: str) -> None:
    for _ in range(240):
        if get(f"{url}/api/v1/gpus") is not None:
            return
        time.sleep(0.5)
    raise SystemExit(f"the exporter did not answer at {url} in 120 s (see its log)")


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait(10)


def _wait_gpu_free() -> None:
    for _ in range(60):
        held = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, check=False).stdout.strip()  # fmt: skip
        if not held:
            return
        time.sleep(1)
    raise SystemExit("GPU 0 is still held a minute after the case's processes were stopped")


def markdown(results: list[dict], header: str) -> str:
    lines = [header, "", "| case | what runs | class (answers) | advice (first sentence) | named beside it | agrees |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in results:
        last = r["last"] or {}
        advice = (last.get("recommended_action") or "—").split(";")[0].split(". ")[0]
        classes = ", ".join(f"{c} {n}" for c, n in sorted(r["classes"].items(), key=lambda kv: -kv[1])) or "none"
        shared = last.get("observed", "").partition("; shared with ")[2] or "—"
        lines.append(f"| {r['case']} | {r['what']} | {classes} | {advice} | {shared} | "
                     f"{'yes' if r['agree'] else '**no**'} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--exporter", required=True, help="the exporter's command line (without --sim)")
    parser.add_argument("--url", default="http://127.0.0.1:10051")
    parser.add_argument("--settle", type=float, default=45, help="seconds before watching (the window is 20 s)")
    parser.add_argument("--watch", type=float, default=30)
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--sim", action="store_true", help="a dry run over simulator stand-ins (no GPU)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    chosen = [c for c in cases(args.settle + args.watch + 15) if not args.only or c.name in args.only.split(",")]
    results = [run_case(case, args, args.out) for case in chosen]
    header = f"Exporter: `{args.exporter}`{' (simulator stand-ins)' if args.sim else ''}; {time.strftime('%F %T')}"
    (args.out / "diagnosis-gpu.json").write_text(json.dumps({"exporter": args.exporter, "sim": args.sim,
                                                              "results": results}, indent=1))  # fmt: skip
    (args.out / "diagnosis-gpu.md").write_text(markdown(results, header))
    print(markdown(results, header))
    sys.exit(0 if all(r["agree"] for r in results) else 1)


if __name__ == "__main__":
    main()
