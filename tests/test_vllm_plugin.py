"""specplan's vLLM plugin (specplan/integrations/vllm.py).

Two halves. The plugin's own logic (which row is which request, acceptance from sampled tokens,
the step record, caps, configuration errors) runs everywhere, on arrays shaped as vLLM passes
them. The rest runs vLLM for real on a tiny random-weight Llama and skips where vLLM is not
installed (CI): run it with ``/work/vllm-venv/bin/python -m pytest tests/test_vllm_plugin.py``.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from specplan.engine.decider import StepRecord, StepView
from specplan.integrations.vllm import (PlanningDrafter, PluginConfigError, PluginOptions, build_planner,
                                        check_vllm_version)
from specplan.integrations.vllm_lookup import BatchTokens, NgramLookup, SuffixLookup
from specplan.integrations.vllm_rows import RowTracker

MAX_LEN = 64


class Scripted:
    """A planner stand-in that asks for fixed k and keeps what it was shown (tests the drafter's
    side of the SpecDecider contract, not the planner)."""

    def __init__(self, k: int):
        self.k = k
        self.views: list[StepView] = []
        self.records: list[StepRecord] = []

    def decide(self, view: StepView) -> list[int]:
        self.views.append(view)
        return [self.k] * len(view.requests)

    def observe(self, record: StepRecord) -> None:
        self.records.append(record)


class Batch:
    """vLLM's persistent input buffers: token_ids_cpu [rows, MAX_LEN], num_tokens_no_spec [rows]."""

    def __init__(self, rows: int = 4):
        self.toks = np.zeros((rows, MAX_LEN), dtype=np.int32)
        self.lens = np.zeros(rows, dtype=np.int32)

    def put(self, row: int, tokens: list[int]) -> None:
        self.toks[row, :len(tokens)] = tokens
        self.lens[row] = len(tokens)

    def append(self, row: int, tokens: list[int]) -> list[int]:
        n = int(self.lens[row])
        self.toks[row, n:n + len(tokens)] = tokens
        self.lens[row] = n + len(tokens)
        return tokens


REPEATING = [5, 6, 7, 8] * 3  # the lookup finds 5 6 7 8 ... after any suffix of it
OTHER = [20, 21, 22, 23, 20, 21, 22]


def test_rows_follow_requests_when_the_batch_condenses():
    tracker = RowTracker()
    b = Batch()
    b.put(0, REPEATING + [5])
    b.put(1, OTHER + [23])
    b.put(2, [40, 41, 42, 43, 44])  # still prefilling: it committed nothing
    first = tracker.read([[5], [23], []], b.lens, b.toks)
    assert [r.continued for r in first.decodes] == [False, False] and first.prefill_rows == [2]
    a, o = (r.request.seq_id for r in first.decodes)
    # Request 0 finished; vLLM moved request 1 into row 0 and the prefilled one into row 1.
    b.put(0, OTHER + [23])
    b.append(0, [20, 21])
    b.put(1, [40, 41, 42, 43, 44, 45])
    second = tracker.read([[20, 21], [45]], b.lens[:2], b.toks[:2])
    assert [(r.request.seq_id, r.continued) for r in second.decodes] == [(o, True), (tracker._next_id - 1, False)]
    assert second.decodes[0].request.toks == OTHER + [23, 20, 21]  # the index reads the appended tokens
    assert NgramLookup().lookup([second.decodes[0].request], [3])[0].drafts == [22, 23, 20]
    assert a not in {r.request.seq_id for r in second.decodes}


# Set by ``test_the_compiled_ngram_scan_*`` for the run of this file it starts in a process of its
# own: the scan compiled by numba, as the plugin runs it in vLLM (importing numba in this process
# would break the in-process vLLM starts of the tests below; see ``vllm_env``).
COMPILED_SCAN = os.environ.get("SPECPLAN_TEST_NGRAM_SCAN") == "1"


