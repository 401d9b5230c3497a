"""A steadier cold start: a prior that a few drafts move, exploration priced by how memory-bound
the step is, step-time feedback that one noisy step does not swing, and mixed batches where each
request gets its own k."""

from __future__ import annotations

import dataclasses
import itertools
import math
import random

import pytest

from specplan.engine.decider import RequestRecord, RequestView, StepRecord, StepView
from specplan.planner import Planner, PolicyState, RequestState, StepPricing
from specplan.planner.acceptance import AcceptanceConfig, AcceptanceEstimate, PooledAcceptance, RequestAcceptance, default_prior
from specplan.planner.drift import DraftPrice, DraftSlope, DraftSlopeConfig
from specplan.planner.goodput import DraftCost, step_goodput
from specplan.planner.timing import StepTimingLearner, TimingConfig
from specplan.policies import GoodputPolicy, make_policy
from specplan.policies.goodput import allocate
from specplan.profiler.latency_model import StepShape
from specplan.profiler.roofline import LinearRoofline

from conftest import RidgeLatency


# ------------------------------------------------------------------ priors that are distributions

def accepted_run(config: AcceptanceConfig, steps: int, pool_evidence: int = 0) -> float:
    """alpha_first of a request whose first ``steps`` drafts (after a 1-token match: prior 0.2)
    were all accepted, in a pool that had seen ``pool_evidence`` request-steps at the prior."""
    pool = PooledAcceptance(default_prior("ngram").for_match(1), config)
    for i in range(pool_evidence):  # other requests behaving as the prior says
        pool.observe(1, 1, 0, 8, (0.2, 0.2))
    pool.refresh()
    request = RequestAcceptance(pool)
    for _ in range(steps):
        request.observe(1, 1, 1, 8)
        pool.refresh()
    return request.estimate().alpha_first


def test_a_few_accepted_drafts_move_a_cold_prior_quickly():
    """The built-in prior is a wide distribution while nobody has checked it on this traffic: a
    request's first few accepted drafts move it most of the way; once its pool has seen many
    request-steps agreeing with the prior, the same drafts move it less."""
    config = AcceptanceConfig()
    assert accepted_run(config, 0) == pytest.approx(0.2)
    assert accepted_run(config, 1) > 0.45 and accepted_run(config, 2) > 0.55 and accepted_run(config, 4) > 0.65
    # A warm pool's prior weighs 6 outcomes: (6 * 0.2 + 4) / 10 = 0.52.
    assert accepted_run(config, 4, pool_evidence=40) == pytest.approx(0.52, abs=0.01)
    # At the warm strength from the start (the behaviour before), two drafts get to 0.46.
    assert accepted_run(dataclasses.replace(config, cold_prior_strength=6.0), 2) < 0.5
    with pytest.raises(ValueError, match="strengths"):
        AcceptanceConfig(cold_prior_strength=0)


# ------------------------------------------------------------------ exploration vs the roofline

FLOPS_PER_TOKEN = 2.7e8  # ~ SmolLM2-135M, matmuls and LM head


def roofline(ridge: float) -> LinearRoofline:
    # 0.54 GB of weights read once per step: intensity ~ 0.5 FLOP/B per query token.
    return LinearRoofline(ridge=ridge, flops_per_token=FLOPS_PER_TOKEN, bytes_per_step=5.4e8)


def probe_state(n: int, ridge: float | None) -> PolicyState:
    """n requests whose drafts the learned slope prices out of reach (so the choice is off), while
    the optimistic exploration slope would let them draft."""
    reqs = tuple(RequestState(i, f"r{i}", 8, 300, AcceptanceEstimate(0.7, (1.0,) * 8, 0.2), None, 0)
                 for i in range(n))
    latency = RidgeLatency(a=0.03 * n, b=0.0075, ridge_tokens=n)  # a draft: +25% of B = 1's step
    pricing = StepPricing(latency=latency, draft_slope=1.0, explore_slope=0.2)
    return PolicyState(requests=reqs, base=StepShape(n, n, 300 * n), max_k=8, proposer="ngram", workload="w",
                       pricing=pricing, roofline=roofline(ridge) if ridge is not None else None)


