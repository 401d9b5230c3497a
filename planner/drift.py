"""Closed loop on the latency model: a robust multiplicative correction from measured step times.

A profile is measured under one load (other processes, thermal state, a different prompt mix);
serving runs under another. We compare each step's measured forward + verify time with what the
model predicted for that exact step shape and keep an EMA of the log ratio. Working in log space
makes 2x too slow and 2x too fast symmetric; clipping each sample's innovation keeps one outlier
(a GC pause, a page fault storm) from yanking the correction; clipping the total keeps a broken
measurement from switching the planner's notion of cost off entirely.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, fields

import numpy as np

from ..profiler.latency_model import LatencyModel, StepShape, predict_added, predict_many
from .timing import solve3


@dataclass(frozen=True)
class DriftConfig:
    smoothing: float = 0.1  # EMA weight of a new sample once warm (~10 steps of memory)
    max_innovation: float = 0.25  # largest move of the log factor from one sample (~1.28x)
    max_log_factor: float = math.log(4.0)  # the correction stays within 1/4x .. 4x
    min_seconds: float = 1e-6  # steps faster than this carry no timing information

    def __post_init__(self) -> None:
        if not 0.0 < self.smoothing <= 1.0:
            raise ValueError(f"smoothing must be in (0, 1], got {self.smoothing}")
        if self.max_innovation <= 0 or self.max_log_factor <= 0:
            raise ValueError("max_innovation and max_log_factor must be > 0")


class DriftCorrection:
    """measured / predicted, smoothed in log space; ``factor`` multiplies the model's predictions."""

    def __init__(self, config: DriftConfig = DriftConfig()):
        self.config = config
        self.log_factor = 0.0
        self.factor = 1.0  # kept as a plain attribute: read on every prediction
        self.samples = 0

    def update(self, predicted_s: float, measured_s: float) -> None:
        cfg = self.config
        if not (predicted_s > cfg.min_seconds and measured_s > cfg.min_seconds):
            return  # also rejects NaN
        # A running mean for the first samples (fast warm-up), then an EMA.
        weight = max(cfg.smoothing, 1.0 / (self.samples + 1))
        innovation = math.log(measured_s / predicted_s) - self.log_factor
        innovation = max(-cfg.max_innovation, min(cfg.max_innovation, innovation))
        self.log_factor = max(-cfg.max_log_factor,
                              min(cfg.max_log_factor, self.log_factor + weight * innovation))
        self.factor = math.exp(self.log_factor)
        self.samples += 1

    def state(self) -> dict:
        return {"log_factor": self.log_factor, "samples": self.samples}

    def load_state(self, state: dict, max_samples: int) -> None:
        """A saved factor, as if from at most ``max_samples`` samples (so this run's first steps,
        averaged in at weight 1 / (samples + 1), move it fast)."""
        cfg = self.config
        self.log_factor = max(-cfg.max_log_factor, min(cfg.max_log_factor, float(state["log_factor"])))
        self.factor = math.exp(self.log_factor)
        self.samples = max(0, min(int(state["samples"]), max_samples))


