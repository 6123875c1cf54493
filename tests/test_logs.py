"""Daemon logs: text by default, one JSON object per line with ``--log-format json`` (real daemons too)."""

from __future__ import annotations

import json
import logging
import uuid
from pathlib import Path

import pytest

from snapshotd.harness.cluster import LocalCluster
from snapshotd.logs import JsonFormatter, RateLimit, fields, setup_logging

KEYS = {"time", "level", "logger", "node", "job", "rank", "step", "event", "message"}


def _record(msg: str, *args: object, extra: dict | None = None, exc: bool = False) -> logging.LogRecord:
    record = logging.getLogger("snapshotd.test").makeRecord(
        "snapshotd.test", logging.WARNING, __file__, 1, msg, args, None, extra=extra
    )
    if exc:
        try:
            raise OSError("disk full")
        except OSError:
            import sys

            record.exc_info = sys.exc_info()
    return record


def test_a_json_line_has_every_field_and_nulls_for_the_unknown() -> None:
    line = json.loads(JsonFormatter("node-a").format(_record("rank %d restores", 3)))
    assert set(line) == KEYS
    assert (line["node"], line["message"], line["level"], line["logger"]) == (
        "node-a",
        "rank 3 restores",
        "WARNING",
        "snapshotd.test",
    )
    assert line["job"] is line["rank"] is line["step"] is line["event"] is None
    assert line["time"].endswith("+00:00")


def test_fields_and_exceptions_are_carried() -> None:
    record = _record("restored", extra=fields("run-42", 3, 17, "restore"), exc=True)
    line = json.loads(JsonFormatter(None).format(record))
    assert (line["job"], line["rank"], line["step"], line["event"]) == ("run-42", 3, 17, "restore")
    assert "OSError: disk full" in line["exc"]


def test_an_unknown_format_is_refused() -> None:
    with pytest.raises(ValueError, match="--log-format"):
        setup_logging(0, "yaml")


@pytest.mark.integration
def test_daemons_log_json_lines(tmp_path) -> None:
    node = f"json-{uuid.uuid4().hex[:6]}"
    with LocalCluster(str(tmp_path)) as cluster:
        coord = cluster.start_coordinator("tcp://127.0.0.1:0", "--log-format", "json")
        side = cluster.start_sidecar(node, "--log-format", "json")
        cluster.stop(side)
        cluster.stop(coord)
        logs = {p.name: Path(p.log_path).read_text().splitlines() for p in (coord, side)}
    for name, lines in logs.items():
        parsed = [
            json.loads(line) for line in lines if not line.startswith("snapshotd ")
        ]  # not the ready line
        assert parsed, f"{name} logged nothing"
        assert all(set(p) >= KEYS for p in parsed), parsed
    sidecar_lines = [json.loads(x) for x in logs[side.name] if not x.startswith("snapshotd ")]
    assert {p["node"] for p in sidecar_lines} == {node}


def test_a_flood_of_one_warning_is_held_back_and_counted() -> None:
    """A peer sending bad messages without end makes the same warning without end: the daemons' handler lets a
    burst of each call site through per window and then says how many it held back."""
    now = [0.0]
    limit = RateLimit(burst=3, window=60.0, clock=lambda: now[0])

    def record(msg: str, *args: object) -> logging.LogRecord:
        return logging.LogRecord("snapshotd.sidecar.daemon", logging.WARNING, __file__, 1, msg, args, None)

    passed = [limit.filter(record("data plane: %s", f"bad message {i}")) for i in range(10)]
    assert passed == [True] * 3 + [False] * 7
    assert limit.filter(record("ipc: %s", "another call site"))  # counted apart
    now[0] = 61.0
    after = record("data plane: %s", "bad message 10")
    assert limit.filter(after)
    assert after.getMessage() == "data plane: bad message 10 (7 more like this held back in the last 60 s)"
    assert limit.filter(record("data plane: %s", "bad message 11"))  # a new window, a new burst
