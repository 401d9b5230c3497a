"""``PlanningPause``: the planner stops planning while planning does not pay for itself.

Planning has a price of its own: the screen and ``decide`` run on every step the engine asks, and
the engine runs its lookups for them. On the Q4_1 engine at B = 16 and 32 the goodput policy gave
no drafts on 98-100% of request-steps (a draft that is accepted would pay, so the screen says yes,
but the drafts found are not good enough) and still spent 0.3-0.6 ms a step on lookups and
decisions, 1.3-2.1% of the wall time, where SD off spends nothing (reports/
evaluation-q4_1-xeon-s20). Where the drafts the policy chooses save less time than planning
costs, the cheapest plan is not to plan: answer 0 for everyone without asking (no screen, lookup
or decision), as SD off would. A paused step's ``observe`` learns nothing either (the planner
returns at once), so a paused step costs what an SD-off step does.

Two rules decide, each over windows of planned steps and by batch size:

* **Predicted** (steps of at least ``min_decodes`` decodes):

      saved = sum over the window's steps of (expected tokens x off seconds per token - step seconds)
      spent = sum over the window's steps of the planner's own seconds (screen + decide)

  (a step given no drafts saves 0), and the window did not pay when saved < spent.

* **Measured** (steps of ``min_measured_decodes`` up to ``min_decodes``): at B = 4 a draft is cheap
  and the model's prediction of what drafts save is close to what they save, but the planner's
  own time and the engine's lookups for it are several percent of the step (0.2-0.35 ms of a
  6.6 ms Q4_1 step: reports/profile-zen4-q4_1-s34), and drafts chosen at about their break-even
  acceptance saved nothing to pay for them. The predicted rule cannot see that (measured paired,
  it moved the B = 4 cells by -3 to +2%: reports/planner-ab). So here the window's own wall time is
  weighed against SD off's, measured in the steps the planner last paused for:

      saved = window's emitted tokens x (paused seconds / paused tokens) - window's seconds

  (seconds of the whole engine step, planning, lookups and ``observe`` included). When fewer than
  half of ``reference_steps`` paused steps of this batch size were timed, or none in the last
  ``reference_ttl`` planned steps, the window ends in a short pause of ``reference_steps`` that
  times them (a reference, not a failed window). SD off's own step time moves by 10-15% between
  references a minute apart on the 2-core VMs (traced at B = 4 on Q4_1), so one window decides
  little alone; the doubling pause is what makes a lasting loss cost little.

When a window did not pay, the planner pauses for ``first_pause`` steps, twice as long after each
further window that did not pay (up to ``max_pause``), and plans again after it: acceptance and
prices move, and only planning shows whether they did. A window that paid resets the pause
length. A pause ends early when the batch size moves to another power-of-two bucket (planner/
drift.py ``DraftSlope.bucket``): what drafts cost, and so what they save, changes with it; but
not at a step that also runs a prompt (a request taking a finished one's place).

Steps of fewer than ``min_measured_decodes`` decodes (B = 1) never pause. There a step is
memory-bound and a draft cheap, and what planning saves comes in bursts (a request starts copying
a passage; each step then emits several tokens); a window without one says little about the
next. Measured on the Q4_1 engine, paired over 5 rounds of the evaluation's cells
(reports/planner-ab/README.md), the predicted pause against none read 0.991x at B = 1, 1.008x at
B = 16 and 1.015x at B = 32.

Worked example, window 8, first pause 16: at B = 32 the policy answers 0 for everyone, at 0.5 ms
a step: the first 8 steps saved nothing against 4 ms spent, so it pauses 16 steps, plans 8,
pauses 32, plans 8, pauses 64, ...: of the first 64 steps it plans 16, of the first 256, 32.
At B = 4, reference 8: it plans 8 steps, pauses 8 to time SD off (4 tokens a step, 6.6 ms a
step), then plans 8 steps that emit 34 tokens in 58 ms. SD off would have taken 34 x 6.6 / 4 =
56 ms for them: planning lost 2 ms, and the planner pauses 16 steps.
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
    min_decodes: int = 8  # steps of this many decodes or more: the predicted rule
    # Steps of this many decodes up to min_decodes: the measured rule (0: none; smaller steps never pause).
    min_measured_decodes: int = 2
    reference_steps: int = 8  # SD-off steps the measured rule times when it has none fresh
    reference_ttl: int = 64  # planned steps after which those are timed again
    # Decode steps right after a step that ran a prompt are slow for a while (planner/drift.py
    # ``DraftSlopeConfig.settle_steps``): the measured rule counts neither them nor that step.
    settle_steps: int = 4

    def __post_init__(self) -> None:
        if self.window < 1 or self.first_pause < 1 or self.max_pause < self.first_pause:
            raise ValueError("need window >= 1, first_pause >= 1 and max_pause >= first_pause")
        if self.min_decodes < 1:
            raise ValueError(f"min_decodes must be >= 1, got {self.min_decodes}")
        if self.min_measured_decodes < 0 or self.reference_steps < 1 or self.reference_ttl < 1 or self.settle_steps < 0:
            raise ValueError("need min_measured_decodes >= 0, reference_steps >= 1, reference_ttl >= 1 "
                             "and settle_steps >= 0")


class _Timed:
    """Tokens and seconds summed over some steps of one batch-size bucket."""

    __slots__ = ("bucket", "steps", "tokens", "seconds")

    def __init__(self, bucket: int = 0):
        self.bucket, self.steps, self.tokens, self.seconds = bucket, 0, 0, 0.0

    def add(self, tokens: int, seconds: float) -> None:
        self.steps += 1
        self.tokens += tokens
        self.seconds += seconds


class PlanningPause:
    """When the planner answers 0 for every request without planning (the module's rules)."""

    def __init__(self, config: PauseConfig = PauseConfig(), clock: Callable[[], float] = time.perf_counter):
        self.config = config
        self.clock = clock  # what the planner times its own work with
        self._length = config.first_pause  # the next pause's steps
        self._until = -1  # steps up to this one are paused
        self._bucket = 0  # the batch-size bucket the pause began in
        self._steps = 0  # planned steps in the current window (predicted rule)
        self._saved_s = 0.0
        self._spent_s = 0.0
        self._window = _Timed()  # planned steps of the current window (measured rule)
        self._reference = _Timed()  # paused steps: SD off's rate (measured rule)
        self._reference_age = 0  # planned steps timed since the reference was
        self._settling = 0  # decode steps after a prompt still to pass uncounted
        self.paused_steps = 0  # steps answered by the pause (for reports)
        self.pauses = 0
        self.references = 0  # pauses taken to time SD off (measured rule)

    def weighs(self, num_decodes: int) -> bool:
        """Whether a step of this many decodes is weighed by either rule. A smaller one is not
        (the planner then spends nothing on the pause): it ends any pause and the windows so far."""
        if num_decodes >= self.config.min_decodes or self.measures(num_decodes):
            return True
        self._until = -1
        self._steps, self._saved_s, self._spent_s = 0, 0.0, 0.0  # a window is of large steps only
        self._window = _Timed()
        return False

    def measures(self, num_decodes: int) -> bool:
        """Whether the measured rule (not the predicted one) weighs a step of this many decodes."""
        return 0 < self.config.min_measured_decodes <= num_decodes < self.config.min_decodes

    def paused(self, step: int, num_decodes: int, prefill: bool = False) -> bool:
        """Whether ``step`` (the planner's step counter) is paused for a batch of ``num_decodes``;
        ``prefill``: the step also runs a prompt. That step has one decode fewer when a request
        just took a finished one's place, which is no new batch size: it does not end the pause
        (at B = 4 with requests arriving as others finish, every pause ended within ~16 steps)."""
        if step > self._until:
            return False
        if DraftSlope.bucket(num_decodes) != self._bucket and not prefill:
            self._until = -1  # another batch size: plan again now
            return False
        self.paused_steps += 1
        return True

    def planned(self, step: int, num_decodes: int, spent_s: float, saved_s: float) -> None:
        """A step the planner planned: its own seconds, and what its drafts were predicted to save
        (the predicted rule; a step it does not weigh breaks its window)."""
        if num_decodes < self.config.min_decodes:
            self._steps, self._saved_s, self._spent_s = 0, 0.0, 0.0
            return
        self._steps += 1
        self._spent_s += spent_s
        self._saved_s += saved_s
        if self._steps < self.config.window:
            return
        self._close(step, num_decodes, self._saved_s >= self._spent_s)
        self._steps, self._saved_s, self._spent_s = 0, 0.0, 0.0

    def timed(self, step: int, num_decodes: int, tokens: int, seconds: float, *, paused: bool, prefill: bool) -> None:
        """A step as it ran (the measured rule): the tokens it emitted and its wall seconds,
        planning and ``observe`` included; ``paused``: the pause answered it; ``prefill``: it also
        ran a prompt (neither it nor the next ``settle_steps`` decode steps count)."""
        if prefill:
            self._settling = self.config.settle_steps
            return
        if not self.measures(num_decodes) or not seconds > 0.0:  # NaN: a step of unknown length
            return
        if self._settling:
            self._settling -= 1
            return
        bucket = DraftSlope.bucket(num_decodes)
        if paused:
            if self._reference.bucket != bucket:
                self._reference = _Timed(bucket)
            self._reference.add(tokens, seconds)
            self._reference_age = 0
            return
        window = self._window
        if window.bucket != bucket:
            window = self._window = _Timed(bucket)
        window.add(tokens, seconds)
        self._reference_age += 1
        if window.steps < self.config.window:
            return
        self._window = _Timed(bucket)
        ref = self._reference
        # A reference cut short (the batch size moved, or prompts ran) is too few steps to go by.
        if (ref.bucket != bucket or 2 * ref.steps < self.config.reference_steps
                or self._reference_age > self.config.reference_ttl):
            self._reference = _Timed(bucket)  # the pause now starting times SD off afresh
            self._until, self._bucket = step + self.config.reference_steps, bucket
            self.references += 1
            return
        saved = window.tokens * ref.seconds / ref.tokens - window.seconds
        if self._close(step, num_decodes, saved >= 0.0):
            self._reference = _Timed(bucket)  # time SD off again in the pause now starting

    def _close(self, step: int, num_decodes: int, paid: bool) -> bool:
        """A window ends: pause unless it paid (the pause doubling while windows keep not paying).
        Returns whether a pause began."""
        if paid:
            self._length = self.config.first_pause
            return False
        self._until, self._bucket = step + self._length, DraftSlope.bucket(num_decodes)
        self._length = min(self.config.max_pause, 2 * self._length)
        self.pauses += 1
        return True
