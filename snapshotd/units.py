"""Human units on the command line and in reports: sizes (``64GiB``), rates (``10Gbit``), durations (``3s``)."""

from __future__ import annotations

import re
from collections.abc import Mapping

__all__ = [
    "format_bytes",
    "format_rate",
    "format_seconds",
    "parse_bytes",
    "parse_duration",
    "parse_fraction",
    "parse_rate",
]

_SIZE = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 1 << 10,
    "mib": 1 << 20,
    "gib": 1 << 30,
    "tib": 1 << 40,
}
_RATE = {
    "bit": 1 / 8,
    "kbit": 1e3 / 8,
    "mbit": 1e6 / 8,
    "gbit": 1e9 / 8,
    "tbit": 1e12 / 8,
    "b/s": 1,
    "kb/s": 1e3,
    "mb/s": 1e6,
    "gb/s": 1e9,
    "mib/s": 1 << 20,
    "gib/s": 1 << 30,
}
_FRACTION = {"": 1.0, "%": 0.01}
_TIME = {"": 1.0, "s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_NUM = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z/%]*)\s*$", re.IGNORECASE)


def _parse(text: str, units: Mapping[str, float], what: str) -> float:
    m = _NUM.match(str(text))
    if not m or m.group(2).lower() not in units:
        raise ValueError(f"cannot read {text!r} as a {what} (units: {', '.join(k for k in units if k)})")
    return float(m.group(1)) * units[m.group(2).lower()]


def parse_bytes(text: str) -> int:
    """``"64GiB"`` -> 68719476736. Plain numbers are bytes."""
    return int(_parse(text, _SIZE, "size"))


def parse_rate(text: str) -> float:
    """``"10Gbit"`` -> 1.25e9 bytes per second."""
    return _parse(text, _RATE, "rate")


def parse_duration(text: str) -> float:
    """``"3s"``, ``"500ms"``, ``"2h"`` -> seconds. Plain numbers are seconds."""
    return _parse(text, _TIME, "duration")


def parse_fraction(text: str) -> float:
    """``"1%"`` -> 0.01; plain numbers are fractions (``"0.01"`` -> 0.01)."""
    return _parse(text, _FRACTION, "fraction")


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_rate(bytes_per_s: float) -> str:
    """Bytes per second as GB/s (decimal), the unit network links are sold in."""
    if bytes_per_s >= 1e9:
        return f"{bytes_per_s / 1e9:.2f} GB/s"
    return f"{bytes_per_s / 1e6:.1f} MB/s"


def format_seconds(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.0f} us"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    if s < 120:
        return f"{s:.2f} s"
    return f"{s / 60:.1f} min"


def parse_host_port(text: str, what: str) -> tuple[str, int]:
    """``HOST:PORT`` (``[::1]:9400`` for IPv6; port 0 picks a free one) as ``(host, port)``.

    Raises:
        ValueError: not ``HOST:PORT`` with a port in 0..65535, naming ``what`` (the flag).
    """
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"{what} must be HOST:PORT (e.g. 0.0.0.0:9400), got {text!r}")
    return host.strip("[]"), int(port)
