"""Online acceptance estimation: how many tokens a request will emit if we let it speculate.

Two things decide what k drafts are worth, and both are learned here from ``RequestRecord``s:

* **acceptance** – the chance that a draft token at the next position is accepted, given that
  the proposer produced one there and every earlier draft was accepted. Verification stops at the
  first rejection, so the positions after it were never judged. Two numbers, with a Beta prior
  each: ``alpha_first`` for the first draft and ``alpha`` for every later one (the alpha of
  docs/design.md §5 when the two are equal). They differ a lot for lookup proposers: a first n-gram
  draft is a guess about whether the text repeats, a later one follows a match that has held so
  far, and is accepted far more often (measured: reports/README.md#planner-measurements). One
  geometric alpha would price the first draft too high and every later draft too low, and so
  speculate too shallowly where drafts are cheap.
* **proposal length** – n-gram and suffix proposers often find nothing, or fewer tokens than asked.
  Counting a draft that never exists would overstate speculation, so we also learn
  ``P(proposal has >= j tokens)`` for each position j, as a product of per-position continuation
  probabilities (Kaplan–Meier style): a proposal shorter than asked tells us exactly where it
  stopped; a full one only that it reached k (censored). The proposer's ``natural_k`` extends a
  full proposal's lower bound (the proposer saw that much continuation), and for the n-gram
  proposer, whose natural_k is the length available up to a cap, it is an exact length.
  Trees (suffix) are read as chains of their node count, which undercounts their acceptance a
  little (a fully accepted branch shorter than the tree counts one rejection): conservative.

* **match length** – a lookup proposer that drafts before the decision (n-gram, suffix) says how
  many trailing tokens it matched. That predicts acceptance better than anything else it knows:
  the longer the match, the more often both the first draft and the later ones are accepted,
  from a poor bet after a 1-token match to an almost sure one after a 16-token one (measured:
  reports/README.md#planner-measurements). So the planner keeps one belief per match-length bucket
  (``match_bucket``), each with its own prior (``ProposerPrior.by_match_length``), and values a
  draft by the belief of the match that found it: drafts after a 1-token match can stay off
  while those after a 16-token one run deep, in the same request, and can pay even in a
  compute-bound step. (The suffix proposer's prior has no per-length values; each of its buckets learns.)

Both statistics are kept per request (discounted, so a request that moves from copying its prompt
to free text is tracked) on top of a pooled prior per (proposer, workload) that learns from every
observed request, so a new request starts from what its neighbours showed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import accumulate, chain, repeat
from operator import mul
from types import MappingProxyType
from typing import Mapping


@dataclass(frozen=True)
class AcceptanceEstimate:
    """What the planner believes about one request: alpha and the proposal-length survival."""

    alpha: float  # acceptance of draft j >= 2, given a draft exists there and drafts 1..j-1 were accepted
    p_len_ge: tuple[float, ...]  # p_len_ge[j - 1] = P(proposal has >= j tokens), j = 1..max_k; non-increasing
    alpha_first: float | None = None  # acceptance of the first draft; None: the same as alpha

    # gains[j - 1]: expected extra emitted tokens from the j-th draft,
    # P(len >= j) * alpha_first * alpha^(j - 1) (non-increasing in j). Derived, computed once: the
    # allocator reads it every step.
    gains: tuple[float, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.alpha_first is None:
            object.__setattr__(self, "alpha_first", self.alpha)
        for name in ("alpha", "alpha_first"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        object.__setattr__(self, "gains", _gains(self.alpha, self.p_len_ge, self.alpha_first))

    @staticmethod
    def _checked(alpha: float, p_len_ge: tuple[float, ...], alpha_first: float) -> "AcceptanceEstimate":
        """An estimate of values already known to be in range (posterior means of ones that were):
        built without the constructor's checks. Every request's estimate is rebuilt each step it
        was observed in, and at B = 32 the checks were about a tenth of the planner's step (cProfile of
        the vLLM plugin's simulation, scripts/vllm_plugin_cost.py)."""
        e = object.__new__(AcceptanceEstimate)
        e.__dict__.update(alpha=alpha, p_len_ge=p_len_ge, alpha_first=alpha_first,
                          gains=_gains(alpha, p_len_ge, alpha_first))
        return e

    @property
    def max_k(self) -> int:
        return len(self.p_len_ge)

    def with_first(self, alpha_first: float) -> "AcceptanceEstimate":
        """The same estimate with another first-draft acceptance (clipped to [0, 1]); every gain
        moves with it."""
        return AcceptanceEstimate._checked(self.alpha, self.p_len_ge, max(0.0, min(1.0, alpha_first)))

    def marginal_gains(self, k: int) -> tuple[float, ...]:
        """The gains of drafts 1..k."""
        return self.gains[:max(0, k)]

    def expected_emitted(self, k: int) -> float:
        """E[tokens emitted] with k drafts asked: 1 + sum_j P(len >= j) * alpha_first * alpha^(j - 1)."""
        return 1.0 + sum(self.marginal_gains(k))

    @property
    def expected_proposal_length(self) -> float:
        """E[min(proposal length, max_k)]: how many drafts a request asking max_k would really get."""
        return sum(self.p_len_ge)


