"""The case suite's scoring (issue 49): per episode (a run of polls naming one GPU with one kind of finding), against
what each case says happened (tests/helpers/job_cases.py), and the confusion table over all cases.

- an expectation is *found* when an episode of its kind names its GPU starting at or after its onset, within its
  bound (60 s on a node; a hang: the hang's own delay plus the window);
- an episode that matches no expectation, or starts before the onset, is *false*; one that outlives its
  expectation's end by more than the clearing allowance is *stale*; a false hang is counted apart.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from tests.helpers.job_cases import Case, CaseRun, Expect, Poll

# --- episodes --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Episode:
    check: str
    gpu: int | None
    start: float
    end: float  # the last poll naming it
    cause: str


def episodes(polls: list[Poll]) -> list[Episode]:
    open_: dict[tuple[str, int | None], tuple[float, float, str]] = {}
    done: list[Episode] = []
    for poll in polls:
        for key in list(open_):
            if key not in poll.named:
                start, last, cause = open_.pop(key)
                done.append(Episode(key[0], key[1], start, last, cause))
        for key in poll.named:
            start, _, cause = open_.get(key, (poll.t, poll.t, poll.causes.get(key, "")))
            open_[key] = (start, poll.t, cause)
    done += [Episode(k[0], k[1], s, last, c) for k, (s, last, c) in open_.items()]
    return sorted(done, key=lambda e: (e.start, str(e.gpu)))


def _matches(episode: Episode, expect: Expect, case: Case) -> bool:
    if episode.gpu != expect.gpu:
        return False
    if expect.kind == "collective_hang":  # a stopped rank is a straggler first, then named in the hang
        allowed = {"collective_hang", "straggler"} if expect.gpu is not None else {"collective_hang"}
    else:
        allowed = {expect.kind}
    end = case.seconds if expect.end is None else expect.end
    return episode.check in allowed and expect.start <= episode.start <= end + case.clear_within


@dataclass
class Score:
    case: Case
    found: list[tuple[Expect, float | None, str]]  # each expectation: seconds to name it (None: missed), cause
    right: list[Episode]
    false: list[Episode]
    stale: list[Episode]  # right GPU, named long after its straggle ended
    grouping_ok: bool
    causes_right: int = 0  # expectations with a cause named with it within their bound

    @property
    def false_hangs(self) -> int:
        return sum(e.check == "collective_hang" for e in self.false)

    @property
    def passed(self) -> bool:
        named_in_time = all(at is not None and at <= e.within for e, at, _ in self.found)
        return named_in_time and not self.false and not self.stale and self.grouping_ok


def score(result: CaseRun) -> Score:
    case = result.case
    seen = episodes(result.polls)
    found: list[tuple[Expect, float | None, str]] = []
    right: set[Episode] = set()
    stale: list[Episode] = []
    for expect in case.expect:
        matching = [e for e in seen if _matches(e, expect, case)]
        right |= set(matching)
        named = [e for e in matching if expect.kind != "collective_hang" or e.check == "collective_hang"]
        first = min(named, key=lambda e: e.start, default=None)
        found.append((expect, None if first is None else first.start - expect.start, first.cause if first else ""))
        end = case.seconds if expect.end is None else expect.end
        stale += [e for e in matching if e.end > end + case.clear_within]
    false = [e for e in seen if e not in right]
    causes = sum(_cause_named(result.polls, e) for e in case.expect if e.cause)
    right_sorted = sorted(right, key=lambda e: e.start)
    return Score(case, found, right_sorted, false, stale, _grouping_ok(case, result.groups), causes)


def _cause_named(polls: list[Poll], expect: Expect) -> bool:
    """Whether the expectation's GPU was named with its cause at some poll within its bound."""
    check = "straggler" if expect.kind == "straggler" else "collective_hang"
    key = (check, expect.gpu)
    return any(p.causes.get(key) == expect.cause for p in polls if expect.start <= p.t <= expect.start + expect.within)


