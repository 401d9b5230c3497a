"""``PlanningPause``: the planner stops planning while planning does not pay for itself.

Planning has a price of its own: the screen and ``decide`` run on every step the engine asks, and
the engine runs its lookups for them. On the Q4_1 engine at B = 16 and 32 the goodput policy gave
no drafts on 98-100% of request-steps (a draft that is accepted would pay there, so the screen
says yes, but the drafts found are not good enough) and still spent 0.3-0.6 ms a step on lookups
and decisions, 1.3-2.1% of the wall time, where SD off spends nothing (reports/
evaluation-q4_1-xeon-s20). Where the drafts the policy chooses are predicted to save less time
than the planner spends choosing them, the cheapest plan is not to plan: answer 0 for everyone
without asking (no screen, lookup or decision), as SD off would.

The rule, over windows of planned steps:

    saved = sum over the window's steps of (expected tokens x off seconds per token - step seconds)
    spent = sum over the window's steps of the planner's own seconds (screen + decide)

(a step given no drafts saves 0). When saved < spent, the planner pauses for ``first_pause``
steps, twice as long after each further window that did not pay (up to ``max_pause``), and
plans again after it: acceptance and prices move, and only planning shows whether they did. A
window that paid resets the pause length. A pause ends early when the batch size moves to
another power-of-two bucket (planner/drift.py ``DraftSlope.bucket``): what drafts cost, and so
what they save, changes with it.

Only steps of at least ``min_decodes`` decodes pause. Below that a step is memory-bound and a
draft cheap, and what planning saves comes in bursts (a request starts copying a passage: each
step then emits several tokens); a window without one says little about the next. Measured on the
Q4_1 engine, paired over 5 rounds of the evaluation's cells (reports/planner-ab/README.md), the
pause against none read 0.991x at B = 1 (all four workloads a little under 1), 1.005x at B = 4,
1.008x at B = 16 and 1.015x at B = 32.

Worked example, window 8, first pause 16: at B = 32 the policy answers 0 for everyone, at 0.5 ms
a step: the first 8 steps saved nothing against 4 ms spent, so it pauses 16 steps, plans 8,
pauses 32, plans 8, pauses 64, ...: of the first 64 steps it plans 16, of the first 256, 32.
At B = 1 with a 15 ms step where drafts save 4 ms a step, the first window pays and nothing
pauses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from .drift import DraftSlope


@dataclass(frozen=True)
class PauseConfig:
    window: int = 8  # planned steps weighed together
    first_pause: int = 16  # steps of the first pause after a window that did not pay
    max_pause: int = 128  # a pause doubles while planning keeps not paying, up to this
    min_decodes: int = 8  # smaller steps never pause

    def __post_init__(self) -> None:
        if self.window < 1 or self.first_pause < 1 or self.max_pause < self.first_pause:
            raise ValueError("need window >= 1, first_pause >= 1 and max_pause >= first_pause")
        if self.min_decodes < 1:
            raise ValueError(f"min_decodes must be >= 1, got {self.min_decodes}")


class PlanningPause:
    """When the planner answers 0 for every request without planning (the module's rule)."""

    def __init__(self, config: PauseConfig = PauseConfig(), clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.clock = clock  # what the planner times its own work with
        self._length = config.first_pause  # the next pause's steps
        self._until = -1  # steps up to this one are paused
        self._bucket = 0  # the batch-size bucket the pause began in
        self._steps = 0  # planned steps in the current window
        self._saved_s = 0.0
        self._spent_s = 0.0
        self.paused_steps = 0  # steps answered by the pause (for reports)
        self.pauses = 0

    def weighs(self, num_decodes: int) -> bool:
        """Whether a step of this many decodes is timed and weighed at all. A smaller one is not
        (the planner then spends nothing on the pause): it ends any pause and the window so far."""
        if num_decodes >= self.config.min_decodes:
            return True
        self._until = -1
        self._steps, self._saved_s, self._spent_s = 0, 0.0, 0.0  # a window is of large steps only
        return False

    def paused(self, step: int, num_decodes: int) -> bool:
        """Whether ``step`` (the planner's step counter) is paused for a batch of ``num_decodes``."""
        if step > self._until:
            return False
        if DraftSlope.bucket(num_decodes) != self._bucket:
            self._until = -1  # another batch size: plan again now
            return False
        self.paused_steps += 1
        return True

    def planned(self, step: int, num_decodes: int, spent_s: float, saved_s: float) -> None:
        """A step the planner planned: its own seconds, and what its drafts were predicted to save."""
        if not self.weighs(num_decodes):
            return
        self._steps += 1
        self._spent_s += spent_s
        self._saved_s += saved_s
        if self._steps < self.config.window:
            return
        if self._saved_s < self._spent_s:
            self._until, self._bucket = step + self._length, DraftSlope.bucket(num_decodes)
            self._length = min(self.config.max_pause, 2 * self._length)
            self.pauses += 1
        else:
            self._length = self.config.first_pause
        self._steps, self._saved_s, self._spent_s = 0, 0.0, 0.0
