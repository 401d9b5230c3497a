"""The decision rules behind ``Policy.choose(state)`` and the ``make_policy`` registry."""

from __future__ import annotations

import dataclasses

import pytest

from specplan.planner import Outcome, Policy, PolicyState, RequestState, StepPricing
from specplan.planner.acceptance import AcceptanceEstimate
from specplan.policies import (POLICIES, BatchTablePolicy, GoodputPolicy, HeuristicPolicy, OffPolicy, OraclePolicy,
                               RooflinePolicy, StaticPolicy, best_static_k, make_policy)
from specplan.policies.heuristic import next_k
from specplan.profiler.latency_model import StepShape
from specplan.profiler.roofline import LinearRoofline

from conftest import RidgeLatency




FLAT = RidgeLatency(a=0.03)
COMPUTE_BOUND = RidgeLatency(a=0.0, b=0.001)


def req(i: int, alpha: float = 0.7, *, max_k: int = 8, outcome: Outcome | None = None, steps: int = 0,
        p_len_ge: tuple[float, ...] | None = None) -> RequestState:
    return RequestState(seq_id=i, request_id=f"r{i}", max_k=max_k, context_tokens=200,
                        acceptance=AcceptanceEstimate(alpha, p_len_ge or (1.0,) * 8),
                        last_outcome=outcome, steps_observed=steps)


def state(requests, *, latency=None, sla=None, roofline=None, prefill_tokens=0, workload="chat") -> PolicyState:
    n = len(requests)
    base = StepShape(n + (1 if prefill_tokens else 0), n + prefill_tokens, 200 * n + prefill_tokens)
    return PolicyState(requests=tuple(requests), base=base, max_k=8, proposer="ngram", workload=workload,
                       pricing=StepPricing(latency=latency), sla_itl_s=sla, roofline=roofline)


def without_baseline(s: PolicyState) -> PolicyState:
    """``s`` with no plain step of its batch size measured recently."""
    return dataclasses.replace(s, pricing=dataclasses.replace(s.pricing, draft_baseline=False))


# ---------------------------------------------------------------------------- simple rules

def test_off_and_static():
    s = state([req(0), req(1, max_k=2), req(2, max_k=0)])
    assert OffPolicy().choose(s) == [0, 0, 0]
    assert StaticPolicy(4).choose(s) == [4, 2, 0]  # each request's cap applies
    assert StaticPolicy(0).choose(s) == [0, 0, 0]
    with pytest.raises(ValueError):
        StaticPolicy(-1)


def test_batch_table_lookup():
    table = BatchTablePolicy()  # default: 1 -> 6, 2 -> 4, <= 4 -> 3, <= 8 -> 2, <= 16 -> 1, else 0
    assert [table.k_for(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17, 64)] == [6, 4, 3, 3, 2, 2, 1, 1, 0, 0]
    assert table.choose(state([req(i) for i in range(3)])) == [3, 3, 3]
    assert table.choose(state([req(0, max_k=1), req(1)])) == [1, 4]
    custom = make_policy("batch_table:2=4,8=2,32=1")
    assert [custom.k_for(b) for b in (1, 2, 3, 8, 9, 32, 33)] == [4, 4, 2, 2, 1, 1, 0]
    assert custom.name == "batch_table:2=4,8=2,32=1" and make_policy("batch_table").name == "batch_table"
    with pytest.raises(ValueError, match="increasing"):
        BatchTablePolicy(((8, 2), (4, 3)))


def test_heuristic_plus_two_minus_one():
    # HF assisted generation: +2 when every draft was accepted, -1 otherwise, never below 1.
    assert next_k(4, Outcome(4, 4, 4)) == 6
    assert next_k(4, Outcome(4, 4, 3)) == 3
    assert next_k(1, Outcome(1, 1, 0)) == 1
    assert next_k(4, Outcome(4, 0, 0)) == 3  # nothing proposed: not "all accepted"
    assert next_k(4, Outcome(4, 2, 2)) == 6  # all of a short proposal accepted
    policy = HeuristicPolicy(start_k=4)
    assert policy.choose(state([req(0), req(1)])) == [4, 4]
    # Request 0 accepted everything, request 1 missed.
    s = state([req(0, outcome=Outcome(4, 4, 4), steps=1), req(1, outcome=Outcome(4, 4, 1), steps=1)])
    assert policy.choose(s) == [6, 3]
    assert policy.choose(s) == [6, 3]  # no new observation: no new update
    s = state([req(0, outcome=Outcome(6, 6, 6), steps=2), req(1, outcome=Outcome(3, 3, 0), steps=2)])
    assert policy.choose(s) == [8, 2]
    s = state([req(0, outcome=Outcome(8, 8, 8), steps=3), req(1, outcome=Outcome(2, 2, 0), steps=3)])
    assert policy.choose(s) == [8, 1]  # capped at max_k; floored at 1
    s = state([req(0, outcome=Outcome(8, 8, 2), steps=4), req(1, outcome=Outcome(1, 1, 0), steps=4)])
    assert policy.choose(s) == [7, 1]  # the cap was remembered: one miss takes it to max_k - 1
    # A request that leaves is forgotten; a new one starts at start_k.
    assert policy.choose(state([req(5)])) == [4]
    assert 0 not in policy._k


