"""Choose k per request to maximise predicted step goodput, under an optional ITL SLA.

Greedy by marginal gain, one draft at a time: the j-th draft of request i adds
``g_ij = P(len_i >= j) * alpha_first_i * alpha_i^(j-1)`` expected tokens, and the step's cost depends only on how many
drafts it carries in total (plus, for a draft model, the deepest k). Each request's gains are
non-increasing in j (a product of probabilities), so handing drafts out one at a time to the
request with the largest next gain — what a heap over requests does — visits exactly the gains in
globally sorted order, and the first n of them are the best possible n drafts. So we sort once and
only have to choose how many to hand out:

    goodput(n) = (B + G(n)) / T(n),   G(n) = sum of the n largest gains.

goodput(n) need not be unimodal (step time can jump at a kernel's tile size), so stopping at the
first dip could miss a later peak. We search n exactly instead, by branch and bound over intervals
of n: with T non-decreasing in n, every n strictly inside (lo, hi) has goodput at most
``(B + G(hi - 1)) / T(lo)``, so an interval whose bound cannot beat the best n seen is dropped and
the rest are bisected. That takes O(log N) latency predictions on smooth curves instead of N
(N = B * max_k = 512 at B = 64), which is what keeps ``decide`` under a millisecond. Monotone T is
an assumption about the latency model (a step with more query tokens is not faster): if a
prediction we happen to make shows T decreasing, we fall back to evaluating every n; for a model
known not to be monotone (say, a raw table of noisy measurements) pass ``assume_monotone=False``
to always evaluate every n, which is exact for any model.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from itertools import accumulate, chain
from typing import Callable, Sequence

from .acceptance import AcceptanceEstimate
from .goodput import StepCostModel


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


class _NotMonotone(Exception):
    """The step-time model decreased in n: interval bounds do not hold."""


def _scan(cum: list[float], base: float, step_s: Callable[[int], float], sla_s: float | None,
          floor: float) -> tuple[int, float, float]:
    """Every n, keeping the best: correct for any step-time model."""
    best = (0, floor, 0.0)
    for n in range(1, len(cum)):
        t = step_s(n)
        if sla_s is not None and t > sla_s:
            continue
        g = (base + cum[n]) / t
        if g > best[1]:
            best = (n, g, t)
    return best


def _branch_and_bound(cum: list[float], base: float, step_s: Callable[[int], float], sla_s: float | None,
                      floor: float) -> tuple[int, float, float]:
    """The best n in 1..N beating ``floor``, assuming step_s is non-decreasing (raises otherwise)."""
    last = len(cum) - 1
    best = (0, floor, 0.0)
    if last < 1:
        return best  # no draft to hand out (the step's token budget is spent)

    def feasible(t: float) -> bool:
        return sla_s is None or t <= sla_s

    def consider(n: int, t: float) -> None:
        nonlocal best
        g = (base + cum[n]) / t
        if g > best[1]:
            best = (n, g, t)

    # T(1), not T(0), bounds every n >= 1 from below: it includes what having drafts at all costs
    # (a draft model's pass, the learned jump), which often settles the search right here: if the
    # most tokens any n can emit over T(1) cannot beat the floor, no n can.
    t_first = step_s(1)
    if t_first < step_s(0):
        raise _NotMonotone
    if not feasible(t_first) or (base + cum[last]) / t_first <= best[1]:
        return best
    times = {1: t_first}
    consider(1, t_first)
    if last == 1:
        return best
    t_last = step_s(last)
    if t_last < t_first:
        raise _NotMonotone
    times[last] = t_last
    if feasible(t_last):
        consider(last, t_last)
    # Intervals are open: n strictly between lo and hi; T(lo) is known and feasible.
    heap = [(-(base + cum[last - 1]) / t_first, 1, last)] if last > 2 else []
    while heap:
        neg_bound, lo, hi = heapq.heappop(heap)
        if -neg_bound <= best[1]:
            break  # the heap is ordered by bound: nothing left can win
        mid = (lo + hi) // 2
        t = step_s(mid)
        if t < times[lo] or (hi in times and t > times[hi]):
            raise _NotMonotone
        times[mid] = t
        if feasible(t):
            consider(mid, t)
            if hi - mid > 1:
                heapq.heappush(heap, (-(base + cum[hi - 1]) / t, mid, hi))
        # mid infeasible: with T monotone so is everything above it; only (lo, mid) remains.
        if mid - lo > 1:
            heapq.heappush(heap, (-(base + cum[mid - 1]) / times[lo], lo, mid))
    return best


def allocate(estimates: Sequence[AcceptanceEstimate], caps: Sequence[int], cost: StepCostModel, *,
             sla_itl_s: float | None = None, min_relative_gain: float = 0.0,
             assume_monotone: bool = True, max_total_drafts: int | None = None) -> Allocation:
    """k_i in [0, caps[i]] maximising predicted goodput; all zeros when nothing beats plain decoding
    by ``min_relative_gain`` (e.g. a compute-bound step) or when even plain decoding breaks the SLA.
    ``max_total_drafts`` caps the drafts of the whole step (the engine's token budget): only the
    best that many gains are candidates."""
    num = len(estimates)
    if len(caps) != num:
        raise ValueError(f"{num} estimates but {len(caps)} caps")
    zeros = (0,) * num
    if num == 0:
        return Allocation((), 0.0, 0.0, 0.0)
    # Goodput is over the seconds charged to the decodes (StepCostModel.charged_seconds); the
    # SLA bounds the whole step. Both differ by the constant ``shared``, so the search runs on
    # charged seconds against an SLA lowered by it.
    shared = cost.shared_s
    fixed = cost.overhead_s - shared
    t_cache: dict[int, float] = {}

    def target_s(n: int) -> float:
        t = t_cache.get(n)
        if t is None:
            t = t_cache[n] = cost.target_seconds(n)
        return t

    off_s = target_s(0) + fixed  # charged
    off_goodput = num / off_s
    sla_s = sla_itl_s - shared if sla_itl_s is not None else None
    if sla_s is not None and off_s > sla_s:
        return Allocation(zeros, off_goodput, off_s + shared, off_goodput, meets_sla=False)  # nothing can meet it
    # Speculation must beat plain decoding by a margin: the model is not exact, and "never slower
    # than off" matters more than a sliver of predicted gain.
    floor = off_goodput * (1.0 + min_relative_gain)

    gains = [e.marginal_gains(c) for e, c in zip(estimates, caps)]
    deepest = max(len(g) for g in gains)
    if deepest == 0:
        return Allocation(zeros, off_goodput, off_s + shared, off_goodput)
    draft = cost.draft_cost
    # A draft model pays one pass per position up to the deepest k, a cost that does not split
    # across requests; so try each depth cap D (drafts at positions <= D only) and keep the best.
    depth_caps = range(1, deepest + 1) if draft.per_pass_s > 0.0 else (deepest,)
    best_n, best_g, best_s, chosen = 0, floor, off_s, []
    # All gains in one flat list, request i's at [i * deepest, i * deepest + caps[i]), padded with
    # -1 (gains are >= 0, so padding sorts last and is cut off); sorting indices by a C-level key
    # is what keeps this cheap at B = 64. One sort serves every depth cap: a cap keeps a
    # subsequence of the same order. Python's sort is stable, so ties go to the earlier request.
    pad = (-1.0,) * deepest
    flat = list(chain.from_iterable(g + pad[len(g):] for g in gains))
    full = sorted(range(len(flat)), key=flat.__getitem__, reverse=True)[:sum(map(len, gains))]
    limit = len(full) if max_total_drafts is None else max(0, max_total_drafts)
    for depth in depth_caps:
        order = (full if depth == deepest else [x for x in full if x % deepest < depth])[:limit]
        cum = list(accumulate(map(flat.__getitem__, order), initial=0.0))
        pass_s = draft.per_pass_s * depth  # exact for prefixes this deep; shallower ones win at their own cap

        def step_s(n: int, pass_s: float = pass_s) -> float:
            return target_s(n) + fixed + (pass_s + draft.per_token_s * n if n else 0.0)

        search = _branch_and_bound if assume_monotone else _scan
        try:
            n, g, t = search(cum, num, step_s, sla_s, best_g)
        except _NotMonotone:  # a prediction fell as tokens grew: the bounds do not hold
            n, g, t = _scan(cum, num, step_s, sla_s, best_g)
        if n and g > best_g:
            best_n, best_g, best_s, chosen = n, g, t, order
    if best_n == 0:
        return Allocation(zeros, off_goodput, off_s + shared, off_goodput)
    ks = [0] * num
    for x in chosen[:best_n]:
        ks[x // deepest] += 1
    return Allocation(tuple(ks), best_g, best_s + shared, off_goodput)
