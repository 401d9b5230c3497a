"""A draft head's confidence, read as acceptance: where a model draft stops (issue #33).

A lookup proposer's drafts are judged by their match length before they exist; a draft head's
drafts carry something better, the head's own probability of each token (its *confidence*), known
the moment the token is drafted and before the target runs. Two pieces turn it into a stopping rule:

* ``ConfidenceCalibration`` learns, online, P(a draft is accepted | its confidence bucket, the
  drafts before it accepted): draft j of a step is judged only if drafts 1..j-1 were accepted, and
  it was accepted iff j <= the step's accepted count. Each bucket starts from a weak prior at its
  upper edge (a head trained on the target's distribution is roughly calibrated: a draft the head
  gives 0.8 is accepted about 80% of the time under greedy verification), and the table is kept
  non-decreasing in confidence (pool-adjacent-violators), so one unlucky bucket cannot make a
  surer draft look worse than a less sure one. The upper edge, not the mid-point: the table learns
  only from drafts that were verified, so a bucket priced too low is judged only on steps whose
  stop price is lower still, while one priced too high is verified and corrected down at once;
  and the shipped SmolLM2 head is under-confident (its drafts at confidence 0.3-0.4 were accepted
  46-51% of the time, at 0.6-0.7 67-82%: reports/README.md#planner-measurements).
* ``ConfidenceStop`` is the engine's ``DraftStop`` (engine/decider.py): that table, ``min_gain``,
  the tokens one more query token must be expected to add to pay for itself, and ``pass_gain``,
  what one more head pass costs in tokens. The planner sets both each step from the step the
  policy chose (``marginal_draft_prices``).

Worked example of the calibration: bucket [0.8, 0.9) with prior strength 4 starts at 0.9. After
10 judged drafts of which 6 were accepted it reads (4 * 0.9 + 6) / (4 + 10) = 0.69.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from typing import Sequence

# Upper edges of the confidence buckets (the last one is 1.0 inclusive). Finer at the top, where
# a trained head's drafts mostly fall and where one bucket's acceptance decides a long draft.
BUCKET_EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


def bucket_of(confidence: float, edges: Sequence[float] = BUCKET_EDGES) -> int:
    """The bucket of a confidence in [0, 1] (values outside are clamped)."""
    return min(bisect.bisect_right(edges, max(0.0, confidence)), len(edges) - 1)


def _non_decreasing(values: Sequence[float], weights: Sequence[float]) -> tuple[float, ...]:
    """The weighted least-squares non-decreasing fit (pool adjacent violators)."""
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, weights):
        blocks.append([v, w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    return tuple(m for m, _, n in blocks for _ in range(n))


@dataclass(frozen=True)
class ConfidenceConfig:
    prior_strength: float = 4.0  # pseudo-drafts at the bucket's upper edge
    discount: float = 0.999  # per judged draft: the table remembers about the last thousand

    def __post_init__(self) -> None:
        if self.prior_strength <= 0:
            raise ValueError(f"prior_strength must be > 0, got {self.prior_strength}")
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {self.discount}")


class ConfidenceCalibration:
    """P(accepted | confidence bucket, earlier drafts accepted), learned from verified drafts."""

    def __init__(self, config: ConfidenceConfig = ConfidenceConfig(), edges: Sequence[float] = BUCKET_EDGES):
        self.config = config
        self.edges = tuple(edges)
        self.prior = self.edges  # each bucket's upper edge: optimistic, see the module docstring
        self.judged = [0.0] * len(self.edges)  # discounted drafts judged, per bucket
        self.accepted = [0.0] * len(self.edges)  # ... of which accepted
        self._table: tuple[float, ...] | None = None

    @property
    def evidence(self) -> float:
        return sum(self.judged)

    def observe(self, confidences: Sequence[float], num_accepted: int) -> None:
        """One verified proposal: each draft's confidence and how many drafts were accepted. Drafts
        past the first rejected one were never judged; nan confidences (a chained proposal's
        lookup tokens) carry no signal."""
        d = self.config.discount
        for j, c in enumerate(confidences[:num_accepted + 1]):
            if c is None or math.isnan(c):
                continue
            if d < 1.0:
                self.judged = [x * d for x in self.judged]
                self.accepted = [x * d for x in self.accepted]
            b = bucket_of(c, self.edges)
            self.judged[b] += 1.0
            self.accepted[b] += 1.0 if j < num_accepted else 0.0
            self._table = None

    def table(self) -> tuple[float, ...]:
        """Acceptance per bucket, posterior means made non-decreasing in confidence."""
        if self._table is None:
            s = self.config.prior_strength
            means = [(s * p + a) / (s + n) for p, a, n in zip(self.prior, self.accepted, self.judged)]
            self._table = _non_decreasing(means, [s + n for n in self.judged])
        return self._table

    def accept_probability(self, confidence: float) -> float:
        return self.table()[bucket_of(confidence, self.edges)]

    def state(self) -> dict:
        return {"edges": list(self.edges), "judged": list(self.judged), "accepted": list(self.accepted)}

    def load_state(self, state: dict, max_judged: float) -> None:
        """A saved table, weighed as at most ``max_judged`` judged drafts in all (another edge
        layout is ignored: ValueError)."""
        if tuple(float(e) for e in state["edges"]) != self.edges:
            raise ValueError("confidence buckets differ from this planner's")
        judged = [float(x) for x in state["judged"]]
        accepted = [float(x) for x in state["accepted"]]
        if len(judged) != len(self.edges) or len(accepted) != len(self.edges) \
                or any(a < 0 or a > n + 1e-9 for a, n in zip(accepted, judged)):
            raise ValueError("confidence counts do not fit their buckets")
        total = sum(judged)
        scale = min(1.0, max_judged / total) if total > 0 else 0.0
        self.judged = [x * scale for x in judged]
        self.accepted = [x * scale for x in accepted]
        self._table = None

    def stop(self, min_gain: float, pass_gain: float = 0.0) -> "ConfidenceStop":
        """The engine's DraftStop for this step: the current table, ``min_gain`` and ``pass_gain``."""
        return ConfidenceStop(self.edges, self.table(), min_gain, pass_gain)


@dataclass(frozen=True)
class ConfidenceStop:
    """The engine's ``DraftStop``: a frozen acceptance table and the step's ``min_gain``."""

    edges: tuple[float, ...]
    acceptance: tuple[float, ...]  # per bucket
    min_gain: float  # tokens one more query token costs
    pass_gain: float = 0.0  # tokens one more head pass costs (engine/decider.py ``DraftStop``)

    def accept_probability(self, confidence: float) -> float:
        return self.acceptance[bucket_of(confidence, self.edges)]


__all__ = ["BUCKET_EDGES", "ConfidenceCalibration", "ConfidenceConfig", "ConfidenceStop", "bucket_of"]
