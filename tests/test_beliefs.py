"""planner/beliefs.py: what the planner learned, saved beside its profile and loaded at start."""

from __future__ import annotations

import json
import random

import pytest

from specplan.engine.decider import RequestRecord, RequestView, StepRecord, StepView
from specplan.planner import Planner
from specplan.planner.acceptance import OutcomeCounts
from specplan.planner.beliefs import (BELIEFS_FORMAT, BeliefConfig, BeliefKey, BeliefStore, capture, latency_id,
                                      read_beliefs, restore)
from specplan.policies import make_policy

from conftest import RidgeLatency

LATENCY = RidgeLatency(a=0.03, b=0.0006, ridge_tokens=4)
MODEL = {"model": "tiny", "model_config_hash": "abc"}


def shown(ids: list[str], match: int = 5) -> StepView:
    return StepView(tuple(RequestView(i, rid, 500, 10, 8, True, 8, match) for i, rid in enumerate(ids)),
                    0, 0, 500 * len(ids), "ngram")


def outcome(ids: list[str], ks: list[int], alpha: float, rng: random.Random, match: int = 5,
            forward_s: float = 0.03) -> StepRecord:
    reqs = []
    for i, (rid, k) in enumerate(zip(ids, ks)):
        acc = 0
        while acc < k and rng.random() < alpha:
            acc += 1
        reqs.append(RequestRecord(i, rid, k, k, acc, acc + 1, natural_k=8, match_length=match))
    n = len(ids)
    return StepRecord(tuple(reqs), n, n + sum(ks), 0, 500 * n + sum(ks), 0.0, forward_s, 0.0, forward_s + 0.002)


def trained(alpha: float, request_steps: int, *, seed: int = 0, workload: str = "default") -> Planner:
    """A planner that served ``request_steps`` single-request steps (a new request every 8 steps)
    whose drafts after a 5-token match (bucket 4) are accepted with probability ``alpha``: 4 drafts a step,
    every 4th step a plain one, on a machine where 4 drafts add 20% to a step (the model, floored, says 8%)."""
    planner = Planner(make_policy("static:4"), LATENCY, proposer="ngram", workload=workload)
    rng = random.Random(seed)
    for step in range(request_steps):
        ids = [f"r{step // 8}"]
        planner.decide(shown(ids))
        k = 0 if step % 4 == 0 else 4
        planner.observe(outcome(ids, [k], alpha, rng, forward_s=0.03 if k == 0 else 0.036))
    return planner


def first_draft(planner: Planner, rid: str = "fresh", match: int = 5) -> float:
    """alpha_first of a new request's drafts after a ``match``-token lookup."""
    planner.decide(shown([rid], match))
    return planner.last_state.requests[0].acceptance.alpha_first


def store(tmp_path, **kw) -> tuple[BeliefStore, list[str]]:
    warnings: list[str] = []
    kw.setdefault("identity", MODEL)
    return BeliefStore(tmp_path / "m.beliefs.json", warn=warnings.append, **kw), warnings


def test_saved_beliefs_start_the_next_planner_warm(tmp_path):
    s, warnings = store(tmp_path, latency="L1")
    old = trained(0.95, 200)
    assert first_draft(old) > 0.85
    s.save(old)
    assert [p.name for p in tmp_path.iterdir()] == ["m.beliefs.json"]  # no temporary file left behind
    doc = json.loads(s.path.read_text())
    assert doc["format"] == BELIEFS_FORMAT and doc["version"] == 1
    assert "ngram/default/greedy/match:4" in doc["acceptance"]

    cold = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
    assert first_draft(cold) == pytest.approx(0.73)  # the built-in prior for bucket 4 (4-7 tokens)
    warm = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
    restored = BeliefStore(s.path, latency="L1", identity=MODEL).load_into(warm)
    assert restored.pools >= 1 and restored.step_cost and restored.timing
    assert first_draft(warm) > 0.93
    pool = warm.pool("ngram", "default", True, 4)
    assert pool.evidence == pytest.approx(BeliefConfig().max_pool_evidence)  # capped, not the 200 it saw
    assert warm.drift.factor == pytest.approx(old.drift.factor)
    assert old.draft_slope.price(1).slope > 2.0  # it learned that drafts cost more than the model says
    assert warm.draft_slope.price(1).slope == pytest.approx(old.draft_slope.price(1).slope, rel=0.15)
    assert not warm.draft_slope.has_baseline(1)  # another run's level: measure a plain step first
    assert warm.timing.overhead_s == pytest.approx(old.timing.overhead_s, rel=0.05)
    assert warnings == []


def test_loaded_beliefs_are_capped_so_a_stale_belief_gives_way():
    """Yesterday's traffic accepted 95% of drafts, today's 20%: with the cap the restored pool
    follows today's within ~60 request-steps; restored at full weight it would not."""
    doc = capture(trained(0.95, 400))

    def after_today(config: BeliefConfig) -> float:
        planner = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
        restore(planner, doc, config=config)
        rng = random.Random(1)
        for step in range(64):
            ids = [f"t{step // 8}"]
            planner.decide(shown(ids))
            planner.observe(outcome(ids, [4], 0.2, rng))
        return planner.pool("ngram", "default", True, 4).alpha_first

    assert after_today(BeliefConfig()) < 0.55
    assert after_today(BeliefConfig(max_pool_evidence=1e9)) > 0.75


