"""Where ``restore()`` draws its progress (client/progress.py): only on a terminal, only on the first local rank."""

from __future__ import annotations

import io

import pytest

from snapshotd.client.progress import RestoreDisplay, restore_display
from snapshotd.proto import RestoreProgress, RestoreReply


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("stream", "env", "drawn"),
    [
        (Tty(), {}, True),
        (Tty(), {"LOCAL_RANK": "0"}, True),
        (Tty(), {"LOCAL_RANK": "1"}, False),
        (io.StringIO(), {}, False),
        (io.StringIO(), {"LOCAL_RANK": "0"}, False),
    ],
)
def test_drawn_only_on_a_terminal_by_the_first_local_rank(
    stream: io.StringIO, env: dict, drawn: bool
) -> None:
    display = restore_display("j", 0, stream=stream, env=env)
    assert (display is not None) == drawn
    if display is not None:
        display.finish(None)
    assert bool(stream.getvalue()) == drawn


def test_a_pull_is_drawn_with_its_source_and_bytes() -> None:
    stream = Tty()
    display = restore_display("j", 3, stream=stream, env={})
    assert isinstance(display, RestoreDisplay)
    display.draw()
    for done in (0, 4 << 20):
        display.update(
            RestoreProgress(
                job="j",
                rank=3,
                step=7,
                done_bytes=done,
                total_bytes=8 << 20,
                source="pull",
                sources=("tcp://10.0.0.2:7071",),
            )
        )
        display.draw()
    display.finish(RestoreReply(job="j", rank=3, step=7, source="pull", bytes_pulled=8 << 20))
    text = stream.getvalue()
    assert "restore j rank 3 step 7: pull from tcp://10.0.0.2:7071 (8.00 MiB)" in text
    assert "4.00 MiB/8.00 MiB" in text and "8.00 MiB/8.00 MiB" in text
    assert text.endswith(("\n", "\x1b[?25h"))  # the line ended (rich shows the cursor again last)


def test_a_display_that_cannot_draw_gives_up_quietly() -> None:
    stream = Tty()
    display = restore_display("j", 0, stream=stream, env={})
    assert display is not None
    stream.close()  # the terminal went away
    display.draw()
    display.finish(RestoreReply(job="j", rank=0, step=0, source="fresh"))  # no exception