class DriftCorrectedLatency:
    """A LatencyModel whose predictions are scaled by the current drift factor."""

    def __init__(self, inner: LatencyModel, drift: DriftCorrection):
        self.inner = inner
        self.drift = drift
        # The inner model's latest short curve, (base, count, seconds): one decision prices the
        # same base step at the learned and at the optimistic price, and the screen before it too.
        self._added: tuple[StepShape, int, list[float]] | None = None

    def predict(self, shape: StepShape) -> float:
        return self.inner.predict(shape) * self.drift.factor

    def predict_many(self, num_seqs: int, num_tokens: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        return predict_many(self.inner, num_seqs, num_tokens, context_tokens) * self.drift.factor

    def predict_added(self, base: StepShape, count: int) -> list[float]:
        """profiler/latency_model.py ``predict_added``, scaled by the drift factor (the same floats
        as ``predict_many``); the inner model's curve is kept for the next question on this base."""
        kept = self._added
        if kept is not None and kept[0] == base and kept[1] >= count:
            inner = kept[2]
        else:
            inner = predict_added(self.inner, base, count)
            self._added = (base, count, inner)
        factor = self.drift.factor
        return [x * factor for x in inner[:count + 1]]


@dataclass(frozen=True)
class DraftSlopeConfig:
    """How the price of draft tokens is learned (see ``DraftSlope``)."""

    discount: float = 0.98  # per observed decode step: ~50 steps of memory
    unit_increment: float = 0.1  # a step whose drafts add 10% to its predicted time is one unit of evidence
    # The profile's slope (1) counts as this many units. Drafts priced near the floor make small
    # increments, and at 1 unit the prior outweighed them: a machine charging well above the
    # floor was learned as charging little more than it (tests/test_planner.py, ``free``).
    prior_units: float = 0.25
    optimism: float = 0.5  # with no evidence, exploration prices drafts at (1 - optimism) x the slope
    min_slope: float = 0.1
    max_slope: float = 4.0
    # The jump's prior (0) weighs jump_prior_units * unit_increment^2: at 100, moving a step's
    # price by 0.1 of its base through the jump costs the fit what moving it through the slope
    # costs for drafts the model prices at +10%, and more than that for dearer drafts (the slope
    # needs a smaller change there). So steps with a single draft count, which a scale and a jump
    # explain alike, mostly move the slope; the jump follows from steps of different draft counts
    # whose costs do not sit on a line through the plain step. Very large values pin it to 0.
    jump_prior_units: float = 100.0
    max_jump: float = 0.5  # |jump| stays within half a base step
    # A baseline is fresh while the bucket's discounted count of plain steps is at least this:
    # at 0.25 and a discount of 0.98, for ~70 decode steps after a plain one (``has_baseline``).
    fresh_baseline: float = 0.25
    # Outliers (a GC pause, a page-fault storm, another process's burst): once a bucket holds
    # ``outlier_warmup`` steps, a step's log ratio to the fit's prediction is clipped to within
    # ``outlier_width`` of the median of it and the bucket's ``outlier_window - 1`` previous ones.
    # A lone spike is clipped to ~16%; a lasting change of level is the median after half the
    # window and passes whole (``_robust``).
    outlier_window: int = 5
    outlier_width: float = 0.15
    outlier_warmup: float = 4.0
    # Decode steps right after a step that ran a prompt are slow for a while, and the first of a
    # request's steps are often its plain baseline: measured on the Q4_1 engine at B = 4, the
    # five decode steps after a 400-token prefill ran 1.6, 1.5, 1.35, 1.2 and 1.1x the steady
    # step (fp32: within 1.05x). Fitted as the plain level, they made every later step with
    # drafts look cheaper than plain ones (a jump of -0.2: drafts priced free, and drafted at 14%
    # acceptance). So the first ``settle_steps`` decode steps after a prefill are not learned
    # from, and no plain baseline is asked for while they run (``settling``).
    settle_steps: int = 4
    # The price the policy is given moves off the profile's (slope 1, jump 0) only by what lies
    # beyond this many standard errors of the fit (``_shrunk``): a slope fitted at 1.3 +- 0.2
    # prices drafts at 1.3 - 2 x 0.2 = 0.9 -> 1. At B = 1 a draft adds ~4% to a step that varies
    # by ~3% from one step to the next, so the raw fit wanders with the machine's noise, and the
    # choices with it: replayed on 40 noisy machines the raw price made the adaptive arm's run-to-
    # run spread (paired with SD off) up to twice static k's; shrunk, it is static k's, and a
    # machine charging drafts twice what the profile says is still learned (reports/choice-replay,
    # "The learned draft price and the run-to-run spread"). 0: the fit as it is.
    significance: float = 2.0
    # The same for a price above the profile's (the fit says a typical step's drafts cost more
    # than the profile says). Erring that way drafts a little less than the best choice; erring
    # the other way drafts where drafts lose, slower than SD off: the failure users notice. Held
    # at the profile's price until two standard errors clear, the vLLM plugin kept drafting at
    # B = 16, where vLLM charges a few drafts up to twice what its profile's uniform grid says,
    # and read 0.92x vLLM off in two cells (reports/vllm-peer-xeon/grid-s26). At B = 1 the
    # replay on 40 noisy machines reads the same ratios (within 0.3%) and spreads (within 0.1
    # point) at 2, 1 and 0.5 (reports/choice-replay, "Believing a dearer price sooner").
    dearer_significance: float = 1.0
    noise_steps: int = 16  # the memory of the noise estimate the shrinkage uses, in steps
    min_noise_samples: int = 3  # fewer prediction errors than this: the profile's price

    def __post_init__(self) -> None:
        if not 0.0 < self.discount <= 1.0:
            raise ValueError("discount must be in (0, 1]")
        if self.unit_increment <= 0 or self.prior_units <= 0:
            raise ValueError("unit_increment and prior_units must be > 0")
        if not 0.0 <= self.optimism < 1.0:
            raise ValueError(f"optimism must be in [0, 1), got {self.optimism}")
        if not 0.0 < self.min_slope <= 1.0 <= self.max_slope:
            raise ValueError("need 0 < min_slope <= 1 <= max_slope")
        if self.jump_prior_units <= 0 or self.max_jump < 0:
            raise ValueError("jump_prior_units must be > 0 and max_jump >= 0")
        if self.outlier_window < 1 or self.outlier_width <= 0:
            raise ValueError("outlier_window must be >= 1 and outlier_width > 0")
        if self.settle_steps < 0:
            raise ValueError(f"settle_steps must be >= 0, got {self.settle_steps}")
        if self.significance < 0 or self.dearer_significance < 0:
            raise ValueError(f"significance and dearer_significance must be >= 0, got {self.significance}, "
                             f"{self.dearer_significance}")
        if self.noise_steps < 1 or self.min_noise_samples < 1:
            raise ValueError("noise_steps and min_noise_samples must be >= 1")


@dataclass
class _Bucket:
    # Discounted sums over this bucket's decode steps of (x, d, z): x the model's relative draft
    # increment (0 for a plain step), d = 1 for a step with drafts, z = measured / T(base).
    w: float = 0.0
    wx: float = 0.0
    wxx: float = 0.0
    wd: float = 0.0  # = sum w d d
    wxd: float = 0.0
    wz: float = 0.0
    wxz: float = 0.0
    wdz: float = 0.0
    plain_steps: int = 0
    plain_w: float = 0.0  # discounted count of plain steps: how fresh the baseline is
    evidence: float = 0.0  # sum of x^2 over steps with drafts, discounted only by such steps
    recent: list = field(default_factory=list)  # the latest steps' log(z / predicted z), raw (``_robust``)
    # The fit's one-step prediction error, log(z / predicted z) as it enters (clipped), squared
    # and averaged over recent steps (a running mean for the first ``noise_steps``, then an EMA of
    # weight 1 / noise_steps): the machine's step-to-step noise at this batch size, what the
    # price's shrinkage measures the fit's deviations in (``DraftSlope._shrunk``).
    noise: float = 0.0
    noise_samples: int = 0
    # The fit of the sums as they are (``DraftSlope._solve``) and the price made of it
    # (``DraftSlope.price``), until ``_add`` changes them: a step asks for them up to three times
    # (its decision's price, its observation's outlier filter and price), and nothing moves them
    # in between.
    solved: tuple[float, float, float] | None = None
    priced: DraftPrice | None = None

    def sums(self) -> dict:
        """The fit's discounted sums (what the belief store saves; the rest is this run's)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NOT_SAVED}


# This run's: the latest errors, and the fit and price made of the sums.
_NOT_SAVED = frozenset({"recent", "solved", "priced"})
_NOT_SUMS = frozenset({"noise", "noise_samples", "plain_steps"})  # saved, but not scaled as sums on load
_RIDGE = 1e-6  # the fit's pull of the level toward 1: only keeps its normal equations solvable


@dataclass(frozen=True)
class DraftPrice:
    """What drafts cost at one batch size, against the latency model (``DraftSlope``)."""

    slope: float = 1.0  # x the model's increment
    jump: float = 0.0  # + this x the base step, once a step carries drafts
    units: float = 0.0  # evidence behind them, in steps with a 10% increment


class DraftSlope:
    """How much draft tokens really cost, relative to what the latency model says, per batch size.

    The drift factor fixes the level of the model's predictions; what decides speculation is their
    *slope*: how much a step grows when its decodes carry drafts. A profile fitted over a grid can
    misprice that growth at one batch size (price it at a few times what it measures:
    reports/README.md#planner-measurements), and then the policy never speculates there and
    never learns otherwise. So we learn, per batch-size bucket (powers of two), a slope s with

        step(base + n drafts) = r * [T(base) + s * dT(n)]

    T the profile's model, dT(n) its increment for the n drafts (T(base + n) - T(base), but never
    under a small floor per draft: planner/goodput.py ``draft_increment``; a profile that prices
    drafts at 0 would leave s nothing to scale) and r the machine's current level against it.
    With x = dT(n) / T(base) the model's relative increment (0 for a plain step) and z = measured /
    T(base), that is z = r + (r s) x: a line, fitted by discounted least squares over this bucket's
    recent decode steps, plain and speculative alike, with s pulled toward the profile's 1 by
    ``prior_units`` steps' worth of a 10% increment. Why both at once: the level moves with the
    machine (a shared VM's bandwidth can move by a large factor within minutes). Measured against a
    level taken from plain steps long ago, while the policy speculated on every step since, drafts
    looked nearly free after the machine sped up, though they were not. Fitted together, the level
    comes from the same recent steps, and steps with more or fewer drafts tell it apart from the
    slope. Until a bucket has seen a plain step, s stays at 1.

    The jump: the model's increment can be wrong in shape as well as in scale. A fitted profile
    can price the first draft of a step far dearer than serving measures it and the further ones
    cheaper (measured: reports/README.md#planner-measurements). One slope cannot fit both ends.
    So the line has a third term, z = r + (r s) x + (r j) d with d = 1 for a step with drafts: j
    is what having drafts at all costs beyond the slope, relative to the base step (negative when
    the model's first draft is too dear), pulled toward 0 by ``jump_prior_units`` steps. Steps
    with different numbers of drafts tell j from s. Drafts are then priced at
    max(0, s dT(n) + j T(base)) (``priced_seconds``).

    Shrinkage: the price the policy is given is the fit's, moved toward the profile's (1, 0) by
    ``significance`` standard errors (``dearer_significance`` where the fit prices drafts above
    the profile), measured against the step-to-step noise the fit's own predictions meet
    (``_shrunk``). Where drafts add a few percent to a step that varies by a few
    percent (B = 1 on a CPU), the raw fit wanders with the noise and the choices with it; the
    profile was measured on this machine, so it stands until the evidence clearly says otherwise.

    Exploration: a policy that prices drafts too high turns speculation off and then sees no
    speculative step to learn from. ``explore_slope`` is an optimistic slope for that case,
    (1 - optimism / (1 + units)) * s, units = the steps with drafts seen (their x^2 over 0.1^2,
    discounted only by later such steps): with no evidence, half the model's increment, 3/4 after
    one unit, 9/10 after four. The goodput policy tries it only when its own choice is "off" and
    the optimistic choice is predicted, at the learned slope, to lose at most a small budget; each
    speculative step measured then moves s toward the truth.
    """

    def __init__(self, config: DraftSlopeConfig = DraftSlopeConfig()):
        self.config = config
        self._buckets: dict[int, _Bucket] = {}
        self._settling = 0  # decode steps still to pass unlearned after the latest prefill

    @property
    def settling(self) -> bool:
        """Whether decode steps are still settling after a prefill (``prefilled``): not learned from."""
        return self._settling > 0

    def prefilled(self) -> None:
        """A step ran a prompt (or a chunk of one): its next ``settle_steps`` decode steps settle."""
        self._settling = self.config.settle_steps

    def _settled(self) -> bool:
        """For a decode step: False while it is one of the settling ones (it is counted off)."""
        if self._settling > 0:
            self._settling -= 1
            return False
        return True

    @staticmethod
    def bucket(num_seqs: int) -> int:
        return max(num_seqs, 1).bit_length()  # 1 -> 1, 2-3 -> 2, 4-7 -> 3, ...

    def price(self, num_seqs: int) -> DraftPrice:
        """The learned slope and jump for this batch size, each as far off the profile's as the
        evidence is clear (``_shrunk``)."""
        b = self._buckets.get(self.bucket(num_seqs))
        if b is None or b.plain_steps == 0:
            return DraftPrice()
        if b.priced is None:
            cfg = self.config
            r, q, v = self._solve(b)
            if r > 0:
                slope, jump = self._shrunk(b, r, q, v)
            else:
                slope, jump = cfg.max_slope, 0.0
            b.priced = DraftPrice(max(cfg.min_slope, min(cfg.max_slope, slope)),
                                  max(-cfg.max_jump, min(cfg.max_jump, jump)), b.evidence / cfg.unit_increment ** 2)
        return b.priced

    def _normal_matrix(self, b: _Bucket) -> list[list[float]]:
        """[3, 3]: the fit's normal equations (``_solve``), rows d/dr, d/dq, d/dv."""
        cfg = self.config
        p, pj, eps = cfg.prior_units * cfg.unit_increment ** 2, cfg.jump_prior_units * cfg.unit_increment ** 2, _RIDGE
        return [[b.w + p + eps, b.wx - p, b.wd], [b.wx - p, b.wxx + p, b.wxd], [b.wd, b.wxd, b.wd + pj]]

    def _solve(self, b: _Bucket) -> tuple[float, float, float]:
        """(r, q = r s, v = r j): the bucket's fitted level, slope term and jump term."""
        if b.solved is not None:
            return b.solved
        # Minimize sum w (z - r - q x - v d)^2 + p (q - r)^2 + pj v^2 + eps (r - 1)^2 over
        # (r, q = r s, v = r j): the priors say s = 1 and j = 0; eps only keeps the system
        # solvable. Normal equations, rows d/dr, d/dq, d/dv:
        #   (w + p + eps) r + (wx - p) q + wd v         = wz + eps
        #   (wx - p) r      + (wxx + p) q + wxd v       = wxz
        #   wd r            + wxd q       + (wd + pj) v = wdz
        r, q, v = solve3(self._normal_matrix(b), [b.wz + _RIDGE, b.wxz, b.wdz])
        b.solved = (r, q, v)
        return b.solved

    def _shrunk(self, b: _Bucket, r: float, q: float, v: float) -> tuple[float, float]:
        """(slope, jump) of the fit (r, q, v), moved toward the profile's (1, 0) by ``significance``
        standard errors of the fit along the line between them (``dearer_significance`` where
        they price a typical step's drafts above the profile), and no further than to it.

        The fit's covariance: the machine's step-to-step noise (``_Bucket.noise``, the variance
        of the fit's one-step prediction errors in log units, so relative to the level r) times
        the inverse of the fit's normal matrix. Its distance from the profile's price in standard
        errors is the Mahalanobis distance D of (s - 1, j) (read from the normal matrix itself,
        which is the covariance's inverse up to the noise); the deviation is scaled by
        max(0, 1 - significance / D). Along one parameter that is soft thresholding, |s - 1| less
        significance x its standard error; measured jointly, because when every step carried the
        same number of drafts a slope and a jump explain them alike: each alone is uncertain, the
        price they make together is not. Before ``min_noise_samples`` prediction errors there is
        no noise to measure against: the profile's price. The noise is read from the latest
        steps (not from the fit's residuals): a change of the machine's level that the fit has
        since followed leaves residuals in the fit's memory, not in its predictions.

        Worked example (jump fixed at 0): s = 1.5 with standard error 0.1, significance 2: D = 5,
        the deviation 0.5 scaled by 1 - 2 / 5 = 0.6, slope 1.3."""
        slope, jump = q / r, v / r
        cfg = self.config
        # Dearer: the deviation adds to the price of the bucket's typical step with drafts (its
        # mean relative increment x); the policy drafts less for it, never where drafts lose.
        typical_x = b.wxd / b.wd if b.wd > 0.0 else 0.0
        k = cfg.dearer_significance if (slope - 1.0) * typical_x + jump > 0.0 else cfg.significance
        if k == 0.0:
            return slope, jump
        if b.noise_samples < cfg.min_noise_samples:
            return 1.0, 0.0
        if not b.noise > 0.0:  # no noise measured: the fit as it is
            return slope, jump
        # The fit's precision for (q, v) with the level fitted too: the normal matrix's Schur
        # complement of its level entry, over the noise (the covariance's inverse, so nothing to
        # invert); for (s, j) = (q, v) / r the same, the noise being relative to the level.
        (a00, a01, a02), (_, a11, a12), (_, _, a22) = self._normal_matrix(b)
        m_ss, m_sj, m_jj = a11 - a01 * a01 / a00, a12 - a01 * a02 / a00, a22 - a02 * a02 / a00
        ds, dj = slope - 1.0, jump
        distance_sq = (ds * ds * m_ss + 2.0 * ds * dj * m_sj + dj * dj * m_jj) / b.noise  # (s - 1, j) Sigma^-1 (s - 1, j)
        keep = max(0.0, 1.0 - k / math.sqrt(distance_sq)) if distance_sq > 0.0 else 0.0
        return 1.0 + keep * ds, keep * dj

    def slope(self, num_seqs: int) -> float:
        """The learned slope for this batch size."""
        return self.price(num_seqs).slope

    def explore_slope(self, num_seqs: int, price: DraftPrice | None = None) -> float:
        """The learned slope, made optimistic while evidence is thin; not before a plain step of
        this batch size was seen (a probe could teach nothing without one to compare with)."""
        price = price or self.price(num_seqs)
        if not self.has_baseline(num_seqs):
            return price.slope
        return price.slope * (1.0 - self.config.optimism / (1.0 + price.units))

    def has_baseline(self, num_seqs: int) -> bool:
        """Whether a plain step of this batch size was seen recently (what speculative steps are
        measured against; the goodput policy takes one when not). Without recent plain steps the
        fit has only steps with drafts, and when their counts vary little it cannot tell the level
        from the drafts' cost: the prior pulls the slope toward 1 and the level takes the rest,
        and drafts come out priced well under what they cost (measured:
        reports/README.md#planner-measurements)."""
        b = self._buckets.get(self.bucket(num_seqs))
        return b is not None and b.plain_steps > 0 and b.plain_w >= self.config.fresh_baseline

    def observe_plain(self, num_seqs: int, predicted_s: float, measured_s: float) -> None:
        """A decode step without drafts: the machine's level at this batch size right now."""
        if self._settled() and predicted_s > 0 and measured_s > 0:
            b = self._buckets.setdefault(self.bucket(num_seqs), _Bucket())
            self._add(b, 0.0, measured_s / predicted_s)
            b.plain_steps += 1

    def observe_drafts(self, num_seqs: int, base_s: float, increment_s: float, measured_s: float) -> None:
        """A decode step that carried drafts: base_s is the model's prediction without them,
        increment_s what it adds for them (planner/goodput.py ``draft_increment``, never 0)."""
        if not (self._settled() and self.has_baseline(num_seqs) and base_s > 0 and increment_s > 0 and measured_s > 0):
            return  # no plain baseline yet: nothing to compare with
        b = self._buckets[self.bucket(num_seqs)]
        x = increment_s / base_s
        self._add(b, x, measured_s / base_s, drafted=True)
        b.evidence = b.evidence * self.config.discount + x * x

    def _robust(self, b: _Bucket, x: float, z: float, d: float) -> float:
        """z with its log ratio to the fit's prediction clipped to within ``outlier_width`` of the
        median of the bucket's recent ratios and its own (a median filter: one noisy step moves the
        fit a little, a lasting change fully once it is the median).

        Worked example, window 5, width 0.15: recent ratios [0.01, -0.02, 0.0, 0.03] and a step at
        log ratio 1.1 (a 3x spike): the median of the five is 0.01, the step enters at 0.16 (1.17x
        the prediction). Two more steps at 1.1 after it make 1.1 the median: they enter whole."""
        cfg = self.config
        if b.w < cfg.outlier_warmup or b.plain_steps == 0:
            return z
        r, q, v = self._solve(b)
        predicted = r + q * x + v * d
        if not predicted > 0:
            return z
        e = math.log(z / predicted)
        b.recent = (b.recent + [e])[-cfg.outlier_window:]
        m = statistics.median(b.recent)
        entered = max(m - cfg.outlier_width, min(m + cfg.outlier_width, e))
        b.noise_samples += 1
        weight = max(1.0 / cfg.noise_steps, 1.0 / b.noise_samples)
        b.noise += weight * (entered * entered - b.noise)
        return predicted * math.exp(entered)

    def state(self) -> dict:
        """Every batch-size bucket's sums, as plain numbers (planner/beliefs.py saves them)."""
        return {str(k): b.sums() for k, b in self._buckets.items()}

    def load_state(self, state: dict, max_steps: float) -> None:
        """Saved buckets, each weighed as at most ``max_steps`` decode steps. None of them counts as
        a fresh baseline: the machine's level in another run says little about this one's, so the
        policy measures a plain step first, as it does without saved beliefs. The noise the price
        is measured against comes as saved, as if from at most ``noise_steps`` errors (so this
        run's first steps move it fast); files saved before it had one give the profile's price
        until it is measured."""
        names = {f.name for f in fields(_Bucket)} - _NOT_SAVED
        for key, sums in state.items():
            values = {k: float(v) for k, v in sums.items() if k in names}
            scale = min(1.0, max_steps / values["w"]) if values.get("w", 0.0) > 0 else 0.0
            b = _Bucket(**{k: v * scale for k, v in values.items() if k not in _NOT_SUMS})
            b.plain_steps, b.plain_w = int(values.get("plain_steps", 0)), 0.0
            b.noise = max(0.0, values.get("noise", 0.0))
            b.noise_samples = max(0, min(int(values.get("noise_samples", 0)), self.config.noise_steps))
            self._buckets[int(key)] = b

    def _add(self, b: _Bucket, x: float, z: float, drafted: bool = False) -> None:
        g, d = self.config.discount, float(drafted)
        z = self._robust(b, x, z, d)
        b.solved = b.priced = None  # the sums move now
        b.plain_w = b.plain_w * g + (1.0 - d)
        b.w = b.w * g + 1.0
        b.wx = b.wx * g + x
        b.wxx = b.wxx * g + x * x
        b.wd = b.wd * g + d
        b.wxd = b.wxd * g + x * d
        b.wz = b.wz * g + z
        b.wxz = b.wxz * g + x * z
        b.wdz = b.wdz * g + d * z
