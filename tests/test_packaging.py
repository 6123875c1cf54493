"""The installed surface: one distribution under the `snapshotd` namespace, the public names, the CLIs."""

from __future__ import annotations

import subprocess
import sys

import pytest

import snapshotd.client
import snapshotd.proto


@pytest.mark.parametrize("module", [snapshotd.client, snapshotd.proto])
def test_exported_members_exist_and_are_public(module) -> None:
    assert module.__all__, module.__name__
    for name in module.__all__:
        assert hasattr(module, name), f"{module.__name__}.{name} is in __all__ but missing"
        assert not name.startswith("_")


def test_design_interface_names() -> None:
    from snapshotd.client import RNGState, Snapshotter

    for method in ("restore", "capture", "wait", "close", "__enter__", "__exit__"):
        assert callable(getattr(Snapshotter, method))
    assert callable(RNGState().state_dict)
    assert snapshotd.proto.PROTOCOL_VERSION >= 1
    assert issubclass(snapshotd.proto.ProtocolError, ValueError)


def test_nothing_generic_is_importable_from_outside_the_checkout(tmp_path) -> None:
    code = (
        "import importlib.util, snapshotd.proto, snapshotd.client, snapshotd.bench;"
        "print([n for n in ('client', 'proto', 'bench') if importlib.util.find_spec(n) is not None])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("argv", [["snapshotd.cli", "--help"], ["snapshotd.bench.cli", "--help"]])
def test_console_entry_points_answer_help(argv) -> None:
    out = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "usage" in out.stdout.lower()


def test_bad_flag_values_are_one_clear_line(tmp_path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "snapshotd.cli",
            "serve",
            "--coordinator",
            "tcp://127.0.0.1:1",
            "--memory-limit",
            "lots",
            "--ipc",
            str(tmp_path / "x.ipc"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2
    assert "cannot read 'lots' as a size" in out.stderr
