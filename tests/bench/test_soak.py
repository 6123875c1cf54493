"""The soak, short: two trials of a real training job, each with a fault that the other tests leave out (the
coordinator killed while a recovery round is open; a sidecar stopped past the death timeout), each ending
bit-identical. ``make soak`` runs a hundred trials drawn from every fault (see :mod:`snapshotd.bench.soak`); a
node's loss alone is the pressure test here and tests/integration's."""

from __future__ import annotations

import json

import pytest

from snapshotd.bench.cli import main
from snapshotd.client.schedule import max_steps_lost

pytestmark = pytest.mark.integration

FAULTS = ("coordinator-in-recovery", "sidecar-stop")


@pytest.mark.long  # make soak runs a hundred such trials; the stride story below stays in make test
@pytest.mark.timeout(400)
def test_two_faults_each_end_in_a_bit_identical_restore(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    json_path = tmp_path / "soak.json"
    status = main(
        [
            "soak",
            "--trials",
            "2",
            "--seed",
            "47",
            "--cycle",
            "--faults",
            ",".join(FAULTS),
            "--steps",
            "12",
            "--step-delay",
            "0.05",
            "--max-hang",
            "2.0",
            "--json",
            str(json_path),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    report = json.loads(json_path.read_text())
    rows = report["results"]
    assert [r["fault"] for r in rows] == list(FAULTS)
    assert all(r["passed"] for r in rows), rows
    assert report["summary"]["trials"] == report["summary"]["passed"] == 2
    # at least one process stayed stopped past the coordinator's death timeout (1.5 s), and nothing was lost to it
    assert any(r["hang_s"] > 1.5 for r in rows if r["fault"].endswith("-stop")), rows
    assert all(r["steps_lost"] <= max_steps_lost(r["stride"]) for r in rows), rows
    assert "seed: 47" in out and "passed: 2" in out


@pytest.mark.timeout(300)
def test_under_pressure_the_stride_grows_and_a_node_loss_stays_within_its_bound(tmp_path, capsys) -> None:
    """Sidecars held to 3 MB/s, a fifth of what a snapshot after every step needs here: the ranks skip snapshots
    and their stride grows, and a node killed then costs more steps, but no more than the README's bound."""
    json_path = tmp_path / "soak.json"
    status = main(
        [
            "soak",
            "--trials",
            "1",
            "--seed",
            "2",
            "--faults",
            "node-kill",
            "--steps",
            "16",
            "--step-delay",
            "0.05",
            "--max-rate",
            "3MB/s",
            "--no-noise",
            "--json",
            str(json_path),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    (row,) = json.loads(json_path.read_text())["results"]
    assert row["passed"] and row["stride"] >= 2, row  # the ranks were skipping
    assert row["steps_lost"] <= max_steps_lost(row["stride"]), row
