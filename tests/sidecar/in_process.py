"""A real :class:`~snapshotd.sidecar.daemon.Sidecar` run in the test's own process, on an event loop thread."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator

from snapshotd.sidecar.config import SidecarConfig
from snapshotd.sidecar.daemon import Sidecar

__all__ = ["InProcessSidecar", "in_process_sidecar"]


class InProcessSidecar:
    """A started sidecar: its object (state, services) and where it listens."""

    def __init__(self, sidecar: Sidecar, data_addr: str, ipc: str) -> None:
        self.sidecar = sidecar
        self.data_addr = data_addr
        self.ipc = ipc


@contextlib.contextmanager
def in_process_sidecar(cfg: SidecarConfig, timeout: float = 10.0) -> Iterator[InProcessSidecar]:
    """Run ``Sidecar(cfg)`` on a thread of its own until the block ends (then stop it and join the thread).

    Raises:
        RuntimeError: it did not report ready within ``timeout`` seconds, or it failed while running.
    """
    sidecar = Sidecar(cfg)
    ready = threading.Event()
    where: dict[str, str] = {}
    failure: list[BaseException] = []
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def on_ready(data_addr: str, ipc: str) -> None:
        where.update(data=data_addr, ipc=ipc)
        ready.set()

    def main() -> None:
        try:
            loop.run_until_complete(sidecar.run(on_ready, stop))
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            failure.append(exc)
        finally:
            ready.set()
            loop.close()

    thread = threading.Thread(target=main, name=f"sidecar-{cfg.node}", daemon=True)
    thread.start()
    try:
        if not ready.wait(timeout) or failure:
            raise RuntimeError(f"sidecar {cfg.node} did not start: {failure or 'timeout'}")
        yield InProcessSidecar(sidecar, where["data"], where["ipc"])
    finally:
        if not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        thread.join(timeout)
        if thread.is_alive():
            raise RuntimeError(f"sidecar {cfg.node} did not stop within {timeout:.0f} s")
    if failure:
        raise RuntimeError(f"sidecar {cfg.node} failed") from failure[0]
