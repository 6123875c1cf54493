"""Suite-wide settings."""

from __future__ import annotations

import os

import pytest

from snapshotd.bench.warm import WARM_ENV

# the harnesses fork their rank processes from a server that imported torch once (the stories start dozens; see
# snapshotd.bench.warm); a value in the environment wins, 0 starts every process cold
os.environ.setdefault(WARM_ENV, "1")


_GROUP = "processes"
_ROOT = os.geteuid() == 0
_NICE = os.getpriority(os.PRIO_PROCESS, 0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``make test`` runs two workers (pytest-xdist, ``--dist loadgroup``): every test that starts rank processes
    or measures time against a job (the integration stories, the benchmarks' smoke tests, the client's multi-rank
    tests) runs on one of them, one after another, as in a serial run; the other worker takes the rest."""
    for item in items:
        if item.get_closest_marker("integration") or item.nodeid.startswith(("tests/bench/", "tests/client/")):
            item.add_marker(pytest.mark.xdist_group(_GROUP))


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, the tests outside the group run at the lowest CPU priority, those in it at the suite's own:
    the group's jobs and daemons (the sidecars run at nice 10, as on a node) then get the CPU they would have in
    a serial run, and the rest takes what is left. Only where a process may raise its priority again (root)."""
    if _ROOT and os.environ.get("PYTEST_XDIST_WORKER"):
        grouped = any(m.args == (_GROUP,) for m in item.iter_markers("xdist_group"))
        os.setpriority(os.PRIO_PROCESS, 0, _NICE if grouped else 19)
