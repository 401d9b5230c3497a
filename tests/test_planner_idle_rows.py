"""Idle requests: a planner shown only the rows that have drafts (the others counted in
``StepView.idle_seq_ids`` and ``StepRecord.num_idle``) decides and learns exactly as one shown every
row. The vLLM plugin relies on it at B = 32, where most rows of most steps have no draft."""

from __future__ import annotations

import dataclasses
import random
from types import SimpleNamespace

import numpy as np
import pytest

from specplan.engine import RequestRecord, RequestView, StepRecord, StepView
from specplan.engine.decider import takes_idle_requests
from specplan.integrations.vllm import PlanningDrafter
from specplan.planner import AcceptanceEstimate, Planner, StepCostModel
from specplan.planner.acceptance import exact_length
from specplan.policies import make_policy
from specplan.policies.goodput import allocate
from specplan.profiler.latency_model import DraftCost, StepShape

from conftest import RidgeLatency

# Memory-bound up to 10 query tokens, then 2 ms a token: some steps of 3-12 decodes pay for drafts, some not.
LATENCY = RidgeLatency(a=0.03, b=2e-3, c=2e-8, ridge_tokens=10)


@pytest.mark.parametrize("seed", range(4))
def test_allocate_counts_idle_requests_as_rows_with_nothing_to_draft(seed):
    """``allocate(..., num_idle=m)`` over the rows with drafts is ``allocate`` over those rows and
    m rows of zero gains: the same ks for the rows searched, the same goodput (both searches)."""
    import specplan.policies.goodput as goodput_module

    rng = random.Random(seed)
    for _ in range(40):
        found = [rng.randint(1, 8) for _ in range(rng.randint(1, 6))]
        estimates = [AcceptanceEstimate(rng.uniform(0.2, 0.95), exact_length(n, 8), rng.uniform(0.2, 0.95))
                     for n in found]
        idle = rng.randint(0, 30)
        nothing = AcceptanceEstimate(0.0, (0.0,) * 8, 0.0)
        base = StepShape(len(found) + idle, len(found) + idle, 400 * (len(found) + idle))
        cost = StepCostModel(LATENCY, base, DraftCost(per_token_s=rng.choice((0.0, 2e-4))), 5e-4)
        budget = rng.choice((None, rng.randint(0, 20)))
        for few in (64, -1):  # plain Python, then numpy
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(goodput_module, "_FEW_DRAFTS", few)
                full = allocate(estimates + [nothing] * idle, found + [0] * idle, dataclasses.replace(cost),
                                max_total_drafts=budget, min_relative_gain=0.02)
                summed = allocate(estimates, found, dataclasses.replace(cost), max_total_drafts=budget,
                                  min_relative_gain=0.02, num_idle=idle)
            assert full.ks == summed.ks + (0,) * idle
            assert (full.goodput, full.step_s, full.off_goodput) == (summed.goodput, summed.step_s, summed.off_goodput)


def random_steps(rng: random.Random, num_steps: int):
    """Steps of a batch whose requests come and go: per step the rows (seq_id, context, drafts
    found, match length), as the vLLM plugin sees them (a row's max_k is what its lookup found)."""
    live: dict[int, int] = {}
    next_id = 0
    for _ in range(num_steps):
        while len(live) < rng.randint(3, 12):
            live[next_id] = rng.randint(50, 900)
            next_id += 1
        if rng.random() < 0.1:
            live.pop(rng.choice(list(live)))
        rows = []
        for seq_id in live:
            found = rng.choice((0, 0, 0, rng.randint(1, 8)))
            rows.append((seq_id, live[seq_id], found, rng.randint(1, 6) if found else None))
            live[seq_id] += 1
        yield rows


def full_view(rows) -> StepView:
    views = tuple(RequestView(s, "", n, 10, found, True, found, match) for s, n, found, match in rows)
    return StepView(views, 0, 0, sum(r[1] for r in rows), "ngram", draft_budget=4096)


def summarised_view(rows) -> StepView:
    full = full_view(rows)
    idle = [r for r in rows if not r[2]]
    return dataclasses.replace(full, requests=tuple(v for v in full.requests if v.available_drafts),
                               idle_seq_ids=tuple(r[0] for r in idle), idle_context_tokens=sum(r[1] for r in idle))


def outcome(rows, ks, rng: random.Random) -> StepRecord:
    """What the step did: each row accepts a random prefix of its drafts; its time from LATENCY
    with some noise (so the drift and the drafts' slope learn)."""
    reqs = []
    for (seq_id, _, found, match), k in zip(rows, ks):
        k = min(k, found)
        accepted = sum(1 for _ in iter(lambda: rng.random() < 0.7, False)) if k else 0
        accepted = min(accepted, k)
        reqs.append(RequestRecord(seq_id, "", k, k, accepted, accepted + 1, found if k else None, match if k else None))
    tokens = sum(1 + r.k for r in reqs)
    context = sum(r[1] for r in rows) + tokens
    forward = LATENCY.predict(StepShape(len(rows), tokens, context)) * rng.uniform(0.9, 1.3)
    return StepRecord(tuple(reqs), len(rows), tokens, 0, context, 0.0, forward, 0.0, forward + rng.uniform(0, 2e-3))


def summarised_record(record: StepRecord) -> StepRecord:
    given = tuple(r for r in record.requests if r.k)
    return dataclasses.replace(record, requests=given, num_idle=len(record.requests) - len(given))