def test_roofline_off_past_the_ridge():
    # Weights 500 MB read once per step, 270 MFLOP per token: intensity ~ 0.54 * tokens FLOP/B.
    roof = LinearRoofline(ridge=8.6, flops_per_token=2.7e8, bytes_per_step=5.0e8)
    assert roof.intensity(StepShape(1, 1, 100)) == pytest.approx(0.54)
    policy = RooflinePolicy(k=4)
    small = state([req(0), req(1)], roofline=roof)  # 2 * (1 + 4) = 10 tokens: 5.4 FLOP/B
    assert policy.choose(small) == [4, 4]
    big = state([req(i) for i in range(4)], roofline=roof)  # 20 tokens: 10.8 FLOP/B > ridge
    assert policy.choose(big) == [0, 0, 0, 0]
    with pytest.raises(ValueError, match="roofline"):
        policy.choose(state([req(0)]))


def test_goodput_policy_takes_a_plain_step_before_drafting_without_a_baseline():
    """What drafts cost is learned against plain steps of the same batch size: without a recent one
    the policy takes one, unless the step carries a prompt chunk (that is no baseline, and under a
    steady stream of arrivals waiting for one would keep speculation off)."""
    policy = GoodputPolicy()
    many = [req(i, alpha=0.9) for i in range(4)]
    assert all(policy.choose(state(many, latency=FLAT)))
    assert policy.choose(without_baseline(state(many, latency=FLAT))) == [0] * 4
    chunked = without_baseline(state(many, latency=FLAT, prefill_tokens=64))
    assert all(policy.choose(chunked))


def test_goodput_policy_off_when_compute_bound_on_when_memory_bound():
    policy = GoodputPolicy()
    many = [req(i, alpha=a) for i, a in enumerate((0.95, 0.9, 0.8, 0.6, 0.3, 0.7))]
    assert policy.choose(state(many, latency=COMPUTE_BOUND)) == [0] * 6
    # FLAT prices drafts at the planner's floor (a third of a percent of this B = 6 step each): a
    # request drafts while its next draft gains more than ~0.066 tokens, so the depth follows alpha.
    assert policy.choose(state(many, latency=FLAT)) == [8, 8, 8, 5, 2, 7]
    # Two requests, alpha 0.9 and 0.2, past a low ridge: the 0.9 one is served first.
    ks = policy.choose(state([req(0, alpha=0.9), req(1, alpha=0.2)],
                             latency=RidgeLatency(a=0.03, b=0.003, ridge_tokens=2)))
    assert ks[0] > 0 and ks[1] == 0
    # The margin: a proposer that almost never proposes is not worth switching on for.
    rare = req(0, alpha=0.9, p_len_ge=(0.01,) + (0.002,) * 7)  # +1.8% expected tokens
    assert policy.choose(state([rare], latency=FLAT)) == [0]
    with pytest.raises(ValueError, match="latency"):
        policy.choose(state(many))


def test_goodput_slow_start_holds_back_requests_valued_at_an_unproven_prior():
    """Requests without a verified draft of their own, whose pool belief rests on fewer than
    32 observed request-steps: only max(1, evidence) of them draft in a step, the best first
    drafts; a request with drafts of its own verified is not held back."""
    alphas = [0.6, 0.9, 0.7, 0.8, 0.65, 0.75, 0.85, 0.6]

    def drafting(evidence: float, observed: tuple[int, ...] = ()) -> list[int]:
        reqs = [dataclasses.replace(req(i, a, steps=2 if i in observed else 0), pool_evidence=evidence)
                for i, a in enumerate(alphas)]
        return [i for i, k in enumerate(GoodputPolicy().choose(state(reqs, latency=FLAT))) if k]

    assert drafting(float("inf")) == list(range(8))  # memory-bound: every request drafts
    assert drafting(0.0) == [1]  # the prior alone: one request, the best first draft (0.9)
    assert drafting(3.0) == [1, 3, 6]
    assert drafting(0.0, observed=(0,)) == [0, 1]  # request 0's own drafts were verified
    assert drafting(32.0) == list(range(8))
    with pytest.raises(ValueError, match="slow_start_evidence"):
        GoodputPolicy(slow_start_evidence=-1)


