"""``goodput``: the default adaptive policy, per-request k maximising predicted step goodput.

The choice is an allocation (``allocate``): k_i in [0, cap_i] for every request at once, under the
ITL SLA and the engine's draft budget, maximising expected emitted tokens per charged second of the
step (planner/goodput.py ``StepCostModel``). ``min_relative_gain`` is the margin by which
speculation must beat plain decoding before it is switched on: the latency model and the
acceptance estimates are not exact, and being slower than ``off`` is the failure users notice.
When the choice is off, a cheap exploratory allocation may run instead (``explore_budget``): one
that would pay if drafts cost what an optimistic slope says (``DraftSlope`` in planner/drift.py),
or if a first draft whose belief rests on little evidence were accepted as often as that belief
plausibly allows (``explore_optimism``). While the acceptance beliefs are still the proposer's
prior, requests start speculating a few at a time (``slow_start_evidence``).

How ``allocate`` chooses: the j-th draft of request i adds ``g_ij = P(len_i >= j) * alpha_first_i *
alpha_i^(j-1)`` expected tokens, and the step's cost depends only on how many drafts it carries in
total (plus, for a draft model, the deepest k). Each request's gains are non-increasing in j (a
product of probabilities), so handing drafts out one at a time to the request with the largest
next gain visits exactly the gains in globally sorted order, and the first n of them are the best
possible n drafts. So we sort once and only have to choose how many to hand out:

    goodput(n) = (B + G(n)) / T(n),   G(n) = sum of the n largest gains.

goodput(n) need not be unimodal (step time can jump at a kernel's tile size), so stopping at the
first dip could miss a later peak. Every n is weighed instead, at once: the latency model
predicts the whole curve T(0..N) in one call (``StepCostModel.target_seconds_list``), and the
best n is an argmax over arrays of N + 1 entries (N = B * max_k = 256 at B = 32). That is exact for
any step-time model, monotone or not, and is what keeps ``decide`` cheap at large batches. Small
problems (B * max_k <= 64: a few requests) are searched the same way in plain Python
(``_best_few``), on a curve priced in plain Python: there numpy's per-call cost, and the code it
must fetch back into a cache the forward pass has just flushed, is most of the work.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Sequence

import numpy as np

from ..planner.acceptance import AcceptanceEstimate
from ..planner.goodput import StepCostModel, step_goodput
from ..planner.policy import PolicyState


# Pseudo-outcomes behind a belief that nothing checked yet (the planner's cold prior strength,
# planner/acceptance.py ``AcceptanceConfig.cold_prior_strength``): how wide ``explore_optimism``
# takes a fresh bucket's belief to be.
_PRIOR_OUTCOMES = 2.0


@dataclass(frozen=True)
class Allocation:
    ks: tuple[int, ...]  # drafts per request (0 = no speculation)
    goodput: float  # predicted emitted tokens per charged second (StepCostModel.charged_seconds)
    step_s: float  # predicted seconds of the chosen step, all of it
    off_goodput: float  # the same goodput with k = 0 everywhere
    meets_sla: bool = True  # False when even plain decoding is predicted to break the ITL SLA

    @property
    def total_drafts(self) -> int:
        return sum(self.ks)


def _best_total(cum: np.ndarray, num: int, seconds: np.ndarray, sla_s: float | None, floor: float
                ) -> tuple[int, float, float]:
    """(n, goodput, seconds) of the best n in 1..N: the most tokens per second, (num + cum[n]) /
    seconds[n], above ``floor`` and within the SLA; (0, floor, 0.0) when no n beats the floor.
    cum [N + 1]: the n best gains summed (cum[0] = 0); seconds [>= N + 1]: the step at each n.
    Ties go to the smallest n."""
    last = len(cum) - 1
    if last < 1:
        return 0, floor, 0.0  # no draft to hand out (the step's token budget is spent)
    t = seconds[1:last + 1]  # [N]
    goodput = (num + cum[1:]) / t  # [N]
    if sla_s is not None:
        goodput[t > sla_s] = -np.inf
    i = int(np.argmax(goodput))
    if goodput[i] > floor:
        return i + 1, float(goodput[i]), float(t[i])
    return 0, floor, 0.0


def _step_seconds(cost: StepCostModel, max_drafts: int, depth: int) -> np.ndarray:
    """[max_drafts + 1]: the charged seconds of a step carrying n = 0..max_drafts drafts at most
    ``depth`` deep (a draft model pays one pass per position up to the deepest; exact for
    allocations that deep, shallower ones win at their own depth)."""
    n = np.arange(max_drafts + 1)  # [n]
    draft = cost.draft_cost
    extra = (draft.per_pass_s * depth + draft.per_token_s * n) * (n > 0)  # [n]
    return cost.target_curve(max_drafts)[:max_drafts + 1] + (cost.overhead_s - cost.shared_s) + extra


# Up to this many candidate drafts ``allocate`` searches in plain Python (``_best_few``), every
# depth cap of a draft model included: on a small problem numpy's per-call cost is most of the
# work (at B = 1 a decision took ~0.2 ms of an 8 ms step on the Q4_1 engine, measured:
# reports/README.md; at B = 4 on the chain, one numpy pass per depth cap, ~0.47 ms).
_FEW_DRAFTS = 64


def _best_few(rows: Sequence[tuple[float, ...]], lengths: Sequence[int], depths: Sequence[int], limit: int,
              cost: StepCostModel, sla_s: float | None, floor: float,
              drafted: Sequence[bool] | None = None, num_idle: int = 0) -> tuple[tuple[int, ...], float]:
    """``allocate``'s search over at most ``_FEW_DRAFTS`` candidates, in plain Python: the same
    order (one stable sort, ties to the earlier request), the same depth caps in the same order,
    the same float operations in the same order, so the same answer (tests/test_planner.py checks
    both on random problems, chains of lookup and model drafts included). ``depths``: the depth
    caps to try (a cap D keeps model drafts at positions < D and every lookup draft, whose
    request ``drafted`` marks False); a cap must beat the best so far, starting from ``floor``.
    ``num_idle``: decodes beside ``rows`` that draft nothing (one token each). Returns (ks, goodput),
    or ((), floor) when no total beats ``floor``.

    At B = 4 on the chain (four depth caps or more a step) the numpy search took ~0.47 ms of a
    ~37 ms step in the engine; a head's drafts always bring several caps."""
    owners = [i for i, n in enumerate(lengths) for _ in range(n)]  # [drafts]: whose gain
    positions = [j for n in lengths for j in range(n)]  # [drafts]: its draft position (0-based)
    gains = [g for row, n in zip(rows, lengths) for g in row[:n]]  # [drafts], request-major
    full = sorted(range(len(gains)), key=gains.__getitem__, reverse=True)  # stable
    deepest = max(lengths, default=0)
    draft = cost.draft_cost
    fixed = cost.overhead_s - cost.shared_s
    num = len(lengths) + num_idle
    best_g, best = floor, ()
    for depth in depths:
        # A cap at or past the deepest draft keeps them all (as allocate's numpy search does for
        # caps past the deepest model draft: the filter below would keep them all there too).
        kept = full if depth >= deepest else [x for x in full if positions[x] < depth
                                              or not (drafted is None or drafted[owners[x]])]
        order = kept[:limit]
        if not order:
            continue
        curve = cost.target_seconds_list(len(order))
        per_pass = draft.per_pass_s * depth
        best_n, depth_g, cum = 0, -math.inf, 0.0
        for n, x in enumerate(order, start=1):
            cum += gains[x]
            t = curve[n] + fixed + (per_pass + draft.per_token_s * n)  # as _step_seconds
            g = (num + cum) / t if sla_s is None or t <= sla_s else -math.inf
            if g > depth_g:  # the first best, as argmax
                best_n, depth_g = n, g
        if depth_g > best_g:
            best_g, best = depth_g, order[:best_n]
    if not best:
        return (), floor
    ks = [0] * len(lengths)
    for x in best:
        ks[owners[x]] += 1
    return tuple(ks), best_g