def _gains(alpha: float, p_len_ge: tuple[float, ...], alpha_first: float) -> tuple[float, ...]:
    """P(len >= j) * alpha_first * alpha^(j - 1) for j = 1..max_k (C-level itertools: every
    request's estimate runs it)."""
    reach = accumulate(repeat(alpha, len(p_len_ge) - 1), mul, initial=alpha_first)
    return tuple(map(mul, p_len_ge, reach))


@lru_cache(maxsize=None)
def exact_length(n: int, max_k: int) -> tuple[float, ...]:
    """P(len >= j), j = 1..max_k, of a proposal known to have exactly n drafts (a lookup that
    ran before the decision): 1 up to n, 0 after."""
    n = max(0, min(n, max_k))
    return (1.0,) * n + (0.0,) * (max_k - n)


@dataclass(frozen=True)
class ProposerPrior:
    """The starting belief for a proposer before anything was observed (weak: a few pseudo-outcomes),
    and how to read its ``natural_k``."""

    alpha: float  # prior acceptance of drafts after the first
    p_first: float  # prior P(proposal is non-empty)
    p_continue: float  # prior P(a proposal of >= j - 1 tokens has a j-th), j >= 2
    # When natural_k is the length available (n-gram: min(available, cap)), a value below the cap
    # is an exact length even if we asked for fewer; None: natural_k is only a lower bound (the
    # suffix proposer's is a preference from the match length, not what it could produce).
    natural_k_exact_below: int | None = None
    alpha_first: float | None = None  # prior acceptance of the first draft; None: alpha
    # (alpha_first, alpha) after a lookup matched 1, 2, ... trailing tokens (the last entry also
    # covers longer matches); empty: the proposer reports no match length (see ``for_match``).
    by_match_length: tuple[tuple[float, float], ...] = ()

    def __post_init__(self) -> None:
        values = [self.alpha, self.p_first, self.p_continue, *chain.from_iterable(self.by_match_length)]
        if self.alpha_first is not None:
            values.append(self.alpha_first)
        if not all(0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"a prior's probabilities must be in [0, 1], got {self}")

    def for_match(self, bucket: int) -> "ProposerPrior":
        """The prior for drafts found by a match in ``bucket`` (``match_bucket``): the proposal
        exists, and its acceptance is the one measured after matches of that length."""
        if not self.by_match_length:
            return self
        alpha_first, alpha = self.by_match_length[min(bucket, len(self.by_match_length)) - 1]
        return dataclasses.replace(self, alpha=alpha, alpha_first=alpha_first, p_first=1.0, by_match_length=())


# Buckets 1-3 are matches of 1-3 tokens; from 4 on they double: 4-7, 8-15, 16 and more.
MAX_MATCH_BUCKET = 6