def scanning_lookup(**kwargs) -> NgramLookup:
    """The plugin's n-gram lookup in its scan form, running ``scan_rows`` uncompiled (numba
    compiles the same function inside vLLM; CI has no numba), or compiled under COMPILED_SCAN."""
    from specplan.engine.proposers.ngram import scan_rows

    if COMPILED_SCAN:
        return NgramLookup(**kwargs, scan=True)
    lookup = NgramLookup(**kwargs)
    lookup._scan = scan_rows
    return lookup


@pytest.mark.parametrize("params", [{}, {"min_n": 2, "max_n": 3, "max_match_length": 5},
                                    {"min_n": 1, "max_n": 1, "max_match_length": 4}])
def test_the_plugins_ngram_lookup_drafts_what_the_engines_proposer_drafts(params):
    # The plugin's lookup wraps the engine's n-gram index over the tokens the tracker mirrors; its
    # drafts, natural length and match length must be the engine proposer's for the same tokens:
    # caps from 0 to past the tokens available, texts of a few symbols (matches everywhere). The
    # scan form reads the same tokens from vLLM-shaped rows (wider than the text, requests in
    # shuffled rows, spare rows) and must answer the same.
    import random

    from specplan.engine.proposers.ngram import NgramProposer

    engine_params = {k: v for k, v in params.items() if k != "max_match_length"}
    rng = random.Random(7)

    def text() -> list[int]:
        length = rng.randint(1, MAX_LEN)
        if rng.random() < 0.5:  # few symbols, or many
            vocab = rng.choice([2, 3, 30])
            return [rng.randrange(vocab) for _ in range(length)]
        period = [rng.randrange(30) for _ in range(rng.randint(2, 6))]  # copied passages: long matches
        return [period[i % len(period)] if rng.random() < 0.95 else 99 for i in range(length)]

    for _ in range(80):
        tracker = RowTracker()
        requests = [tracker._new(text()) for _ in range(rng.randint(1, 6))]
        caps = [rng.choice([0, 1, 3, 8]) for _ in requests]
        got = NgramLookup(**params).lookup(requests, caps)
        want = NgramProposer(**engine_params, max_match_length=params.get("max_match_length", 16)).propose(
            requests, caps)  # a TrackedRequest reads as an engine Sequence
        batch = Batch(rows=len(requests) + 2)
        rows = rng.sample(range(batch.lens.shape[0]), len(requests))
        for t, row in zip(requests, rows):
            batch.put(row, t.toks)
        scanned = scanning_lookup(**params).lookup(requests, caps, BatchTokens(batch.toks, batch.lens, rows))
        for i, (f, g) in enumerate(zip(got, scanned)):
            expected = (want.token_ids[i], want.natural_k[i], want.match_length[i]) if want.token_ids[i] else ([], 0, 0)
            assert (f.drafts, f.natural_k, f.match_length) == expected
            assert (g.drafts, g.natural_k, g.match_length) == expected


def test_the_ngram_scan_without_numba_says_how_to_get_it():
    if importlib.util.find_spec("numba") is not None:
        pytest.skip("numba is installed here")
    with pytest.raises(ValueError, match="pip install numba"):
        NgramLookup(scan=True)
    assert NgramLookup().form == "ngram-index"


def test_rows_that_keep_their_request_are_matched_on_the_fast_path():
    # A row holding last call's request is checked against that request first (its length before
    # the step, its head and tail tokens); only moved or new rows search the others. A prompt
    # shorter than the head tokens compared (its row fills in past it as it grows) stays on it.
    tracker = RowTracker()
    b = Batch()
    b.put(0, [3, 4, 5])
    b.put(1, REPEATING + [5])
    first = tracker.read([[5], [5]], b.lens, b.toks)
    assert first.num_moved == 2  # both new
    ids = [r.request.seq_id for r in first.decodes]
    for step in range(20):
        sampled = [[7 + step], [6, 7]]
        for row, toks in enumerate(sampled):
            b.append(row, toks)
        batch = tracker.read(sampled, b.lens, b.toks)
        assert batch.num_moved == 0 and all(r.continued for r in batch.decodes)
        assert [r.request.seq_id for r in batch.decodes] == ids
    assert batch.decodes[0].request.toks == b.toks[0, :b.lens[0]].tolist()
    # The same length and tail, another head: not the same request.
    b.toks[1, 0] += 1
    b.append(1, [8])
    b.append(0, [9])
    moved = tracker.read([[9], [8]], b.lens, b.toks)
    assert moved.num_moved == 1 and not moved.decodes[1].continued and moved.decodes[0].continued


