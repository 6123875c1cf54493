"""The live fuzz, short: random and mutated messages at every live socket, and the daemons live on.

``make fuzz`` sends a million messages to each socket; this sends 15,000, with a fixed seed, and checks
what the full run checks (see :mod:`snapshotd.bench.fuzz`).
"""

from __future__ import annotations

import pytest

from snapshotd.bench.cli import main
from snapshotd.bench.fuzz import Mutator
from snapshotd.proto import ProtocolError, decode

pytestmark = pytest.mark.integration


def test_the_mutator_draws_every_kind_of_message_and_the_same_from_the_same_seed() -> None:
    a, b = Mutator(7), Mutator(7)
    drawn = [a.message() for _ in range(3000)]
    assert drawn == [b.message() for _ in range(3000)]
    decoded = refused = 0
    types: set[str] = set()
    for frames in drawn:
        try:
            types.add(decode(frames).TYPE)
            decoded += 1
        except ProtocolError:
            refused += 1
    assert decoded > 300 and refused > 1000, (decoded, refused)  # valid ones and hostile ones, both plenty
    assert len(types) >= 20, types  # valid messages of (nearly) every type


@pytest.mark.timeout(300)
def test_live_fuzz_of_every_socket_leaves_every_daemon_serving(
    tmp_path, capsys: pytest.CaptureFixture[str]
) -> None:
    json_path = tmp_path / "fuzz.json"
    status = main(
        [
            "fuzz",
            "--messages",
            "8000",
            "--seed",
            "11",
            "--answer-timeout",
            "5",
            "--json",
            str(json_path),
            "--workdir",
            str(tmp_path / "work"),
        ]
    )
    out = capsys.readouterr().out
    assert status == 0, out
    assert "seed 11" in out and "restore_bit_identical: True" in out, out
