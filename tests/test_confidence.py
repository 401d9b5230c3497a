"""A draft head's confidence in the planner: the calibration it learns, the stop rule it hands the
engine, and the beliefs file that keeps the table (planner/confidence.py, controller.py)."""

from __future__ import annotations

import math
import random

import pytest

from specplan.engine import RequestRecord, RequestView, StepRecord, StepView
from specplan.planner import Planner, PlannerConfig
from specplan.planner.beliefs import capture, restore
from specplan.planner.confidence import BUCKET_EDGES, ConfidenceCalibration, ConfidenceConfig, bucket_of
from specplan.planner.goodput import marginal_draft_prices
from specplan.planner.policy import PolicyState
from specplan.profiler.latency_model import DraftCost
from specplan.policies import make_policy

from conftest import RidgeLatency

FLAT = RidgeLatency(a=0.03, b=0.0005, c=1e-9)  # memory-bound: a draft adds ~2% of a step


def view(n: int, *, max_k: int = 8, proposer: str = "eagle") -> StepView:
    return StepView(tuple(RequestView(i, f"r{i}", 500, 10, max_k, True) for i in range(n)),
                    num_prefill_tokens=0, num_prefill_seqs=0, context_tokens=500 * n, proposer=proposer)


def warmed(planner: Planner, n: int) -> Planner:
    """A planner that has seen plain decode steps of n requests (the goodput policy's baseline for
    pricing drafts: without one its first step is plain)."""
    for _ in range(2):
        planner.decide(view(n))
        reqs = tuple(RequestRecord(i, f"r{i}", 0, 0, 0, 1) for i in range(n))
        planner.observe(StepRecord(reqs, n, n, 0, 500 * n, 0.001, 0.03, 0.001, 0.033))
    return planner


def test_buckets_cover_zero_to_one():
    assert bucket_of(0.0) == 0 and bucket_of(1.0) == len(BUCKET_EDGES) - 1
    assert bucket_of(0.85) == bucket_of(0.8) != bucket_of(0.79)
    assert bucket_of(-1.0) == 0 and bucket_of(7.0) == len(BUCKET_EDGES) - 1


def test_calibration_judges_drafts_up_to_the_first_rejection():
    cal = ConfidenceCalibration(ConfidenceConfig(prior_strength=1.0, discount=1.0))
    cal.observe([0.95, 0.95, 0.15, 0.95], num_accepted=2)  # 3rd rejected, 4th never judged
    top, low = bucket_of(0.95), bucket_of(0.15)
    assert cal.judged[top] == 2 and cal.accepted[top] == 2
    assert cal.judged[low] == 1 and cal.accepted[low] == 0
    assert cal.evidence == 3
    cal.observe([math.nan, math.nan, 0.95], num_accepted=3)  # lookup tokens (nan) carry no signal
    assert cal.evidence == 4 and cal.accepted[top] == 3


def test_calibration_learns_and_stays_monotone():
    rng = random.Random(0)
    cal = ConfidenceCalibration()
    start = cal.table()
    assert start == BUCKET_EDGES  # the prior: each bucket's upper edge
    for _ in range(3000):  # a head twice as sure as it should be: true acceptance = confidence / 2
        c = rng.random()
        cal.observe([c], int(rng.random() < c / 2))
    table = cal.table()
    assert list(table) == sorted(table)
    assert abs(cal.accept_probability(0.97) - 0.49) < 0.08
    assert abs(cal.accept_probability(0.45) - 0.22) < 0.08


def test_calibration_state_round_trips_with_its_weight_capped():
    cal = ConfidenceCalibration(ConfidenceConfig(discount=1.0))
    for _ in range(100):
        cal.observe([0.92], 0)
    fresh = ConfidenceCalibration(ConfidenceConfig(discount=1.0))
    fresh.load_state(cal.state(), max_judged=10.0)
    assert fresh.evidence == pytest.approx(10.0)
    assert fresh.accept_probability(0.92) < ConfidenceCalibration().accept_probability(0.92)
    with pytest.raises(ValueError, match="buckets"):
        fresh.load_state({**cal.state(), "edges": [0.5, 1.0]}, 10.0)
    with pytest.raises(ValueError, match="counts"):
        fresh.load_state({**cal.state(), "accepted": [5.0] * len(BUCKET_EDGES)}, 10.0)


