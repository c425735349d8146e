"""Replays the straggler runs recorded on a lent 2x H200 (docs/validation/2026-11-28-h200x2-stragglers and
-h200x2-jobs) through this checkout's job view, and says whether each injected straggler is named as then, and when.

The recordings hold every answer of /api/v1/diagnosis, every 2 s. From each answer this rebuilds what the job view
reads over its window, GPU by GPU:
- the GPU's window from its bottleneck finding (class, driver busy, SM, tensor, FP32, FP16, DRAM, NVLink, PCIe rx over
  20 s: the runs set bottleneck_window_s to the job view's 20 s), or from the straggler finding's numbers; a GPU with
  neither read a healthy class (`tensor_bound` is not a finding): it gets the job's balanced window as measured on
  those GPUs (IMPUTED: busy 55 %, SM 42 %, tensor 11 %, NVLink 17 GB/s);
- a straggler finding states since when its GPUs disagreed (`since`): its straggler's numbers and co-located process
  stand for the answers from then until the first that carries them (a healthy class was not recorded before);
- its main process's host evidence from the finding's "Host evidence (...)" or "on the host: ..." text;
- a process computing beside it where a finding named one ("another process computes on it: pid N (name, SM x%)");
- the two GPUs joined by NVLink (NV18), torchrun's job of world size 2.
Each rebuilt answer is one poll of the real CollectiveStep (jobs/collective.py) on a clock that moves as the
recording's. Limits of a replay: the texts round to 1 % and 0.1 GB/s; a healthy GPU's numbers are imputed; PCIe tx,
clocks and throttle reasons were not recorded. The per-node fleet replay (call A, one GPU per "node") runs the step
once per GPU as a node of its own and feeds its findings, with each GPU's wait now, to fleet/stragglers.py.

    python bench/straggler_replay.py [--markdown]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from gpuwarden.fleet.stragglers import stragglers_of
from gpuwarden.health.bottleneck import WindowActivity
from gpuwarden.health.thresholds import DEFAULT, Thresholds
from gpuwarden.jobs import waits
from gpuwarden.jobs.collective import CollectiveStep
from gpuwarden.model.draft import Draft
from gpuwarden.model.snapshot import HostEvidence, JobMember, PeerLink, ProcessView

ROOT = Path(__file__).resolve().parent.parent / "docs" / "validation"
GPU_NUMBERS = re.compile(
    r"driver busy (?P<busy>\d+)%, SM (?P<sm>\d+)%, tensor (?P<tensor>\d+)%, FP32 (?P<fp32>\d+)%"
    r"(?:, FP16 (?P<fp16>\d+)%, DRAM (?P<dram>\d+)%, NVLink (?P<nvlink>[\d.]+) GB/s, PCIe rx (?P<pcie>[\d.]+))?"
)
HOST = re.compile(
    r"PID (?P<pid>\d+), (?P<samples>\d+) samples\)?: main thread running (?P<main>\d+)%, I/O wait (?P<io>\d+)%, "
    r"workers running (?P<workers_running>\d+)% \((?P<workers>\d+) workers\), all asleep (?P<asleep>\d+)%"
    r"(?:, writing (?P<written>\d+) MB/s)?"
)
COTENANT = re.compile(r"another process computes on it: pid (?P<pid>\d+) \((?P<name>[^,]+), SM (?P<sm>\d+)%\)")
IMPUTED = WindowActivity(True, 0.42, 0.11, 0.01, 0.0, 0.2, 17e9, 0.0, 0.55)
UUIDS = ("GPU-replay-0", "GPU-replay-1")
CLEARED_S = 30  # the job view's window and confirmation: a straggler that ended may be named this long after
PIDS = (869, 870)


@dataclass(frozen=True)
class Injection:
    label: str
    kind: str
    rank: int
    onset: float  # on the recording's clock
    end: float
    recorded: float | None  # when the recorded job view named it (seconds after the onset), None: missed
    cause: str = ""  # the cause it gave then


@dataclass
class Gpu:
    activity: WindowActivity | None = None
    evidence: HostEvidence | None = None
    cotenant: tuple[int, str, float] | None = None


Stated = list[tuple[float, float, int, Gpu]]  # (since, first answer carrying it, GPU, what it showed)


def stated(timeline: list[tuple[float, dict]]) -> Stated:
    """What each straggler finding states of its straggler's GPU, from the time it says the GPUs began to disagree."""
    found: Stated = []
    seen: set[tuple[float, int]] = set()
    for at, answer in timeline:
        for finding in answer.get("findings", []):
            since, gpu = (finding.get("job") or {}).get("since"), finding.get("gpu")
            if finding.get("check") == "straggler" and since and gpu in (0, 1) and (since, gpu) not in seen:
                seen.add((since, gpu))
                found.append((since, at, gpu, read({"findings": [finding]})[gpu]))
    return found


