"""A job's plan round: which ranks asked for a recovery plan and were answered, and the outcome every rank of the
round gets (:mod:`.plans` runs the rounds; :class:`~.jobs.Job` keeps its latest, whose frozen step caps D)."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["MAX_LISTED", "Round"]

MAX_LISTED = 8
"""Ranks named in one wait or none reason."""


@dataclasses.dataclass(slots=True, eq=False)
class Round:
    """One plan round of a job.

    Ranks ask until every rank ``0 .. world_size - 1`` has asked; the last ask freezes the outcome (``fresh``,
    ``none`` or ``ready`` at ``step``) and every rank of the round gets that same answer. A rank that asks again
    after its answer restarted again and opens a new round, unless it asks under the ``attempt`` it was answered
    under (:attr:`attempts`: the request repeated, its reply lost or late). Once frozen, the round caps D at
    ``step`` (so that buddies keep what the plan needs) until every rank was answered and G moved past ``step``:
    training resumed (see :meth:`caps`). Before the freeze there is no plan step yet and no cap is needed (D <= G always).
    """

    asked: set[int] = dataclasses.field(default_factory=set)
    answered: set[int] = dataclasses.field(default_factory=set)
    attempts: dict[int, int] = dataclasses.field(default_factory=dict)
    """The ``attempt`` each answered rank was answered under (a rank answered under none is not listed)."""
    frozen: bool = False
    outcome: str = ""
    step: int = -1
    reason: str = ""
    waiting_note: tuple[int, str] = (-1, "")  # (len(asked), wait reason), so a poll costs O(1)
    frozen_at: float = 0.0  # when the last rank asked (the coordinator's clock); set once frozen
    answered_at: float | None = None  # when the last rank was answered
    opened: float = 0.0  # when its first request came (the coordinator's clock)

    def caps(self, recoverable: int, world_size: int) -> bool:
        """Whether D is capped at :attr:`step` while G is ``recoverable``: frozen, and training has not resumed
        past the step yet (some rank still unanswered, or G not past it)."""
        return self.frozen and not (len(self.answered) >= world_size and recoverable > self.step)

    def continues(self, ranks: tuple[int, ...], attempt: int) -> bool:
        """Whether a request for ``ranks`` under ``attempt`` belongs to this round: none of them was answered, or
        each answered one was answered under ``attempt`` (the request repeated)."""
        if self.answered.isdisjoint(ranks):
            return True
        return attempt != 0 and all(self.attempts.get(r) == attempt for r in ranks if r in self.answered)

    def resized(self, world_size: int) -> Round | None:
        """This round once the job has ``world_size`` ranks: abandoned (None) if frozen, else without the ranks
        now outside."""
        if self.frozen:
            return None
        self.asked = {r for r in self.asked if r < world_size}
        return self

    def status(self, now: float) -> dict[str, Any]:
        """The round for the status document: outcome and step (once frozen), ranks asked and answered,
        ``age_s`` since it froze and ``answer_s``, from the freeze to the last rank's answer (None until then)."""
        return {
            "outcome": self.outcome or "asking",
            "step": self.step,
            "asked": len(self.asked),
            "answered": len(self.answered),
            "age_s": round(now - self.frozen_at, 3) if self.frozen else None,
            "answer_s": None if self.answered_at is None else round(self.answered_at - self.frozen_at, 6),
        }

    def wait_reason(self, world_size: int) -> str:
        """Why a request of this round waits: how many ranks asked, and which are missing when few are."""
        if self.waiting_note[0] != len(self.asked):
            missing = world_size - len(self.asked)
            if missing <= MAX_LISTED:
                who = "rank(s) " + ", ".join(str(r) for r in range(world_size) if r not in self.asked)
            else:
                who = f"{missing} more ranks"
            text = f"{len(self.asked)} of {world_size} ranks accounted for; waiting for {who}"
            self.waiting_note = (len(self.asked), text)
        return self.waiting_note[1]
