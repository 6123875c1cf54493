"""The command line: units as network engineers write them, the address forms, the version, ``-v`` on either side
of the subcommand, and one line (not a traceback) for a port in use."""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys

import pytest

import snapshotd
from snapshotd.cli import _parser, main
from snapshotd.flags import endpoint
from snapshotd.units import parse_bytes, parse_duration, parse_rate


@pytest.mark.parametrize(
    ("text", "bytes_per_s"),
    [
        ("10Gbit", 1.25e9),
        ("10gbit", 1.25e9),
        ("10Gbit/s", 1.25e9),
        ("10Gbps", 1.25e9),
        ("10Gb/s", 1.25e9),  # a lowercase b is a bit
        ("10GB/s", 10e9),  # an uppercase B a byte
        ("10GBps", 10e9),
        ("10GiB/s", 10 * 2**30),
        ("100 Mbit", 12.5e6),
    ],
)
def test_rates_read_bits_and_bytes_as_network_engineers_write_them(text: str, bytes_per_s: float) -> None:
    assert parse_rate(text) == pytest.approx(bytes_per_s)


@pytest.mark.parametrize(
    ("text", "n"), [("64Gi", 64 * 2**30), ("64GiB", 64 * 2**30), ("64GB", 64e9), ("4k", 4000)]
)
def test_sizes_take_binary_and_decimal_prefixes(text: str, n: int) -> None:
    assert parse_bytes(text) == n


@pytest.mark.parametrize(("text", "s"), [("1m30s", 90.0), ("1h 2m", 3720.0), ("500ms", 0.5), ("3", 3.0)])
def test_durations_may_be_compound(text: str, s: float) -> None:
    assert parse_duration(text) == s


@pytest.mark.parametrize(
    ("parse", "text", "says"),
    [
        (parse_rate, "10 furlongs", "write bits as 10Gbit/s"),
        (parse_bytes, "lots", "cannot read 'lots' as a size"),
        (parse_duration, "1m30x", "cannot read '1m30x' as a duration"),
    ],
)
def test_a_unit_not_understood_is_named_with_examples(parse, text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse(text)


@pytest.mark.parametrize(
    ("text", "as_zmq"),
    [
        ("tcp://h:7070", "tcp://h:7070"),
        ("localhost:7070", "tcp://localhost:7070"),
        ("[::1]:7070", "tcp://[::1]:7070"),
        ("7070", "tcp://127.0.0.1:7070"),
        ("ipc:///run/x.ipc", "ipc:///run/x.ipc"),
    ],
)
def test_the_three_address_forms_are_one(text: str, as_zmq: str) -> None:
    assert endpoint(text) == as_zmq
    assert _parser().parse_args(["status", "--coordinator", text]).coordinator == as_zmq


def test_an_address_that_is_none_of_them_is_refused() -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="is not an endpoint"):
        endpoint("localhost")


def test_version_and_verbosity_on_either_side_of_the_subcommand() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "snapshotd.cli", "--version"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == f"snapshotd {snapshotd.__version__}"
    assert snapshotd.__version__ != "0+unknown"  # the package is installed
    for argv, level in ((["serve", "-v"], 1), (["-v", "serve", "-vv"], 3), (["serve"], 0)):
        args = _parser().parse_args(argv)
        assert args.verbose + args.verbose_here == level, argv


def test_a_port_in_use_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["coordinator", "--bind", f"127.0.0.1:{port}"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.splitlines()[-1].startswith("snapshotd coordinator: cannot bind the coordinator to")
    assert "in use" in err and "Traceback" not in err


def test_the_secret_comes_from_a_file_where_one_is_given(tmp_path, monkeypatch, capsys) -> None:
    from snapshotd.flags import read_secret as _secret

    monkeypatch.setenv("SNAPSHOTD_SECRET", "from-env")
    (tmp_path / "secret").write_text("from-file\n")
    assert _secret(str(tmp_path / "secret")) == "from-file"
    assert _secret(None) == "from-env"
    (tmp_path / "empty").write_text("  \n")
    for path, says in ((tmp_path / "empty", "is empty"), (tmp_path / "absent", "cannot read --secret-file")):
        assert main(["status", "--coordinator", "7", "--secret-file", str(path)]) == 2
        assert says in capsys.readouterr().err


def test_every_flag_may_come_from_the_environment_and_the_command_line_wins(monkeypatch, capsys) -> None:
    monkeypatch.setenv("SNAPSHOTD_MAX_RATE", "10Gbit/s")
    monkeypatch.setenv("SNAPSHOTD_COORDINATOR", "coord-host:7070")
    monkeypatch.setenv("SNAPSHOTD_INSECURE", "yes")
    monkeypatch.setenv("SNAPSHOTD_JOB", "run-42")
    args = _parser().parse_args(["serve", "--node", "n1"])
    assert (args.max_rate, args.coordinator, args.insecure, args.node) == (
        "10Gbit/s",
        "tcp://coord-host:7070",
        True,
        "n1",
    )
    assert _parser().parse_args(["serve", "--max-rate", "1GB/s"]).max_rate == "1GB/s"
    assert _parser().parse_args(["export", "--out", "d"]).job == "run-42"  # --job is required otherwise
    with pytest.raises(SystemExit):
        _parser().parse_args(["serve", "--help"])
    assert "[$SNAPSHOTD_PEER_TIMEOUT]" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("SNAPSHOTD_CODEC", "zstd", "not one of auto, raw, delta-lz4"),
        ("SNAPSHOTD_INSECURE", "maybe", "a switch"),
    ],
)
def test_an_environment_value_no_flag_takes_is_one_line(
    monkeypatch, capsys, name: str, value: str, says: str
) -> None:
    monkeypatch.setenv(name, value)
    assert main(["status"]) == 2
    err = capsys.readouterr().err
    assert f"${name}" in err and says in err and len(err.strip().splitlines()) == 1


def test_the_rendezvous_store_binds_loopback_unless_told_and_stops_cleanly(tmp_path) -> None:
    import datetime
    import signal
    import subprocess
    import sys

    import torch.distributed as dist

    assert (
        main(["rdzv-store", "--bind", "0.0.0.0:0"]) == 2
    )  # routable, without --insecure: refused, nothing bound
    proc = subprocess.Popen(
        [sys.executable, "-m", "snapshotd", "rdzv-store", "--bind", "0"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # ends when the store is ready, or the process has exited
        assert line.startswith("rendezvous store ready 127.0.0.1:"), line
        host, port = line.split()[-1].rsplit(":", 1)
        client = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        proc.kill()
        proc.wait(10)
        assert proc.stdout is not None
        proc.stdout.close()
