"""The goodput model of docs/design.md §5: expected emitted tokens over the time a step costs.

A step that gives request i k_i drafts emits ``sum_i E_i(k_i)`` tokens and costs the target's
forward + verify time (from the profile's latency model, for the whole batch: decodes with their
drafts and any prefill chunks already scheduled), plus drafting time, plus the engine's fixed
per-step overhead. Goodput is their ratio.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..profiler.latency_model import DraftCost, LatencyModel, StepShape, predict_added, predict_many
from .acceptance import AcceptanceEstimate


def expected_tokens(alpha: float, k: int) -> float:
    """E(alpha, k) = (1 - alpha^(k+1)) / (1 - alpha): accepted prefix plus the bonus/recovered token."""
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    if 1.0 - alpha < 1e-9:  # the closed form is 0/0 at alpha = 1; the sum is exact there
        return float(k + 1)
    return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def with_drafts(base: StepShape, total_drafts: int) -> StepShape:
    """The step's shape when its decodes carry ``total_drafts`` drafts in all: each draft is one
    more query token, and its K/V is read by the step's attention."""
    return StepShape(base.num_seqs, base.num_tokens + total_drafts, base.context_tokens + total_drafts)


# Curves of up to this many drafts are priced in plain Python (``StepCostModel.target_seconds_list``): at
# the planner's small batches numpy's per-call cost was most of the work, several times a step.
# Measured (a fresh curve, Xeon VM): 8 drafts 15 us in Python against 37-42 us with numpy, 32
# drafts 34 against 36-47, 64 drafts 58-62 against 38.
_SHORT_CURVE = 32

# The least a draft adds to a step, as a fraction of the step's average seconds per query token:
# the latency model's increment is never taken below this. A quick profile's fit can come out
# flat over the first drafts at small batch sizes. Priced at 0, drafts looked free, and the learned
# slope (planner/drift.py ``DraftSlope``), a multiple of the increment, could not move it off zero.
# The floor sits under what a draft was measured to add in that flat region, and the slope scales
# it like any other increment. Per token, not per step: on a GPU at a large batch a draft adds a
# sliver of a memory-bound step, and a per-step floor would turn speculation off there.
# Measured: reports/README.md#planner-measurements.
MIN_DRAFT_INCREMENT = 0.02


def draft_increment(base_s: float, with_drafts_s: float | np.ndarray, drafts: int | np.ndarray,
                    base_tokens: int) -> float | np.ndarray:
    """The latency model's seconds for a step's ``drafts`` over its base step (``base_tokens``
    query tokens in ``base_s``), at least ``MIN_DRAFT_INCREMENT`` x base_s / base_tokens per draft.
    Element-wise over arrays of draft counts (the allocator's whole curve) as over single numbers,
    and plain floats for plain floats: the planner's ``observe`` asks this of every step with
    drafts, and numpy scalars there (and in everything computed from them) cost ~0.08 ms a step
    in the engine, with the caches the forward pass has just flushed."""
    floor = MIN_DRAFT_INCREMENT * drafts * base_s / max(base_tokens, 1)
    if isinstance(with_drafts_s, np.ndarray) or isinstance(floor, np.ndarray):
        return np.maximum(with_drafts_s - base_s, floor)
    return max(with_drafts_s - base_s, floor)


def priced_seconds(base_s: float, increment_s: float | np.ndarray, slope: float = 1.0, jump: float = 0.0
                   ) -> float | np.ndarray:
    """A step with drafts as the planner prices it: the model's ``increment_s`` for them
    (``draft_increment``) scaled by the learned ``slope``, plus ``jump`` x the base for having
    drafts at all (both from planner/drift.py ``DraftSlope``), never below the base step. An
    increment of 0 is a step without drafts: the base. Element-wise, as ``draft_increment`` (and
    plain floats for plain floats, as it)."""
    if isinstance(increment_s, np.ndarray):
        return base_s + np.maximum(0.0, slope * increment_s + jump * base_s) * (increment_s > 0.0)
    return base_s + max(0.0, slope * increment_s + jump * base_s) * (increment_s > 0.0)


