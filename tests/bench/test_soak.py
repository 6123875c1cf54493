"""The soak, short: five trials of a real training job, one of each kind of fault that the other tests leave out,
each ending bit-identical (``make soak`` runs a hundred drawn ones; see :mod:`snapshotd.bench.soak`)."""

from __future__ import annotations

import json

import pytest

from snapshotd.bench.cli import main

pytestmark = pytest.mark.integration

FAULTS = ("node-kill", "coordinator-in-recovery", "sidecar-stop", "coordinator-stop", "rank-stop")


@pytest.mark.timeout(400)
def test_five_faults_each_end_in_a_bit_identical_restore(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "soak.json"
    status = main(["soak", "--trials", "5", "--seed", "5", "--cycle", "--faults", ",".join(FAULTS), "--steps", "16",
                   "--step-delay", "0.05", "--max-hang", "2.0", "--json", str(json_path),
                   "--workdir", str(tmp_path / "work")])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0, out
    report = json.loads(json_path.read_text())
    rows = report["results"]
    assert [r["fault"] for r in rows] == list(FAULTS)
    assert all(r["passed"] for r in rows), rows
    assert report["summary"]["trials"] == report["summary"]["passed"] == 5
    # at least one process stayed stopped past the coordinator's death timeout (1.5 s), and nothing was lost to it
    assert any(r["hang_s"] > 1.5 for r in rows if r["fault"].endswith("-stop")), rows
    assert all(r["steps_lost"] <= 2 * r["stride"] - 1 for r in rows), rows
    assert "seed: 5" in out and "passed: 5" in out
