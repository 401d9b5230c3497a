"""Speculative decoding in the engine is lossless: same tokens as without speculation."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import loaded_from_hf, tiny_hf_model, tiny_llm
from specplan.engine import SamplingParams, StepRecord, StepView
from specplan.engine.model_runner import kv_bytes_per_block

GREEDY = dict(temperature=0.0)


def repetitive_prompts(vocab: int, n: int = 6, seed: int = 3) -> list[list[int]]:
    """Prompts with repeated spans, so prompt lookup finds matches (and some fail)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(vocab) for _ in range(rng.randint(3, 8))]
        noise = [rng.randrange(vocab) for _ in range(rng.randint(0, 10))]
        out.append(noise + motif * rng.randint(2, 4) + noise[:3])
    return out


@pytest.fixture(scope="module")
def model():
    return tiny_hf_model("llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def baseline(model):
    prompts = repetitive_prompts(model.config.vocab_size)
    llm = tiny_llm(model)
    return prompts, [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))]


def spec_llm(model, proposer: str, k: int, **kwargs):
    spec = {"proposer": proposer, "k": k, "draft_layers": 2}
    draft = None
    if proposer == "draft":  # a different random model with the same vocabulary
        draft = loaded_from_hf(tiny_hf_model("llama", num_hidden_layers=1, seed=11))
    return tiny_llm(model, speculative_config=spec, draft_loaded=draft, **kwargs)


@pytest.mark.parametrize("proposer", ["ngram", "suffix", "layer-skip", "draft"])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculation_is_lossless(model, baseline, proposer, k):
    prompts, expected = baseline
    llm = spec_llm(model, proposer, k)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats
    assert stats.num_draft_tokens > 0, "the proposer never proposed: the test would prove nothing"
    assert 0 < stats.num_accepted_tokens, "nothing accepted: the acceptance path was never exercised"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_target_as_its_own_draft_accepts_everything(model, baseline):
    prompts, expected = baseline
    llm = tiny_llm(model, speculative_config={"proposer": "draft", "k": 3}, draft_loaded=loaded_from_hf(model))
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert [o.token_ids for o in outs] == expected
    assert llm.engine.stats.acceptance_rate == 1.0


class PerRequestK:
    """A decider that gives each request its own k (0, 1, 3 or 8), and records what it saw."""

    def __init__(self):
        self.records: list[StepRecord] = []

    def decide(self, view: StepView) -> list[int]:
        return [(0, 1, 3, 8)[r.seq_id % 4] for r in view.requests]

    def observe(self, record: StepRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize("proposer", ["ngram", "layer-skip", "draft"])
def test_mixed_k_with_preemption_is_lossless(model, baseline, proposer):
    prompts, expected = baseline
    per_block = kv_bytes_per_block(loaded_from_hf(model).config, 4, torch.float64)
    decider = PerRequestK()
    draft = loaded_from_hf(tiny_hf_model("llama", num_hidden_layers=1, seed=11)) if proposer == "draft" else None
    llm = tiny_llm(model, speculative_config={"proposer": proposer, "k": 2, "draft_layers": 2},
                   decider=decider, draft_loaded=draft, kv_cache_bytes=per_block * 40)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert [o.token_ids for o in outs] == expected
    assert sum(o.num_preemptions for o in outs) > 0, "meant to force preemption"
    ks = {r.k for rec in decider.records for r in rec.requests}
    assert 0 in ks and len(ks) >= 3, ks
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


class AsksForEight(PerRequestK):
    """Always asks for 8 drafts; keeps the views too."""

    def __init__(self):
        super().__init__()
        self.views: list[StepView] = []

    def decide(self, view: StepView) -> list[int]:
        self.views.append(view)
        return [8] * len(view.requests)


@pytest.mark.parametrize("proposer,longest_match,every_match_drafts", [("ngram", 16, True), ("suffix", 24, False)])
def test_lookup_drafts_are_shown_to_the_decider_before_it_decides(model, baseline, proposer, longest_match,
                                                                  every_match_drafts):
    prompts, expected = baseline
    decider = AsksForEight()
    llm = tiny_llm(model, speculative_config={"proposer": proposer, "k": 8}, decider=decider)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, **GREEDY))
    assert [o.token_ids for o in outs] == expected
    shown = [r.available_drafts for v in decider.views for r in v.requests]
    # The view carries the token budget left for drafts, and the engine ran no more than that.
    budget = llm.engine.config.scheduler.max_num_batched_tokens
    assert all(0 <= v.draft_budget <= budget - len(v.requests) for v in decider.views)
    for view, rec in zip(decider.views, [rec for rec in decider.records if rec.requests]):
        assert sum(rr.k for rr in rec.requests) <= view.draft_budget
    # The lookup's match length comes with the drafts: >= 1 with drafts, 0 without a match (None
    # when no request could take a draft, so the proposer was not asked). A suffix match can
    # still give no drafts (every continuation below min_prob).
    matched = [r.match_length for v in decider.views for r in v.requests]
    assert all(0 <= (m or 0) <= longest_match for m in matched)
    assert all(a == 0 for m, a in zip(matched, shown) if not m)  # no match, no drafts
    if every_match_drafts:
        assert all(a > 0 for m, a in zip(matched, shown) if m)
    assert max(m or 0 for m in matched) > 1
    assert None not in shown and 0 in shown and max(shown) > 0  # some requests had no match
    decode_steps = [rec for rec in decider.records if rec.requests]  # prefill-only steps are not decided
    assert len(decode_steps) == len(decider.views)
    for view, rec in zip(decider.views, decode_steps):
        for rv, rr in zip(view.requests, rec.requests):
            assert rv.max_k <= rv.available_drafts  # the cap says what exists
            assert rr.k <= rv.available_drafts and rr.num_proposed == rr.k  # asked no more than there was
            if rr.k:  # the record says which lookup the drafts came from
                assert rr.match_length == rv.match_length


