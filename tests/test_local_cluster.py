"""``snapshotd.harness.cluster``'s signal helpers: an interrupt never comes between starting a child and recording it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from snapshotd.harness.cluster import held_interrupts, sigterm_as_interrupt


@pytest.fixture
def sigint_interrupts() -> Iterator[None]:
    """SIGINT raises KeyboardInterrupt, as in a fresh interpreter, whatever an earlier test left installed."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_an_interrupt_inside_a_held_block_is_raised_as_it_ends(
    signum: signal.Signals, sigint_interrupts: None
) -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    recorded = []
    with sigterm_as_interrupt():
        with pytest.raises(KeyboardInterrupt), held_interrupts():
            os.kill(os.getpid(), signum)
            time.sleep(0.05)  # the handler runs here, and must not raise
            recorded.append("child")
        assert recorded == ["child"]
        with pytest.raises(KeyboardInterrupt):  # outside the block an interrupt is raised at once again
            os.kill(os.getpid(), signum)
            time.sleep(1)
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before


def test_a_held_block_without_an_interrupt_leaves_the_handlers_as_they_were() -> None:
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    with held_interrupts():
        assert signal.getsignal(signal.SIGTERM) not in before
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
