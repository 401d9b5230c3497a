"""What a step costs besides the target's forward + verify: drafting and fixed engine overhead.

The latency model covers forward + verify. Goodput's denominator is the whole step, so we learn the
rest from each ``StepRecord``: ``rest = total_s - forward_s - verify_s`` (scheduling, the decider,
drafting, appending tokens). Model it as

    rest = overhead + per_pass * passes + per_token * total_drafts

(passes: the draft model's forward passes as the engine reports them, none for lookup drafts;
else the deepest k) and fit the three coefficients by discounted least squares, regularised toward the prior draft
cost (the profile's), so steps without drafts pin the overhead, and a draft model's per-pass cost
emerges from steps with different depths. Coefficients are kept >= 0.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from .goodput import DraftCost


@dataclass(frozen=True)
class TimingConfig:
    discount: float = 0.98  # per step: ~50 steps of memory
    prior_weight: float = 0.05  # how many steps' worth of evidence the prior draft cost counts for
    # Outliers (a GC pause inside the step's bookkeeping): once ``outlier_warmup`` steps were seen,
    # a step's residual against the fit is clipped to within max(outlier_width x the prediction,
    # outlier_floor_s) of the median of it and the previous ``outlier_window - 1`` residuals. A lone
    # 50 ms pause then moves the overhead by what a ~1.5x step would; a lasting change becomes the
    # median after half the window and passes whole (as in planner/drift.py ``DraftSlope``).
    outlier_window: int = 5
    outlier_width: float = 0.5
    outlier_floor_s: float = 2e-4
    outlier_warmup: int = 8

    def __post_init__(self) -> None:
        if not 0.0 < self.discount <= 1.0:
            raise ValueError(f"discount must be in (0, 1], got {self.discount}")
        if self.prior_weight <= 0:
            raise ValueError("prior_weight must be > 0")
        if self.outlier_window < 1 or self.outlier_width <= 0 or self.outlier_floor_s < 0:
            raise ValueError("outlier_window must be >= 1, outlier_width > 0 and outlier_floor_s >= 0")


def solve3(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a 3x3 system (well-conditioned by the ridge).

    Written out row by row (the planner solves two of these every step, and the loops over lists
    were most of their cost), with the float operations of the textbook loops in the same order:
    the pivot is the first row of largest |a[r][c]|; each lower row r loses f = a[r][c] / a[c][c]
    times the pivot row; back substitution subtracts left to right."""
    r0, r1, r2 = (*a[0], b[0]), (*a[1], b[1]), (*a[2], b[2])
    # Column 0.
    if abs(r1[0]) > abs(r0[0]):
        r0, r1 = r1, r0
    if abs(r2[0]) > abs(r0[0]):
        r0, r2 = r2, r0
    p00, p01, p02, p03 = r0
    f = r1[0] / p00
    r1 = (0.0, r1[1] - f * p01, r1[2] - f * p02, r1[3] - f * p03)
    f = r2[0] / p00
    r2 = (0.0, r2[1] - f * p01, r2[2] - f * p02, r2[3] - f * p03)
    # Column 1.
    if abs(r2[1]) > abs(r1[1]):
        r1, r2 = r2, r1
    _, p11, p12, p13 = r1
    f = r2[1] / p11
    m22, m23 = r2[2] - f * p12, r2[3] - f * p13
    # Back substitution.
    x2 = m23 / m22
    x1 = (p13 - p12 * x2) / p11
    x0 = (p03 - (p01 * x1 + p02 * x2)) / p00
    return [x0, x1, x2]