def test_draft_prices_split_one_more_draft_into_its_query_token_and_its_pass():
    """A deeper draft on the deepest request costs a query token and a head pass; a draft on a
    shallower request only the token (its pass runs anyway): the two prices tell them apart."""
    planner = Planner(make_policy("goodput"), FLAT, proposer="eagle",
                      draft_cost=DraftCost(per_pass_s=0.002, per_token_s=0.0001))
    planner.decide(view(2))
    state: PolicyState = planner.last_state
    cost = state.cost_model()
    est = [r.acceptance for r in state.requests]
    token, pass_ = marginal_draft_prices(est, [3, 1], cost)
    goodput = (est[0].expected_emitted(3) + est[1].expected_emitted(1)) / cost.charged_seconds([3, 1])
    deeper = goodput * (cost.charged_seconds([4, 1]) - cost.charged_seconds([3, 1]))  # token and pass
    shallower = goodput * (cost.charged_seconds([3, 2]) - cost.charged_seconds([3, 1]))  # token only
    assert token == pytest.approx(shallower) and token + pass_ == pytest.approx(deeper)
    assert pass_ == pytest.approx(goodput * 0.002) and 0 < token < pass_ < 1


def test_goodput_planner_hands_a_stop_rule_to_a_model_proposer_and_lets_drafts_run_deeper():
    planner = warmed(Planner(make_policy("goodput:stop"), FLAT, proposer="eagle", config=PlannerConfig(max_k=6)), 2)
    ks = planner.decide(view(2))
    # each drafting request may run to its cap (slow start: one fresh request drafts at first) ...
    assert sorted(ks) == [0, 6]
    stop = planner.draft_stop
    assert stop is not None and 0 < stop.min_gain < 1  # ... and stops where a draft no longer pays
    assert stop.accept_probability(0.99) > stop.accept_probability(0.3)


@pytest.mark.parametrize("policy,proposer", [("static:3", "eagle"), ("goodput:stop", "ngram"), ("goodput", "eagle")])
def test_no_stop_rule_for_fixed_k_lookup_drafts_or_the_default_goodput(policy, proposer):
    """The stop is goodput:stop's, for a model proposer's drafts only (plain goodput drafts the k it
    chose: measured faster with the shipped head, policies/goodput.py ``confidence_stop``)."""
    planner = warmed(Planner(make_policy(policy), FLAT, proposer=proposer), 2)
    ks = planner.decide(view(2, proposer=proposer))
    assert planner.draft_stop is None and max(ks) < 8


def test_no_stop_rule_without_confidence_config():
    planner = warmed(Planner(make_policy("goodput:stop"), FLAT, proposer="eagle", config=PlannerConfig(confidence=None)), 1)
    ks = planner.decide(view(1))
    assert planner.draft_stop is None and 0 < ks[0] < 8  # the policy's own k


def test_deeper_drafts_must_fit_the_sla():
    slow = RidgeLatency(a=0.03, b=0.004)  # each query token adds 4 ms
    planner = warmed(Planner(make_policy("goodput:stop"), slow, proposer="eagle", sla_itl_s=0.045), 1)
    ks = planner.decide(view(1))
    assert 0 < ks[0] < 8 and planner.draft_stop is not None  # the policy's k: 8 would break the SLA
    assert planner.last_state.cost_model().seconds(ks) <= 0.045


def test_observe_learns_confidence_and_reads_a_stopped_draft_as_asked_for():
    planner = warmed(Planner(make_policy("goodput:stop"), FLAT, proposer="eagle"), 1)
    for step in range(40):
        ks = planner.decide(view(1))
        # the head stopped after 2 of its k drafts; the first was accepted
        rr = RequestRecord(0, "r0", ks[0], 2, 1, 2, confidence=(0.97, 0.4), stop_rule=True)
        planner.observe(StepRecord((rr,), 1, 3, 0, 502, 0.001, 0.03, 0.001, 0.033))
    cal = planner.confidence
    assert cal.judged[bucket_of(0.97)] > 10 and cal.judged[bucket_of(0.4)] > 10
    assert cal.accept_probability(0.4) < 0.3 < 0.8 < cal.accept_probability(0.97)
    # read as k = 2 (what was drafted): the proposal did not fall short of k
    acc = planner.acceptance(planner._requests[0], None).estimate()
    assert acc.p_len_ge[1] > 0.9


def test_beliefs_keep_the_confidence_table():
    planner = Planner(make_policy("goodput"), FLAT, proposer="eagle")
    for _ in range(50):
        planner.confidence.observe([0.93, 0.6], 0)
    doc = capture(planner)
    assert "eagle" in doc["confidence"]
    fresh = Planner(make_policy("goodput"), FLAT, proposer="eagle")
    restored = restore(fresh, doc)
    assert restored.confidence and "draft confidence" in restored.describe()
    assert fresh.confidence.accept_probability(0.93) < 0.7 < Planner(make_policy("goodput"), FLAT).confidence.accept_probability(0.93)
    with pytest.raises(ValueError, match="malformed"):
        restore(fresh, {**doc, "confidence": {"eagle": {"edges": [1.0], "judged": [1], "accepted": [0]}}})

