"""snapshotd.bench.baselines.raw_socket_transfer on loopback and over a shaped netns link."""

from __future__ import annotations

import os

import pytest

from snapshotd.bench.baselines import raw_socket_transfer
from snapshotd.bench.links import links_available, shaped_link


def test_raw_socket_transfer_on_loopback() -> None:
    rate = raw_socket_transfer(8 << 20, chunk=256 << 10, repeat=2, timeout=60)
    assert rate > 10e6  # bytes/s; loopback moves GB/s here, anything alive beats 10 MB/s


def test_raw_socket_transfer_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        raw_socket_transfer(0)


@pytest.mark.netns
def test_shaped_link_rate_and_cleanup() -> None:
    reason = links_available()
    if reason is not None:
        pytest.skip(reason)
    rate_bps = 100e6
    with shaped_link(rate_bps) as link:
        names = (link.ns_a, link.ns_b)
        assert all(os.path.exists(f"/run/netns/{ns}") for ns in names)
        assert link.exec_argv(link.ns_b, ["true"]) == ["ip", "netns", "exec", link.ns_b, "true"]
        measured = raw_socket_transfer(5_000_000, link=link, timeout=60)
    assert measured * 8 == pytest.approx(rate_bps, rel=0.2)
    assert not any(os.path.exists(f"/run/netns/{ns}") for ns in names)


@pytest.mark.netns
def test_shaped_link_cleans_up_after_an_error() -> None:
    reason = links_available()
    if reason is not None:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="boom"), shaped_link(1e9) as link:
        raise RuntimeError("boom")
    assert not os.path.exists(f"/run/netns/{link.ns_a}") and not os.path.exists(f"/run/netns/{link.ns_b}")