def match_bucket(match_length: int | None) -> int | None:
    """Which acceptance belief a draft found by a ``match_length``-token lookup belongs to (None:
    no match length known, or no match, so the request's one belief for the proposer)."""
    if match_length is None or match_length <= 0:
        return None
    return match_length if match_length <= 3 else min(1 + match_length.bit_length(), MAX_MATCH_BUCKET)


# Proposers that look drafts up in text (no model forward): often no match, drafting ~free.
LOOKUP_PROPOSERS = frozenset({"ngram", "suffix"})

# Lookup proposers often find no match; a draft model always proposes k tokens. The n-gram
# proposer reports natural_k = min(available, max_natural_k), 8 by default in the engine.
_MODEL_PRIOR = ProposerPrior(alpha=0.6, p_first=1.0, p_continue=1.0)
_HEAD_PRIOR = ProposerPrior(alpha=0.35, p_first=1.0, p_continue=1.0, alpha_first=0.35)
# (alpha_first, alpha) of n-gram drafts per match bucket, measured by scripts/measure_match_acceptance.py
# (SmolLM2-135M, greedy, 24 prompts per workload that the evaluation does not use;
# reports/README.md#planner-measurements).
_NGRAM_BY_MATCH = ((0.2, 0.65), (0.5, 0.75), (0.65, 0.75), (0.73, 0.82), (0.87, 0.9), (0.93, 0.94))
DEFAULT_PRIORS: Mapping[str, ProposerPrior] = MappingProxyType({
    "ngram": ProposerPrior(alpha=0.7, p_first=0.6, p_continue=0.85, natural_k_exact_below=8, alpha_first=0.5,
                           by_match_length=_NGRAM_BY_MATCH),
    "suffix": ProposerPrior(alpha=0.7, p_first=0.6, p_continue=0.85, alpha_first=0.5),
    # An EAGLE-3 head always proposes k tokens. Its acceptance is the shipped SmolLM2 head's on the
    # evaluation's MT-Bench prompts (reports/eagle: about 0.35 for the first draft and for each
    # next one); a better head moves the beliefs up within a few steps.
    "eagle": _HEAD_PRIOR,
    # The chain (engine/proposers/chain.py): lookup drafts where the lookup matched enough tokens
    # (priced as the n-gram's, by match length), the head's elsewhere (the chain reports their
    # match length as 0: bucket None, the head's belief).
    "chain": dataclasses.replace(_HEAD_PRIOR, by_match_length=_NGRAM_BY_MATCH),
})


def default_prior(proposer: str) -> ProposerPrior:
    """The prior for a proposer name; any name not known as a lookup proposer is a draft model."""
    return DEFAULT_PRIORS.get(proposer, _MODEL_PRIOR)


