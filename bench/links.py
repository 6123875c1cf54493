"""Emulated network links for benchmarks: two network namespaces joined by a shaped veth pair.

Each end of a :func:`shaped_link` is its own network namespace with its own address, so processes started in
them (``link.exec_argv(link.ns_a, argv)``) talk over a link of a chosen rate, as two nodes would. Both
directions are shaped with a token bucket (``tc qdisc ... tbf``); the kernel here has no ``netem``, so
there is no emulated delay or loss. Needs root and iproute2 (``ip``, ``tc``).

Nothing outside the namespaces is touched: the veth pair is created inside the first namespace with its peer
inside the second, the addresses (``10.213.x.1/30``, ``10.213.x.2/30``) exist only there, and there is no
route to anywhere else. Leaving the context deletes the veth pair and both namespaces, after errors too.

Accuracy: ``tbf`` counts whole packets (Ethernet, IP and TCP headers included), so TCP goodput over a link of
rate R is about 0.95 R at MTU 1500, as on a real link of that rate. Measured here with
:func:`snapshotd.bench.baselines.raw_socket_transfer`: 0.96 R at 100 Mbit/s and 1 Gbit/s, 0.95 R at
10 Gbit/s, with the burst chosen below (a burst of one 64 KiB GSO packet reaches only ~0.73 R at 10 Gbit/s).
GSO and GRO stay on (as on real NICs); ``tbf`` segments any packet larger than its burst.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator

__all__ = ["Link", "links_available", "shaped_link"]

log = logging.getLogger(__name__)

_CMD_TIMEOUT = 10.0
_MIN_BURST_BYTES = 128 * 1024  # more than one 64 KiB GSO packet plus headers
_BURST_SECONDS = 1e-3  # a burst of 1 ms at line rate keeps tbf accurate at 10 Gbit/s
_LATENCY = "20ms"  # how long a packet may wait in the tbf queue before it is dropped
_VETH_A, _VETH_B = "snapd-a", "snapd-b"
_counter = itertools.count()


@dataclasses.dataclass(frozen=True, slots=True)
class Link:
    """One emulated link between two namespaces.

    Attributes:
        ns_a: namespace of end A (``ip netns`` name).
        ns_b: namespace of end B.
        addr_a: IPv4 address of end A, reachable from B.
        addr_b: IPv4 address of end B, reachable from A.
        rate_bps: shaped rate of each direction, bits per second.
    """

    ns_a: str
    ns_b: str
    addr_a: str
    addr_b: str
    rate_bps: float

    def exec_argv(self, ns: str, argv: list[str]) -> list[str]:
        """``argv`` prefixed to run inside namespace ``ns`` (one of ``ns_a``, ``ns_b``).

        Raises:
            ValueError: when ``ns`` is not one of this link's namespaces.
        """
        if ns not in (self.ns_a, self.ns_b):
            raise ValueError(f"{ns!r} is not a namespace of this link ({self.ns_a}, {self.ns_b})")
        return ["ip", "netns", "exec", ns, *argv]


def _run(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=False)


def _must(argv: list[str]) -> None:
    """Run an iproute2 command.

    Raises:
        RuntimeError: when it fails, with its stderr.
    """
    proc = _run(argv)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed ({proc.returncode}): {proc.stderr.strip()}")


def _netns_exists(name: str) -> bool:
    return os.path.exists(os.path.join("/run/netns", name))


def _delete_netns(name: str) -> None:
    """Delete namespace ``name`` (logging, not raising, on failure)."""
    pids = _run(["ip", "netns", "pids", name]).stdout.split()
    if pids:
        log.warning("namespace %s still has processes %s; it disappears when they exit", name, pids)
    proc = _run(["ip", "netns", "delete", name])
    if proc.returncode != 0:
        log.warning("could not delete namespace %s: %s", name, proc.stderr.strip())


def links_available() -> str | None:
    """None when :func:`shaped_link` can work here, else why not.

    Checks root, ``ip`` and ``tc``, then really creates a throwaway namespace, puts a ``tbf`` qdisc on its
    loopback device, and deletes it.
    """
    if os.geteuid() != 0:
        return "emulated links need root (ip netns, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"emulated links need iproute2; not found: {', '.join(missing)}"
    probe = f"snapd-probe-{os.getpid()}-{secrets.token_hex(3)}"
    try:
        _must(["ip", "netns", "add", probe])
        try:
            _must(
                [
                    "ip",
                    "netns",
                    "exec",
                    probe,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    "lo",
                    "root",
                    "tbf",
                    "rate",
                    "1gbit",
                    "burst",
                    "128kb",
                    "latency",
                    "20ms",
                ]
            )
        finally:
            _delete_netns(probe)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create a shaped network namespace: {exc}"
    return None


def _burst_bytes(rate_bps: float) -> int:
    return max(_MIN_BURST_BYTES, int(rate_bps / 8 * _BURST_SECONDS))


@contextlib.contextmanager
def shaped_link(rate_bps: float, *, name_prefix: str = "snapd") -> Iterator[Link]:
    """Two fresh namespaces joined by a veth pair shaped to ``rate_bps`` in each direction.

    Args:
        rate_bps: link rate, bits per second (``1e9`` for 1 Gbit/s).
        name_prefix: start of the namespace names, which are made unique with the pid and a random tag.

    Yields:
        The :class:`Link`; its namespaces and veth pair exist until the context exits.

    Raises:
        ValueError: when ``rate_bps`` is not positive.
        RuntimeError: when a namespace, the veth pair, an address or the qdisc cannot be set up (see
            :func:`links_available` for a reason before trying).
    """
    if not rate_bps > 0:
        raise ValueError(f"rate_bps must be positive, got {rate_bps}")
    n = next(_counter)
    tag = f"{name_prefix}-{os.getpid()}-{n}-{secrets.token_hex(2)}"
    subnet = f"10.213.{n % 256}"
    link = Link(f"{tag}-a", f"{tag}-b", f"{subnet}.1", f"{subnet}.2", float(rate_bps))
    rate = f"{int(rate_bps)}bit"
    burst = str(_burst_bytes(rate_bps))
    created: list[str] = []
    try:
        for ns in (link.ns_a, link.ns_b):
            _must(["ip", "netns", "add", ns])
            created.append(ns)
        # Created inside ns_a with its peer inside ns_b: the pair never appears in the caller's namespace.
        _must(
            [
                "ip",
                "-n",
                link.ns_a,
                "link",
                "add",
                _VETH_A,
                "type",
                "veth",
                "peer",
                "name",
                _VETH_B,
                "netns",
                link.ns_b,
            ]
        )
        for ns, dev, addr in ((link.ns_a, _VETH_A, link.addr_a), (link.ns_b, _VETH_B, link.addr_b)):
            _must(["ip", "-n", ns, "addr", "add", f"{addr}/30", "dev", dev])
            _must(["ip", "-n", ns, "link", "set", "lo", "up"])
            _must(["ip", "-n", ns, "link", "set", dev, "up"])
            _must(
                [
                    "ip",
                    "netns",
                    "exec",
                    ns,
                    "tc",
                    "qdisc",
                    "add",
                    "dev",
                    dev,
                    "root",
                    "tbf",
                    "rate",
                    rate,
                    "burst",
                    burst,
                    "latency",
                    _LATENCY,
                ]
            )
        log.info("link %s <-> %s at %s (burst %s bytes)", link.ns_a, link.ns_b, rate, burst)
        yield link
    finally:
        if link.ns_a in created:
            _run(["ip", "-n", link.ns_a, "link", "delete", _VETH_A])
        for ns in reversed(created):
            _delete_netns(ns)
        leftover = [ns for ns in created if _netns_exists(ns)]
        if leftover:
            log.warning("namespaces left behind: %s", leftover)
