"""``snapshotd-bench scale``: a real coordinator against a few simulated sidecars, end to end, at tiny sizes."""

from __future__ import annotations

import json
import math
import pstats
import resource

import pytest

from snapshotd.bench import cli, scale
from snapshotd.bench.report import Report
from snapshotd.bench.simsidecars import HeartbeatFrames, raise_nofile
from snapshotd.proto import Heartbeat, InventoryItem, ProtocolError, RankInfo, decode, encode

_FAST = ["--window", "1", "--settle", "0.2", "--heartbeat-timeout", "1.0", "--timeout", "10"]


def test_heartbeat_frames_are_what_proto_encodes() -> None:
    ranks = (RankInfo("j", 8, 16, 100_008, True), RankInfo("j", 9, 16, 100_009, False))
    inventory = (InventoryItem("j", 8, 5, True), InventoryItem("j", 1, 4, False))
    hb = Heartbeat(
        node="sim-1",
        incarnation="1",
        changed=True,
        ranks=ranks,
        inventory=inventory,
        bytes_out=3,
        bytes_in=2,
        stored_bytes=1,
    )
    frames = HeartbeatFrames()
    fixed = frames.sidecar("sim-1", "1", [list(dataclass_values(r)) for r in ranks])
    head = frames.frame(fixed, True, [list(dataclass_values(i)) for i in inventory], 3, 2, 1)
    assert head == bytes(encode(hb)[0])
    assert decode([head]) == hb
    quiet = frames.frame(fixed, False, [], 4, 3, 2)
    assert quiet == bytes(
        encode(
            Heartbeat(node="sim-1", incarnation="1", changed=False, bytes_out=4, bytes_in=3, stored_bytes=2)
        )[0]
    )
    with pytest.raises(ProtocolError):  # the checks encode runs
        frames.frame(fixed, True, [["j", -1, 5, True]], 3, 2, 1)


def dataclass_values(record: RankInfo | InventoryItem) -> tuple[object, ...]:
    return tuple(getattr(record, name) for name in record.__dataclass_fields__)


def test_raise_nofile_refuses_beyond_the_hard_limit() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files")
    with pytest.raises(OSError, match="hard limit"):
        raise_nofile(hard + 1)


def test_scale_small_end_to_end(tmp_path) -> None:
    out, png = tmp_path / "scale.json", tmp_path / "scale.png"
    assert cli.main(["scale", "--sidecars", "20", "--json", str(out), "--plot", str(png), *_FAST]) == 0
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    doc = json.loads(out.read_text())
    assert doc["bench"] == "scale"
    assert set(doc["summary"]) == {"sidecars", "heartbeats_per_s", "coordinator_cpu", "plan_ms_p99"}
    (row,) = doc["results"]
    assert row["sidecars"] == doc["summary"]["sidecars"] == 20
    assert row["up"] == 20 and row["reregistered"] == 0
    assert row["hb_interval_s"] == 0.5 and row["hb_ratio"] > 0.5, row  # 20 sidecars: the configured interval
    assert row["death_timeout_s"] == 1.0, row
    assert 0 < row["coordinator_cpu"] < 1.5
    assert 0 < row["status_ms"] < 5000  # the status document asked for halfway through the window
    # every rank (19 live nodes' and the replacement's) got its plan in the one round, timed from its freeze
    assert row["freeze_s"] is not None and row["plan_samples"] == 160
    assert row["plan_answered"] == row["plan_samples"] and row["plan_wrong"] == 0, row
    assert 0 < row["plan_p50_ms"] <= row["plan_p99_ms"] == doc["summary"]["plan_ms_p99"] < 5000
    # the coordinator's part of the latest answer
    assert 0 <= row["plan_answer_ms"] <= row["plan_max_ms"], row


def test_scale_profile_writes_a_loadable_profile(tmp_path) -> None:
    prof = tmp_path / "coord.prof"
    out = tmp_path / "scale.json"
    assert cli.main(["scale", "--sidecars", "4", "--profile", str(prof), "--json", str(out), *_FAST]) == 0
    stats = pstats.Stats(str(tmp_path / "coord-4.prof"))
    assert any(func[2] == "heartbeat" for func in stats.stats)  # type: ignore[attr-defined]
    (row,) = json.loads(out.read_text())["results"]
    assert row["plan_wrong"] == 0 and math.isfinite(row["coordinator_cpu"])


def test_plot_leaves_out_values_not_measured(tmp_path) -> None:
    rows = [
        {
            "sidecars": 10,
            "heartbeats_per_s": 20.0,
            "hb_interval_s": 0.5,
            "coordinator_cpu": 0.1,
            "plan_p50_ms": 3.0,
            "plan_p99_ms": 9.0,
        },
        {
            "sidecars": 100,
            "heartbeats_per_s": 200.0,
            "hb_interval_s": 0.5,
            "coordinator_cpu": 0.2,
            "plan_p50_ms": math.nan,
            "plan_p99_ms": None,
            "hb_rtt_p50_ms": math.inf,
        },
    ]
    png = tmp_path / "scale.png"
    scale.plot(Report("scale", {"heartbeat_interval": 0.5}, rows, {}, columns=list(rows[0])), str(png))
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")  # no warning (the suite's warnings are errors)