@pytest.mark.parametrize("seed", range(4))
def test_rows_are_recognised_whatever_vllm_does_to_them(seed):
    # vLLM condenses its batch, finishes requests and starts new ones in freed rows, some of them
    # prefilling (committing nothing) for a call. A newcomer here is often built to pass for the
    # request it replaces on all but one check: the same length before the step and head (a
    # shared system prompt) with one tail token changed; the same length and tail with another
    # first token; or the same head and tail, 8 tokens longer. The tracker must say which
    # request each row holds, as the simulation knows it.
    rng = random.Random(seed)
    rows = 8
    b = Batch(rows=rows)
    truth: list[list[int] | None] = [None] * rows  # row -> the simulated request's tokens
    prefilling = [False] * rows
    ids: dict[int, int] = {}  # id(simulated request) -> the tracker's seq_id
    alive = []  # every simulated request, so that no id is reused
    tracker = RowTracker()
    for call in range(80):
        sampled = []
        for row in range(rows):
            toks = truth[row]
            if toks is None or len(toks) > MAX_LEN - 12 or rng.random() < 0.1:  # a new request takes the row
                variant = rng.randrange(4) if toks is not None and 12 < len(toks) < MAX_LEN - 12 else 3
                fresh = list(toks) if variant < 3 else [rng.randrange(50) for _ in range(rng.randrange(3, 30))]
                if variant == 0:
                    fresh[-rng.randrange(1, 9)] += 1000
                elif variant == 1:
                    fresh[0] += 1000
                elif variant == 2:
                    fresh += fresh[-8:]
                truth[row], prefilling[row] = fresh, rng.random() < 0.25
                alive.append(fresh)
                step = [] if prefilling[row] else [rng.randrange(50)]
                fresh.extend(step)
                b.put(row, fresh)
            else:
                step = [rng.randrange(50) for _ in range(1 if prefilling[row] else rng.randrange(1, 4))]
                prefilling[row] = False
                toks.extend(step)
                b.append(row, step)
            sampled.append(step)
        num_rows = rows
        if rng.random() < 0.3:  # condense: the last row moves into a random earlier one
            dst = rng.randrange(rows - 1)
            truth[dst], prefilling[dst], sampled[dst] = truth[-1], prefilling[-1], sampled[-1]
            b.put(dst, truth[dst])
            truth[-1], num_rows = None, rows - 1
        batch = tracker.read(sampled[:num_rows], b.lens[:num_rows], b.toks[:num_rows])
        assert batch.prefill_rows == [i for i in range(num_rows) if not sampled[i]]
        for r in batch.decodes:
            toks = truth[r.row]
            assert r.request.toks == toks
            if id(toks) in ids:
                assert r.continued and r.request.seq_id == ids[id(toks)], (call, r.row)
            else:
                assert not r.continued, (call, r.row)
                ids[id(toks)] = r.request.seq_id


def test_a_row_with_other_tokens_is_a_new_request():
    tracker = RowTracker()
    b = Batch()
    b.put(0, REPEATING + [5])
    (r0,) = tracker.read([[5]], b.lens, b.toks).decodes
    b.put(0, [9] + REPEATING[1:] + [5])  # the same length as if it continued, another prompt
    b.append(0, [6])
    (r1,) = tracker.read([[6]], b.lens, b.toks).decodes
    assert not r1.continued and r1.request.seq_id != r0.request.seq_id
    # Requests that stop appearing are forgotten.
    for _ in range(tracker.forget_after_calls + tracker.forget_every_calls):
        tracker.read([], b.lens, b.toks)
    assert tracker.num_tracked == 0