def test_stop_inside_accepted_run_truncates(model):
    prompt = repetitive_prompts(model.config.vocab_size, n=1, seed=9)[0]
    plain = tiny_llm(model).generate(prompt, SamplingParams(max_tokens=40, **GREEDY))[0].token_ids
    llm = tiny_llm(model, speculative_config={"proposer": "draft", "k": 8}, draft_loaded=loaded_from_hf(model))
    for stop_at in (5, 17):
        stop_token = plain[stop_at]
        first = plain.index(stop_token)
        out = llm.generate(prompt, SamplingParams(max_tokens=40, stop_token_ids=[stop_token], **GREEDY))[0]
        assert out.token_ids == plain[:first + 1] and out.finish_reason == "stop"
    for max_tokens in (1, 3, 10):  # max_tokens inside an accepted run
        out = llm.generate(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))[0]
        assert out.token_ids == plain[:max_tokens] and out.finish_reason == "length"


def test_sampled_with_q_equal_p_accepts_every_draft(model):
    llm = tiny_llm(model, speculative_config={"proposer": "draft", "k": 4}, draft_loaded=loaded_from_hf(model))
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=3))
    assert all(len(o.token_ids) == 30 for o in outs)
    assert llm.engine.stats.num_draft_tokens > 0 and llm.engine.stats.acceptance_rate == 1.0


def test_cancel_mid_speculation_returns_all_blocks(model, baseline):
    prompts, _ = baseline
    llm = spec_llm(model, "layer-skip", 4)
    engine = llm.engine
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, SamplingParams(max_tokens=40, **GREEDY))
    for _ in range(4):
        engine.step()
    engine.abort_request("r0")
    engine.abort_request("r3")
    while engine.has_unfinished:
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_spec_metrics_are_reported(model, baseline):
    prompts, _ = baseline
    llm = spec_llm(model, "ngram", 4)
    out = llm.generate(prompts[0], SamplingParams(max_tokens=40, **GREEDY))[0]
    spec = out.metrics["spec"]
    assert spec["num_draft_tokens"] >= spec["num_accepted_tokens"] >= 0
    assert spec["mean_accepted_length"] >= 1.0
    assert len(spec["acceptance_per_position"]) <= 4


class OracleTreeProposer:
    """Proposes a tree whose FIRST branch is wrong and whose second holds the true continuation,
    so the accepted branch's K/V must be moved into place (tree compaction) for later steps."""

    name = "oracle-tree"
    proposes_prefixes = False

    def __init__(self, expected: dict[tuple, list[int]], vocab: int):
        self.expected, self.vocab = expected, vocab
        self.accepted_paths = 0

    def propose(self, seqs, k):
        from specplan.engine import DraftTokens, DraftTree

        trees, linear = [], []
        for seq, ki in zip(seqs, k):
            future = self.expected[tuple(seq.prompt_token_ids)][seq.num_output_tokens:]
            if ki < 4 or len(future) < 3:
                trees.append(None)
                linear.append([])
                continue
            wrong = (future[0] + 1) % self.vocab
            # root -> wrong(1) ; root -> f0(2) -> f1(3) -> f2(4), and f0 -> wrong sibling(5)
            tokens = (seq.token_ids[-1], wrong, future[0], future[1], future[2], (future[1] + 1) % self.vocab)
            parents = (-1, 0, 0, 2, 3, 2)
            trees.append(DraftTree(tokens[:ki + 1], parents[:ki + 1]))
            linear.append([future[0]])
        return DraftTokens(token_ids=linear, trees=trees)

    def on_finished(self, seq):
        pass


@pytest.mark.parametrize("temperature", [0.0])
def test_tree_verification_keeps_the_right_branch(model, baseline, temperature):
    prompts, expected = baseline
    llm = tiny_llm(model, speculative_config={"proposer": "ngram", "k": 5})
    proposer = OracleTreeProposer({tuple(p): e for p, e in zip(prompts, expected)}, model.config.vocab_size)
    llm.engine.set_proposer(proposer)
    outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=temperature))
    assert [o.token_ids for o in outs] == expected
    stats = llm.engine.stats
    # Each tree step accepts the three true tokens (f0, f1, f2) out of five drafts.
    assert stats.num_accepted_tokens >= 3 * len(prompts) and stats.acceptance_rate < 1.0
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks
