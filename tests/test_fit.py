"""The latency fit recovers a known synthetic latency function, and generalises to held-out cells."""

from __future__ import annotations

import dataclasses
import random

import numpy as np
import pytest

from specplan.profiler.fit import HingeLatencyModel, fit_latency_model, heldout_error, mape
from specplan.profiler.latency_model import StepShape


def synthetic(shape: StepShape) -> float:
    # flat (memory-bound) up to 16 tokens, then 1.5 ms per token; attention and per-sequence terms
    return 0.030 + 0.0015 * max(0, shape.num_tokens - 16) + 2e-7 * shape.context_tokens + 1e-4 * shape.num_seqs


def grid(noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    shapes, secs = [], []
    for b in (1, 2, 4, 8, 16, 32, 64):
        for t in (1, 2, 3, 5, 9):
            for ctx in (128, 512, 1024):
                s = StepShape(b, b * t, b * (ctx + t))
                shapes.append(s)
                secs.append(synthetic(s) * (1 + rng.gauss(0, noise)))
    return shapes, secs


def test_fit_recovers_known_function():
    shapes, secs = grid()
    model = fit_latency_model(shapes, secs)
    assert mape([model.predict(s) for s in shapes], secs) < 0.5
    assert model.intercept == pytest.approx(0.030, rel=0.05)
    assert model.per_context_token == pytest.approx(2e-7, rel=0.1)
    # the fitted curve is flat before the ridge and ~1.5 ms per token after it
    flat = model.predict(StepShape(1, 8, 0)) - model.predict(StepShape(1, 1, 0))
    steep = model.predict(StepShape(1, 64, 0)) - model.predict(StepShape(1, 32, 0))
    assert flat < 2e-3 and steep == pytest.approx(32 * 0.0015, rel=0.05)


def test_fit_prices_drafts_by_their_context():
    """Attention scores every query token against its sequence's context: with that term in the
    step time, a draft costs more at a long context, and the fit (N * C / B) recovers it; the
    terms without it put one price on a draft at every context (profiler/fit.py)."""
    def attention_bound(shape: StepShape) -> float:
        return synthetic(shape) + 2e-8 * shape.num_tokens * shape.context_tokens / shape.num_seqs

    shapes, _ = grid()
    model = fit_latency_model(shapes, [attention_bound(s) for s in shapes])
    assert model.per_query_context == pytest.approx(2e-8, rel=0.05)
    for ctx in (128, 1024):  # one draft per request at B = 16
        plain, drafted = StepShape(16, 16, 16 * ctx), StepShape(16, 32, 16 * (ctx + 1))
        measured = attention_bound(drafted) - attention_bound(plain)
        assert model.predict(drafted) - model.predict(plain) == pytest.approx(measured, rel=0.02)
    assert fit_latency_model(*grid()).per_query_context < 1e-10  # none where the data has none
    # A profile saved before the term existed reads as it was fitted.
    old = {k: v for k, v in model.to_dict().items() if k != "per_query_context"}
    assert HingeLatencyModel.from_dict(old).per_query_context == 0.0


def test_heldout_error_small_with_noise():
    shapes, secs = grid(noise=0.02)
    err, held = heldout_error(shapes, secs)
    assert held and err < 4.0


def test_model_round_trips_through_dict():
    shapes, secs = grid()
    model = fit_latency_model(shapes, secs)
    again = HingeLatencyModel.from_dict(model.to_dict())
    assert again == model
    tiled = fit_latency_model(*staircase_grid())
    assert tiled.row_tile and HingeLatencyModel.from_dict(tiled.to_dict()) == tiled
    edge = dataclasses.replace(tiled, row_block_limit=1)
    assert HingeLatencyModel.from_dict(edge.to_dict()) == edge
    # A profile saved before the single edge existed reads as the staircase it was fitted as.
    old = {k: v for k, v in tiled.to_dict().items() if k != "row_block_limit"}
    assert HingeLatencyModel.from_dict(old) == tiled


def staircase(shape: StepShape) -> float:
    # A GEMM that computes 6 rows at a time and streams the weights again for every further block:
    # flat up to 6 tokens, +8 ms at 7, 13, ...; a gentle slope and attention besides.
    return 0.040 + 0.008 * ((shape.num_tokens - 1) // 6) + 2e-4 * shape.num_tokens + 2e-7 * shape.context_tokens


def staircase_grid(noise: float = 0.0, seed: int = 0):
    rng = random.Random(seed)
    shapes, secs = [], []
    for b in (1, 2, 4, 8, 16, 32):
        for t in (1, 2, 3, 5, 9):
            for ctx in (128, 512):
                s = StepShape(b, b * t, b * (ctx + t))
                shapes.append(s)
                secs.append(staircase(s) * (1 + rng.gauss(0, noise)))
    return shapes, secs


def test_fit_finds_the_row_tile_of_a_staircase_and_prices_the_step_past_it():
    shapes, secs = staircase_grid(noise=0.01)
    model = fit_latency_model(shapes, secs)
    assert (model.row_tile, model.row_block_limit) == (6, 0)  # a staircase: the edge alone cannot follow it
    assert model.per_row_block == pytest.approx(0.008, rel=0.25)
    # the token past the tile costs a block; the tokens before it next to nothing
    at = lambda n: model.predict(StepShape(4, n, 4 * 300))  # noqa: E731
    assert at(7) - at(6) > 0.006 and at(6) - at(4) < 0.002
    # and it predicts held-out cells of the staircase better than the convex fit can
    tiled, _ = heldout_error(shapes, secs)
    convex, _ = heldout_error(shapes, secs, row_tiles=())
    assert tiled < 0.7 * convex


def single_edge(shape: StepShape) -> float:
    # Dearer once past 6 tokens, then a steady slope and no further stairs (vLLM-CPU on Zen 4:
    # B = 4 flat to 6 tokens then +7 ms; B = 16 ~4% a token from 16 tokens on).
    n = shape.num_tokens
    return 0.040 + 0.007 * (n > 6) + 1e-3 * max(0, n - 8) + 2e-7 * shape.context_tokens


def test_fit_prices_a_single_edge_as_one_and_the_tokens_past_it_by_the_slope():
    rng = random.Random(1)
    shapes, secs = [], []
    for b in (1, 2, 4, 8, 16, 32):
        for t in (1, 2, 3, 5, 9):
            s = StepShape(b, b * t, b * (256 + t))
            shapes.append(s)
            secs.append(single_edge(s) * (1 + rng.gauss(0, 0.01)))
    model = fit_latency_model(shapes, secs)
    assert (model.row_tile, model.row_block_limit) == (6, 1)
    assert model.per_row_block == pytest.approx(0.007, rel=0.3)
    # B = 4: the drafts up to 6 tokens are nearly free, the 7th token costs the edge
    at4 = lambda n: model.predict(StepShape(4, n, 4 * 256))  # noqa: E731
    assert at4(6) - at4(4) < 0.002 and at4(7) - at4(6) > 0.005
    # B = 16: the 17th-20th tokens cost the slope, with no further edge
    at = lambda n: model.predict(StepShape(16, n, 16 * 256))  # noqa: E731
    assert (at(20) - at(16)) / 4 == pytest.approx(1e-3, rel=0.3)
    assert at(19) - at(18) == pytest.approx(at(18) - at(17), rel=1e-6)


def test_fit_keeps_no_tile_on_a_smooth_grid():
    for seed in range(3):
        shapes, secs = grid(noise=0.02, seed=seed)
        assert fit_latency_model(shapes, secs).row_tile == 0


def random_model(rng: random.Random) -> HingeLatencyModel:
    """A fitted-form model with random knots (unsorted too), slopes, jump and attention term."""
    knots = tuple(rng.sample([1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0], rng.randint(1, 8)))
    tile = rng.choice([0, 6, 8])
    return HingeLatencyModel(rng.uniform(0, 0.05), knots, tuple(rng.uniform(0, 1e-3) for _ in knots),
                             rng.uniform(0, 1e-6), rng.uniform(0, 1e-3), rng.choice([0.0, 0.004]),
                             rng.choice([0.0, 1e-8]), tile, rng.uniform(0, 0.01) if tile else 0.0,
                             rng.choice([0, 1, 2]) if tile else 0)


@pytest.mark.parametrize("seed", range(5))
def test_predict_many_agrees_with_predict(seed):
    # The allocator prices a whole curve of draft totals at once (predict_many); every single
    # question goes through predict. Random knots (unsorted too), slopes and shapes.
    rng = random.Random(seed)
    model = random_model(rng)
    num_seqs = rng.randint(1, 64)
    tokens = np.arange(0, 600)
    context = tokens * 3 + rng.randint(0, 10_000)
    many = model.predict_many(num_seqs, tokens, context)
    assert many.shape == (600,)
    one = [model.predict(StepShape(num_seqs, int(t), int(c))) for t, c in zip(tokens, context)]
    assert many.tolist() == pytest.approx(one, rel=1e-12, abs=1e-15)


@pytest.mark.parametrize("seed", range(5))
def test_predict_added_is_predict_many_in_plain_python(seed):
    # The planner's short curves (a base step plus 0..count drafts) are priced in plain Python;
    # they must be the very floats numpy gives, so no decision depends on which path ran.
    rng = random.Random(seed)
    model = random_model(rng)
    for _ in range(50):
        base = StepShape(rng.randint(1, 64), rng.randint(0, 300), rng.randint(0, 20_000))
        count = rng.randint(0, 200)
        n = np.arange(count + 1)
        expected = model.predict_many(base.num_seqs, base.num_tokens + n, base.context_tokens + n).tolist()
        assert model.predict_added(base, count) == expected
