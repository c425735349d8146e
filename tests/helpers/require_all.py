"""A pytest plugin: in CI every tool is installed, so a skip means a test silently stopped running. With
CI_REQUIRE_ALL_TESTS=1 (set by .ci/run) any skip fails the run; elsewhere a missing tool skips its tests with one
line saying what is missing. Loaded by tests/conftest.py."""

from __future__ import annotations

import os

import pytest


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if os.environ.get("CI_REQUIRE_ALL_TESTS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    if skipped:
        reasons = sorted({str(r.longrepr[-1]) if isinstance(r.longrepr, tuple) else str(r.longrepr) for r in skipped})
        reporter.write_line(f"CI_REQUIRE_ALL_TESTS: {len(skipped)} test(s) skipped, which CI does not allow: {reasons}")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