@dataclass(frozen=True)
class AcceptanceConfig:
    max_k: int = 8  # positions tracked (the planner never asks for more)
    initial_strength: float = 2.0  # pseudo-outcomes behind the proposer prior in a fresh pool
    request_prior_strength: float = 6.0  # pseudo-outcomes a warm pool lends each request's posterior
    # ... and a pool that has seen nothing (its belief is the built-in prior): a prior nobody has
    # checked on this traffic is a wide distribution, so a request's first few drafts move its
    # estimate quickly. One more per request-step the pool has observed, up to the above
    # (``RequestAcceptance.prior_strength``).
    cold_prior_strength: float = 2.0
    request_discount: float = 0.95  # per observed step: a request's own evidence fades over ~20 steps
    pool_discount: float = 0.998  # per observed request-step: the pool remembers ~500 of them

    def __post_init__(self) -> None:
        if self.max_k < 1:
            raise ValueError(f"max_k must be >= 1, got {self.max_k}")
        for name in ("request_discount", "pool_discount"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if self.initial_strength <= 0 or self.request_prior_strength <= 0 or self.cold_prior_strength <= 0:
            raise ValueError("prior strengths must be > 0")


class OutcomeCounts:
    """Discounted sufficient statistics of observed proposals (mutable; owned by one estimator).

    ``add`` is O(1): instead of multiplying every count by the discount, later observations are
    stored with weight 1 / scale and ``scale`` shrinks by the discount each time; reading
    multiplies back. Proposal lengths are stored as a histogram of what each observation proved
    (length >= m, and whether it stopped exactly there), turned into per-position counts on read.
    """

    def __init__(self, max_k: int):
        self.max_k = max_k
        self._scale = 1.0  # stored * scale = discounted count
        self._first_accepted = 0.0  # steps whose first draft was accepted
        self._first_rejected = 0.0  # steps whose first draft was rejected
        self._accepted = 0.0  # judged later positions (j >= 2) that were accepted
        self._rejected = 0.0  # judged later positions that were rejected (at most one per step)
        self._at_least = [0.0] * (max_k + 1)  # [m]: proposals proven to have >= m tokens (no more known)
        self._stopped = [0.0] * max_k  # [m]: of those, proposals seen to end after exactly m tokens

    def add(self, k: int, num_proposed: int, num_accepted: int, natural_k: int | None, discount: float,
            natural_k_exact_below: int | None = None) -> bool:
        """Fold in one step's outcome; returns False when the step told nothing (k = 0)."""
        if k <= 0:
            return False  # the proposer was not asked: nothing about this request was observed
        if discount < 1.0:
            self._scale *= discount
            if self._scale < 1e-100:
                self._rescale()
        w = 1.0 / self._scale
        proposed = max(0, num_proposed)
        acc = max(0, min(num_accepted, proposed))
        if proposed > 0:
            if acc > 0:
                self._first_accepted += w
                self._accepted += (acc - 1) * w
                if acc < proposed:
                    self._rejected += w
            else:
                self._first_rejected += w
        # A proposal shorter than asked ends exactly there; so does an n-gram style natural_k below
        # its cap. Otherwise a full proposal (or the natural length) is only a lower bound.
        if proposed < k:
            self._length(proposed, exact=True, w=w)
        elif natural_k is not None and natural_k_exact_below is not None and proposed <= natural_k < natural_k_exact_below:
            self._length(natural_k, exact=True, w=w)
        else:
            self._length(max(proposed, natural_k or 0), exact=False, w=w)
        return True

    def _length(self, m: int, exact: bool, w: float) -> None:
        if m >= self.max_k:
            self._at_least[self.max_k] += w  # beyond what we track, exact or not
            return
        self._at_least[m] += w
        if exact:
            self._stopped[m] += w

    def _rescale(self) -> None:
        s = self._scale
        self._first_accepted *= s
        self._first_rejected *= s
        self._accepted *= s
        self._rejected *= s
        self._at_least = [x * s for x in self._at_least]
        self._stopped = [x * s for x in self._stopped]
        self._scale = 1.0

    def state(self) -> dict:
        """The discounted counts as plain numbers (the belief store saves them)."""
        s = self._scale
        return {"first_accepted": self._first_accepted * s, "first_rejected": self._first_rejected * s,
                "accepted": self._accepted * s, "rejected": self._rejected * s,
                "at_least": [x * s for x in self._at_least], "stopped": [x * s for x in self._stopped]}

    def load_state(self, state: Mapping, weight: float = 1.0) -> None:
        """Counts from ``state`` (``OutcomeCounts.state``), each times ``weight``. Saved with another
        max_k: lengths proven beyond this one's max_k fold into its last bucket ("at least max_k").

        Worked example, saved with max_k = 3 and loaded with max_k = 2: at_least [a0, a1, a2, a3]
        becomes [a0, a1, a2 + a3], stopped [s0, s1, s2] becomes [s0, s1]."""
        at_least = [float(x) * weight for x in state["at_least"]]
        stopped = [float(x) * weight for x in state["stopped"]]
        n = self.max_k
        self._at_least = at_least[:n] + [sum(at_least[n:])] if len(at_least) > n else at_least + [0.0] * (n + 1 - len(at_least))
        self._stopped = (stopped + [0.0] * n)[:n]
        self._first_accepted = float(state["first_accepted"]) * weight
        self._first_rejected = float(state["first_rejected"]) * weight
        self._accepted = float(state["accepted"]) * weight
        self._rejected = float(state["rejected"]) * weight
        self._scale = 1.0

    def alphas(self, strength: float, prior_alpha: float, prior_alpha_first: float) -> tuple[float, float]:
        """Posterior means (alpha, alpha_first): ``strength`` pseudo-outcomes at the prior's values
        plus the discounted counts."""
        s = self._scale
        a, r = self._accepted * s, self._rejected * s
        fa, fr = self._first_accepted * s, self._first_rejected * s
        return ((strength * prior_alpha + a) / (strength + a + r),
                (strength * prior_alpha_first + fa) / (strength + fa + fr))

    def positions(self) -> tuple[list[float], list[float]]:  # for inspection and tests
        """(reached, at_risk) per position j = 1..max_k: proposals seen to have >= j tokens, and
        proposals known to have >= j - 1 tokens of which we learned whether a j-th existed."""
        reached, at_risk = [0.0] * self.max_k, [0.0] * self.max_k
        s, tail = self._scale, 0.0
        for j in range(self.max_k, 0, -1):
            tail += self._at_least[j]  # proven >= j
            reached[j - 1] = tail * s
            at_risk[j - 1] = (tail + self._stopped[j - 1]) * s
        return reached, at_risk


@dataclass(frozen=True)
class _Belief:
    """Point estimates of one level (pool or request), the prior of the level below."""

    alpha: float
    alpha_first: float
    p_continue: tuple[float, ...]  # P(len >= j | len >= j - 1), j = 1..max_k


def _posterior(prior: _Belief, strength: float, counts: OutcomeCounts, available: int | None = None,
               first_scale: float = 1.0) -> AcceptanceEstimate:
    """Beta-style posterior means (``strength`` pseudo-outcomes at the prior's values plus the
    counts) of both acceptances and of each position's continuation probability, turned into the
    survival P(len >= j) = prod_{i <= j} P(continue at i). With ``available`` drafts already
    proposed (a lookup ran before the decision) the survival is known exactly instead
    (``exact_length``). ``first_scale`` scales the first draft's acceptance (capped at 1), and with
    it every draft's gain: the planner's calibration (planner/calibration.py). Runs for every
    request every step, hence the C-level itertools."""
    alpha, alpha_first = counts.alphas(strength, prior.alpha, prior.alpha_first)
    if available is not None:
        return _exact_estimate(alpha, min(1.0, alpha_first * first_scale), available, counts.max_k)
    scale = counts._scale
    # proven[j - 1]: stored observations proving length >= j (a suffix sum of the histogram).
    proven = list(accumulate(reversed(counts._at_least[1:])))[::-1]
    pseudo = strength / scale  # in stored units, so the scale cancels
    cont = [(pseudo * p + r) / (pseudo + r + x) for p, r, x in zip(prior.p_continue, proven, counts._stopped)]
    p_len_ge = tuple(accumulate(cont, mul))
    return AcceptanceEstimate._checked(alpha, p_len_ge, min(1.0, alpha_first * first_scale))


def _exact_estimate(alpha: float, alpha_first: float, available: int, max_k: int) -> AcceptanceEstimate:
    """``AcceptanceEstimate._checked(alpha, exact_length(available, max_k), alpha_first)``, built
    without multiplying by the survival's 1s and 0s: the gains are alpha_first * alpha^(j - 1) up
    to ``available`` and 0 after (the same floats: x * 1.0 is x). Every lookup-served request
    takes this path every step."""
    n = max(0, min(available, max_k))
    e = object.__new__(AcceptanceEstimate)
    reach = tuple(accumulate(repeat(alpha, n - 1), mul, initial=alpha_first)) if n else ()
    e.__dict__.update(alpha=alpha, p_len_ge=exact_length(n, max_k), alpha_first=alpha_first,
                      gains=reach + (0.0,) * (max_k - n))
    return e


def _belief(estimate: AcceptanceEstimate) -> _Belief:
    """Back from survival to per-position continuation (the pool's belief is the requests' prior)."""
    cont, prev = [], 1.0
    for s in estimate.p_len_ge:
        cont.append(s / prev if prev > 0.0 else 0.0)
        prev = s
    return _Belief(estimate.alpha, estimate.alpha_first, tuple(cont))


class PooledAcceptance:
    """The prior for new requests of one (proposer, workload): learns from every observed request.

    Proposal-length statistics pool the raw counts (the population's per-position continuation).
    Acceptance does not: a request with alpha 0.95 gets ~20 draft positions judged per step and one
    with 0.1 gets ~1, so pooled counts would weigh the pool toward the easy requests. Instead each
    observed request-step contributes its request's current estimates, so the pool's alpha and
    alpha_first are means over request-steps, i.e. what to expect of the next request.

    Its belief is published by ``refresh`` (once per engine step) and only when it moved by more
    than ``tolerance``: every request's posterior is rebuilt when the pool changes, and a warm pool
    moves slowly, so this keeps the per-step cost of B posteriors off most steps.
    """

    def __init__(self, prior: ProposerPrior, config: AcceptanceConfig, tolerance: float = 0.002):
        self.config = config
        self.tolerance = tolerance
        alpha_first = prior.alpha if prior.alpha_first is None else prior.alpha_first
        self._initial = _Belief(prior.alpha, alpha_first, (prior.p_first,) + (prior.p_continue,) * (config.max_k - 1))
        self.natural_k_exact_below = prior.natural_k_exact_below
        self.counts = OutcomeCounts(config.max_k)
        self._alpha_sum = 0.0  # discounted sum of request alpha estimates
        self._alpha_first_sum = 0.0  # ... and of their alpha_first estimates
        self._alpha_weight = 0.0
        self._publish(_posterior(self._initial, config.initial_strength, self.counts))
        self.version = 0  # bumps whenever a new belief is published
        self._dirty = False

    def observe(self, k: int, num_proposed: int, num_accepted: int, natural_k: int | None,
                request_alphas: tuple[float, float]) -> None:
        """One request-step: its raw outcome (for proposal lengths) and the request's (alpha,
        alpha_first) estimates."""
        d = self.config.pool_discount
        if self.counts.add(k, num_proposed, num_accepted, natural_k, d, self.natural_k_exact_below):
            self._alpha_sum = self._alpha_sum * d + request_alphas[0]
            self._alpha_first_sum = self._alpha_first_sum * d + request_alphas[1]
            self._alpha_weight = self._alpha_weight * d + 1.0
            self._dirty = True

    @property
    def evidence(self) -> float:
        """Observed request-steps behind the belief (discounted; 0: the belief is the prior)."""
        return self._alpha_weight

    @property
    def alpha(self) -> float:
        s = self.config.initial_strength
        return (s * self._initial.alpha + self._alpha_sum) / (s + self._alpha_weight)

    @property
    def alpha_first(self) -> float:
        s = self.config.initial_strength
        return (s * self._initial.alpha_first + self._alpha_first_sum) / (s + self._alpha_weight)

    def refresh(self) -> None:
        """Publish the current belief if it moved by more than the tolerance since the last one."""
        if not self._dirty:
            return
        self._dirty = False
        lengths = _posterior(self._initial, self.config.initial_strength, self.counts)
        new = AcceptanceEstimate._checked(self.alpha, lengths.p_len_ge, self.alpha_first)  # means of in-range values
        old = self._estimate
        moved = (abs(new.alpha - old.alpha) > self.tolerance
                 or abs(new.alpha_first - old.alpha_first) > self.tolerance) or any(
            abs(a - b) > self.tolerance for a, b in zip(new.p_len_ge, old.p_len_ge))
        if moved:
            self._publish(new)
            self.version += 1

    def state(self) -> dict:
        """What this pool learned, as plain numbers (planner/beliefs.py saves it)."""
        return {"counts": self.counts.state(), "alpha_sum": self._alpha_sum,
                "alpha_first_sum": self._alpha_first_sum, "alpha_weight": self._alpha_weight}

    def load_state(self, state: Mapping, max_evidence: float) -> float:
        """Take over a saved pool's learning, weighed as at most ``max_evidence`` request-steps so
        that beliefs from an earlier run still give way to this one's traffic within a few dozen
        steps; publishes the result. Returns the evidence it now rests on.

        Worked example: a pool saved after 400 request-steps at alpha_first 0.8, loaded with
        max_evidence 24 and the n-gram prior 0.5 at strength 2: every count is scaled by 24/400,
        so alpha_first = (2 * 0.5 + 24 * 0.8) / 26 = 0.78, and 24 request-steps at 0.3 after it
        bring it to (1 + 19.2 + 7.2) / 50 ~ 0.55."""
        weight = float(state["alpha_weight"])
        scale = min(1.0, max_evidence / weight) if weight > 0 else 0.0
        self.counts.load_state(state["counts"], scale)
        self._alpha_sum = float(state["alpha_sum"]) * scale
        self._alpha_first_sum = float(state["alpha_first_sum"]) * scale
        self._alpha_weight = weight * scale
        lengths = _posterior(self._initial, self.config.initial_strength, self.counts)
        self._publish(AcceptanceEstimate(self.alpha, lengths.p_len_ge, self.alpha_first))
        self.version += 1
        self._dirty = False
        return self._alpha_weight

    def _publish(self, estimate: AcceptanceEstimate) -> None:
        self._estimate = estimate
        self.belief = _belief(estimate)  # what request posteriors use as their prior

    def estimate(self) -> AcceptanceEstimate:
        """The pool's published belief: what a request with no evidence of its own is given."""
        return self._estimate


class RequestAcceptance:
    """One request's posterior: its own discounted evidence on top of its pool's published belief."""

    def __init__(self, pool: PooledAcceptance):
        self.pool = pool
        self.counts = OutcomeCounts(pool.config.max_k)
        self.steps_observed = 0
        self._cached: AcceptanceEstimate | None = None
        self._cached_for: tuple = ()  # (pool version, available, first_scale) of the cached estimate

    def observe(self, k: int, num_proposed: int, num_accepted: int, natural_k: int | None = None) -> None:
        """Update this request and its pool with one step's outcome (call ``pool.refresh`` after)."""
        pool = self.pool
        if not self.counts.add(k, num_proposed, num_accepted, natural_k, pool.config.request_discount,
                               pool.natural_k_exact_below):
            return
        self.steps_observed += 1
        self._cached = None
        pool.observe(k, num_proposed, num_accepted, natural_k, self.alphas())

    @property
    def prior_strength(self) -> float:
        """Pseudo-outcomes behind this request's prior: few while its pool rests on little evidence.

        Worked example (defaults: cold 2, warm 6): the n-gram prior after a 1-token match gives a
        first draft 0.2. In a fresh pool, a request whose first draft was accepted reads
        (2 * 0.2 + 1) / 3 = 0.47, and 0.57 after two (by then its prior weighs 3 and the pool has
        moved up with it); against a warm pool that many requests confirmed at 0.2, the same two
        drafts give (6 * 0.2 + 2) / 8 = 0.4 (tests/test_planner_cold_start.py)."""
        cfg = self.pool.config
        return min(cfg.request_prior_strength, cfg.cold_prior_strength + self.pool.evidence)

    def alphas(self) -> tuple[float, float]:
        """This request's posterior (alpha, alpha_first): the cheap part of ``estimate``."""
        belief = self.pool.belief
        return self.counts.alphas(self.prior_strength, belief.alpha, belief.alpha_first)

    def estimate(self, available: int | None = None, first_scale: float = 1.0) -> AcceptanceEstimate:
        """The posterior (planner/acceptance.py ``_posterior``); ``available``: drafts already
        proposed this step (known lengths), ``first_scale``: the calibration factor. Kept until the
        request or its pool's belief moves, or the question changes."""
        key = (self.pool.version, available, first_scale)
        if self._cached is None or self._cached_for != key:
            self._cached = _posterior(self.pool.belief, self.prior_strength, self.counts, available, first_scale)
            self._cached_for = key
        return self._cached