class StepTimingLearner:
    """fit_per_pass: learn a per-pass drafting cost (a draft model). For a lookup proposer it stays
    at the prior: its steps always have a similar depth, so a per-pass term would only soak up
    part of the fixed overhead and make the allocator think deep drafts cost time."""

    def __init__(self, prior: DraftCost = DraftCost(), config: TimingConfig = TimingConfig(), *,
                 fit_per_pass: bool = True):
        self.prior = prior
        self.config = config
        self.fit_per_pass = fit_per_pass
        self._xtx = [[0.0] * 3 for _ in range(3)]
        self._xty = [0.0] * 3
        self.steps = 0
        self.overhead_s = 0.0
        self.draft_cost = prior
        self._recent: list[float] = []  # the latest steps' residuals against the fit, raw (``_robust``)

    def observe(self, rest_s: float, total_drafts: int, passes: int) -> None:
        if not rest_s >= 0.0:  # negative or NaN: clocks disagree; skip
            return
        d = self.config.discount
        x = (1.0, float(passes) if self.fit_per_pass else 0.0, float(total_drafts))
        rest_s = self._robust(rest_s, x)
        # The discounted sums, written out (the same operations as two nested loops over i, j;
        # this runs every engine step, and the loops were a third of its cost).
        x0, x1, x2 = x
        (a00, a01, a02), (a10, a11, a12), (a20, a21, a22) = self._xtx
        self._xtx = [[a00 * d + x0 * x0, a01 * d + x0 * x1, a02 * d + x0 * x2],
                     [a10 * d + x1 * x0, a11 * d + x1 * x1, a12 * d + x1 * x2],
                     [a20 * d + x2 * x0, a21 * d + x2 * x1, a22 * d + x2 * x2]]
        b0, b1, b2 = self._xty
        self._xty = [b0 * d + x0 * rest_s, b1 * d + x1 * rest_s, b2 * d + x2 * rest_s]
        self.steps += 1
        self._refit()

    def _robust(self, rest_s: float, x: tuple[float, float, float]) -> float:
        """rest_s with its residual clipped around the median of the recent ones (a median filter).

        Worked example, window 5, width 0.5, the fit predicting 1 ms: residuals [0.0, 0.1, -0.1,
        0.0] ms and a step at 51 ms (+50): the median of the five is 0.0, the step enters at 1.5 ms."""
        cfg = self.config
        if self.steps < cfg.outlier_warmup:
            return rest_s
        predicted = self.overhead_s + self.draft_cost.per_pass_s * x[1] + self.draft_cost.per_token_s * x[2]
        e = rest_s - predicted
        self._recent = (self._recent + [e])[-cfg.outlier_window:]
        m = statistics.median(self._recent)
        width = max(cfg.outlier_width * predicted, cfg.outlier_floor_s)
        return max(0.0, predicted + max(m - width, min(m + width, e)))

    def state(self) -> dict:
        return {"xtx": [row[:] for row in self._xtx], "xty": self._xty[:], "steps": self.steps}

    def load_state(self, state: dict, max_steps: float) -> None:
        """A saved fit, weighed as at most ``max_steps`` steps (xtx[0][0] is the discounted step count)."""
        xtx = [[float(v) for v in row] for row in state["xtx"]]
        xty = [float(v) for v in state["xty"]]
        if len(xtx) != 3 or any(len(row) != 3 for row in xtx) or len(xty) != 3:
            raise ValueError("timing state needs a 3x3 xtx and 3 xty")
        scale = min(1.0, max_steps / xtx[0][0]) if xtx[0][0] > 0 else 0.0
        self._xtx = [[v * scale for v in row] for row in xtx]
        self._xty = [v * scale for v in xty]
        self.steps = int(state.get("steps", 0))
        self._refit()

    def _refit(self) -> None:
        # Ridge toward the prior, scaled per feature so the prior weighs like `prior_weight` steps
        # of typical size (a draft count of 1 and a depth of 1 when nothing larger was seen yet).
        # The overhead's ridge is far weaker: when the drafts per step hardly vary, overhead and
        # per-draft cost cannot be told apart, and the time is then read as fixed overhead (the
        # prior view: drafting costs what the profile says) rather than as a cost of drafting.
        w = self.config.prior_weight
        xtx, xty = self._xtx, self._xty
        steps = max(xtx[0][0], 1e-12)
        scale = (1e-3, max(1.0, xtx[1][1] / steps), max(1.0, xtx[2][2] / steps))
        theta0 = (0.0, self.prior.per_pass_s, self.prior.per_token_s)
        a = [[v + w * scale[i] if i == j else v for j, v in enumerate(row)] for i, row in enumerate(xtx)]
        b = [v + w * scale[i] * theta0[i] for i, v in enumerate(xty)]
        overhead, per_pass, per_token = solve3(a, b)
        self.overhead_s = max(0.0, overhead)
        self.draft_cost = DraftCost(per_pass_s=max(0.0, per_pass), per_token_s=max(0.0, per_token))