def any_draft_pays(num: int, cap: int, cost: StepCostModel, *, sla_itl_s: float | None = None,
                   min_relative_gain: float = 0.0, max_total_drafts: int | None = None) -> bool:
    """Whether ``allocate`` would hand out any draft to ``num`` requests of cap ``cap`` if every
    draft were accepted (each gain 1). Real gains are at most 1, so False means ``allocate``
    answers all zeros for any estimates: the planner's screen (controller.py ``may_speculate``),
    without building estimates or sorting gains (with equal gains the n best sum to n)."""
    if num == 0 or cap <= 0:
        return False
    off_s = cost.charged_seconds((0,))
    sla_s = sla_itl_s - cost.shared_s if sla_itl_s is not None else None
    if sla_s is not None and off_s > sla_s:
        return False
    floor = num / off_s * (1.0 + min_relative_gain)
    limit = num * cap if max_total_drafts is None else max(0, min(num * cap, max_total_drafts))
    for depth in (range(1, cap + 1) if cost.draft_cost.per_pass_s > 0.0 else (cap,)):
        if num * depth <= _FEW_DRAFTS:  # as allocate: a small search in plain Python, the same answer
            if _best_few(((1.0,) * depth,) * num, (depth,) * num, (depth,), limit, cost, sla_s, floor)[0]:
                return True
            continue
        most = min(limit, num * depth)
        cum = np.arange(most + 1, dtype=float)  # [most + 1]
        if _best_total(cum, num, _step_seconds(cost, most, depth), sla_s, floor)[0]:
            return True
    return False


