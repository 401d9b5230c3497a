"""The planner stops planning while planning does not pay for itself (planner/pause.py)."""

from __future__ import annotations

import random

import pytest

from specplan.engine import RequestRecord, RequestView, StepOutline, StepRecord, StepView
from specplan.planner import Planner, PlannerConfig
from specplan.planner.pause import PauseConfig, PlanningPause
from specplan.policies import make_policy

from conftest import RidgeLatency

FLAT = RidgeLatency(a=0.03, c=1e-9)  # a 30 ms memory-bound step: drafts save a lot


class Ticks:
    """A clock that moves ``tick`` seconds each time it is read: every timed piece of the planner's
    work then costs the same, whatever this machine's speed."""

    def __init__(self, tick: float):
        self.tick, self.now = tick, 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def view(n: int, max_k: int = 4) -> StepView:
    return StepView(tuple(RequestView(i, f"r{i}", 500, 10, max_k, True) for i in range(n)),
                    num_prefill_tokens=0, num_prefill_seqs=0, context_tokens=500 * n, proposer="ngram")


def outline(n: int, max_k: int = 4) -> StepOutline:
    return StepOutline(n, 500 * n, 0, 0, 500 * n, max_k, None)


def record(ks, alpha: float, rng: random.Random, seconds: float = 0.03) -> StepRecord:
    reqs = []
    for i, k in enumerate(ks):
        acc = 0
        while acc < k and rng.random() < alpha:
            acc += 1
        reqs.append(RequestRecord(i, f"r{i}", k, k, acc, acc + 1, natural_k=k))
    n = len(ks)
    return StepRecord(tuple(reqs), n, n + sum(ks), 0, 500 * n + sum(ks), 0.0, seconds, 0.0, seconds)


def run(planner: Planner, steps: int, n: int = 8, alpha: float = 0.8, seed: int = 0) -> list[bool]:
    """Screen, decide and observe ``steps`` steps as the engine does; per step whether it was screened in."""
    rng, screened = random.Random(seed), []
    for _ in range(steps):
        ok = planner.may_speculate(outline(n))
        ks = planner.decide(view(n)) if ok else [0] * n
        screened.append(ok)
        planner.observe(record(ks, alpha, rng))
    return screened


def test_the_rule_pauses_after_a_window_that_did_not_pay_and_doubles_the_pause():
    pause = PlanningPause(PauseConfig(window=4, first_pause=2, max_pause=8))
    step = 0

    def plan(saved: float, spent: float = 1.0) -> None:
        nonlocal step
        step += 1
        assert not pause.paused(step, 8)
        pause.planned(step, 8, spent, saved)

    def paused_for() -> int:
        nonlocal step
        count = 0
        while pause.paused(step + 1, 8):
            step += 1
            count += 1
        return count

    for _ in range(4):
        plan(saved=2.0)  # paid: no pause
    assert paused_for() == 0
    for _ in range(4):
        plan(saved=0.5)  # 2 saved against 4 spent
    assert paused_for() == 2
    for _ in range(4):
        plan(saved=0.0)
    assert paused_for() == 4
    for _ in range(4):
        plan(saved=0.0)
    assert paused_for() == 8
    for _ in range(4):
        plan(saved=0.0)
    assert paused_for() == 8  # max_pause
    for _ in range(4):
        plan(saved=5.0)  # paid again: the next pause starts short
    assert paused_for() == 0
    for _ in range(4):
        plan(saved=0.0)
    assert paused_for() == 2
    assert pause.pauses == 5 and pause.paused_steps == 24


def test_a_pause_ends_when_the_batch_size_moves_to_another_bucket():
    pause = PlanningPause(PauseConfig(window=1, first_pause=10))
    pause.planned(1, 16, 1.0, 0.0)
    assert pause.paused(2, 16) and pause.paused(3, 31)  # 16-31: one bucket
    assert not pause.paused(4, 15)  # 8-15: another one; the pause is over
    assert not pause.paused(5, 16)
    pause.planned(6, 16, 1.0, 0.0)  # window 1: the next pause
    # A step that runs a prompt beside 15 decodes (a request replacing a finished one) does not end it.
    assert pause.paused(7, 15, prefill=True) and pause.paused(8, 16)


def test_small_steps_never_pause():
    """Below ``min_decodes`` a window never fills, and a small step breaks a window of large ones."""
    pause = PlanningPause(PauseConfig(window=2, first_pause=4, min_decodes=8))
    for step in range(1, 20):
        pause.planned(step, 4, 1.0, 0.0)
        assert not pause.paused(step + 1, 4)
    pause.planned(20, 8, 1.0, 0.0)
    pause.planned(21, 4, 1.0, 0.0)
    pause.planned(22, 8, 1.0, 0.0)
    assert not pause.paused(23, 8)
    pause.planned(23, 8, 1.0, 0.0)
    assert pause.paused(24, 8)