def read(answer: dict, at: float | None = None, backfill: Stated = ()) -> dict[int, Gpu]:
    """One recorded answer → what each GPU's window and host showed; `backfill`: what later findings state."""
    gpus = {0: Gpu(), 1: Gpu()}
    for since, first, gpu, state in backfill:
        if at is not None and since <= at < first:
            gpus[gpu] = Gpu(state.activity, None, state.cotenant)
    for finding in answer.get("findings", []):
        gpu = finding.get("gpu")
        text = finding.get("observed", "")
        if finding.get("check") == "bottleneck" and gpu in gpus:
            gpus[gpu].activity = _activity(text) or gpus[gpu].activity
            gpus[gpu].evidence = _evidence(finding.get("likely_cause", "")) or gpus[gpu].evidence
        elif finding.get("check") in ("straggler", "collective_hang") and gpu in gpus:
            own = text[text.find("(") : text.find("(the waiters")]
            if gpus[gpu].activity is None and GPU_NUMBERS.search(own):
                gpus[gpu].activity = _activity(own)
            gpus[gpu].evidence = _evidence(text) or gpus[gpu].evidence
            if found := COTENANT.search(text):
                gpus[gpu].cotenant = (int(found["pid"]), found["name"], int(found["sm"]) / 100)
    return gpus


def _activity(text: str) -> WindowActivity | None:
    found = GPU_NUMBERS.search(text)
    if found is None:
        return None
    pct = {k: int(v) / 100 for k, v in found.groupdict().items() if v and k not in ("nvlink", "pcie")}
    nvlink = float(found["nvlink"]) * 1e9 if found["nvlink"] else IMPUTED.nvlink_bytes_per_second
    pcie = float(found["pcie"]) * 1e9 if found["pcie"] else 0.0
    return WindowActivity(True, pct["sm"], pct["tensor"], pct["fp32"], pct.get("fp16", 0.0),
                          pct.get("dram", IMPUTED.dram), nvlink, pcie, pct["busy"],
                          paths=frozenset({"nvlink", "pcie"}))  # fmt: skip


def _evidence(text: str) -> HostEvidence | None:
    found = HOST.search(text)
    if found is None:
        return None
    written = found["written"]
    return HostEvidence(int(found["pid"]), int(found["samples"]), int(found["main"]) / 100, int(found["io"]) / 100,
                        int(found["workers_running"]) / 100, int(found["asleep"]) / 100, int(found["workers"]),
                        None if written is None else int(written) * 1e6)  # fmt: skip


