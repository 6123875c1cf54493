"""Human units on the command line and in reports: sizes (``64GiB``), rates (``10Gbit``), durations (``3s``)."""

from __future__ import annotations

import re

__all__ = [
    "format_bytes",
    "format_rate",
    "format_seconds",
    "parse_bytes",
    "parse_duration",
    "parse_fraction",
    "parse_rate",
]

_DECIMAL = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_BINARY = {"ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}
_NUMBER = r"([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)"
_SIZE_RE = re.compile(rf"^\s*{_NUMBER}\s*([kKmMgGtT]i?)?([bB])?\s*$")
_RATE_RE = re.compile(rf"^\s*{_NUMBER}\s*([kKmMgGtT]i?)?(bits?|Bits?|b|B)(/s|ps)?\s*$")
_FRACTION_RE = re.compile(rf"^\s*{_NUMBER}\s*(%?)\s*$")
_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
_TIME_PART = re.compile(rf"{_NUMBER}\s*(ms|us|min|s|m|h|d)", re.IGNORECASE)
_PLAIN = re.compile(rf"^\s*{_NUMBER}\s*$")


def _multiplier(prefix: str | None) -> float:
    """The factor of a unit prefix: ``k``, ``M``, ``G``, ``T`` (either case, decimal) or ``Ki`` .. ``Ti``."""
    prefix = (prefix or "").lower()
    return float(_BINARY[prefix]) if prefix in _BINARY else _DECIMAL[prefix]


def parse_bytes(text: str) -> int:
    """``"64GiB"``, ``"64Gi"`` -> 68719476736; ``"64GB"``, ``"64G"`` -> 64e9. Plain numbers are bytes."""
    m = _SIZE_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a size (e.g. 512MiB, 64Gi, 64GB, 1000000)")
    return int(float(m.group(1)) * _multiplier(m.group(2)))


def parse_rate(text: str) -> float:
    """A rate in bytes per second, from network units: ``"10Gbit"``, ``"10Gbit/s"``, ``"10Gbps"`` and
    ``"10Gb/s"`` are bits (1.25e9 bytes/s); ``"10GB/s"``, ``"10GBps"`` and ``"10GiB/s"`` are bytes. A lowercase
    ``b`` is a bit and an uppercase ``B`` a byte, as network engineers write them; the prefix may be either case.
    """
    m = _RATE_RE.match(str(text))
    if not m:
        raise ValueError(
            f"cannot read {text!r} as a rate: write bits as 10Gbit/s, 10Gbps or 10Gb/s, bytes as 10GB/s or "
            "10GiB/s"
        )
    value = float(m.group(1)) * _multiplier(m.group(2))
    return value if m.group(3) == "B" else value / 8


def parse_duration(text: str) -> float:
    """``"3s"``, ``"500ms"``, ``"2h"``, ``"1m30s"``, ``"1h 2m"`` -> seconds (``m`` is minutes, ``ms``
    milliseconds). Plain numbers are seconds."""
    raw = str(text)
    if _PLAIN.match(raw):
        return float(raw)
    parts = _TIME_PART.findall(raw)
    if not parts or _TIME_PART.sub("", raw).strip():
        raise ValueError(f"cannot read {text!r} as a duration (e.g. 3s, 500ms, 2h, 1m30s)")
    return sum(float(n) * _TIME[unit.lower()] for n, unit in parts)


def parse_fraction(text: str) -> float:
    """``"1%"`` -> 0.01; plain numbers are fractions (``"0.01"`` -> 0.01)."""
    m = _FRACTION_RE.match(str(text))
    if not m:
        raise ValueError(f"cannot read {text!r} as a fraction (e.g. 1% or 0.01)")
    return float(m.group(1)) * (0.01 if m.group(2) else 1.0)


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