def test_acceptance_and_step_time_reach_the_planner():
    planner = Scripted(k=3)
    drafter = PlanningDrafter(planner, num_speculative_tokens=4, max_model_len=MAX_LEN, max_num_batched_tokens=256)
    b = Batch()
    b.put(0, REPEATING + [5])
    b.put(1, OTHER + [23])
    out = drafter.propose([[5], [23]], b.lens, b.toks)
    assert out == [[6, 7, 8], [20, 21, 22]]
    # Both rows were prefills: no drafts of theirs have run yet; the planner is told that prompts
    # ran (so it does not learn what drafting costs from the next step, which carries this call's
    # indexing of them), with no time, as the step followed an idle gap.
    (prompts,) = planner.records
    assert prompts.requests == () and prompts.num_prefill_tokens == len(REPEATING) + len(OTHER) == prompts.num_tokens
    assert math.isnan(prompts.total_s) and math.isnan(prompts.forward_s) and drafter.stats.steps_observed == 0
    planner.records.clear()
    view = planner.views[-1]
    assert [(r.available_drafts, r.max_k) for r in view.requests] == [(4, 4), (4, 4)]  # vLLM's K
    assert view.requests[0].match_length == 9 and view.draft_budget == 254
    # Row 0 accepted 2 of its 3 drafts (+ the target's token), row 1 none.
    b.append(0, [6, 7, 9])
    b.append(1, [30])
    drafter.propose([[6, 7, 9], [30]], b.lens, b.toks, slot_mappings={"layer.0": np.zeros(8)})
    (rec,) = planner.records
    assert [(r.k, r.num_proposed, r.num_accepted, r.num_emitted) for r in rec.requests] == [(3, 3, 2, 3), (3, 3, 0, 1)]
    assert rec.requests[0].match_length == 9 and rec.requests[0].natural_k == 4
    assert rec.num_seqs == 2 and rec.num_tokens == 8 and rec.num_prefill_tokens == 0
    assert rec.total_s > 0 and rec.forward_s + rec.propose_s == pytest.approx(rec.total_s)
    assert drafter.stats.drafts_accepted == 2 and drafter.stats.drafts_proposed == 6


def test_stats_file_is_rewritten_every_call_or_at_most_as_often_as_asked(tmp_path):
    b = Batch()
    b.put(0, REPEATING + [5])
    for every_s, writes in ((0.0, 3), (3600.0, 1)):  # an hour apart: only the first call's
        path = tmp_path / f"stats-{every_s:g}.json"
        drafter = PlanningDrafter(Scripted(k=0), 4, MAX_LEN, stats_path=str(path), stats_every_s=every_s)
        for _ in range(3):
            drafter.propose([[5]], b.lens, b.toks)
            b.append(0, [5])
        assert json.loads(path.read_text())["calls"] == writes
    opts = PluginOptions(stats_path="/s.json", stats_every_s=1.0)
    assert PluginOptions.from_env(opts.to_env()) == opts


def test_caps_k_zero_and_max_model_len():
    b = Batch()
    b.put(0, REPEATING + [5])
    assert PlanningDrafter(Scripted(k=0), 4, MAX_LEN).propose([[5]], b.lens, b.toks) == [[]]
    assert PlanningDrafter(Scripted(k=9), 2, MAX_LEN).propose([[5]], b.lens, b.toks) == [[6, 7]]
    near_end = len(REPEATING) + 1 + 2  # room for 1 draft and the target's token
    assert PlanningDrafter(Scripted(k=9), 4, near_end).propose([[5]], b.lens, b.toks) == [[6]]