def test_planning_that_costs_more_than_it_saves_pauses_and_answers_zeros():
    """Drafts save several ms a step here; planning timed at 1 s a step does not pay for it: after the
    first window the screen says no and decide answers 0 (no lookup, no decision), for
    ``first_pause`` steps, then the planner plans a window again and pauses twice as long."""
    config = PlannerConfig(pause=PauseConfig(window=8, first_pause=4))
    planner = Planner(make_policy("goodput"), FLAT, proposer="ngram", config=config)
    planner.pause.clock = Ticks(0.5)  # two readings a step: 1 s
    screened = run(planner, 8 + 4 + 8 + 8 + 2)
    assert screened == [True] * 8 + [False] * 4 + [True] * 8 + [False] * 8 + [True] * 2
    assert planner.pause.paused_steps == 12 and planner.pause.pauses == 2
    assert planner.decide(view(8)) != [0] * 8  # planning again: the drafts it chooses pay
    # A paused planner's decide answers zeros without a decision, for an engine that does not screen.
    planner = Planner(make_policy("goodput"), FLAT, proposer="ngram", config=config)
    planner.pause.clock = Ticks(0.5)
    rng = random.Random(1)
    answers = []
    for _ in range(12):
        ks = planner.decide(view(8))
        answers.append(any(ks))
        planner.observe(record(ks, 0.8, rng))
    assert answers[8:] == [False] * 4 and planner.pause.paused_steps == 4
    assert planner.num_decisions == 96 and planner.last_state is None


def test_planning_that_pays_never_pauses():
    """The same steps with planning timed at 10 us: the drafts save far more, nothing pauses, and
    the decisions are those of a planner without the pause."""
    timed = Planner(make_policy("goodput"), FLAT, proposer="ngram")
    timed.pause.clock = Ticks(5e-6)
    plain = Planner(make_policy("goodput"), FLAT, proposer="ngram", config=PlannerConfig(pause=None))
    assert plain.pause is None
    rng_a, rng_b = random.Random(2), random.Random(2)
    for _ in range(80):
        assert timed.may_speculate(outline(8)) and plain.may_speculate(outline(8))
        ks = timed.decide(view(8))
        assert ks == plain.decide(view(8))
        timed.observe(record(ks, 0.8, rng_a))
        plain.observe(record(ks, 0.8, rng_b))
    assert timed.pause.paused_steps == 0 and timed.num_zero_decisions < timed.num_decisions


@pytest.mark.parametrize("spec", ["static:3", "heuristic", "batch_table"])
def test_only_a_policy_that_weighs_its_choices_in_seconds_pauses(spec):
    """A static k is what the user asked for; rules that do not price steps cannot weigh planning."""
    assert Planner(make_policy(spec), FLAT, proposer="ngram").pause is None
    assert Planner(make_policy("goodput"), FLAT, proposer="ngram").pause is not None


def test_pause_config_is_checked():
    with pytest.raises(ValueError):
        PauseConfig(window=0)
    with pytest.raises(ValueError):
        PauseConfig(first_pause=8, max_pause=4)


# ---------------------------------------------------------------- the measured rule (B = 2-7)

def measured_pause(**kw) -> PlanningPause:
    return PlanningPause(PauseConfig(**{"window": 4, "first_pause": 3, "max_pause": 6, "reference_steps": 2,
                                        "reference_ttl": 12, "settle_steps": 2, **kw}))


class Steps:
    """Drives a pause as the planner does at B = 4: each step either paused (SD off: 4 tokens in
    ``off_s``) or planned (``tokens`` in ``seconds``)."""

    def __init__(self, pause: PlanningPause, off_s: float = 0.010):
        self.pause, self.off_s, self.step = pause, off_s, 0
        self.log = []  # "p" planned, "-" paused

    def run(self, steps: int, tokens: int, seconds: float, n: int = 4) -> str:
        out = ""
        for _ in range(steps):
            self.step += 1
            paused = self.pause.paused(self.step, n)
            if paused:
                self.pause.timed(self.step, n, n, self.off_s, paused=True, prefill=False)
            else:
                self.pause.timed(self.step, n, tokens, seconds, paused=False, prefill=False)
            out += "-" if paused else "p"
        return out


def test_the_measured_rule_times_sd_off_then_pauses_where_planning_emits_less_per_second():
    pause = measured_pause()
    s = Steps(pause)
    # The first window has nothing to compare with: a short pause times SD off (a reference).
    assert s.run(6, tokens=4, seconds=0.011) == "pppp--"
    assert pause.references == 1 and pause.pauses == 0
    # Planning at 4.2 tokens in 10.4 ms (0.404 tokens/ms) against SD off's 0.4: it paid.
    assert s.run(8, tokens=42, seconds=0.104) == "pppppppp"
    assert pause.pauses == 0
    # 4 tokens in 10.4 ms: less per second than SD off; pauses of 3, then 6 (max), 6.
    assert s.run(4 + 3 + 4 + 6 + 4 + 6, tokens=4, seconds=0.0104) == "pppp---pppp------pppp------"
    assert pause.pauses == 3 and pause.paused_steps == 2 + 15
    # Paying again resets the pause length.
    assert s.run(4, tokens=5, seconds=0.0104) == "pppp"
    assert s.run(7, tokens=4, seconds=0.0104) == "pppp---"


