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
    """Mark ``serial`` every test that starts rank processes or times a job: the integration stories and the
    benchmarks' smoke tests. ``make test`` runs the others first on two workers (pytest-xdist), then these alone,
    one after another, so that none of them shares the machine with another test."""
    for item in items:
        if item.get_closest_marker("integration") or item.nodeid.startswith("tests/bench/"):
            item.add_marker(pytest.mark.serial)