def _grouping_ok(case: Case, groups: dict[int, str]) -> bool:
    keys = [{groups.get(gpu) for gpu in group} for group in case.groups]
    each_one = all(len(k) == 1 and None not in k for k in keys)
    apart = len({next(iter(k)) for k in keys if len(k) == 1}) == len(keys)
    return each_one and apart


# --- the report -----------------------------------------------------------------------------------------------


@dataclass
class Totals:
    """Summed over the cases: `count` of expected, found, in_time (expectations), right_episodes, false_episodes,
    false_hangs, stale (episodes), causes_expected, causes_right; the slowest naming on a node; the table's rows."""

    count: Counter[str] = field(default_factory=Counter)
    worst: float = 0.0
    rows: list[str] = field(default_factory=list)

    @property
    def precision(self) -> float:
        right = self.count["right_episodes"]
        named = right + self.count["false_episodes"] + self.count["stale"]
        return 1.0 if named == 0 else right / named

    @property
    def recall(self) -> float:
        expected = self.count["expected"]
        return 1.0 if expected == 0 else self.count["in_time"] / expected


def tally(scores: Iterable[Score]) -> Totals:
    totals = Totals()
    for s in scores:
        totals.count.update(
            expected=len(s.found),
            found=sum(at is not None for _, at, _ in s.found),
            in_time=sum(at is not None and at <= e.within for e, at, _ in s.found),
            right_episodes=len(s.right),
            false_episodes=len(s.false),
            false_hangs=s.false_hangs,
            stale=len(s.stale),
            causes_expected=sum(1 for e in s.case.expect if e.cause),
            causes_right=s.causes_right,
        )
        totals.worst = max([totals.worst] + [at for e, at, _ in s.found if at is not None and e.within <= 60])
        totals.rows.append(_row(s))
    return totals


def _row(s: Score) -> str:
    want = ", ".join(
        f"{e.kind} GPU {'-' if e.gpu is None else e.gpu}@{e.start:g}"
        + (f": {at:.0f} s" if at is not None else ": MISSED")
        + (f" ({cause})" if cause else "")
        for e, at, cause in s.found
    )
    false = ", ".join(f"{e.check} GPU {e.gpu} {e.start:g}-{e.end:g} s ({e.cause})" for e in s.false + s.stale)
    verdict = "ok" if s.passed else "FAIL"
    group = "" if s.grouping_ok else " grouping wrong;"
    return (
        f"| {s.case.name} | {s.case.family}{' (grouping)' if s.case.grouping else ''} | {want or 'nothing'} | "
        f"{false or '-'} |{group} {verdict} |"
    )


def report(totals: Totals, extra: Iterable[str] = ()) -> str:
    """The confusion table: per case, then the totals."""
    head = ["| case | family | expected: named after | false or stale findings | verdict |", "|---|---|---|---|---|"]
    c = totals.count
    negatives_named = c["false_episodes"] + c["stale"]
    lines = [
        *head,
        *totals.rows,
        *extra,
        "",
        "| | named (in time) | named late | missed | named, wrong or stale |",
        "|---|---|---|---|---|",
        f"| expected stragglers and hangs ({c['expected']}) | {c['in_time']} | {c['found'] - c['in_time']} | "
        f"{c['expected'] - c['found']} | |",
        f"| nothing to name | | | | {negatives_named} (false hangs: {c['false_hangs']}) |",
        "",
        f"precision {totals.precision:.3f} (right episodes {c['right_episodes']} of "
        f"{c['right_episodes'] + negatives_named}), recall {totals.recall:.3f} ({c['in_time']} of "
        f"{c['expected']} in time), slowest on a node {totals.worst:.0f} s, false hangs {c['false_hangs']}, "
        f"causes named right {c['causes_right']} of {c['causes_expected']}",
    ]
    return "\n".join(lines)
