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

A row tile, where the grid shows one: GEMM micro-kernels compute a block of R rows (tokens) at a
time, and when the weights do not stay in cache each further block streams them again, so the
step is a staircase in N: flat up to R tokens, then a jump. vLLM-CPU on an AVX-512 Zen 4 VM
steps at R = 6 (measured, B = 4: 4, 5, 6 tokens 43.4, 44.0, 44.6 ms; 7 tokens 53.1 ms;
reports/vllm-peer-zen4), which no convex curve can follow: it priced the 7th token at a tenth of
its cost and the 4th at several times it, so the planner drafted past the tile where drafts did not
pay and left free drafts below it. Two forms of the term, each tried for every R in ``ROW_TILES``:

* a single edge, ``r * [N > R]``: the step is dearer once past its first block, and the hinges
  price what comes after. vLLM's step on that VM is one: at B = 16 its 16-24 tokens rose ~4% a
  token with no further stairs;
* a staircase, ``r * (ceil(N / R) - 1)``: dearer again at every block.

A tile is kept where either form cuts the fit's relative squared error by ``MIN_TILE_GAIN``; then
the edge, unless the staircase, which claims more (free drafts inside every block), cuts the
edge's error by as much again.
Where the grid cannot tell them apart the edge is the safer price: it charges the tokens past a
large batch's last full block, which the staircase calls free (on the Zen 4 vLLM grid both fit
within 1%; the B = 16 timing agreed with the edge, reports/vllm-peer-zen4).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
from scipy.optimize import nnls

from .latency_model import StepShape

DEFAULT_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Row tiles tried (the rows common CPU GEMM micro-kernels block by), and how much smaller the
# fit's relative squared error must get for one to be kept: a spurious tile on a smooth grid
# cuts it by a few percent at most (the Xeon VM's fp32 engine grid: 1.6%; vLLM-CPU on Zen 4 with
# R = 6: 10.5% as a staircase, 9.8% as an edge, 14% on an earlier profile; the Q4_1 engine on the
# Xeon with R = 8: 19%).
ROW_TILES = (4, 6, 8, 12, 16)
MIN_TILE_GAIN = 0.10


def row_blocks(num_tokens: int, row_tile: int, limit: int = 0) -> int:
    """Row blocks past the first a step of ``num_tokens`` query tokens runs (0 without a tile),
    at most ``limit`` of them (0: no limit; 1: the single edge).
    Worked example: row_tile 6 -> 1..6 tokens 0, 7..12 tokens 1, 13 tokens 2; with limit 1,
    13 tokens 1."""
    if not row_tile or num_tokens <= 0:
        return 0
    blocks = (num_tokens - 1) // row_tile
    return min(blocks, limit) if limit else blocks


