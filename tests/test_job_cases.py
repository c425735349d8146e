"""The job diagnosis case suite (issue 49, acceptance 1): every family of tests/job_case_list.py on the simulator
beneath the real pynvml, with a fake host /proc, polled every second of a manual clock; each case's findings scored
against what it says happened; the case across nodes through a real Prometheus (tests/job_case_fleet.py); and a
confusion table over all of them.

The grouping cases (`grouping=True`: replicas under one supervisor, jobs from one shell, a loopback rendezvous in two
namespaces, a spoofed Slurm environment, a large environment) rest on how processes are grouped into jobs
(jobs/grouping.py); each asserts the grouping as well as the findings.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.helpers.job_cases import CaseRun, run
from tests.helpers.job_scoring import report, score, tally
from tests.helpers.stack import PROMETHEUS
from tests.job_case_fleet import BOUND_S, FleetResult, run_fleet_case
from tests.job_case_named import all_cases

CASES = {case.name: case for case in all_cases()}
pytestmark = pytest.mark.slow  # minutes of simulated jobs
needs_prometheus = pytest.mark.skipif(PROMETHEUS is None, reason="Debian's prometheus (the README test command)")


@functools.cache
def result(name: str, work: Path) -> CaseRun:
    return run(CASES[name], work)


@functools.cache
def fleet_result(work: Path) -> FleetResult:
    return run_fleet_case(work / "fleet")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("job-cases")


@pytest.mark.parametrize("name", list(CASES))
def test_case(name: str, work: Path) -> None:
    scored = score(result(name, work))
    print(report(tally([scored])))
    assert scored.passed, report(tally([scored]))


@needs_prometheus
def test_the_fleet_names_a_two_node_straggler_of_a_job_twelve_minutes_old_within_90_s(work: Path) -> None:
    found = fleet_result(work)
    print(found.row())
    assert found.answers > 40 and found.passed, found.row()


@needs_prometheus
def test_the_suite_holds_its_precision_recall_and_latency(work: Path) -> None:
    totals = tally(score(result(name, work)) for name in CASES)
    fleet = fleet_result(work)
    totals.count.update(
        expected=1,
        found=fleet.named_after is not None,
        in_time=fleet.passed or (fleet.named_after is not None and fleet.named_after <= BOUND_S),
        right_episodes=fleet.named_after is not None,
        false_episodes=len(fleet.wrong),
    )
    print("\n" + report(totals, [fleet.row()]))
    assert len(CASES) + 1 >= 30
    assert totals.count["false_hangs"] == 0
    assert totals.precision >= 0.95 and totals.recall >= 0.90
    assert totals.worst <= 60 and fleet.named_after is not None and fleet.named_after <= BOUND_S