def test_suffix_drafts_are_the_engine_suffix_proposers():
    from specplan.engine import SamplingParams, Sequence, SuffixProposer

    planner = Scripted(k=3)
    drafter = PlanningDrafter(planner, 4, MAX_LEN, lookup=SuffixLookup())
    b = Batch()
    b.put(0, REPEATING + [5])
    out = drafter.propose([[5]], b.lens, b.toks)
    seq = Sequence(seq_id=0, request_id="0", prompt_token_ids=REPEATING + [5], params=SamplingParams())
    engine = SuffixProposer().propose([seq], [4])
    assert out == [engine.token_ids[0][:3]] and out == [[6, 7, 8]]
    assert planner.views[-1].proposer == "suffix" and planner.views[-1].requests[0].match_length == engine.match_length[0]
    b.append(0, [6, 7, 9])
    drafter.propose([[6, 7, 9]], b.lens, b.toks)
    assert planner.records[-1].requests[0].natural_k == engine.natural_k[0]
    # A request that stops appearing is forgotten; its output joins the suffix cache of finished requests.
    for _ in range(drafter.rows.forget_after_calls + drafter.rows.forget_every_calls):
        drafter.propose([], b.lens, b.toks)
    assert drafter.lookup.proposer.num_tracked() == 0 and drafter.lookup.proposer.num_cached_requests() == 1


def test_a_step_without_drafts_does_not_ask_the_planner():
    planner = Scripted(k=3)
    drafter = PlanningDrafter(planner, 4, MAX_LEN)
    b = Batch()
    b.put(0, [1, 2, 3, 4, 5, 6])  # no token repeats: the lookup finds nothing
    assert drafter.propose([[6]], b.lens, b.toks) == [[]]
    assert planner.views == [] and drafter.stats.decisions == 0 and drafter.stats.request_steps == 1
    assert drafter.stats.by_batch[1][0] == 1 and drafter.stats.own_ms_per_call(1) > 0


def test_a_step_the_planner_screens_out_looks_nothing_up():
    """A planner that says no draft could pay in this step (``may_speculate``): no lookup, no
    ``decide``, no drafts; the next step's record still reaches it (k = 0 for all)."""

    class Screening(Scripted):
        outlines: list = []

        def may_speculate(self, outline):
            self.outlines.append(outline)
            return False

    class CountingLookup(NgramLookup):
        asked = 0

        def lookup(self, requests, caps, tokens=None):
            CountingLookup.asked += sum(1 for c in caps if c)
            return super().lookup(requests, caps, tokens)

    planner = Screening(k=3)
    drafter = PlanningDrafter(planner, 4, MAX_LEN, max_num_batched_tokens=256, lookup=CountingLookup())
    b = Batch()
    b.put(0, REPEATING + [5])
    b.put(1, OTHER + [23])
    assert drafter.propose([[5], [23]], b.lens, b.toks) == [[], []]
    (outline,) = planner.outlines
    assert (outline.num_decodes, outline.max_k, outline.draft_budget) == (2, 4, 254)
    assert outline.context_tokens == outline.decode_context_tokens == len(REPEATING) + len(OTHER) + 2
    assert CountingLookup.asked == 0 and planner.views == []
    b.append(0, [6])
    b.append(1, [30])
    drafter.propose([[6], [30]], b.lens, b.toks)
    assert [(r.k, r.num_proposed) for r in planner.records[-1].requests] == [(0, 0), (0, 0)]


def test_fast_built_views_and_records_equal_the_engines():
    from specplan.engine.decider import RequestRecord, RequestView
    from specplan.integrations.vllm import _request_record, _request_view

    assert _request_view(3, "", 100, 10, 4, True, 4, 7) == RequestView(3, "", 100, 10, 4, True, 4, 7)
    record = _request_record(3, "", 4, 4, 2, 3, 8, 7, None, False)  # every field: none is left to a default
    assert record == RequestRecord(3, "", 4, 4, 2, 3, 8, 7) and record.accepted_per_position == (True, True, False, False)


def test_options_from_the_environment_round_trip():
    opts = PluginOptions(policy="static:2", profile="/p.json", proposer="suffix", sla_itl_ms=50.0, max_k=4)
    assert PluginOptions.from_env(opts.to_env()) == opts
    index = PluginOptions(ngram_scan=False)
    assert index.to_env()["SPECPLAN_NGRAM_SCAN"] == "0" and PluginOptions.from_env(index.to_env()) == index
    assert PluginOptions.from_env({}).ngram_scan  # the scan unless told otherwise
    with pytest.raises(PluginConfigError, match="SPECPLAN_PROPOSER='draft' is not one of ngram, suffix"):
        PluginOptions.from_env({"SPECPLAN_PROPOSER": "draft"})
    with pytest.raises(PluginConfigError, match="SPECPLAN_NGRAM_SCAN='yes' is not 0 or 1"):
        PluginOptions.from_env({"SPECPLAN_NGRAM_SCAN": "yes"})