@dataclass(frozen=True)
class HingeLatencyModel:
    intercept: float  # seconds
    knots: tuple[float, ...]  # token counts where the slope may change
    slopes: tuple[float, ...]  # seconds per token added past each knot
    per_context_token: float  # seconds per KV token read
    per_seq: float  # seconds per sequence
    multi_token_jump: float = 0.0  # seconds added once a step has 2 or more tokens
    per_query_context: float = 0.0  # seconds per query token per KV token of its sequence (N * C / B)
    row_tile: int = 0  # tokens per GEMM row block (0: no tile term)
    per_row_block: float = 0.0  # seconds per row block past the first (``row_blocks``)
    row_block_limit: int = 0  # blocks priced at most (1: a single edge; 0: a staircase)

    def predict(self, shape: StepShape) -> float:
        n = shape.num_tokens
        t = self.intercept + self.per_context_token * shape.context_tokens + self.per_seq * shape.num_seqs
        if self.per_query_context:
            t += self.per_query_context * n * shape.context_tokens / max(1, shape.num_seqs)
        if self.row_tile:
            t += self.per_row_block * row_blocks(n, self.row_tile, self.row_block_limit)
        if n >= 2:
            t += self.multi_token_jump
        for knot, slope in zip(self.knots, self.slopes):
            if n > knot:
                t += slope * (n - knot)
        return t

    def predict_many(self, num_seqs: int, num_tokens: np.ndarray, context_tokens: np.ndarray) -> np.ndarray:
        """``predict`` over arrays of token counts at one batch size (the planner's allocator
        prices every total of drafts at once). The hinge terms sum to one convex piecewise-linear
        function of the token count, read off its values at the knots by interpolation; tests
        check that both forms agree. Shapes: num_tokens [n], context_tokens [n] -> seconds [n]."""
        knots_x, knots_y = self._hinge_points
        t = (self.intercept + self.per_context_token * context_tokens + self.per_seq * num_seqs
             + self.per_query_context * num_tokens * context_tokens / max(1, num_seqs)
             + self.multi_token_jump * (num_tokens >= 2) + np.interp(num_tokens, knots_x, knots_y))
        if self.row_tile:
            blocks = (np.maximum(num_tokens, 1) - 1) // self.row_tile
            if self.row_block_limit:
                blocks = np.minimum(blocks, self.row_block_limit)
            t = t + self.per_row_block * blocks
        return t

    def predict_added(self, base: StepShape, count: int) -> list[float]:
        """``predict_many`` at base.num_tokens + n and base.context_tokens + n for n = 0..count, in
        plain Python with the same float operations in the same order (np.interp's included), so
        the same floats (tests/test_fit.py checks): at the planner's short curves numpy's per-call
        cost is most of the work."""
        xs, ys, slopes = self._hinge_lists
        b, n0, c0 = base.num_seqs, base.num_tokens, base.context_tokens
        fixed_b, per_b = self.per_seq * b, max(1, b)
        a, pc, pq, jump = self.intercept, self.per_context_token, self.per_query_context, self.multi_token_jump
        tile, per_block, limit = self.row_tile, self.per_row_block, self.row_block_limit
        out = []
        j, last = 0, len(xs) - 2  # j: the knot segment [xs[j], xs[j + 1]) holding n (n only grows)
        for n, c in zip(range(n0, n0 + count + 1), range(c0, c0 + count + 1)):
            if n <= xs[0]:
                hinge = ys[0]  # np.interp's left value
            else:
                while j < last and n >= xs[j + 1]:
                    j += 1
                hinge = slopes[j] * (n - xs[j]) + ys[j]  # np.interp: slope * (x - x_j) + y_j
            t = a + pc * c + fixed_b + pq * n * c / per_b + jump * (n >= 2) + hinge
            out.append(t + per_block * row_blocks(n, tile, limit) if tile else t)
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
        return {"form": "hinge", "intercept": self.intercept, "multi_token_jump": self.multi_token_jump,
                "knots": list(self.knots), "slopes": list(self.slopes),
                "per_context_token": self.per_context_token, "per_seq": self.per_seq,
                "per_query_context": self.per_query_context, "row_tile": self.row_tile,
                "per_row_block": self.per_row_block, "row_block_limit": self.row_block_limit}

    @staticmethod
    def from_dict(d: dict) -> "HingeLatencyModel":
        return HingeLatencyModel(float(d["intercept"]), tuple(float(k) for k in d["knots"]),
                                 tuple(float(s) for s in d["slopes"]), float(d["per_context_token"]), float(d["per_seq"]),
                                 float(d.get("multi_token_jump", 0.0)), float(d.get("per_query_context", 0.0)),
                                 int(d.get("row_tile", 0)), float(d.get("per_row_block", 0.0)),
                                 int(d.get("row_block_limit", 0)))


def _features(shapes: list[StepShape], knots: tuple[float, ...], row_tile: int = 0, limit: int = 0) -> np.ndarray:
    rows = []
    for s in shapes:
        rows.append([1.0, float(s.num_tokens >= 2)] + [max(0.0, s.num_tokens - k) for k in knots]
                    + [float(s.context_tokens), float(s.num_seqs), s.num_tokens * s.context_tokens / max(1, s.num_seqs),
                       float(row_blocks(s.num_tokens, row_tile, limit))])
    return np.asarray(rows)  # [cells, 2 + knots + 4]; the last column all 0 without a tile