class Replayed:
    """What the job view of a node holding `gpus` (indices into the recording) names over a recording."""

    def __init__(self, gpus: tuple[int, ...], limits: Thresholds = DEFAULT) -> None:
        self.gpus, self.limits = gpus, limits
        self.windows: dict[str, WindowActivity | None] = {}
        self.step = CollectiveStep(lambda: self)  # type: ignore[arg-type, return-value]

    @property
    def thresholds(self) -> Thresholds:
        return self.limits

    def collective_activity(self, uuid: str, now: float) -> WindowActivity | None:
        return self.windows.get(uuid)

    def poll(self, now: float, seen: dict[int, Gpu]) -> Draft:
        uuids = tuple(UUIDS[g] for g in self.gpus)
        self.windows = {UUIDS[g]: seen[g].activity or IMPUTED for g in self.gpus}
        processes = {UUIDS[g]: _processes(g, seen[g]) for g in self.gpus}
        jobs = {UUIDS[g]: JobMember("replay/job", str(g), 2, "torchrun", PIDS[g], uuids) for g in self.gpus}
        topology = {UUIDS[g]: tuple(PeerLink(o, UUIDS[o], "NV18", 18) for o in (0, 1) if o != g) for g in self.gpus}
        draft = Draft(now, True, None, {}, (), {}, {}, {}, 0, {}, {}, topology=topology, processes=processes, jobs=jobs,
                      host_evidence={UUIDS[g]: e for g in self.gpus if (e := seen[g].evidence)})  # fmt: skip
        self.step(draft)
        return draft


def _processes(gpu: int, seen: Gpu) -> tuple[ProcessView, ...]:
    main = ProcessView(PIDS[gpu], "python", "compute", 40 << 30, 0.3, None, None, None, "", "", "", "")
    if seen.cotenant is None:
        return (main,)
    pid, name, sm = seen.cotenant
    return (main, ProcessView(pid, name, "compute", 4 << 30, 0.03, sm, None, None, "", "", "", ""))


def recordings() -> Iterator[tuple[str, list[tuple[float, dict]], list[Injection]]]:
    """(name, [(time, answer)], injections) of every recording kept."""
    folder = ROOT / "2026-11-28-h200x2-stragglers"
    runs = (("run4-cpu-r1", "cpu", 29.1, "cpu"), ("run4-gpu-r1", "gpu", None, ""), ("run3-hang-r1", "hang", None, ""))
    for name, kind, recorded, cause in runs:
        answers = [json.loads(line) for line in (folder / f"{name}.samples.jsonl").open()]
        timeline = [(a["t"], a) for a in answers]
        yield name, timeline, [Injection(name, kind, 1, 0.0, timeline[-1][0], recorded, cause)]
    jobs = ROOT / "2026-11-28-h200x2-jobs"
    report = [json.loads(line) for line in (jobs / "report.jsonl").open()]
    for call in ("A", "B"):
        events = [json.loads(line) for line in (jobs / f"call-{call}" / "events.jsonl").open()]
        with gzip.open(jobs / f"call-{call}" / "samples.jsonl.gz", "rt") as handle:
            timeline = [(a["wall"], a) for a in map(json.loads, handle)]
        recorded = [r for r in report if r["folder"] == call]
        onsets = [e for e in events if e.get("what") == "onset"]
        injections = []
        for number, event in enumerate(onsets):
            named = recorded[number]["named"] if number < len(recorded) else None
            injections.append(Injection(f"call {call} #{number + 1}", event["kind"], event["rank"], event["onset"],
                                        event["end"], named["t"] if named else None,
                                        named["cause"] if named else ""))  # fmt: skip
        yield f"call-{call}", timeline, injections


def replay(timeline: list[tuple[float, dict]], injections: list[Injection]) -> list[dict]:
    """Each injection: when this checkout's job view (one node, both GPUs) first names the injected rank, and
    anything else it names; with the per-node fleet replay where the recording has fleet answers."""
    node = Replayed((0, 1))
    per_gpu = (Replayed((0,)), Replayed((1,)))
    named: list[tuple[float, str, str | None, str]] = []
    fleet: list[tuple[float, str]] = []
    backfill = stated(timeline)
    for at, answer in timeline:
        seen = read(answer, at, backfill)
        draft = node.poll(at, seen)
        named += [(at, f.kind, f.straggler, f.cause) for f in draft.collective]
        if answer.get("fleet_jobs") is not None:
            fleet += [(at, uuid) for uuid in _fleet(at, seen, per_gpu)]
    return [_judge(i, named, fleet, timeline, injections) for i in injections]