def test_the_real_planner_with_a_static_policy():
    drafter = PlanningDrafter(build_planner(PluginOptions(policy="static:2"), num_speculative_tokens=4), 4, MAX_LEN)
    b = Batch()
    b.put(0, REPEATING + [5])
    assert drafter.propose([[5]], b.lens, b.toks) == [[6, 7]]
    b.append(0, [6, 7, 8])
    assert drafter.propose([[6, 7, 8]], b.lens, b.toks) == [[5, 6]]
    assert drafter.planner.num_decisions == 2 and drafter.stats.steps_observed == 1


def test_bad_configuration_says_what_to_do():
    with pytest.raises(PluginConfigError, match="SPECPLAN_PROFILE=PATH"):
        build_planner(PluginOptions(), num_speculative_tokens=8)  # goodput needs a profile
    with pytest.raises(PluginConfigError, match="num_speculative_tokens=6.*SPECPLAN_MAX_K=4"):
        build_planner(PluginOptions(policy="static:2", max_k=6), num_speculative_tokens=4)
    with pytest.raises(PluginConfigError, match="SPECPLAN_POLICY='nope'"):
        build_planner(PluginOptions(policy="nope"), num_speculative_tokens=4)
    with pytest.raises(PluginConfigError, match="SPECPLAN_SLA_ITL_MS='-3'"):
        PluginOptions.from_env({"SPECPLAN_SLA_ITL_MS": "-3"})
    with pytest.raises(PluginConfigError, match=r"supports vLLM 0\.32\.x, found 0\.11\.0; install"):
        check_vllm_version("0.11.0")
    check_vllm_version("0.32.0")
    opts = PluginOptions.from_env({"SPECPLAN_POLICY": "static:3", "SPECPLAN_MAX_K": "3"})
    assert (opts.policy, opts.max_k, opts.profile) == ("static:3", 3, None)


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    fields = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=0.2, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1, pad_token_id=0)
    fields.update(overrides)
    return LlamaConfig(**fields)


def synthetic_profile(hf_config, path: Path, kernels: str = "vllm-0.32.0-cpu") -> Path:
    """A profile for ``hf_config``'s model: flat up to 16 query tokens (memory-bound), then steep."""
    from specplan.engine.config import ModelConfig
    from specplan.profiler.fit import HingeLatencyModel
    from specplan.profiler.profile import (CeilingsModel, CostConstants, DraftCost, FitError, Fingerprint, Profile,
                                           model_config_hash)

    latency = HingeLatencyModel(0.004, (16.0,), (4e-4,), 1e-8, 1e-5)
    # As `specplan profile --engine vllm` would write it (the kernels field names the engine).
    fp = Fingerprint(model="tiny", model_config_hash=model_config_hash(ModelConfig.from_hf(hf_config)),
                     dtype="float32", device="cpu", threads=2, torch_version="2", cpu="test", kernels=kernels)
    Profile(fingerprint=fp,
            ceilings=CeilingsModel(peak_flops=1e11, bandwidth=2e10, ridge=5.0),
            cost=CostConstants(weight_bytes=1e6, flops_per_token=1e5, lm_head_flops_per_row=4e4,
                               kv_bytes_per_token=1e3, attention_flops_per_token_pair=1e3),
            latency_model=latency.to_dict(),
            fit=FitError(heldout_mape=5, train_mape=4, roofline_mape=50, num_cells=8, num_heldout=2),
            draft_costs={"ngram": DraftCost(per_token_s=1e-6)}, max_batch=32, max_tokens_per_seq=5).save(path)
    return path


