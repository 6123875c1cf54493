"""Emulated nodes with two networks each, for partition stories: :func:`fabric`.

Each node is a network namespace with two links to a router namespace: one on the snapshot network (its sidecar
binds there, and reaches the coordinator there), one on the training network (its gloo ranks bind there). The
router forwards between the nodes, so a pair of nodes' snapshot path can be cut in one direction or both
(``ip rule ... blackhole`` in the router: packets from one to the other vanish silently, as on a dead switch
port) or slowed (``htb`` on the router's link towards a node, for the packets from the other one), while their
training path and every other path stay as they were. The coordinator runs in the test's own namespace, on one
end of a management link to the router, so the test reads its status directly.

Nothing outside the namespaces is touched but the management link's root end (an address of its own, routed to
the fabric's networks only). Leaving the context deletes every namespace and that link, after errors too. Needs
root and iproute2 with ``htb`` and ``u32`` (:func:`fabric_available` says why not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import secrets
import shutil
import subprocess
from collections.abc import Iterator, Sequence

__all__ = ["Fabric", "fabric", "fabric_available"]

_TIMEOUT = 10.0
_counter = itertools.count(1)


def _ip(*argv: str, ns: str | None = None) -> None:
    cmd = ["ip", *argv] if ns is None else ["ip", "netns", "exec", ns, "ip", *argv]
    _must(cmd)


def _must(cmd: Sequence[str]) -> None:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, timeout=_TIMEOUT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed ({proc.returncode}): {proc.stderr.strip()}")


@dataclasses.dataclass
class Fabric:
    """The namespaces and addresses of one fabric (see the module docstring).

    Attributes:
        router: the router's namespace.
        coordinator_host: the address the coordinator binds, in the test's namespace.
        ns: node name -> its namespace.
        snapshot: node name -> its address on the snapshot network.
        training: node name -> its address on the training network.
    """

    tag: str
    router: str
    coordinator_host: str
    ns: dict[str, str] = dataclasses.field(default_factory=dict)
    snapshot: dict[str, str] = dataclasses.field(default_factory=dict)
    training: dict[str, str] = dataclasses.field(default_factory=dict)

    TRAINING_IFACE = "train0"

    def exec_argv(self, node: str) -> list[str]:
        """The prefix that runs a command on ``node``."""
        return ["ip", "netns", "exec", self.ns[node]]

    def cut(self, a: str, b: str, *, both: bool = True) -> None:
        """Drop every packet from ``a`` to ``b`` on the snapshot network (and from ``b`` to ``a`` with ``both``)."""
        for src, dst in ((a, b), (b, a)) if both else ((a, b),):
            _ip(
                "rule",
                "add",
                "from",
                self.snapshot[src],
                "to",
                self.snapshot[dst],
                "blackhole",
                ns=self.router,
            )

    def slow(self, a: str, b: str, rate: str) -> None:
        """Shape the snapshot packets from ``a`` to ``b`` and from ``b`` to ``a`` to ``rate`` (e.g. ``10mbit``)."""
        for src, dst in ((a, b), (b, a)):
            dev = f"s-{dst}"
            tc = ["ip", "netns", "exec", self.router, "tc"]
            _must([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "20"])
            _must(
                [*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb", "rate", "10gbit"]
            )
            _must(
                [
                    *tc,
                    "class",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:",
                    "classid",
                    "1:10",
                    "htb",
                    "rate",
                    rate,
                    "ceil",
                    rate,
                ]
            )
            _must(
                [
                    *tc,
                    "filter",
                    "add",
                    "dev",
                    dev,
                    "parent",
                    "1:",
                    "protocol",
                    "ip",
                    "prio",
                    "1",
                    "u32",
                    "match",
                    "ip",
                    "src",
                    f"{self.snapshot[src]}/32",
                    "flowid",
                    "1:10",
                ]
            )


def fabric_available() -> str | None:
    """None when :func:`fabric` can work here, else why not."""
    if os.geteuid() != 0:
        return "the partition stories need root (ip netns, tc)"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the partition stories need iproute2; not found: {', '.join(missing)}"
    try:
        with fabric(["x", "y"]) as f:
            f.slow("x", "y", "1mbit")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot build a fabric here: {exc}"
    return None


@contextlib.contextmanager
def fabric(nodes: Sequence[str]) -> Iterator[Fabric]:
    """Namespaces for ``nodes`` (short names), a router between them, and a management link to this namespace."""
    k = (os.getpid() * 7 + next(_counter)) % 200 + 20
    tag = f"{k}{secrets.token_hex(2)}"
    f = Fabric(tag=tag, router=f"sdr-{tag}", coordinator_host=f"10.217.{k}.1")
    mgmt = f"sdm-{tag}"
    made: list[str] = []
    try:
        _ip("netns", "add", f.router)
        made.append(f.router)
        _ip("link", "set", "lo", "up", ns=f.router)
        _must(["ip", "netns", "exec", f.router, "sysctl", "-qw", "net.ipv4.ip_forward=1"])
        _ip("link", "add", mgmt, "type", "veth", "peer", "name", "mgmt", "netns", f.router)
        _ip("addr", "add", f"{f.coordinator_host}/30", "dev", mgmt)
        _ip("link", "set", mgmt, "up")
        _ip("addr", "add", f"10.217.{k}.2/30", "dev", "mgmt", ns=f.router)
        _ip("link", "set", "mgmt", "up", ns=f.router)
        for net in ("10.215", "10.216"):
            _ip("route", "add", f"{net}.{k}.0/24", "via", f"10.217.{k}.2", "dev", mgmt)
        for i, node in enumerate(nodes):
            ns = f"sdn-{tag}-{node}"
            _ip("netns", "add", ns)
            made.append(ns)
            f.ns[node] = ns
            _ip("link", "set", "lo", "up", ns=ns)
            for net, dev, table in (
                ("10.215", "snap0", f.snapshot),
                ("10.216", Fabric.TRAINING_IFACE, f.training),
            ):
                peer = f"{'s' if net == '10.215' else 't'}-{node}"
                base = 4 * i
                _ip("link", "add", dev, "type", "veth", "peer", "name", peer, "netns", f.router, ns=ns)
                _ip("addr", "add", f"{net}.{k}.{base + 2}/30", "dev", dev, ns=ns)
                _ip("link", "set", dev, "up", ns=ns)
                _ip("addr", "add", f"{net}.{k}.{base + 1}/30", "dev", peer, ns=f.router)
                _ip("link", "set", peer, "up", ns=f.router)
                _ip("route", "add", f"{net}.{k}.0/24", "via", f"{net}.{k}.{base + 1}", "dev", dev, ns=ns)
                table[node] = f"{net}.{k}.{base + 2}"
            _ip("route", "add", f"10.217.{k}.0/30", "via", f"10.215.{k}.{4 * i + 1}", "dev", "snap0", ns=ns)
        yield f
    finally:
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True, timeout=_TIMEOUT, check=False)
        subprocess.run(["ip", "link", "delete", mgmt], capture_output=True, timeout=_TIMEOUT, check=False)