def allocate(estimates: Sequence[AcceptanceEstimate], caps: Sequence[int], cost: StepCostModel, *,
             sla_itl_s: float | None = None, min_relative_gain: float = 0.0,
             max_total_drafts: int | None = None, num_idle: int = 0) -> Allocation:
    """k_i in [0, caps[i]] maximising predicted goodput; all zeros when nothing beats plain decoding
    by ``min_relative_gain`` (e.g. a compute-bound step) or when even plain decoding breaks the SLA.
    ``max_total_drafts`` caps the drafts of the whole step (the engine's token budget): only the
    best that many gains are candidates. ``num_idle``: decodes of the step beside ``estimates``
    that cannot draft (PolicyState.num_idle): each emits one token, so they count in goodput as
    requests whose estimates are all 0 would, without being searched."""
    if len(caps) != len(estimates):
        raise ValueError(f"{len(estimates)} estimates but {len(caps)} caps")
    num = len(estimates) + num_idle  # the step's decodes: goodput is (num + drafts' gains) / seconds
    zeros = (0,) * len(estimates)
    if not estimates:
        return Allocation((), 0.0, 0.0, 0.0)
    # Goodput is over the seconds charged to the decodes (StepCostModel.charged_seconds); the
    # SLA bounds the whole step. Both differ by the constant ``shared``, so the search runs on
    # charged seconds against an SLA lowered by it.
    shared = cost.shared_s
    # Request i's candidate drafts: its gains up to its cap, without the zero gains at the end
    # (a lookup's estimate has gains 0 past the drafts it found: [g1, g2, 0, 0, ...]). A draft that
    # adds no token and some time never raises goodput, so leaving them out changes no answer,
    # and at B = 4 with 8-wide rows it is most of the candidates the search sorts and prices.
    rows = [e.gains for e in estimates]
    width = len(rows[0])
    lengths = []
    for c, g in zip(caps, rows):
        n = max(0, min(c, len(g)))
        while n and g[n - 1] <= 0.0:
            n -= 1
        lengths.append(n)
    cost.target_seconds_list(sum(lengths))  # every total of drafts priced at once, kept
    off_s = cost.charged_seconds(zeros)
    off_goodput = num / off_s
    sla_s = sla_itl_s - shared if sla_itl_s is not None else None
    if sla_s is not None and off_s > sla_s:
        return Allocation(zeros, off_goodput, off_s + shared, off_goodput, meets_sla=False)  # nothing can meet it
    # Speculation must beat plain decoding by a margin: the model is not exact, and "never slower
    # than off" matters more than a sliver of predicted gain.
    floor = off_goodput * (1.0 + min_relative_gain)

    deepest = max(lengths)
    if deepest == 0:
        return Allocation(zeros, off_goodput, off_s + shared, off_goodput)
    draft = cost.draft_cost
    # A draft model pays one pass per position up to the deepest k, a cost that does not split
    # across requests; so try each depth cap D (drafts at positions <= D only) and keep the best.
    # Lookup drafts run no pass (StepCostModel.model_drafted): a depth cap leaves them whole.
    drafted = cost.model_drafted
    model_deepest = deepest if drafted is None else max((n for n, m in zip(lengths, drafted) if m), default=0)
    # Depth 0 (lookup drafts only) is a candidate of its own where both sources are in the step.
    looked_up = drafted is not None and any(n and not m for n, m in zip(lengths, drafted))
    depth_caps = (range(0 if looked_up else 1, model_deepest + 1) if draft.per_pass_s > 0.0 and model_deepest
                  else (model_deepest,))
    limit = sum(lengths) if max_total_drafts is None else max(0, min(sum(lengths), max_total_drafts))
    if sum(lengths) <= _FEW_DRAFTS or (len(depth_caps) == 1 and limit <= _FEW_DRAFTS):
        ks, goodput = _best_few(rows, lengths, depth_caps, limit, cost, sla_s, floor, drafted, num_idle)
        if not ks:
            return Allocation(zeros, off_goodput, off_s + shared, off_goodput)
        return Allocation(ks, goodput, cost.seconds(ks), off_goodput)
    # Request i's gains, padded with -1 past its length (gains are >= 0, so padding sorts last
    # and is cut off): [requests, deepest].
    if all(len(g) == width for g in rows):  # the planner's estimates: one length, max_k
        table = np.array(rows, dtype=float)[:, :deepest]  # [requests, deepest]
        table[np.arange(deepest) >= np.array(lengths)[:, None]] = -1.0
    else:
        pad = (-1.0,) * deepest
        table = np.array([g[:n] + pad[n:] for g, n in zip(rows, lengths)], dtype=float)  # [requests, deepest]
    # All gains in one flat array, request i's at [i * deepest, i * deepest + caps[i]). One stable
    # sort (ties go to the earlier request) serves every depth cap: a cap keeps a subsequence of
    # the same order.
    # Worked example, deepest = 3: request 0's gains (0.9, 0.5) and request 1's (0.7,) flatten to
    # [0.9, 0.5, -1, 0.7, -1, -1]; the order is [0, 3, 1] (x // 3 is the request, x % 3 the
    # position), and n = 2 drafts give k = (1, 1).
    flat = table.ravel()  # [requests * deepest]
    full = np.argsort(-flat, kind="stable")[:sum(lengths)]  # [drafts], best gain first
    passless = ~np.array(drafted or (True,) * len(estimates))[full // deepest]  # [drafts]: lookup drafts
    best_n, best_g, chosen = 0, floor, full
    for depth in depth_caps:
        order = full if depth >= model_deepest else full[(full % deepest < depth) | passless]
        order = order[:limit]  # [n]
        cum = np.concatenate(([0.0], np.cumsum(flat[order])))  # [n + 1]
        n, g, _ = _best_total(cum, num, _step_seconds(cost, len(order), depth), sla_s, best_g)
        if n and g > best_g:
            best_n, best_g, chosen = n, g, order
    if best_n == 0:
        return Allocation(zeros, off_goodput, off_s + shared, off_goodput)
    ks = tuple(np.bincount(chosen[:best_n] // deepest, minlength=len(estimates)).tolist())
    return Allocation(ks, best_g, cost.seconds(ks), off_goodput)


@dataclass(frozen=True)
class GoodputPolicy:
    min_relative_gain: float = 0.02
    # Exploring when the choice is "off": the optimistic allocation may lose at most this share of
    # predicted goodput (at the learned draft slope) to find out whether drafts really cost that much.
    explore_budget: float = 0.05
    # ... in a memory-bound step. Exploring pays where a draft is cheap; in a compute-bound step a
    # draft costs about what a token does, and a probe there mostly loses (at B = 16 a probe
    # bought little evidence per step, so the optimistic slope lasted and probes kept running).
    # So the budget is whole while the step's arithmetic intensity is under this share of the
    # ridge, falls linearly to nothing at the ridge, and is nothing past it (``explore_share``).
    # Without a roofline (no profile) the budget is whole.
    explore_full_below: float = 0.5
    # A belief that was never checked on this traffic, or only a few times, may be far off: a
    # bucket whose first drafts were rejected twice reads 0.1 and is never drafted again, so it
    # never learns that it is accepted 0.3 of the time (measured: reports/README.md). So, where
    # exploring is affordable, a probe also values each request's first draft this many standard
    # deviations above its mean, the deviation of a Beta belief resting on
    # ``_PRIOR_OUTCOMES`` + the pool's evidence (request-steps observed in that match bucket).
    # It fades as the bucket is tried: after ~30 tries the bonus of a 0.05 bucket is ~0.04.
    explore_optimism: float = 1.0
    # Requests without a verified draft of their own speculate a few at a time while their pool's
    # belief rests on fewer observed request-steps than this (``_slow_start``).
    slow_start_evidence: float = 32.0
    # With a draft head, let drafts run past the chosen k while the head is sure enough, and stop
    # where one more draft no longer pays (planner/controller.py ``_confident_drafts``). Off by
    # default: paired on the Xeon VM with the shipped SmolLM2 head, the chosen k as they are ran
    # faster than with the stop in 7 of 8 cells, by up to 6% (B = 1 and 4, four workloads;
    # reports/eagle/README.md, "The confidence stop, measured against no stop"). ``goodput:stop``
    # turns it on.
    confidence_stop: bool = False
    requires: ClassVar[frozenset[str]] = frozenset({"latency"})
    # A request that cannot draft counts only in goodput's token count (allocate's ``num_idle``).
    counts_idle_requests: ClassVar[bool] = True
    # Its choices are weighed in seconds, so the planner may weigh its own seconds against what
    # they save, and stop planning while they do not pay (planner/pause.py).
    weighs_planning_cost: ClassVar[bool] = True

    def __post_init__(self) -> None:
        if self.min_relative_gain < 0:
            raise ValueError(f"min_relative_gain must be >= 0, got {self.min_relative_gain}")
        if not 0 <= self.explore_budget < 1:
            raise ValueError(f"explore_budget must be in [0, 1), got {self.explore_budget}")
        if not 0 <= self.explore_full_below < 1:
            raise ValueError(f"explore_full_below must be in [0, 1), got {self.explore_full_below}")
        if self.slow_start_evidence < 0:
            raise ValueError(f"slow_start_evidence must be >= 0, got {self.slow_start_evidence}")
        if self.explore_optimism < 0:
            raise ValueError(f"explore_optimism must be >= 0, got {self.explore_optimism}")

    @property
    def name(self) -> str:
        if self.min_relative_gain != 0.02:
            return f"goodput:{self.min_relative_gain:g}" + ("+stop" if self.confidence_stop else "")
        return "goodput:stop" if self.confidence_stop else "goodput"

    @property
    def stops_on_confidence(self) -> bool:
        """Whether the planner hands a model proposer the confidence stop (``confidence_stop``)."""
        return self.confidence_stop

    def _allocate(self, state: PolicyState, cost: StepCostModel) -> Allocation:
        return allocate([r.acceptance for r in state.requests], [r.max_k for r in state.requests], cost,
                        sla_itl_s=state.sla_itl_s, min_relative_gain=self.min_relative_gain,
                        max_total_drafts=state.draft_budget, num_idle=state.num_idle)

    def plan(self, state: PolicyState) -> Allocation:
        """The full allocation (predicted goodput and step time too), for reports and tests."""
        cost = state.cost_model()
        chosen = self._allocate(state, cost)
        if chosen.total_drafts:
            if not state.pricing.draft_baseline and state.decode_only:
                return self._baseline(state, cost, chosen)
            return self._slow_start(state, cost, chosen)
        budget = self.explore_budget * self.explore_share(state) if self.explore_budget else 0.0
        return (self._probe(state, cost, chosen, budget) if budget > 0 else None) or chosen

    def may_pay(self, state: PolicyState) -> bool:
        """Whether ``plan`` could give anyone drafts in this step (the planner's screen, controller.py
        ``may_speculate``; ``state.requests`` matter only through their number and context, each
        with cap ``state.max_k``), judged as if every draft were accepted. ``plan`` only keeps or
        cuts what an allocation at the learned price, or a probe at the optimistic one, hands out;
        so False is exact: plan would answer 0 for all, and the engine can skip its lookups."""
        def pays(cost: StepCostModel) -> bool:
            return any_draft_pays(state.batch_size, state.max_k, cost, sla_itl_s=state.sla_itl_s,
                                  min_relative_gain=self.min_relative_gain, max_total_drafts=state.draft_budget)

        if pays(state.cost_model()):
            return True
        probing = (self.explore_budget and state.pricing.explore_slope < state.pricing.draft_slope
                   and self.explore_share(state) > 0)
        return bool(probing and pays(state.cost_model(state.pricing.explore_slope)))

    def explore_share(self, state: PolicyState) -> float:
        """How much of the exploration budget this step may spend: 1 while its intensity is under
        ``explore_full_below`` x the ridge, 0 from the ridge on, linear between.

        Worked example, ridge 4.4 FLOP/B, full below 0.5: B = 1 (intensity 0.5) and B = 4 (2.0) get
        the whole budget, B = 8 (3.6) 1 - (3.6 / 4.4 - 0.5) / 0.5 = 0.36 of it, B = 16 (6.1) none."""
        roofline = state.roofline
        if roofline is None:
            return 1.0
        bound = roofline.intensity(state.base) / roofline.ridge
        return max(0.0, min(1.0, (1.0 - bound) / (1.0 - self.explore_full_below)))

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
        few drafts instead of a whole batch of them (a draft model whose prior was far too high
        once drafted for almost every request of a large batch at once: measured,
        reports/README.md#planner-measurements)."""
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
        return Allocation(tuple(ks), step_goodput(estimates, ks, cost, state.num_idle), cost.seconds(ks),
                          chosen.off_goodput)

    def optimistic_estimates(self, state: PolicyState) -> list[AcceptanceEstimate] | None:
        """Each request's estimate with its first draft valued ``explore_optimism`` standard
        deviations above its mean, the deviation of a Beta belief of ``_PRIOR_OUTCOMES`` + the
        request's pool evidence outcomes; None when no estimate moves (every pool is warm, or no
        request has a draft). Worked example: a first draft at 0.1 after 2 request-steps of
        evidence becomes 0.1 + sqrt(0.1 * 0.9 / 4) = 0.25; after 30, 0.1 + 0.05 = 0.15."""
        if not self.explore_optimism:
            return None
        out, moved = [], False
        for r in state.requests:
            e = r.acceptance
            first = e.alpha_first
            if e.gains and e.gains[0] > 0.0 and first < 1.0 and r.pool_evidence < float("inf"):
                bonus = self.explore_optimism * math.sqrt(first * (1.0 - first) / (_PRIOR_OUTCOMES + r.pool_evidence))
                if bonus > 1e-3:
                    e, moved = e.with_first(first + bonus), True
            out.append(e)
        return out if moved else None

    def _probe(self, state: PolicyState, cost: StepCostModel, off: Allocation, budget: float) -> Allocation | None:
        """Off at the learned price and beliefs; would drafts pay if they cost what the optimistic
        slope says, or were accepted as often as the optimistic first-draft beliefs say
        (``optimistic_estimates``)? Then the largest cut of that optimistic allocation predicted to
        lose at most ``budget`` at the learned slope and beliefs: every request's k capped at a
        depth (deepest first), then at depth 1 only the r requests with the best first draft (r
        found by bisection). The measured step then tells the planner what drafts really cost
        here, and the outcome what they are worth."""
        estimates = [r.acceptance for r in state.requests]
        # One optimism at a time (both at once would probe where only a lucky draft at half its
        # price pays): the slope's with the beliefs as they are, else the beliefs' at the learned price.
        candidates = []
        if state.pricing.explore_slope < state.pricing.draft_slope:
            candidates.append((estimates, state.cost_model(state.pricing.explore_slope)))
        hopeful = self.optimistic_estimates(state)
        if hopeful is not None:
            candidates.append((hopeful, cost))
        caps = [r.max_k for r in state.requests]
        optimistic = next((ks for ks in (allocate(e, caps, c, sla_itl_s=state.sla_itl_s,
                                                  min_relative_gain=self.min_relative_gain,
                                                  max_total_drafts=state.draft_budget, num_idle=state.num_idle).ks
                                         for e, c in candidates) if any(ks)), None)
        if optimistic is None:
            return None
        floor = (1 - budget) * off.goodput

        def judged(ks: tuple[int, ...]) -> Allocation | None:
            step_s = cost.seconds(ks)
            if state.sla_itl_s is not None and step_s > state.sla_itl_s:
                return None
            goodput = step_goodput(estimates, ks, cost, state.num_idle)
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
