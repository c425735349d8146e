"""What gpuwarden said during bench/straggler_suite.py's runs, judged against what was injected (issue 37).

Reads OUT/events.jsonl and OUT/samples.jsonl (one folder per call) and prints, as Markdown:
- per straggler injection: when the job finding first named a GPU (seconds after the onset), whether it named the
  right GPU, cause and waiters, any finding that named another GPU, the classes the waiting GPUs got, and (for a
  two-node run) when the fleet service named the straggler's node and GPU (bench/straggler_replay.py replays
  the recorded answers through this checkout's rules);
- the job findings seen while the job ran balanced (the warm-up);
- per suite run: the bottleneck class each GPU got over the run's last `--last-s` seconds (the most frequent) and
  the job findings seen.
    python3 bench/straggler_report.py OUT [OUT...]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

JOB_CHECKS = ("straggler", "collective_hang", "waiting_elsewhere")
# what a right diagnosis says the cause is, per injected kind (a sleeping rank's threads are all asleep: the cause is
# not one of the four, and the finding says so: "unknown" with every thread asleep)
EXPECTED_CAUSE = {"cpu": "cpu", "input": "input", "gpu": "slower_gpu", "sleep": "unknown", "hang": None}


def load(folder: Path) -> tuple[list[dict], list[dict]]:
    events = [json.loads(line) for line in (folder / "events.jsonl").open()]
    samples = [json.loads(line) for line in (folder / "samples.jsonl").open()]
    return events, samples


def gpu_class(finding: dict) -> str:
    return finding.get("observed", "").split(":")[0]


def injections(folder: Path) -> tuple[list[dict], list[dict]]:
    events, samples = load(folder)
    onsets = [e for e in events if e.get("what") == "onset"]
    rows = []
    for number, onset in enumerate(onsets):
        start, end, rank = onset["onset"], onset["end"], onset["rank"]
        window = [s for s in samples if start <= s["wall"] <= end]
        # the fleet reads 1m rates of scraped counters: it may name the straggler after the injection ended, up to
        # the 120 s (or the next onset)
        later = onsets[number + 1]["onset"] if number + 1 < len(onsets) else float("inf")
        fleet_window = [s for s in samples if start <= s["wall"] <= min(start + 120, later)]
        row: dict = {"folder": folder.parent.name, "kind": onset["kind"], "rank": rank, "samples": len(window)}
        wrong, classes, named = Counter(), Counter(), None
        fleet_at = None
        for sample in window:
            t = sample["wall"] - start
            for finding in sample["findings"]:
                if finding.get("check") == "bottleneck" and finding.get("gpu") != rank:
                    classes[gpu_class(finding)] += 1
                if finding.get("check") not in JOB_CHECKS:
                    continue
                job = finding.get("job") or {}
                straggler = (job.get("straggler") or {}).get("gpu", finding.get("gpu"))
                if straggler != rank:
                    wrong[f"{finding['check']} GPU {straggler}"] += 1
                elif named is None:
                    named = {"t": round(t, 1), "check": finding["check"], "cause": job.get("cause"),
                             "waiting": sorted(w["gpu"] for w in job.get("waiting", [])),
                             "shares": [w.get("wait_share") for w in job.get("waiting", [])]}  # fmt: skip
        for sample in fleet_window:
            fleet = sample.get("fleet_jobs") or {}
            for job in fleet.get("jobs", []) if isinstance(fleet, dict) else []:
                straggler = job.get("straggler") or {}
                if fleet_at is None and straggler and str(straggler.get("gpu")) == str(rank):
                    t = sample["wall"] - start
                    fleet_at = {"t": round(t, 1), "node": straggler.get("node"), "gpu": straggler.get("gpu")}
        row.update(named=named, wrong=dict(wrong), waiter_classes=dict(classes), fleet=fleet_at)
        expected = EXPECTED_CAUSE[onset["kind"]]
        others = sorted({g for s in window for f in s["findings"] if (g := f.get("gpu")) is not None} - {rank})
        row["right_gpu"] = named is not None and named["t"] <= 60
        row["right_waiters"] = named is not None and named["waiting"] == others
        if onset["kind"] == "hang":
            row["right_cause"] = named is not None and any(
                f.get("check") == "collective_hang" for s in window for f in s["findings"]
            )
        else:
            row["right_cause"] = named is not None and named["cause"] == expected
        rows.append(row)
    balanced = [s for s in samples if s.get("label") == "warmup"]
    return rows, balanced


def suite_runs(folder: Path, last_s: float) -> list[dict]:
    events, samples = load(folder)
    rows = []
    for start, end in zip(
        [e for e in events if e.get("what") == "run"], [e for e in events if e.get("what") == "run end"], strict=False
    ):
        window = [s for s in samples if start["wall"] <= s["wall"] <= end["wall"]]
        tail = [s for s in window if s["wall"] >= end["wall"] - last_s]
        for name, gpus in start["gpus"].items():
            classes, details = Counter(), Counter()
            for sample in tail:
                for finding in sample["findings"]:
                    if finding.get("check") == "bottleneck" and finding.get("gpu") in gpus:
                        classes[gpu_class(finding)] += 1
                        details[finding.get("likely_cause", "")[:90]] += 1
            job_findings = Counter(
                f["check"]
                for s in window
                for f in s["findings"]
                if f.get("check") in JOB_CHECKS and f.get("gpu") in gpus
            )
            rows.append({"run": name, "gpus": gpus, "expected": start["expected"][name], "classes": dict(classes),
                         "cause_text": details.most_common(1)[0][0] if details else "", "samples": len(tail),
                         "job_findings": dict(job_findings)})  # fmt: skip
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--last-s", type=float, default=20)
    args = parser.parse_args()
    for folder in args.folders:
        events, _ = load(folder)
        if any(e.get("what") == "onset" for e in events):
            rows, balanced = injections(folder)
            for row in rows:
                print(json.dumps(row))
            job = Counter(f["check"] for s in balanced for f in s["findings"] if f.get("check") in JOB_CHECKS)
            span = balanced[-1]["wall"] - balanced[0]["wall"] if balanced else 0
            print(json.dumps({"folder": str(folder), "balanced_samples": len(balanced), "balanced_s": round(span, 1),
                              "job_findings_while_balanced": dict(job)}))  # fmt: skip
        else:
            for row in suite_runs(folder, args.last_s):
                print(json.dumps(row))


if __name__ == "__main__":
    main()