def test_step_cost_corrections_load_only_under_their_latency_model(tmp_path):
    s, _ = store(tmp_path, latency=latency_id({"kind": "hinge", "a": 1}))
    old = trained(0.9, 60)
    old.drift.update(0.03, 0.06)  # the machine read 2x slower than the profile
    s.save(old)
    same = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
    assert BeliefStore(s.path, latency=latency_id({"a": 1, "kind": "hinge"}), identity=MODEL).load_into(same).step_cost
    assert same.drift.factor == pytest.approx(old.drift.factor)
    other = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
    restored = BeliefStore(s.path, latency=latency_id({"kind": "hinge", "a": 2}), identity=MODEL).load_into(other)
    assert not restored.step_cost and restored.pools >= 1  # a new profile: acceptance still carries over
    assert other.drift.factor == 1.0


def test_saving_merges_other_workloads_and_keeps_signals_it_does_not_know(tmp_path):
    s, _ = store(tmp_path)
    s.save(trained(0.9, 40, workload="code"))
    doc = json.loads(s.path.read_text())
    # A belief keyed by a signal this planner does not condition on (a draft head's confidence).
    doc["acceptance"]["draft/default/greedy/confidence:3"] = doc["acceptance"]["ngram/code/greedy/match:4"]
    s.path.write_text(json.dumps(doc))
    planner = trained(0.3, 40, workload="chat")
    assert BeliefStore(s.path, identity=MODEL).load_into(planner).pools == 1  # code's; confidence skipped
    s.save(planner)
    keys = set(json.loads(s.path.read_text())["acceptance"])
    assert {"ngram/code/greedy/match:4", "ngram/chat/greedy/match:4", "draft/default/greedy/confidence:3"} <= keys
    key = BeliefKey.parse("draft/default/greedy/confidence:3")
    assert key.signal == "confidence" and key.bucket == 3 and key.pool_key() is None
    assert BeliefKey.parse(BeliefKey.of_pool(("ngram", "w", False, None)).name).pool_key() == ("ngram", "w", False, None)


@pytest.mark.parametrize("content, says", [
    (b"{\"format\": \"specplan-beliefs\", \"vers", "corrupted or truncated"),
    (b"\xff\xfe\x00garbage", "cannot be read"),
    (json.dumps({"format": "something-else", "version": 1}).encode(), "not a specplan beliefs file"),
    (json.dumps({"format": BELIEFS_FORMAT, "version": 99}).encode(), "version 99"),
    (json.dumps({"format": BELIEFS_FORMAT, "version": 1, "identity": {"model": "other", "model_config_hash": "x"},
                 "acceptance": {}}).encode(), "another model"),
    (json.dumps({"format": BELIEFS_FORMAT, "version": 1, "identity": MODEL,
                 "acceptance": {"ngram/default/greedy/match:4": {"counts": "nonsense"}}}).encode(), "malformed"),
    (json.dumps({"format": BELIEFS_FORMAT, "version": 1, "identity": MODEL,
                 "acceptance": {"no-slashes": {}}}).encode(), "malformed"),
])
def test_a_bad_beliefs_file_is_named_in_one_warning_and_ignored(tmp_path, content, says):
    s, warnings = store(tmp_path)
    s.path.write_bytes(content)
    for _ in range(3):  # every planner of a run (evaluate builds many) asks; one warning in all
        planner = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
        assert s.load_into(planner).pools == 0
        assert planner.pools == {}  # untouched: nothing half-restored
    assert len(warnings) == 1 and str(s.path) in warnings[0] and says in warnings[0]
    assert "\n" not in warnings[0]
    s.save(trained(0.9, 20))  # saving replaces the unusable file with a good one
    assert read_beliefs(s.path, MODEL)["acceptance"]


def test_an_unreadable_path_warns_once(tmp_path):
    s, warnings = store(tmp_path)
    s.path.mkdir()  # a directory where the file should be
    assert s.load_into(Planner(make_policy("static:4"), LATENCY, proposer="ngram")).pools == 0
    assert len(warnings) == 1 and "cannot be read" in warnings[0]


def test_no_file_is_no_warning_and_reset_removes_it(tmp_path):
    s, warnings = store(tmp_path)
    assert s.load_into(Planner(make_policy("static:4"), LATENCY, proposer="ngram")).pools == 0
    s.save(trained(0.9, 20))
    assert s.reset() and not s.path.exists() and not s.reset()
    assert warnings == []


def test_outcome_counts_fold_into_a_smaller_max_k():
    # planner/acceptance.py OutcomeCounts.load_state's worked example, max_k 3 -> 2.
    big = OutcomeCounts(3)
    big._at_least, big._stopped = [1.0, 2.0, 3.0, 4.0], [0.5, 0.25, 0.125]
    small = OutcomeCounts(2)
    small.load_state(big.state(), weight=2.0)
    assert small._at_least == [2.0, 4.0, 14.0] and small._stopped == [1.0, 0.5]
    wider = OutcomeCounts(4)
    wider.load_state(big.state())
    assert wider._at_least == [1.0, 2.0, 3.0, 4.0, 0.0] and wider._stopped == [0.5, 0.25, 0.125, 0.0]


def test_serve_saves_beliefs_periodically_from_the_engine_thread(tmp_path):
    from specplan.adaptive import SavesBeliefs

    s, _ = store(tmp_path)
    planner = Planner(make_policy("static:4"), LATENCY, proposer="ngram")
    saver = SavesBeliefs(planner, s, interval_s=3600.0)
    rng = random.Random(0)
    for _ in range(5):
        saver.observe(outcome(["r0"], saver.decide(shown(["r0"])), 0.9, rng))
    assert s.saves == 0 and not s.path.exists()  # not yet an interval
    assert saver.predicted_step_s == planner.predicted_step_s  # the server reads the planner through it
    saver.interval_s = 0.0
    saver.observe(outcome(["r0"], saver.decide(shown(["r0"])), 0.9, rng))
    assert s.saves == 1 and read_beliefs(s.path, MODEL)["acceptance"]
