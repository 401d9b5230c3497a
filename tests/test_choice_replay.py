"""The goodput planner's B = 1 choices on real outputs, without noise: the default model's greedy
outputs for 8 evaluation prompts a workload (recorded by scripts/choice_replay.py on the Q4_1 and
fp32 engines), replayed step by step through each decider and priced by the profile measured
with them (specplan/bench/choice_replay.py). No engine runs here: the replay reads JSON.

What the floor guards: the planner's decisions (priors, acceptance learning, pricing, the
allocation, exploration), not its speed. Measured 2026-11-29 (reports/choice-replay): cold
0.990-1.045x the best single static k, from saved beliefs 1.005-1.047x."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specplan.bench.choice_replay import ADAPTIVE, WARM, ReplayPricing, StepNoise, replay_workload, serve
from specplan.engine.decider import FixedDecider
from specplan.profiler.profile import Profile

REPORTS = Path(__file__).resolve().parent.parent / "reports"
RECORDED = {
    "q4_1": (REPORTS / "choice-replay" / "outputs-q4_1.json", REPORTS / "profile-xeon-q4_1-s23" / "profile.json"),
    "fp32": (REPORTS / "choice-replay" / "outputs-fp32.json", REPORTS / "choice-replay" / "profile-fp32.json"),
}


@pytest.fixture(scope="module", params=sorted(RECORDED))
def replayed(request) -> dict:
    outputs, profile = RECORDED[request.param]
    recorded = json.loads(outputs.read_text())
    profile = Profile.load(profile)
    return {w: replay_workload(profile, sets["test"], sets["train"]) for w, sets in recorded.items()}


def test_planner_choices_hold_against_the_best_static_k(replayed):
    # Cold, each workload: at least 0.98x the best single static k (issue #32 asks 0.95x of a
    # cold planner on the machine, where its own time and the noise come on top); from saved
    # beliefs at least 0.99x (#32: 0.98x). Both far above SD off: the choices speculate.
    for workload, cell in replayed.items():
        ratio = cell["over_best_single"]
        assert ratio[ADAPTIVE] >= 0.98, (workload, ratio)
        assert ratio[WARM] >= 0.99, (workload, ratio)
        assert ratio[ADAPTIVE] >= 1.05 * ratio["static:0"], (workload, ratio)


def test_no_request_is_left_far_behind(replayed):
    # One request whose first few drafts were all rejected may lose a little; none loses much.
    for workload, cell in replayed.items():
        for arm in (ADAPTIVE, WARM):
            assert min(cell["per_request_over_best_single"][arm]) >= 0.9, (workload, arm)


def test_serve_emits_the_recorded_output_and_prices_its_steps():
    # A request whose output repeats its prompt: static k = 4 finds and keeps the drafts, emits
    # the same tokens in fewer, priced steps than SD off.
    class Flat:
        def predict(self, shape):  # 10 ms a step plus 1 ms a query token
            return 0.010 + 0.001 * shape.num_tokens

    prompt = [5, 6, 7, 8, 9, 10, 11, 12]
    output = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    pricing = ReplayPricing(Flat(), overhead_s=0.0)
    off_tokens, off_s = serve(FixedDecider(0), prompt, output, pricing, 0)
    k4_tokens, k4_s = serve(FixedDecider(4), prompt, output, pricing, 0)
    assert off_tokens == k4_tokens == len(output)
    # SD off: the prefill (8 tokens, 18 ms) and 8 decode steps of 11 ms.
    assert off_s == pytest.approx(0.018 + 8 * 0.011)
    assert k4_s < 0.6 * off_s
    # A machine charging drafts twice what the model says: each draft 2 ms instead of 1, a step
    # without drafts as before. Static k = 4 here runs 6 drafts: 4, then the 2 that the rest of
    # the output leaves room for.
    dear = ReplayPricing(Flat(), overhead_s=0.0, draft_price=2.0)
    assert dear.step_seconds(100, 0) == pricing.step_seconds(100, 0) == pytest.approx(0.011)
    assert dear.step_seconds(100, 4) == pytest.approx(0.011 + 2 * 0.004)
    assert serve(FixedDecider(0), prompt, output, dear, 0) == (off_tokens, off_s)
    assert serve(FixedDecider(4), prompt, output, dear, 0)[1] == pytest.approx(k4_s + 6 * 0.001)


def test_step_noise_is_the_same_for_every_decider_of_a_run():
    # The level follows the priced clock and the jitter the step index, both from the run's seed:
    # a decider served twice in one run meets the same machine; another run meets another; a
    # noise of zero is no noise.
    class Flat:
        def predict(self, shape):
            return 0.010 + 0.001 * shape.num_tokens

    prompt, output = [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13]
    quiet = serve(FixedDecider(2), prompt, output, ReplayPricing(Flat(), overhead_s=0.0), 0)
    silent = StepNoise(jitter=0.0, level=0.0, seed=3)
    assert serve(FixedDecider(2), prompt, output, ReplayPricing(Flat(), 0.0), 0, silent.machine(0)) == quiet
    noise = StepNoise(jitter=0.05, level=0.05, level_every_s=0.02, seed=1)
    first = serve(FixedDecider(2), prompt, output, ReplayPricing(Flat(), 0.0), 0, noise.machine(0))
    again = serve(FixedDecider(2), prompt, output, ReplayPricing(Flat(), 0.0), 0, noise.machine(0))
    other = serve(FixedDecider(2), prompt, output, ReplayPricing(Flat(), 0.0), 0,
                  StepNoise(jitter=0.05, level=0.05, level_every_s=0.02, seed=2).machine(0))
    assert first == again and first[0] == other[0] == quiet[0] == len(output)
    assert first[1] != quiet[1] and other[1] != first[1]
    assert 0.7 * quiet[1] < first[1] < 1.4 * quiet[1]


def test_rest_noise_reaches_the_time_the_decider_is_told_and_only_that():
    # The time outside forward + verify: with its noise at zero the replay is the one it always
    # was (the other draws untouched); with it on, each step's record tells the decider a rest of
    # overhead x a level drawn per request x a jitter per step, and the step is charged that.
    class Flat:
        def predict(self, shape):
            return 0.010 + 0.001 * shape.num_tokens

    class Recording(FixedDecider):
        def __init__(self):
            super().__init__(2)
            self.rests = []

        def observe(self, record):
            self.rests.append(record.total_s - record.forward_s - record.verify_s)

    prompt, output = [5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 9, 10, 11, 12, 13] * 3
    pricing = ReplayPricing(Flat(), overhead_s=0.001)
    noise = StepNoise(jitter=0.05, level=0.05, seed=4)
    plain = serve(FixedDecider(2), prompt, output, pricing, 0, noise.machine(0))
    assert serve(FixedDecider(2), prompt, output, pricing, 0,
                 StepNoise(jitter=0.05, level=0.05, seed=4, rest_level=0.0, rest_jitter=0.0).machine(0)) == plain
    told = Recording()
    rest_noise = StepNoise(jitter=0.05, level=0.05, seed=4, rest_level=0.1, rest_jitter=0.3)
    noisy = serve(told, prompt, output, pricing, 0, rest_noise.machine(0))
    rests = told.rests
    assert len(set(round(r, 9) for r in rests)) == len(rests) > 3  # a jitter per step
    assert all(0.2e-3 < r < 5e-3 for r in rests)
    assert noisy[1] - plain[1] == pytest.approx(sum(rests) - 0.001 * len(rests), rel=1e-6)  # charged what it was told