def test_the_measured_rule_times_sd_off_again_when_its_reference_is_stale():
    pause = measured_pause(reference_ttl=8)
    s = Steps(pause)
    s.run(6, tokens=5, seconds=0.010)  # a window, then the first reference
    assert s.run(8, tokens=5, seconds=0.010) == "pppppppp"  # paid twice; 8 planned steps since the reference
    assert s.run(6, tokens=5, seconds=0.010) == "pppp--"  # the reference is stale: time SD off again
    assert pause.references == 2 and pause.pauses == 0


def test_the_measured_rule_skips_prompt_steps_and_the_steps_that_settle_after_them():
    pause = measured_pause()
    s = Steps(pause)
    s.run(6, tokens=4, seconds=0.010)  # window, reference at 0.4 tokens/ms
    pause.timed(s.step, 4, 4, 0.5, paused=False, prefill=True)  # a prompt ran: not counted
    # The two settling steps would have lost badly; they are not counted, and neither window loses.
    assert s.run(2, tokens=4, seconds=0.100) == "pp"
    assert s.run(8, tokens=5, seconds=0.010) == "pppppppp" and pause.pauses == 0


def test_the_measured_rule_keeps_to_its_batch_sizes():
    """B = 1 never pauses; B >= min_decodes is the predicted rule's (``timed`` ignores it); a
    reference timed at one batch-size bucket is no reference for another."""
    pause = measured_pause()
    s = Steps(pause)
    assert s.run(20, tokens=1, seconds=0.1, n=1) == "p" * 20
    assert s.run(20, tokens=1, seconds=0.1, n=8) == "p" * 20
    s.run(6, tokens=4, seconds=0.010, n=4)  # a window and a reference at 4-7 decodes
    assert s.run(6, tokens=2, seconds=0.010, n=2) == "pppp--"  # 2-3 decodes: a reference of their own first
    assert pause.references == 2 and pause.pauses == 0
    assert not PlanningPause(PauseConfig(min_measured_decodes=0)).weighs(4)


def measured_run(planner: Planner, steps: int, planned_s: float, seed: int = 3) -> list[bool]:
    """Screen, decide and observe B = 4 steps; a paused step takes 30 ms, a planned one
    ``planned_s`` (what the engine's clock would say, the planner's time in it); per step whether
    it was screened in. Asserts that a paused step's observe leaves the learners as they were."""
    rng, screened = random.Random(seed), []
    for _ in range(steps):
        ok = planner.may_speculate(outline(4))
        ks = planner.decide(view(4)) if ok else [0] * 4
        screened.append(ok)
        before = (planner.drift.factor, planner.timing.steps, planner.num_decisions)
        planner.observe(record(ks, 0.8, rng, seconds=planned_s if ok else 0.03))
        if not ok:
            assert (planner.drift.factor, planner.timing.steps, planner.num_decisions) == before
    return screened


def test_a_planner_pauses_where_its_measured_steps_emit_less_per_second_than_paused_ones():
    """B = 4: planned steps that take 1 s (drafts accepted at 0.8 emit ~3x the tokens, not 30x)
    pause after the reference; planned steps as fast as paused ones, with their drafts' extra
    tokens, never pause after it. A paused step's observe learns nothing."""
    config = PlannerConfig(pause=PauseConfig(window=4, first_pause=4, reference_steps=2))
    slow = Planner(make_policy("goodput"), FLAT, proposer="ngram", config=config)
    assert measured_run(slow, 4 + 2 + 4 + 4 + 4, planned_s=1.0) == [True] * 4 + [False] * 2 + ([True] * 4 + [False] * 4) + [True] * 4
    assert slow.pause.references == 1 and slow.pause.pauses == 2  # the last window lost too
    fast = Planner(make_policy("goodput"), FLAT, proposer="ngram", config=config)
    assert measured_run(fast, 4 + 2 + 40, planned_s=0.03) == [True] * 4 + [False] * 2 + [True] * 40
    assert fast.pause.pauses == 0 and fast.pause.references == 1


def test_a_reference_cut_short_is_timed_again():
    pause = measured_pause(reference_steps=4)
    s = Steps(pause)
    assert s.run(5, tokens=4, seconds=0.010) == "pppp-"  # a window, then one step of the reference
    assert s.run(1, tokens=2, seconds=0.010, n=2) == "p"  # the batch shrank: the pause is over
    assert s.run(4 + 4, tokens=5, seconds=0.010) == "pppp----"  # one step is no reference: again
    assert pause.references == 2 and pause.pauses == 0