def test_a_profile_for_another_model_or_engine_is_refused(tmp_path):
    from specplan.profiler.profile import ProfileError

    engine = synthetic_profile(tiny_llama_config(), tmp_path / "engine.json", kernels="torch-avx512")
    with pytest.raises(ProfileError, match="timed another engine.*'torch-avx512'.*specplan profile --engine vllm"):
        build_planner(PluginOptions(profile=str(engine)), num_speculative_tokens=4, hf_config=tiny_llama_config())

    path = synthetic_profile(tiny_llama_config(), tmp_path / "p.json")
    with pytest.raises(ProfileError, match="another model.*specplan profile --engine vllm --model DIR"):
        build_planner(PluginOptions(profile=str(path)), num_speculative_tokens=4,
                      hf_config=tiny_llama_config(num_hidden_layers=3))
    with pytest.raises(PluginConfigError, match="num_speculative_tokens=3 is below.*measured steps up to k = 4.*SPECPLAN_MAX_K=3"):
        build_planner(PluginOptions(profile=str(path)), num_speculative_tokens=3, hf_config=tiny_llama_config())
    planner = build_planner(PluginOptions(profile=str(path)), num_speculative_tokens=4, hf_config=tiny_llama_config())
    assert planner.config.max_k == 4 and planner.latency is not None
    # The pause's predicted rule acts from 8 decodes as in the engine; its measured rule (B = 2-7)
    # is not used in vLLM (integrations/vllm.py ``build_planner`` says why).
    assert planner.pause is not None and planner.pause.weighs(8) and not planner.pause.measures(4)


# ---------------------------------------------------------------- vLLM itself

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vLLM is not installed here (CI has none); run this file with vLLM's python")

PROMPTS = [[5, 9, 13, 17, 21, 25] * 4, [100, 200, 300, 400] * 5 + [7], [3, 4, 5, 6, 7, 8, 9, 10], [60, 61] * 6]
PLUGIN = "specplan.integrations.vllm.SpecplanProposer"


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    import torch
    from transformers import LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    LlamaForCausalLM(tiny_llama_config()).to(torch.float32).save_pretrained(d)
    return d


def vllm_greedy(model_dir: Path, spec: dict | None, max_tokens: int = 40) -> list[list[int]]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=str(model_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=256, max_num_seqs=8,
              speculative_config=spec, enforce_eager=True, seed=0)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        del llm
        gc.collect()


@pytest.fixture(scope="module")
def vllm_env(tiny_model_dir):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine core in this process: one startup is enough
    # vLLM-CPU 0.32's worker start walks every loaded module and fails on llvmlite's library wrapper
    # once numba was imported in the process, so the engines started here one after another look
    # drafts up with the index; ``test_the_compiled_ngram_scan_in_vllm`` runs the scan in vLLM.
    mp.setenv("SPECPLAN_NGRAM_SCAN", "1" if COMPILED_SCAN else "0")
    yield mp
    mp.undo()


@pytest.fixture(scope="module")
def vllm_off(vllm_env, tiny_model_dir) -> list[list[int]]:
    return vllm_greedy(tiny_model_dir, None)


def run_plugin(mp, model_dir: Path, stats: Path, k: int = 4, **env: str) -> tuple[list[list[int]], dict]:
    for name in ("SPECPLAN_PROFILE", "SPECPLAN_MAX_K", "SPECPLAN_PROPOSER"):
        mp.delenv(name, raising=False)
    for name, value in env.items():
        mp.setenv(name, value)
    mp.setenv("SPECPLAN_VLLM_STATS", str(stats))
    out = vllm_greedy(model_dir, {"method": "custom_class", "model": PLUGIN, "num_speculative_tokens": k})
    return out, json.loads(stats.read_text())


