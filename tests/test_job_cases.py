"""The job diagnosis case suite (issue 49, acceptance 1): every family of tests/job_case_list.py on the simulator
beneath the real pynvml, with a fake host /proc, polled every second of a manual clock; each case's findings scored
against what it says happened, and a confusion table over all of them.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from tests.helpers.job_cases import CaseRun, report, run, score, tally
from tests.job_case_list import all_cases

CASES = {case.name: case for case in all_cases()}
pytestmark = pytest.mark.slow  # minutes of simulated jobs


@functools.cache
def result(name: str, work: Path) -> CaseRun:
    return run(CASES[name], work)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("job-cases")


@pytest.mark.parametrize("name", list(CASES))
def test_case(name: str, work: Path) -> None:
    scored = score(result(name, work))
    print(report(tally([scored])))
    assert scored.passed, report(tally([scored]))


def test_the_suite_holds_its_precision_recall_and_latency(work: Path) -> None:
    totals = tally(score(result(name, work)) for name in CASES)
    print("\n" + report(totals))
    assert len(CASES) >= 30
    assert totals.false_hangs == 0
    assert totals.precision >= 0.95 and totals.recall >= 0.90
    assert totals.worst <= 60