def test_exploration_is_cheap_when_memory_bound_and_nil_when_compute_bound():
    policy = GoodputPolicy()
    memory_bound = probe_state(1, ridge=10.0)  # intensity 0.5 of a ridge at 10
    assert policy.explore_share(memory_bound) == 1.0
    probe = policy.plan(memory_bound)
    assert probe.total_drafts >= 1 and probe.goodput >= (1 - policy.explore_budget) * probe.off_goodput
    compute_bound = probe_state(8, ridge=2.0)  # intensity 4: past the ridge
    assert policy.explore_share(compute_bound) == 0.0
    assert policy.plan(compute_bound).total_drafts == 0
    assert policy.plan(dataclasses.replace(compute_bound, roofline=None)).total_drafts >= 1  # what it did before
    near = probe_state(1, ridge=0.7)  # intensity 0.5 of 0.7: 71% of the ridge, the budget tapers
    assert 0.0 < policy.explore_share(near) < 1.0
    with pytest.raises(ValueError, match="explore_full_below"):
        GoodputPolicy(explore_full_below=1.0)


def thin_state(pool_evidence: float, ridge: float = 10.0) -> PolicyState:
    """One request whose lookup found 8 drafts after a 1-token match, its first draft believed
    accepted 0.1 of the time (the 0.2 prior after two rejections), on a step where a draft costs 10%
    of it: at 0.1 no draft pays (1.1 tokens for 1.1 steps), at 0.25 one does."""
    request = RequestState(0, "r0", 8, 300, AcceptanceEstimate(0.65, (1.0,) * 8, 0.1), None, 2,
                           pool_evidence=pool_evidence, looked_up=True)
    latency = RidgeLatency(a=0.008, b=0.0008, ridge_tokens=1)
    return PolicyState(requests=(request,), base=StepShape(1, 1, 300), max_k=8, proposer="ngram", workload="w",
                       pricing=StepPricing(latency=latency), roofline=roofline(ridge))


def test_a_thin_belief_is_tried_where_exploring_is_cheap():
    """A belief two outcomes have pulled to 0.1 would never be drafted again, so it could never
    learn that it is accepted 0.3 of the time. Where a draft is cheap (memory-bound) the policy
    values such a first draft a standard deviation above its mean and probes, within the
    exploration budget; with evidence behind the belief, or past the ridge, it does not."""
    policy = GoodputPolicy()
    thin = thin_state(pool_evidence=2.0)
    assert policy._allocate(thin, thin.cost_model()).total_drafts == 0  # off at the belief's mean
    assert policy.optimistic_estimates(thin)[0].alpha_first == pytest.approx(0.1 + (0.09 / 4) ** 0.5)
    probe = policy.plan(thin)
    assert probe.total_drafts >= 1 and probe.goodput >= (1 - policy.explore_budget) * probe.off_goodput
    assert policy.plan(thin_state(pool_evidence=400.0)).total_drafts == 0  # a well-checked 0.1 stays off
    assert GoodputPolicy(explore_optimism=0.0).plan(thin).total_drafts == 0
    assert policy.plan(thin_state(pool_evidence=2.0, ridge=0.1)).total_drafts == 0  # compute-bound: no probe
    with pytest.raises(ValueError, match="explore_optimism"):
        GoodputPolicy(explore_optimism=-1.0)


def planner_on_a_short_match(policy: GoodputPolicy, steps: int) -> list[int]:
    """A B = 1 request whose every lookup matches 1 token, on a machine charging what the model
    says (a draft 10% of a step); its first drafts are accepted 0.35 of the time, but the first two
    drafted steps are rejected, as a cold GSM8K request's were (reports/README.md). k per step."""
    latency = RidgeLatency(a=0.008, b=0.0008, ridge_tokens=1)
    planner = Planner(policy, latency)
    rng = random.Random(4)
    view = StepView((RequestView(0, "r0", 300, 10, 8, True, 8, 1),), 0, 0, 300, "ngram")
    chosen, drafted = [], 0
    for _ in range(steps):
        k = planner.decide(view)[0]
        accepted = 0
        if k:
            drafted += 1
            while drafted > 2 and accepted < k and rng.random() < (0.35 if accepted == 0 else 0.65):
                accepted += 1
        forward = latency.predict(StepShape(1, 1 + k, 300 + k))
        planner.observe(StepRecord((RequestRecord(0, "r0", k, k, accepted, accepted + 1, natural_k=8, match_length=1),),
                                   1, 1 + k, 0, 300 + k, 0.0, forward, 0.0, forward))
        chosen.append(k)
    return chosen


def test_the_planner_learns_a_short_match_pays_after_an_unlucky_start():
    stuck = planner_on_a_short_match(GoodputPolicy(explore_optimism=0.0), 120)
    assert sum(k > 0 for k in stuck) <= 3 and not any(stuck[-100:])  # two rejections and it stays off
    learner = planner_on_a_short_match(GoodputPolicy(), 120)
    assert sum(k > 0 for k in learner[-60:]) >= 45  # tried again, learned, drafting


