"""Suite-wide settings."""

from __future__ import annotations

import contextlib
import os
import pathlib
from collections.abc import Generator

import pytest

from snapshotd.harness.processes import WARM_ENV

# the harnesses fork their rank processes from a server that imported torch once (the stories start dozens; see
# snapshotd.harness.processes); a value in the environment wins, 0 starts every process cold
os.environ.setdefault(WARM_ENV, "1")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` selects by the mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark ``serial`` the integration stories (real sidecars, coordinators and rank processes, timed against a
    job) and the benchmarks' smoke tests. ``make test`` runs the others first on two workers (pytest-xdist), then
    these alone, one after another, so that none of them shares the machine with another test. The others include
    a few multi-process tests (gloo ranks in ``tests/client``, a coordinator or sidecar process in
    ``tests/coordinator/test_server.py`` and ``tests/sidecar``) whose time bounds leave room for a busy machine."""
    for item in items:
        if item.get_closest_marker("integration") or item.nodeid.startswith("tests/bench/"):
            item.add_marker(pytest.mark.serial)


LOG_TAIL_LINES = 60
"""How many of each daemon log's last lines a failed test's report shows."""


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A test that failed after running daemons under ``tmp_path`` (a LocalCluster writes each one's output to a
    ``*.log`` file there) gets the last lines of every such log in its report, so that a failure seen only in CI
    can be explained from what the coordinator and the sidecars said. Clusters under a module's temporary
    directory (``tmp_path_factory``) are not covered; a daemon that fails to start already names its log's last
    lines in the error."""
    report = yield
    funcargs = getattr(item, "funcargs", None) or {}
    if report.failed and report.when == "call" and "tmp_path" in funcargs:
        for path in sorted(pathlib.Path(funcargs["tmp_path"]).rglob("*.log")):
            with contextlib.suppress(OSError):
                lines = path.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
                report.sections.append(
                    (f"daemon log {path.name} (last {len(lines)} lines)", "\n".join(lines))
                )
    return report
