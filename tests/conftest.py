"""Suite-wide settings."""

from __future__ import annotations

import os

import pytest

from snapshotd.bench.warm import WARM_ENV

# the harnesses fork their rank processes from a server that imported torch once (the stories start dozens; see
# snapshotd.bench.warm); a value in the environment wins, 0 starts every process cold
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