def planner_for(policy: str) -> Planner:
    planner = Planner(make_policy(policy), LATENCY)
    if planner.pause is not None:
        planner.pause.clock = lambda: 0.0  # planning is free: the same pauses in both
    return planner


@pytest.mark.parametrize("policy", ["goodput", "static:3", "batch_table", "off"])
@pytest.mark.parametrize("seed", range(3))
def test_a_planner_shown_only_rows_with_drafts_decides_as_one_shown_every_row(policy, seed):
    rng, outcomes_full, outcomes_summarised = random.Random(seed), random.Random(seed), random.Random(seed)
    full, summarised = planner_for(policy), planner_for(policy)
    assert takes_idle_requests(summarised)
    drafted = idle_steps = 0
    for rows in random_steps(rng, 400):
        ks = full.decide(full_view(rows))
        given = iter(summarised.decide(summarised_view(rows)))
        assert ks == [next(given) if found else 0 for _, _, found, _ in rows]
        drafted += sum(ks) > 0
        idle_steps += any(not found for _, _, found, _ in rows) and sum(ks) > 0
        record = outcome(rows, ks, outcomes_full)
        full.observe(record)
        summarised.observe(summarised_record(outcome(rows, ks, outcomes_summarised)))
        assert (full.num_decisions, full.num_zero_decisions, full.steps) == (
            summarised.num_decisions, summarised.num_zero_decisions, summarised.steps)
        assert full.drift.factor == summarised.drift.factor
        assert full.predicted_step_s == summarised.predicted_step_s
    if policy != "off":
        assert idle_steps > 25  # the comparison covered steps that drafted beside idle rows
    assert {k: p.evidence for k, p in full.pools.items()} == {k: p.evidence for k, p in summarised.pools.items()}


def test_the_heuristic_must_see_every_row():
    planner = Planner(make_policy("heuristic"))
    assert not takes_idle_requests(planner)
    rows = [(0, 100, 3, 4), (1, 100, 0, None)]
    assert len(planner.decide(full_view(rows))) == 2
    with pytest.raises(ValueError, match="idle"):
        planner.decide(summarised_view(rows))


class CopyingRows:
    """B rows whose text copies spans of itself now and then, verified greedily against each row's
    own future (vLLM's persistent buffers: token_ids [B, max_len], lens [B])."""

    def __init__(self, rng: random.Random, batch: int, max_len: int = 512):
        self.rng, self.max_len = rng, max_len
        self.token_ids = np.zeros((batch, max_len), dtype=np.int32)
        self.lens = np.zeros(batch, dtype=np.int32)
        self.futures: list[list[int]] = [[] for _ in range(batch)]
        self.sampled = [self.admit(row) for row in range(batch)]

    def admit(self, row: int) -> list[int]:
        rng = self.rng
        toks = [rng.randrange(200) for _ in range(rng.randint(20, 80))]
        while len(toks) < self.max_len - 8:
            if rng.random() < 0.3:
                start = rng.randrange(len(toks) - 8)
                toks += toks[start:start + rng.randint(4, 12)]
            else:
                toks.append(rng.randrange(200))
        self.futures[row] = toks
        n = rng.randint(20, 40)
        self.token_ids[row, :n] = toks[:n]
        self.lens[row] = n
        return [toks[n - 1]]

    def step(self, drafts: list[list[int]]) -> None:
        sampled = []
        for row, d in enumerate(drafts):
            future, n = self.futures[row], int(self.lens[row])
            accepted = 0
            while accepted < len(d) and d[accepted] == future[n + accepted]:
                accepted += 1
            new = future[n:n + accepted + 1]
            if n + len(new) >= self.max_len - 16:
                sampled.append(self.admit(row))
                continue
            self.token_ids[row, n:n + len(new)] = new
            self.lens[row] = n + len(new)
            sampled.append(new)
        self.sampled = sampled


def test_the_vllm_plugin_drafts_the_same_when_it_shows_the_planner_only_rows_with_drafts(monkeypatch):
    """Two plugins in lockstep on the same rows, one describing every row to its planner and one
    only the rows with drafts: the same drafts every call. Their own time reads 0 (it is what the
    overhead learner and the pause would read, which would differ between the two)."""
    import specplan.integrations.vllm as plugin_module

    monkeypatch.setattr(plugin_module, "time", SimpleNamespace(perf_counter=lambda: 0.0, thread_time=lambda: 0.0))
    now = [0.0]
    drafters = []
    for summarise in (False, True):
        planner = planner_for("goodput")
        drafter = PlanningDrafter(planner, 8, 512, 4096, clock=lambda: now[0])
        assert drafter.summarise_idle
        drafter.summarise_idle = summarise
        drafters.append(drafter)
    rows = CopyingRows(random.Random(0), batch=8)
    calls_with_both = 0
    for _ in range(300):
        answers = [d.propose(rows.sampled, rows.lens, rows.token_ids) for d in drafters]
        assert answers[0] == answers[1]
        calls_with_both += any(answers[0]) and not all(answers[0])
        width = sum(1 + len(d) for d in answers[0])
        now[0] += LATENCY.predict(StepShape(8, width, int(rows.lens.sum()) + width))
        rows.step(answers[0])
    assert calls_with_both > 50
    full, summarised = (d.planner for d in drafters)
    assert (full.num_decisions, full.num_zero_decisions) == (summarised.num_decisions, summarised.num_zero_decisions)
    assert full.drift.factor == summarised.drift.factor