def _fleet(at: float, seen: dict[int, Gpu], per_gpu: tuple[Replayed, Replayed]) -> list[str]:
    findings, rows = [], []
    for gpu, replayed in enumerate(per_gpu):
        draft = replayed.poll(at, seen)
        node = f"node-{'ab'[gpu]}"
        findings += [{"node": node, "kind": f.kind, "uuid": f.straggler or "", "cause": f.cause}
                     for f in draft.collective]  # fmt: skip
        now = waits.read(DEFAULT, {UUIDS[gpu]: seen[gpu].activity or IMPUTED})[UUIDS[gpu]].wait
        rows.append({"node": node, "gpu": str(gpu), "uuid": UUIDS[gpu], "rank": str(gpu), "wait_share": now,
                     "now_share": now})  # fmt: skip
    return [s["uuid"] for s in stragglers_of(rows, findings)]


def _cleared(who: str, t: float, stale: list[tuple[str, float]]) -> bool:
    return any(w == who and e <= t <= e + CLEARED_S for w, e in stale)


def _judge(injection: Injection, named: list, fleet: list, timeline: list, injections: list[Injection]) -> dict:
    """When the injection's rank is first named, and with which causes; any other GPU named meanwhile (except the
    last injection's rank within CLEARED_S of its end: the window still holds it); when the fleet named it."""
    start, end = injection.onset, injection.end
    mine = UUIDS[injection.rank]
    during = [(t - start, kind, who, cause) for t, kind, who, cause in named if start <= t <= end + CLEARED_S]
    right = [(t, kind, cause) for t, kind, who, cause in during if who == mine]
    first = min((t for t, kind, _ in right if kind == "straggler" or injection.kind == "hang"), default=None)
    fleet_at = min((t - start for t, who in fleet if who == mine and start <= t <= end + CLEARED_S), default=None)
    return {
        "injection": injection.label, "kind": injection.kind, "rank": injection.rank,
        "recorded_s": injection.recorded, "recorded_cause": injection.cause, "replayed_s": _round(first),
        "hang_s": _round(min((t for t, kind, _, _ in during if kind == "collective_hang"), default=None)),
        "causes": list(dict.fromkeys(cause for _, _, cause in sorted(right))),  # in the order they were given
        "other_named": _others(injection, during, injections), "fleet_s": _round(fleet_at),
        "answers": sum(1 for t, _ in timeline if start <= t <= end),
    }  # fmt: skip


def _others(injection: Injection, during: list, injections: list[Injection]) -> list[str]:
    mine, length = UUIDS[injection.rank], injection.end - injection.onset
    stale = [(UUIDS[i.rank], i.end - injection.onset) for i in injections if i is not injection]
    return sorted(
        f"{kind} GPU {who[-1]} at {t:+.0f} s"
        for t, kind, who, _ in during
        if t <= length and who not in (mine, None) and not _cleared(who, t, stale)
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="a Markdown table instead of JSON lines")
    args = parser.parse_args()
    rows = [row for _, timeline, injections in recordings() for row in replay(timeline, injections)]
    if not args.markdown:
        for row in rows:
            print(json.dumps(row))
        return
    print(
        "| recording | injected | recorded: named after (s), cause | replayed: named after (s) | causes given, in "
        "order | fleet, one GPU per node (s) | another GPU named |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        recorded = f"{r['recorded_s']}, {r['recorded_cause']}" if r["recorded_s"] is not None else "—"
        replayed = "—" if r["replayed_s"] is None else r["replayed_s"]
        fleet = "—" if r["fleet_s"] is None else r["fleet_s"]
        print(f"| {r['injection']} | {r['kind']}, rank {r['rank']} | {recorded} | {replayed} | "
              f"{', '.join(r['causes']) or '—'} | {fleet} | {', '.join(r['other_named']) or 'none'} |")  # fmt: skip


if __name__ == "__main__":
    main()
