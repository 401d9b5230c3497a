"""The fitted latency model: step time from (sequences, query tokens, KV tokens).

Form (a convex piecewise-linear roofline in the token count, plus linear terms):

    t(B, N, C) = a + j * [N >= 2] + sum_k w_k * max(0, N - n_k) + c * C + d * B + q * N * C / B,
    j, w, c, d, q >= 0

The hinge terms let the curve stay flat while the step is memory-bound (extra verify tokens
are nearly free) and bend upward where it turns compute-bound, without assuming where; C (KV
tokens read) prices attention's reads and d per-sequence overhead. N * C / B is attention's
arithmetic: every query token of a sequence scores its whole context, so with drafts spread
evenly it is the query tokens times the mean context. Without it a draft cost the same at any
context: a vLLM-CPU quick profile that timed T = 1-3 at B = 16 read one draft per request as 36%
of a step at 128 tokens of context and 55% at 512, and the fit without the term as 32% and 20%.
The jump j exists because CPU GEMM libraries have a fast matrix-vector path for a single row: on
this machine a step of 2 tokens costs ~1.5x a step of 1, then the curve is flat again for a
while. Fitted by non-negative least squares on relative error (each row divided by its measured
time), so fast and slow cells count alike.

One convex curve in the token count cannot follow a CPU kernel's row blocks: on the Q4_1 engine a
step of 4 sequences with 1 token each and one with 2 each (8 rows, one block) differ by 14%, and 3
each (12 rows, a second block) adds 33% more. The fit split the difference and priced a draft at
B = 4 at ~3x what it measured (1.05 ms against 0.35; scripts/bench_mixed_drafts.py). So the
fitted curve is multiplied by the grid's own residuals (``GridCorrection``): measured / fitted at
each (batch size, tokens per sequence) the grid timed, averaged over its contexts, interpolated
between them. At the grid's cells the model then reads what was measured there; between them (a
step where some requests draft and others do not) it interpolates what was measured nearby.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from scipy.optimize import nnls

from .latency_model import StepShape

DEFAULT_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


@dataclass(frozen=True)
class GridCorrection:
    """Measured / fitted step time over the profile grid's batch sizes and tokens per sequence.

    factor(B, N) interpolates the table linearly in log2 B between the grid's batch sizes and then
    linearly in N / B (tokens per sequence) between its columns; outside the grid it takes the
    nearest edge. Worked example, batch sizes (1, 4), columns (1, 2), ratios ((1.0, 1.0), (1.1,
    0.9)): B = 4 with one draft (N = 5, 1.25 tokens per sequence) reads 1.1 + 0.25 x (0.9 - 1.1)
    = 1.05; B = 2 (halfway in log2 B) with N = 2 reads 1.05, with N = 4 reads 0.95."""

    batch_sizes: tuple[float, ...]  # ascending
    tokens_per_seq: tuple[float, ...]  # ascending
    ratios: tuple[tuple[float, ...], ...]  # [batch_sizes][tokens_per_seq]

    def __post_init__(self) -> None:
        if not self.batch_sizes or not self.tokens_per_seq:
            raise ValueError("a grid correction needs at least one batch size and one column")
        if len(self.ratios) != len(self.batch_sizes) or any(len(r) != len(self.tokens_per_seq) for r in self.ratios):
            raise ValueError("a grid correction's ratios must be [batch_sizes][tokens_per_seq]")
        if list(self.batch_sizes) != sorted(set(self.batch_sizes)) or list(self.tokens_per_seq) != sorted(set(self.tokens_per_seq)):
            raise ValueError("a grid correction's batch sizes and columns must be ascending, without repeats")
        if not all(r > 0 for row in self.ratios for r in row):
            raise ValueError("a grid correction's ratios must be > 0")

    def row(self, num_seqs: int) -> list[float]:
        """The ratios over ``tokens_per_seq`` at this batch size (kept: a planner asks about a few)."""
        rows = self._rows
        row = rows.get(num_seqs)
        if row is None:
            sizes = self.batch_sizes
            b = max(1, num_seqs)
            if b <= sizes[0] or len(sizes) == 1:
                row = list(self.ratios[0])
            elif b >= sizes[-1]:
                row = list(self.ratios[-1])
            else:
                i = next(i for i in range(len(sizes) - 1) if b < sizes[i + 1])
                w = (math.log2(b) - math.log2(sizes[i])) / (math.log2(sizes[i + 1]) - math.log2(sizes[i]))
                row = [lo + w * (hi - lo) for lo, hi in zip(self.ratios[i], self.ratios[i + 1])]
            rows[num_seqs] = row
        return row

    def factor(self, num_seqs: int, num_tokens: int) -> float:
        """The ratio for one step, as ``factors`` computes it (the same floats)."""
        return _interp(num_tokens / max(1, num_seqs), self.tokens_per_seq, self.row(num_seqs), self._slopes(num_seqs))

    def factors(self, num_seqs: int, num_tokens: np.ndarray) -> np.ndarray:
        """``factor`` over an array of token counts at one batch size: [n] -> [n]."""
        return np.interp(num_tokens / max(1, num_seqs), self.tokens_per_seq, self.row(num_seqs))

    def _slopes(self, num_seqs: int) -> list[float]:
        """Each segment's slope of ``row(num_seqs)``, as np.interp computes it."""
        slopes = self._row_slopes.get(num_seqs)
        if slopes is None:
            x, y = self.tokens_per_seq, self.row(num_seqs)
            slopes = self._row_slopes[num_seqs] = [(y[i + 1] - y[i]) / (x[i + 1] - x[i]) for i in range(len(x) - 1)]
        return slopes

    @cached_property
    def _rows(self) -> dict[int, list[float]]:
        return {}

    @cached_property
    def _row_slopes(self) -> dict[int, list[float]]:
        return {}

    def to_dict(self) -> dict:
        return {"batch_sizes": list(self.batch_sizes), "tokens_per_seq": list(self.tokens_per_seq),
                "ratios": [list(r) for r in self.ratios]}

    @staticmethod
    def from_dict(d: dict) -> "GridCorrection":
        return GridCorrection(tuple(float(b) for b in d["batch_sizes"]), tuple(float(t) for t in d["tokens_per_seq"]),
                              tuple(tuple(float(r) for r in row) for row in d["ratios"]))

    @staticmethod
    def of_residuals(shapes: list[StepShape], ratios: list[float]) -> "GridCorrection | None":
        """The table of a grid's measured / fitted ratios (cells whose tokens are a whole number per
        sequence; each (B, tokens per sequence) averaged over its contexts). A batch size missing a
        column reads it interpolated from its own others (``heldout_error`` holds cells out). None
        without a full-width row at two batch sizes or more, or without two columns."""
        cells: dict[tuple[int, int], list[float]] = {}
        for s, r in zip(shapes, ratios):
            if s.num_seqs > 0 and s.num_tokens % s.num_seqs == 0:
                cells.setdefault((s.num_seqs, s.num_tokens // s.num_seqs), []).append(r)
        columns = sorted({t for _, t in cells})
        sizes = sorted({b for b, _ in cells})
        if len(columns) < 2 or len(sizes) < 2:
            return None
        table = []
        for b in sizes:
            present = [t for t in columns if (b, t) in cells]
            means = [sum(cells[b, t]) / len(cells[b, t]) for t in present]
            table.append(tuple(float(v) for v in np.interp(columns, present, means)))
        return GridCorrection(tuple(float(b) for b in sizes), tuple(float(t) for t in columns), tuple(table))


def _interp(x: float, xs: tuple[float, ...], ys: list[float], slopes: list[float]) -> float:
    """np.interp(x, xs, ys) for one x, in plain Python with np.interp's own float operations."""
    if x >= xs[-1]:
        return ys[-1]
    if x < xs[0]:
        return ys[0]
    j = 0
    while x >= xs[j + 1]:
        j += 1
    return ys[j] if x == xs[j] else slopes[j] * (x - xs[j]) + ys[j]


@dataclass(frozen=True)
class HingeLatencyModel:
    intercept: float  # seconds
    knots: tuple[float, ...]  # token counts where the slope may change
    slopes: tuple[float, ...]  # seconds per token added past each knot
    per_context_token: float  # seconds per KV token read
    per_seq: float  # seconds per sequence
    multi_token_jump: float = 0.0  # seconds added once a step has 2 or more tokens
    per_query_context: float = 0.0  # seconds per query token per KV token of its sequence (N * C / B)
    # The grid's measured / fitted ratios, multiplying every prediction (the module's last
    # paragraph); None: the fitted curve alone (a profile made before it, or a grid too sparse).
    correction: GridCorrection | None = None

    def predict(self, shape: StepShape) -> float:
        n = shape.num_tokens
        t = self.intercept + self.per_context_token * shape.context_tokens + self.per_seq * shape.num_seqs
        if self.per_query_context:
            t += self.per_query_context * n * shape.context_tokens / max(1, shape.num_seqs)
        if n >= 2:
            t += self.multi_token_jump
        for knot, slope in zip(self.knots, self.slopes):
            if n > knot:
                t += slope * (n - knot)
        if self.correction is not None:
            t *= self.correction.factor(shape.num_seqs, n)
        return t

    def predict_many(self, num_seqs: int, num_tokens: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """``predict`` over arrays of token counts at one batch size (the planner's allocator
        prices every total of drafts at once). The hinge terms sum to one convex piecewise-linear
        function of the token count, read off its values at the knots by interpolation; tests
        check that both forms agree. Shapes: num_tokens [n], context_tokens [n] -> seconds [n]."""
        knots_x, knots_y = self._hinge_points
        fitted = (self.intercept + self.per_context_token * context_tokens + self.per_seq * num_seqs
                  + self.per_query_context * num_tokens * context_tokens / max(1, num_seqs)
                  + self.multi_token_jump * (num_tokens >= 2) + np.interp(num_tokens, knots_x, knots_y))
        return fitted if self.correction is None else fitted * self.correction.factors(num_seqs, num_tokens)

    def predict_added(self, base: StepShape, count: int) -> list[float]:
        """``predict_many`` at base.num_tokens + n and base.context_tokens + n for n = 0..count, in
        plain Python with the same float operations in the same order (np.interp's included), so
        the same floats (tests/test_fit.py checks): at the planner's short curves numpy's per-call
        cost is most of the work."""
        xs, ys, slopes = self._hinge_lists
        b, n0, c0 = base.num_seqs, base.num_tokens, base.context_tokens
        fixed_b, per_b = self.per_seq * b, max(1, b)
        a, pc, pq, jump = self.intercept, self.per_context_token, self.per_query_context, self.multi_token_jump
        out = []
        j, last = 0, len(xs) - 2  # j: the knot segment [xs[j], xs[j + 1]) holding n (n only grows)
        for n, c in zip(range(n0, n0 + count + 1), range(c0, c0 + count + 1)):
            if n <= xs[0]:
                hinge = ys[0]  # np.interp's left value
            else:
                while j < last and n >= xs[j + 1]:
                    j += 1
                hinge = slopes[j] * (n - xs[j]) + ys[j]  # np.interp: slope * (x - x_j) + y_j
            out.append(a + pc * c + fixed_b + pq * n * c / per_b + jump * (n >= 2) + hinge)
        correction = self.correction
        if correction is not None:
            out = [t * correction.factor(b, n) for t, n in zip(out, range(n0, n0 + count + 1))]
        return out

    @cached_property
    def _hinge_lists(self) -> tuple[list[float], list[float], list[float]]:
        """``_hinge_points`` as lists, with each segment's slope as np.interp computes it."""
        x, y = (v.tolist() for v in self._hinge_points)
        return x, y, [(y[i + 1] - y[i]) / (x[i + 1] - x[i]) for i in range(len(x) - 1)]

    @cached_property
    def _hinge_points(self) -> tuple[np.ndarray, np.ndarray]:
        """(x, y): sum_k slope_k * max(0, x - knot_k) at every knot and at a point far past the
        last (the function is linear between them; 0 before the first knot).
        Worked example: knots (1, 4), slopes (0, 2): x = (1, 4, 4 + 1e9), y = (0, 0, 2e9)."""
        x = np.array(sorted(self.knots) + [max(self.knots) + 1e9])
        y = np.array([sum(s * max(0.0, xi - k) for k, s in zip(self.knots, self.slopes)) for xi in x])
        return x, y

    def to_dict(self) -> dict:
        d = {"form": "hinge", "intercept": self.intercept, "multi_token_jump": self.multi_token_jump,
             "knots": list(self.knots), "slopes": list(self.slopes),
             "per_context_token": self.per_context_token, "per_seq": self.per_seq,
             "per_query_context": self.per_query_context}
        if self.correction is not None:
            d["correction"] = self.correction.to_dict()
        return d

    @staticmethod
    def from_dict(d: dict) -> "HingeLatencyModel":
        return HingeLatencyModel(float(d["intercept"]), tuple(float(k) for k in d["knots"]),
                                 tuple(float(s) for s in d["slopes"]), float(d["per_context_token"]), float(d["per_seq"]),
                                 float(d.get("multi_token_jump", 0.0)), float(d.get("per_query_context", 0.0)),
                                 GridCorrection.from_dict(d["correction"]) if d.get("correction") else None)


def _features(shapes: list[StepShape], knots: tuple[float, ...]) -> np.ndarray:
    rows = []
    for s in shapes:
        rows.append([1.0, float(s.num_tokens >= 2)] + [max(0.0, s.num_tokens - k) for k in knots]
                    + [float(s.context_tokens), float(s.num_seqs), s.num_tokens * s.context_tokens / max(1, s.num_seqs)])
    return np.asarray(rows)  # [cells, 2 + knots + 3]


def fit_latency_model(shapes: list[StepShape], seconds: list[float], knots: tuple[float, ...] = DEFAULT_KNOTS,
                      correct: bool = True) -> HingeLatencyModel:
    """The hinge fit of measured step times, times the grid's residuals (``GridCorrection``) unless
    ``correct`` is False or the cells do not form a grid."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("need one measured time per shape, and at least one")
    max_tokens = max(s.num_tokens for s in shapes)
    knots = tuple(k for k in knots if k < max_tokens) or (knots[0],)
    x = _features(shapes, knots)
    y = np.asarray(seconds, dtype=float)
    weight = 1.0 / y  # relative error
    coef, _ = nnls(x * weight[:, None], y * weight)
    model = HingeLatencyModel(float(coef[0]), knots, tuple(float(c) for c in coef[2:2 + len(knots)]),
                              float(coef[-3]), float(coef[-2]), multi_token_jump=float(coef[1]),
                              per_query_context=float(coef[-1]))
    if not correct:
        return model
    correction = GridCorrection.of_residuals(shapes, [m / model.predict(s) for s, m in zip(shapes, seconds)])
    return model if correction is None else dataclasses.replace(model, correction=correction)


def mape(predicted: list[float] | np.ndarray, measured: list[float] | np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(np.mean(np.abs(p - m) / m) * 100.0)


def heldout_error(shapes: list[StepShape], seconds: list[float], every: int = 4, knots=DEFAULT_KNOTS,
                  correct: bool = True) -> tuple[float, list[int]]:
    """MAPE on cells held out of the fit (every ``every``-th cell, offset so that the smallest and
    largest shapes stay in the training set); returns the error and the held-out indices."""
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i].num_tokens, shapes[i].context_tokens))
    held = [i for j, i in enumerate(order) if j % every == every // 2 and 0 < j < len(order) - 1]
    train = [i for i in range(len(shapes)) if i not in set(held)]
    model = fit_latency_model([shapes[i] for i in train], [seconds[i] for i in train], knots, correct)
    return mape([model.predict(shapes[i]) for i in held], [seconds[i] for i in held]), held