def fit_latency_model(shapes: list[StepShape], seconds: list[float], knots: tuple[float, ...] = DEFAULT_KNOTS,
                      row_tiles: tuple[int, ...] = ROW_TILES) -> HingeLatencyModel:
    """The fit, with a row-tile term where one among ``row_tiles`` (none: ``()``) cuts its relative
    squared error by ``MIN_TILE_GAIN`` or more: the best single edge, or the best staircase where it
    cuts the edge's error by ``MIN_TILE_GAIN`` again."""
    if len(shapes) != len(seconds) or not shapes:
        raise ValueError("need one measured time per shape, and at least one")
    max_tokens = max(s.num_tokens for s in shapes)
    knots = tuple(k for k in knots if k < max_tokens) or (knots[0],)
    y = np.asarray(seconds, dtype=float)
    weight = 1.0 / y  # relative error

    def solve(tile: int, limit: int) -> tuple[np.ndarray, float]:
        x = _features(shapes, knots, tile, limit)  # without a tile its last column is all 0, its coefficient 0
        coef, residual = nnls(x * weight[:, None], y * weight)
        return coef, residual ** 2

    coef, error = solve(0, 0)
    fits = {(tile, form): solve(tile, form) for tile in row_tiles if tile < max_tokens  # a tile the grid never passes says nothing
            for form in (1, 0)}
    tile = limit = 0
    if fits and min(e for _, e in fits.values()) < (1.0 - MIN_TILE_GAIN) * error:  # the grid shows a tile
        edge = min((key for key in fits if key[1] == 1), key=lambda key: fits[key][1])
        stairs = min((key for key in fits if key[1] == 0), key=lambda key: fits[key][1])
        tile, limit = stairs if fits[stairs][1] < (1.0 - MIN_TILE_GAIN) * fits[edge][1] else edge
        coef = fits[tile, limit][0]
    return HingeLatencyModel(float(coef[0]), knots, tuple(float(c) for c in coef[2:2 + len(knots)]),
                             float(coef[-4]), float(coef[-3]), multi_token_jump=float(coef[1]),
                             per_query_context=float(coef[-2]), row_tile=tile,
                             per_row_block=float(coef[-1]) if tile else 0.0, row_block_limit=limit if tile else 0)


def mape(predicted: list[float] | np.ndarray, measured: list[float] | np.ndarray) -> float:
    """Mean absolute percentage error, in percent."""
    p, m = np.asarray(predicted, dtype=float), np.asarray(measured, dtype=float)
    return float(np.mean(np.abs(p - m) / m) * 100.0)


@dataclass(frozen=True)
class GridFit:
    """The latency model fitted to a measured step grid, with its errors (percent)."""

    model: HingeLatencyModel
    heldout_mape: float  # on cells held out of a fit of the rest (``heldout_error``)
    num_heldout: int
    train_mape: float  # on every cell it was fitted to


def fit_grid(grid) -> GridFit:
    """``fit_latency_model`` over a measured grid, with its errors: what a profile records, when it
    is measured (profiler/run.py ``build_profile``, for this engine's grid and vLLM's) and when it is refitted
    (profiler/profile.py ``refit_profile``). ``grid``: a table (pandas) with batch_size,
    num_tokens, context_tokens and seconds columns, one row per cell."""
    shapes = [StepShape(int(r.batch_size), int(r.num_tokens), int(r.context_tokens)) for r in grid.itertuples()]
    seconds = grid["seconds"].tolist()
    model = fit_latency_model(shapes, seconds)
    held_err, held = heldout_error(shapes, seconds)
    return GridFit(model, held_err, len(held), mape([model.predict(s) for s in shapes], seconds))


def heldout_error(shapes: list[StepShape], seconds: list[float], every: int = 4, knots=DEFAULT_KNOTS,
                  row_tiles: tuple[int, ...] = ROW_TILES) -> tuple[float, list[int]]:
    """MAPE on cells held out of the fit (every ``every``-th cell, offset so that the smallest and
    largest shapes stay in the training set); returns the error and the held-out indices."""
    order = sorted(range(len(shapes)), key=lambda i: (shapes[i].num_tokens, shapes[i].context_tokens))
    held = [i for j, i in enumerate(order) if j % every == every // 2 and 0 < j < len(order) - 1]
    train = [i for i in range(len(shapes)) if i not in set(held)]
    model = fit_latency_model([shapes[i] for i in train], [seconds[i] for i in train], knots, row_tiles)
    return mape([model.predict(shapes[i]) for i in held], [seconds[i] for i in held]), held