@needs_vllm
@pytest.mark.slow
@pytest.mark.parametrize("policy,proposer", [("static:3", "ngram"), ("goodput", "ngram"), ("static:3", "suffix")])
def test_plugin_in_vllm_matches_vllm_off(policy, proposer, vllm_env, vllm_off, tiny_model_dir, tmp_path):
    from transformers import AutoConfig

    env = {"SPECPLAN_POLICY": policy, "SPECPLAN_PROPOSER": proposer}
    if policy == "goodput":
        env["SPECPLAN_PROFILE"] = str(synthetic_profile(AutoConfig.from_pretrained(tiny_model_dir),
                                                        tmp_path / "profile.json"))
    out, stats = run_plugin(vllm_env, tiny_model_dir, tmp_path / "stats.json", **env)
    assert out == vllm_off  # greedy: token for token what vLLM emits without speculation
    assert stats["calls"] > 0 and stats["drafts_proposed"] > 0 and stats["steps_observed"] > 0
    assert stats["lookup"] == ("suffix-tree" if proposer == "suffix" else
                               "ngram-scan" if COMPILED_SCAN else "ngram-index")
    assert stats["own_s"] > 0 and sum(stats["phase_s"].values()) <= stats["own_s"]
    print(f"{policy} {proposer}: {stats}")


def run_this_file_compiled(selection: str) -> None:
    """Run the tests ``selection`` (pytest -k) of this file in a process of their own with the
    n-gram scan compiled (COMPILED_SCAN)."""
    env = {**os.environ, "SPECPLAN_TEST_NGRAM_SCAN": "1"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", selection],
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0 and " passed" in done.stdout, done.stdout[-4000:] + done.stderr[-2000:]


@needs_vllm
@pytest.mark.slow
def test_the_compiled_ngram_scan_finds_what_the_index_finds():
    """numba's compilation of ``scan_rows`` (int32 rows as vLLM keeps them) against the engine's index."""
    run_this_file_compiled("drafts_what_the_engines_proposer_drafts")


@needs_vllm
@pytest.mark.slow
def test_the_compiled_ngram_scan_in_vllm():
    """The plugin as it runs by default: the scan compiled in vLLM's worker, greedy output token
    for token vLLM's without speculation, drafts proposed, the counters naming the scan."""
    run_this_file_compiled("test_plugin_in_vllm_matches_vllm_off and goodput-ngram")


@needs_vllm
@pytest.mark.slow
def test_plugin_with_k_zero_proposes_nothing(vllm_env, vllm_off, tiny_model_dir, tmp_path):
    out, stats = run_plugin(vllm_env, tiny_model_dir, tmp_path / "stats.json", SPECPLAN_POLICY="static:0")
    assert out == vllm_off
    assert stats["calls"] > 0 and stats["drafts_proposed"] == 0


@needs_vllm
@pytest.mark.slow
def test_vllm_profiler_forces_every_draft_length(vllm_env, tiny_model_dir):
    """`specplan profile --engine vllm`'s measurement on a tiny grid: every (B, T) cell within the
    grid's tokens per step gets its timed steps (B = 3 at T = 3 would be 9 > 6 tokens: not run),
    vLLM ran exactly the forced widths, and the header names vLLM as the engine."""
    import vllm
    from transformers import AutoConfig

    from specplan.engine.config import ModelConfig
    from specplan.profiler.profile import model_config_hash
    from specplan.profiler.vllm_timer import VllmGrid, measure_vllm_grid

    grid = VllmGrid(batch_sizes=(1, 3), tokens_per_seq=(1, 3), contexts=(16, 32), passes=2, max_tokens_per_step=6)
    hf = AutoConfig.from_pretrained(tiny_model_dir)
    table, header = measure_vllm_grid(tiny_model_dir, grid, vocab_size=hf.vocab_size, kv_bytes_per_token=4096,
                                      progress=False, extra_llm_args={"enforce_eager": True})
    assert sorted(zip(table.batch_size, table.tokens_per_seq, table.context)) == [
        (1, 1, 16), (1, 1, 32), (1, 3, 16), (1, 3, 32), (3, 1, 16), (3, 1, 32)]
    assert (table.num_tokens == table.batch_size * table.tokens_per_seq).all() and (table.seconds > 0).all()
    assert all(len(s) >= grid.passes for s in table.all_seconds)
    assert header["kernels"] == f"vllm-{vllm.__version__}-cpu"
    assert header["model_config_hash"] == model_config_hash(ModelConfig.from_hf(hf))