def test_goodput_policy_respects_the_sla():
    latency = RidgeLatency(a=0.03, b=0.001, ridge_tokens=4)
    plan = GoodputPolicy().plan(state([req(i, alpha=0.9) for i in range(4)], latency=latency, sla=0.035))
    assert plan.step_s <= 0.035 and plan.total_drafts == 5


def test_oracle_plays_the_best_static_k_in_hindsight():
    table = {("chat", 1): {0: 30.0, 2: 41.0, 4: 44.0, 8: 39.0},
             ("chat", 32): {0: 300.0, 2: 280.0, 4: 250.0},
             ("code", 1): {0: 30.0, 4: 70.0, 8: 90.0}}
    assert best_static_k(table[("chat", 1)]) == 4
    assert best_static_k({0: 10.0, 2: 10.0}) == 0  # tie: the cheaper k
    oracle = OraclePolicy(table)
    assert oracle.choose(state([req(0)], workload="chat")) == [4]
    assert oracle.choose(state([req(i) for i in range(30)], workload="chat")) == [0] * 30  # nearest: B=32
    assert oracle.choose(state([req(0, max_k=5)], workload="code")) == [5]
    fixed = OraclePolicy(table, cell=("code", 1))
    assert fixed.choose(state([req(0), req(1)], workload="chat")) == [8, 8]
    with pytest.raises(ValueError, match="workload"):
        oracle.choose(state([req(0)], workload="math"))
    with pytest.raises(ValueError):
        best_static_k({})


# ---------------------------------------------------------------------------- registry

@pytest.mark.parametrize("spec,cls,name", [
    ("off", OffPolicy, "off"), ("static:4", StaticPolicy, "static:4"), ("static:0", StaticPolicy, "static:0"),
    ("batch_table", BatchTablePolicy, "batch_table"), ("heuristic", HeuristicPolicy, "heuristic"),
    ("heuristic:6", HeuristicPolicy, "heuristic:6"), ("roofline", RooflinePolicy, "roofline"),
    ("roofline:2", RooflinePolicy, "roofline:2"), ("goodput", GoodputPolicy, "goodput"),
    ("goodput:0", GoodputPolicy, "goodput:0"), (" Static:3 ", StaticPolicy, "static:3"),
])
def test_make_policy_names(spec, cls, name):
    policy = make_policy(spec)
    assert isinstance(policy, cls) and isinstance(policy, Policy)
    assert policy.name == name
    assert make_policy(policy.name).name == name  # names round-trip


def test_make_policy_oracle_needs_its_table():
    table = {("chat", 1): {0: 1.0, 4: 2.0}}
    assert make_policy("oracle", oracle_table=table).choose(state([req(0)])) == [4]
    with pytest.raises(ValueError, match="oracle_table"):
        make_policy("oracle")


@pytest.mark.parametrize("spec,message", [
    ("fastest", "unknown policy 'fastest'; choose one of: off, static, batch_table"),
    ("", "a policy name is required"),
    ("static", "needs a k, e.g. 'static:4'"),
    ("static:four", "integer k >= 0, got 'four'"),
    ("static:-1", "integer k >= 0, got -1"),
    ("static:", "empty argument"),
    ("off:3", "takes no argument"),
    ("heuristic:0", "k >= 1"),
    ("batch_table:8", "not MAX_BATCH=K"),
    ("batch_table:a=2", "needs integers"),
    ("goodput:fast", "optional margin"),
    ("oracle:4", "takes no argument"),
])
def test_make_policy_errors_are_clear(spec, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        make_policy(spec)


def test_make_policy_rejects_unknown_options():
    with pytest.raises(ValueError, match="unknown policy option"):
        make_policy("static:4", oracle_tabel={})


def test_every_registered_policy_returns_one_k_per_request_within_caps():
    table = {("chat", 3): {0: 1.0, 2: 3.0}}
    roof = LinearRoofline(ridge=8.6, flops_per_token=2.7e8, bytes_per_step=5.0e8)
    s = state([req(0, max_k=1), req(1), req(2, max_k=0)], latency=FLAT, roofline=roof)
    specs = {"static": "static:3"}
    options = {"oracle": {"oracle_table": table}}
    for name in POLICIES:
        ks = make_policy(specs.get(name, name), **options.get(name, {})).choose(s)
        assert len(ks) == 3 and all(0 <= k <= r.max_k for k, r in zip(ks, s.requests)), name