@dataclass(frozen=True)
class StepCostModel:
    """Seconds of a step as a function of how many drafts it carries on top of a base step."""

    latency: LatencyModel
    base: StepShape  # the step with k = 0 for every decode (prefill chunks included)
    draft_cost: DraftCost = DraftCost()
    overhead_s: float = 0.0  # scheduling, sampling, bookkeeping: paid whatever k is
    draft_slope: float = 1.0  # what drafts cost relative to the model's increment (planner/drift.py)
    draft_jump: float = 0.0  # ... and once per step with drafts, relative to the base step
    # Seconds of the base step that are not its decodes' (prefill chunks scheduled beside them):
    # paid whatever k is, and not charged to the decodes' goodput (``charged_seconds``).
    shared_s: float = 0.0
    # Per request, whether its drafts come from draft-model passes (None: all of them do). A draft
    # model runs one pass per position up to the deepest such request; lookup drafts (a chain's
    # n-gram share) run none, so a request served by a 1-token lookup with 8 drafts does not make
    # the head run 8 passes for the others.
    model_drafted: tuple[bool, ...] | None = None
    # The latest priced curve: [seconds as floats, the same as an array or None] (the allocator's,
    # then every scalar question after it). No numpy here unless a numpy path asks: at B = 1 the
    # planner runs right after the forward pass has evicted everything from the caches, and
    # numpy's machinery is more code to fetch back than the arithmetic it saves.
    _curve: list = field(default_factory=lambda: [[], None], init=False, repr=False, compare=False)

    def passes(self, ks: Sequence[int]) -> int:
        """Draft-model passes a step with these drafts runs: the deepest model-drafted k."""
        drafted = self.model_drafted
        if drafted is None:
            return max(ks, default=0)
        if True not in drafted:  # every draft looked up (an n-gram step at B = 32: asked several times a step)
            return 0
        return max((k for k, m in zip(ks, drafted) if m), default=0)

    def target_seconds_list(self, max_drafts: int) -> list[float]:
        """[>= max_drafts + 1]: ``target_seconds(n)`` for n = 0, 1, ..., max_drafts, priced at once
        (the allocator weighs every total of drafts together) and kept, so later questions about
        the same step read it. Short curves in plain Python, long ones with numpy; the same floats."""
        curve = self._curve[0]
        if len(curve) <= max_drafts:
            count = max(max_drafts, 2 * len(curve))
            base = self.base
            if count <= _SHORT_CURVE:
                curve = self._short_curve(predict_added(self.latency, base, count))
                self._curve[:] = [curve, None]
            else:
                n = np.arange(count + 1)  # [n]
                with_n = predict_many(self.latency, base.num_seqs, base.num_tokens + n, base.context_tokens + n)  # [n]
                base_s = with_n[0]
                increment = draft_increment(base_s, with_n, n, base.num_tokens)  # [n], 0 at n = 0
                priced = priced_seconds(base_s, increment, self.draft_slope, self.draft_jump)  # [n]
                curve = priced.tolist()
                self._curve[:] = [curve, priced]
        return curve

    def target_curve(self, max_drafts: int) -> np.ndarray:
        """``target_seconds_list`` as an array (for the allocator's numpy search)."""
        curve = self.target_seconds_list(max_drafts)
        if self._curve[1] is None:
            self._curve[1] = np.array(curve)
        return self._curve[1]

    def _short_curve(self, with_n: list[float]) -> list[float]:
        """``draft_increment`` and ``priced_seconds`` over a short curve, element by element with
        the same float operations (so the same floats as the numpy path)."""
        base_s = with_n[0]
        tokens = max(self.base.num_tokens, 1)
        slope, jumped = self.draft_slope, self.draft_jump * base_s
        out = [base_s]
        for n in range(1, len(with_n)):
            increment = with_n[n] - base_s
            floor = MIN_DRAFT_INCREMENT * n * base_s / tokens
            if increment < floor:
                increment = floor
            priced = slope * increment + jumped
            out.append(base_s + priced if increment > 0.0 and priced > 0.0 else base_s)
        return out

    def target_seconds(self, total_drafts: int) -> float:
        """Forward + verify time predicted by the (drift-corrected) latency model, its increment
        over the base step priced by the learned slope and jump (``priced_seconds``)."""
        return self.target_seconds_list(total_drafts)[total_drafts]

    def seconds(self, ks: Sequence[int]) -> float:
        """The whole step's seconds (what an ITL SLA bounds)."""
        total = sum(ks)
        return self.target_seconds(total) + self.draft_cost.seconds(total, self.passes(ks)) + self.overhead_s

    def charged_seconds(self, ks: Sequence[int]) -> float:
        """The seconds the step's decodes are charged: all but the prefill chunks' share. Goodput
        is the decodes' tokens over these. Over the whole step, a step carrying a prompt chunk is
        several times as long as a plain one, so each of its decode tokens looks that much dearer,
        and a draft's expected token that much more worth its small increment: the policy put far
        more drafts into such steps than into plain ones, in the compute-bound regime where each
        costs the most (measured: reports/README.md#planner-measurements)."""
        return self.seconds(ks) - self.shared_s


def step_goodput(estimates: Sequence[AcceptanceEstimate], ks: Sequence[int], cost: StepCostModel,
                 num_idle: int = 0) -> float:
    """Expected emitted tokens per charged second of the step that gives request i ks[i] drafts,
    beside ``num_idle`` decodes without drafts (one token each: PolicyState.num_idle)."""
    if len(estimates) != len(ks):
        raise ValueError(f"{len(estimates)} estimates but {len(ks)} k values")
    tokens = num_idle + sum(e.expected_emitted(k) for e, k in zip(estimates, ks))
    return tokens / cost.charged_seconds(ks)


def marginal_draft_prices(estimates: Sequence[AcceptanceEstimate], ks: Sequence[int], cost: StepCostModel,
                          num_idle: int = 0) -> tuple[float, float]:
    """(token, pass): in expected tokens, what one more draft adds to the step that gives request
    i ks[i] drafts (its query token, and any per-token drafting), and what one more draft-model
    pass adds; each the step's goodput times the charged seconds. Once its pass has run, a draft
    whose chance of being emitted is below ``token`` lowers the step's goodput; a further pass
    pays only if the drafts it yields bring ``pass`` more (engine/decider.py ``DraftStop``).

    Worked example: a step predicted at 5 tokens in 50 ms (0.1 tokens/ms) where a query token adds
    2 ms and a head pass 2.2 ms: token 0.2, pass 0.22. Priced as one (0.42), a first draft the
    head is 35% sure of was dropped after the pass that drew it had already run."""
    if not ks:
        return 0.0, 0.0
    goodput = step_goodput(estimates, ks, cost, num_idle)
    total = sum(ks)
    token_s = cost.target_seconds(total + 1) - cost.target_seconds(total) + cost.draft_cost.per_token_s
    return goodput * max(0.0, token_s), goodput * cost.draft_cost.per_pass_s