# ------------------------------------------------------------------ robust step-time feedback

def fitted_slope(config: DraftSlopeConfig, seed: int) -> float:
    """B = 1 steps on a machine whose drafts cost exactly what the model says (slope 1), with a
    3x step (a GC pause, another process's burst) every 7th step."""
    slope = DraftSlope(config)
    rng = random.Random(seed)
    for step in range(200):
        spike = 3.0 if step % 7 == 3 else 1.0
        noise = rng.uniform(0.98, 1.02)
        if step % 4 == 0:
            slope.observe_plain(1, 0.02, 0.02 * noise * spike)
        else:
            drafts = rng.randint(1, 6)
            slope.observe_drafts(1, 0.02, 0.001 * drafts, (0.02 + 0.001 * drafts) * noise * spike)
    return slope.slope(1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_one_noisy_step_does_not_swing_the_draft_price(seed):
    # The outlier filter alone: the fit as it is, not shrunk toward the profile (which would
    # hide what the filter does here, the machine's price being the profile's).
    filtered = fitted_slope(DraftSlopeConfig(significance=0.0, dearer_significance=0.0), seed)
    raw = fitted_slope(DraftSlopeConfig(outlier_width=100.0, significance=0.0, dearer_significance=0.0), seed)  # no clipping
    assert filtered == pytest.approx(1.0, abs=0.25)
    assert abs(raw - 1.0) > 2 * abs(filtered - 1.0)


def price_path(config: DraftSlopeConfig, draft_price: float, seed: int, steps: int = 150) -> list[DraftPrice]:
    """The learned price after each of ``steps`` B = 1 steps on a machine whose steps vary by ~3%
    (log-normal) from one to the next, and whose drafts (1-4 a step, each +5% of a step in the
    model) cost ``draft_price`` x what the model says; a plain step every 8th."""
    slope = DraftSlope(config)
    rng = random.Random(seed)
    path = []
    for step in range(steps):
        noise = math.exp(rng.gauss(0.0, 0.03))
        if step % 8 == 0:
            slope.observe_plain(1, 0.01, 0.01 * noise)
        else:
            increment = 0.0005 * rng.randint(1, 4)
            slope.observe_drafts(1, 0.01, increment, (0.01 + draft_price * increment) * noise)
        path.append(slope.price(1))
    return path


def slope_path(config: DraftSlopeConfig, draft_price: float, seed: int, steps: int = 150) -> list[float]:
    """``price_path``'s slopes."""
    return [p.slope for p in price_path(config, draft_price, seed, steps)]


def typical_price_path(config: DraftSlopeConfig, draft_price: float, seed: int) -> list[float]:
    """``price_path`` as what a typical step's drafts (2.5 of them: +12.5% in the model) cost over
    what the model says: the slope and the jump together."""
    return [p.slope + p.jump / 0.125 for p in price_path(config, draft_price, seed)]


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_step_noise_alone_does_not_move_the_draft_price(seed):
    """At B = 1 a draft adds ~5% to a step that varies by ~3% from one step to the next: the raw fit
    of the drafts' price wanders by 0.1-0.2 with the noise (and the choices with it: the run-to-run
    spread of reports/choice-replay); shrunk by two standard errors (one where drafts look dearer:
    ``dearer_significance``), it stays within a few hundredths of the profile's below it and within
    a tenth above."""
    shrunk = typical_price_path(DraftSlopeConfig(), 1.0, seed)
    raw = typical_price_path(DraftSlopeConfig(significance=0.0, dearer_significance=0.0), 1.0, seed)
    assert min(shrunk[30:]) >= 0.94 and max(shrunk[30:]) <= 1.1
    assert max(abs(s - 1.0) for s in raw[30:]) >= 0.1


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_drafts_clearly_dearer_than_the_profile_are_still_learned(seed):
    """The same machine charging drafts twice what the model says: well outside the noise, so the
    shrunk price follows the fit, two standard errors short of it."""
    shrunk = slope_path(DraftSlopeConfig(), 2.0, seed)
    raw = slope_path(DraftSlopeConfig(significance=0.0, dearer_significance=0.0), 2.0, seed)
    assert min(shrunk[-50:]) >= 1.6 and raw[-1] == pytest.approx(2.0, abs=0.15)
    assert all(1.0 <= s <= r + 1e-9 for s, r in zip(shrunk[-50:], raw[-50:]))  # toward the profile, never past the fit


def test_a_price_above_the_profile_is_believed_sooner_than_one_below():
    """Drafts dearer than the profile says are shrunk by fewer standard errors than cheaper ones
    (``dearer_significance``): erring dear drafts a little less than the best choice, erring cheap
    drafts where drafts lose, slower than SD off. A machine charging 1.6x is priced at 1.3 sooner
    than with the one threshold for both (never later, on average ~8 steps sooner over 8 machines);
    one charging 0.5x is priced as with the one threshold."""
    symmetric = DraftSlopeConfig(dearer_significance=DraftSlopeConfig().significance)

    def first_at(path: list[float], level: float) -> int:
        return next((i for i, s in enumerate(path) if s >= level), len(path))

    sooner = [first_at(slope_path(symmetric, 1.6, seed), 1.3) - first_at(slope_path(DraftSlopeConfig(), 1.6, seed), 1.3)
              for seed in range(8)]
    assert min(sooner) >= 0 and sum(sooner) >= 8 * 4
    for seed in range(4):
        assert price_path(DraftSlopeConfig(), 0.5, seed)[-50:] == price_path(symmetric, 0.5, seed)[-50:]


def test_the_shrinkage_weighs_slope_and_jump_together():
    """When every step carries the same number of drafts, a slope and a jump explain them alike:
    each alone has a wide standard error, the price they make together a narrow one. The shrinkage
    measures the deviation jointly, so such a price is learned (shrunk one by one, both would sit
    at the profile's: +25% for drafts that cost +5%)."""
    slope = DraftSlope()
    rng = random.Random(3)
    slope.observe_plain(4, 0.02, 0.04)
    for _ in range(60):
        slope.observe_plain(4, predicted_s=0.02, measured_s=0.04 * rng.uniform(0.98, 1.02))
        slope.observe_drafts(4, base_s=0.02, increment_s=0.005, measured_s=0.042 * rng.uniform(0.98, 1.02))
    price = slope.price(4)
    assert price.slope * 0.25 + price.jump == pytest.approx(0.05, abs=0.02)


def test_a_lasting_change_of_level_passes_the_filter():
    """A machine that turns 2x slower for good is followed almost as fast as without the filter
    (which clips lone spikes only): three steps in, the new level is the median, and from then on
    the fit lags the unfiltered one by a step or two."""

    def level_after(config: DraftSlopeConfig, steps: int) -> float:
        slope = DraftSlope(config)
        for step in range(60 + steps):
            level = 2.0 if step >= 60 else 1.0
            if step % 3 == 0:
                slope.observe_plain(1, 0.02, 0.02 * level)
            else:
                slope.observe_drafts(1, 0.02, 0.002, 0.022 * level)
        r, _, _ = slope._solve(slope._buckets[1])
        return r

    raw = DraftSlopeConfig(outlier_width=100.0)
    for steps in (10, 30, 60):
        assert level_after(DraftSlopeConfig(), steps) == pytest.approx(level_after(raw, steps), rel=0.05)
    assert level_after(DraftSlopeConfig(), 60) > 1.6  # moving to 2 at the fit's memory (~50 steps)


def overhead_with_pauses(config: TimingConfig) -> float:
    """An engine whose steps spend 1 ms outside forward + verify, plus a 50 ms pause every 7th."""
    learner = StepTimingLearner(DraftCost(), config, fit_per_pass=False)
    for step in range(200):
        learner.observe(0.001 + (0.05 if step % 7 == 3 else 0.0), 4, 4)
    return learner.overhead_s


def test_a_pause_now_and_then_does_not_swing_the_overhead():
    assert overhead_with_pauses(TimingConfig()) == pytest.approx(0.001, abs=3e-4)
    assert overhead_with_pauses(TimingConfig(outlier_width=1e9)) > 0.005  # unfiltered: 7x what it is


def test_the_step_after_the_prompts_does_not_teach_what_drafts_cost():
    """What the vLLM plugin met at B = 16: the call after 16 prompts ran indexed them all (21 ms)
    and gave one request 2 drafts; that call's time is charged to the next step. Learned from, it
    priced each draft at ~8.5 ms of a 156 ms step, and steps without drafts never taught it back.
    The planner learns the time outside forward + verify from neither a step that ran a prompt nor
    the one after it."""
    n = 16
    plain = tuple(RequestRecord(i, f"r{i}", 0, 0, 0, 1) for i in range(n))
    first = (RequestRecord(0, "r0", 2, 2, 1, 2),) + plain[1:]
    rests = [0.0033, 0.021] + [0.002] * 30
    records = [StepRecord((), n, 1373, 1373, 1373, 0.0, 2.6, 0.0, 2.6 + rests[0]),
               StepRecord(first, n, n + 2, 0, 1618, 0.0, 0.25, 0.0, 0.25 + rests[1])]
    records += [StepRecord(plain, n, n, 0, 1616, 0.0, 0.156, 0.0, 0.156 + r) for r in rests[2:]]
    planner = Planner(make_policy("goodput"), RidgeLatency(a=0.15, b=0.002, ridge_tokens=n), proposer="ngram")
    for record in records:
        planner.observe(record)
    assert planner.draft_cost.per_token_s < 1e-4
    assert planner.overhead_s == pytest.approx(0.002, abs=3e-4)
    # Fed every step, as before: the first call's work read as the drafts' cost.
    learner = StepTimingLearner(DraftCost(), fit_per_pass=False)
    for record, rest in zip(records, rests):
        drafts = sum(r.num_proposed for r in record.requests)
        learner.observe(rest, drafts, drafts)
    assert learner.draft_cost.per_token_s > 5e-3


# ------------------------------------------------------------------ mixed batches

def test_a_mixed_batch_gives_each_population_its_own_k():
    """Eight requests of a workload whose drafts are accepted 90% of the time and eight of one at
    10%, in one B = 16 step: the allocation drafts for the first and not the second, and beats
    every k that is the same for all (the cost of the step's extra tokens is the whole batch's, so
    each draft has to earn its share of it)."""
    latency = RidgeLatency(a=0.05, b=0.001, ridge_tokens=16)  # every draft: +2% of the step
    code = [AcceptanceEstimate(0.9, (1.0,) * 8, 0.85)] * 8
    chat = [AcceptanceEstimate(0.1, (1.0,) * 8, 0.1)] * 8
    estimates = [e for pair in zip(code, chat) for e in pair]  # interleaved in the batch
    reqs = tuple(RequestState(i, f"r{i}", 8, 300, e, None, 3) for i, e in enumerate(estimates))
    state = PolicyState(requests=reqs, base=StepShape(16, 16, 4800), max_k=8, proposer="ngram", workload="mixed",
                        pricing=StepPricing(latency=latency))
    plan = GoodputPolicy().plan(state)
    ks_code, ks_chat = plan.ks[0::2], plan.ks[1::2]
    assert min(ks_code) >= 3 and max(ks_chat) == 0
    cost = state.cost_model()
    uniform = max(step_goodput(estimates, [k] * 16, cost) for k in range(9))
    assert plan.goodput > 1.05 * uniform
    # The same allocation without the cheap population: fewer drafts in all, each one dearer.
    alone = allocate(chat, [8] * 8, cost)
    assert alone.total_drafts == 0


def test_planner_in_a_mixed_batch_learns_each_workload_and_drafts_for_the_one_that_pays():
    latency = RidgeLatency(a=0.05, b=0.001, ridge_tokens=16)
    planner = Planner(make_policy("goodput"), latency, workload=lambda rid: rid.split("-")[0])
    rng = random.Random(3)
    ids = [f"{w}-{i}" for i, w in zip(range(16), itertools.cycle(("code", "chat")))]
    truth = {"code": 0.9, "chat": 0.1}
    view = StepView(tuple(RequestView(i, rid, 300, 10, 8, True, 8, 4) for i, rid in enumerate(ids)),
                    0, 0, 4800, "ngram")
    chosen = []
    for step in range(80):
        ks = planner.decide(view)
        reqs = []
        for i, (rid, k) in enumerate(zip(ids, ks)):
            acc = 0
            while acc < k and rng.random() < truth[rid.split("-")[0]]:
                acc += 1
            reqs.append(RequestRecord(i, rid, k, k, acc, acc + 1, natural_k=8, match_length=4))
        forward = latency.predict(StepShape(16, 16 + sum(ks), 4800 + sum(ks)))
        planner.observe(StepRecord(tuple(reqs), 16, 16 + sum(ks), 0, 4800 + sum(ks), 0.0, forward, 0.0, forward))
        chosen.append(ks)
    late = chosen[-20:]
    code_k = [k for ks in late for k in ks[0::2]]
    chat_k = [k for ks in late for k in ks[1::2]]
    assert sum(code_k) / len(code_k) >= 2.5
    assert sum(chat_k) / len(chat_k) <= 0.3
