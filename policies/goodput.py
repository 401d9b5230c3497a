"""``goodput``: the default adaptive policy, per-request k maximising predicted step goodput.

Everything lives in planner/allocate.py (the greedy marginal-gain allocation under the SLA); this
file adapts it to the Policy interface. ``min_relative_gain`` is the margin by which speculation
must beat plain decoding before it is switched on: the latency model and the acceptance
estimates are not exact, and being slower than ``off`` is the failure users notice. When the
choice is off, a cheap exploratory allocation may run instead (``explore_budget``): see
``DraftSlope`` in planner/drift.py. While the acceptance beliefs are still the proposer's prior,
requests start speculating a few at a time (``slow_start_evidence``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..planner.allocate import Allocation, allocate
from ..planner.goodput import StepCostModel, step_goodput
from .base import PolicyState


@dataclass(frozen=True)
class GoodputPolicy:
    min_relative_gain: float = 0.02
    # False for a latency model whose predictions may fall as tokens grow (then every total is tried).
    assume_monotone_latency: bool = True
    # Exploring when the choice is "off": the optimistic allocation may lose at most this share of
    # predicted goodput (at the learned draft slope) to find out whether drafts really cost that much.
    explore_budget: float = 0.05
    # Requests without a verified draft of their own speculate a few at a time while their pool's
    # belief rests on fewer observed request-steps than this (``_slow_start``).
    slow_start_evidence: float = 32.0
    requires: ClassVar[frozenset[str]] = frozenset({"latency"})

    def __post_init__(self) -> None:
        if self.min_relative_gain < 0:
            raise ValueError(f"min_relative_gain must be >= 0, got {self.min_relative_gain}")
        if not 0 <= self.explore_budget < 1:
            raise ValueError(f"explore_budget must be in [0, 1), got {self.explore_budget}")
        if self.slow_start_evidence < 0:
            raise ValueError(f"slow_start_evidence must be >= 0, got {self.slow_start_evidence}")

    @property
    def name(self) -> str:
        return "goodput" if self.min_relative_gain == 0.02 else f"goodput:{self.min_relative_gain:g}"

    def _allocate(self, state: PolicyState, cost: StepCostModel) -> Allocation:
        return allocate([r.acceptance for r in state.requests], [r.max_k for r in state.requests], cost,
                        sla_itl_s=state.sla_itl_s, min_relative_gain=self.min_relative_gain,
                        assume_monotone=self.assume_monotone_latency, max_total_drafts=state.draft_budget)

    def plan(self, state: PolicyState) -> Allocation:
        """The full allocation (predicted goodput and step time too), for reports and tests."""
        cost = state.cost_model()
        chosen = self._allocate(state, cost)
        if chosen.total_drafts:
            if not state.draft_baseline and state.decode_only:
                return self._baseline(state, cost, chosen)
            return self._slow_start(state, cost, chosen)
        if not (self.explore_budget and state.explore_slope < state.draft_slope):
            return chosen
        return self._probe(state, cost, chosen) or chosen

    @staticmethod
    def _baseline(state: PolicyState, cost: StepCostModel, chosen: Allocation) -> Allocation:
        """A plain decode step when none of this batch size was measured recently (~70 steps):
        what drafts cost is learned by comparing steps with them against steps without
        (``DraftSlope``). Without one, a policy that drafts on every step never learns the price;
        with a profile that says drafts are free, it drafts deep for good. Only decode-only steps
        are a baseline, so a step that carries a prompt chunk drafts as chosen."""
        zeros = (0,) * len(state.requests)
        return Allocation(zeros, chosen.off_goodput, cost.seconds(zeros), chosen.off_goodput)

    def _slow_start(self, state: PolicyState, cost: StepCostModel, chosen: Allocation) -> Allocation:
        """Bet on an unverified prior a little at a time. A request with no verified draft of its
        own is valued at its pool's belief; while that belief rests on fewer than
        ``slow_start_evidence`` observed request-steps, at most max(1, evidence) such requests
        draft in one step (those with the best first draft). Each step's outcomes add to the
        pool, so the number doubles step by step while the prior holds, and a wrong prior costs a
        few drafts instead of a whole batch of them: a layer-skip draft, priced at the draft-model
        prior of 0.6, once drafted k=3 for 30 requests of a B=32 step at once and 2% were accepted."""
        fresh = [i for i, (r, k) in enumerate(zip(state.requests, chosen.ks))
                 if k and not r.steps_observed and r.pool_evidence < self.slow_start_evidence]
        if not fresh:
            return chosen
        allowed = max(1, int(min(state.requests[i].pool_evidence for i in fresh)))
        if len(fresh) <= allowed:
            return chosen
        fresh.sort(key=lambda i: -state.requests[i].acceptance.gains[0])
        ks = list(chosen.ks)
        for i in fresh[allowed:]:
            ks[i] = 0
        estimates = [r.acceptance for r in state.requests]
        return Allocation(tuple(ks), step_goodput(estimates, ks, cost), cost.seconds(ks), chosen.off_goodput)

    def _probe(self, state: PolicyState, cost: StepCostModel, off: Allocation) -> Allocation | None:
        """Off at the learned slope; would drafts pay if they cost what the optimistic slope says?
        Then the largest cut of that optimistic allocation predicted to lose at most the budget at
        the learned slope: every request's k capped at a depth (deepest first), then at depth 1
        only the r requests with the best first draft (r found by bisection). The measured step
        then tells the planner what drafts really cost here."""
        optimistic = self._allocate(state, state.cost_model(state.explore_slope)).ks
        if not any(optimistic):
            return None
        estimates = [r.acceptance for r in state.requests]
        floor = (1 - self.explore_budget) * off.goodput

        def judged(ks: tuple[int, ...]) -> Allocation | None:
            step_s = cost.seconds(ks)
            if state.sla_itl_s is not None and step_s > state.sla_itl_s:
                return None
            goodput = step_goodput(estimates, ks, cost)
            return Allocation(ks, goodput, step_s, off.off_goodput) if goodput >= floor else None

        for depth in range(max(optimistic), 1, -1):
            found = judged(tuple(min(k, depth) for k in optimistic))
            if found:
                return found
        # Depth 1: the r best first drafts among the requests the optimistic allocation chose.
        ranked = sorted((i for i, k in enumerate(optimistic) if k), key=lambda i: -estimates[i].gains[0])

        def first_drafts(r: int) -> tuple[int, ...]:
            ks = [0] * len(optimistic)
            for i in ranked[:r]:
                ks[i] = 1
            return tuple(ks)

        best, lo, hi = None, 1, len(ranked)  # the loss grows with r: bisect for the largest that fits
        while lo <= hi:
            mid = (lo + hi) // 2
            found = judged(first_drafts(mid))
            if found:
                best, lo = found, mid + 1
            else:
                hi = mid - 1
        return best

    def choose(self, state: PolicyState) -> list[int]:
        return list(self.plan(state).ks)
