"""The training process's one background thread: it owns the ipc socket to the sidecar and runs staging copies.

Everything that crosses from the training thread goes through :meth:`Channel.submit` (a job run on the thread)
or :meth:`Channel.request` (a message sent under a request id, the answer carrying that id awaited with a
deadline). Every other message from the sidecar (slot updates, errors about earlier announces, progress) is
handed to ``on_message`` on the thread. The training
thread never touches the socket, so network trouble never blocks or raises inside a training step.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

from snapshotd.proto import Error, Message, ProtocolError, decode, encode
from snapshotd.transport import Frames, connect_rank

from .errors import SidecarUnavailable, from_reply

__all__ = ["Channel"]

log = logging.getLogger(__name__)


class Channel:
    """A connection to the sidecar's ipc endpoint (a :class:`~snapshotd.transport.ThreadPipe`), serviced by one
    daemon thread, which sleeps until a message arrives or a job is submitted (the pipe's ``wake()``).

    Args:
        sidecar: the sidecar's ipc path (``mem://NAME`` for one in this process).
        on_message: called on the channel thread with each message that answers no request.
    """

    IDLE_WAIT_S = 1.0
    """The longest the channel thread sleeps between two looks at its queue (a wake is what it waits for)."""
    WAIT_TICK = 0.1
    """Seconds between two ``on_wait`` calls of a :meth:`request`."""

    def __init__(self, sidecar: str, on_message: Callable[[Message], None]) -> None:
        self._pipe = connect_rank(sidecar)
        self.endpoint = self._pipe.address
        self._on_message = on_message
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._waiting: dict[
            int, tuple[str, concurrent.futures.Future[Message]]
        ] = {}  # request id -> (reply type, its answer)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="snapshotd-client", daemon=True)
        self._thread.start()

    # called from the training thread

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the channel thread, after every job submitted before it."""
        self._jobs.put(job)
        self._pipe.wake()

    def send(self, msg: Message) -> None:
        """Send a one-way message from the channel thread (after the jobs submitted before it)."""
        self.submit(lambda: self.send_now(msg))

    def request(
        self,
        msg: Message,
        reply_type: str,
        timeout: float,
        on_wait: Callable[[], None] | None = None,
        on_reply: Callable[[Message], None] | None = None,
    ) -> Message:
        """Send ``msg`` under a request id of its own and wait for the sidecar's answer carrying that id: a
        ``reply_type`` message or an error. Whatever else the sidecar sends meanwhile (slot updates, an error about
        an earlier announce, progress) goes to ``on_message``. ``on_wait`` is called on the waiting thread every
        :attr:`WAIT_TICK` seconds while no answer has come (what ``restore()`` draws its progress with; an
        exception it raises ends the wait), ``on_reply`` with the answer on the channel thread, before it handles
        the next message from the sidecar.

        Raises:
            SidecarUnavailable: no answer within ``timeout`` seconds.
            SnapshotdError: the sidecar answered with an error (:func:`~.errors.from_reply` says which).
        """
        fut: concurrent.futures.Future[Message] = concurrent.futures.Future()
        if on_reply is not None:  # before the future can be found: the channel thread runs it when it sets it
            fut.add_done_callback(lambda done: on_reply(done.result()))
        request_id = next(self._ids)
        with self._lock:
            self._waiting[request_id] = (reply_type, fut)
        self.send(dataclasses.replace(msg, request_id=request_id))  # type: ignore[call-arg]
        deadline = time.monotonic() + timeout
        try:
            while on_wait is not None and not fut.done() and time.monotonic() + self.WAIT_TICK < deadline:
                with contextlib.suppress(concurrent.futures.TimeoutError):
                    fut.result(self.WAIT_TICK)
                if not fut.done():  # an answer in hand is never given up for what on_wait finds
                    on_wait()
            reply = fut.result(max(0.0, deadline - time.monotonic()))
        except concurrent.futures.TimeoutError as exc:
            raise SidecarUnavailable(
                f"the snapshotd sidecar at {self.endpoint} did not answer {msg.TYPE} within {timeout:.0f} s "
                "(is `snapshotd serve` running on this node, with the same --ipc path?)"
            ) from exc
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
        if isinstance(reply, Error):
            raise from_reply(reply, msg.TYPE)
        return reply

    def close(self, timeout: float = 5.0) -> None:
        """Finish queued jobs (up to ``timeout``), then stop the thread and close the socket."""
        self._jobs.put(None)
        self._pipe.wake()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("snapshotd client thread did not stop within %.0f s", timeout)
        self._pipe.close()

    # the channel thread

    def send_now(self, msg: Message) -> None:
        """Send on the channel thread itself (from within a job)."""
        if not self._pipe.send_nowait(encode(msg)):
            log.warning("sidecar ipc queue full; dropped %s", msg.TYPE)

    def _run(self) -> None:
        while True:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                try:
                    job()
                except Exception:
                    log.exception("snapshotd background job failed")
            while (frames := self._pipe.recv_nowait()) is not None:
                self._receive(frames)
            if self._jobs.empty():
                self._pipe.wait(self.IDLE_WAIT_S)  # until a message or a job (submit() wakes it)

    def _receive(self, frames: Frames) -> None:
        try:
            msg = decode(frames)
        except ProtocolError as exc:
            log.warning("bad message from the sidecar: %s", exc)
            return
        request_id = getattr(msg, "request_id", 0)
        with self._lock:
            waiting = self._waiting.get(request_id) if request_id else None
        if waiting is not None and msg.TYPE in (waiting[0], Error.TYPE) and not waiting[1].done():
            waiting[1].set_result(msg)
            return
        try:
            self._on_message(msg)
        except Exception:
            log.exception("handling %s from the sidecar failed", msg.TYPE)
