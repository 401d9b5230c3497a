"""Sampling: seeded reproducibility independent of the batch, and top-k / top-p supports."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_llm
from specplan.engine import SamplingParams
from specplan.engine.sampling import probabilities, sample_from


def test_same_seed_same_output_whatever_the_batch(tiny_llama):
    llm = tiny_llm(tiny_llama)
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=20)
    alone = llm.generate([5, 6, 7], p)[0].token_ids
    others = [[1, 2, 3, 4], [9, 8], [11] * 13]
    batch = llm.generate([[5, 6, 7]] + others, [p] + [SamplingParams(temperature=1.0, max_tokens=20)] * 3)
    assert batch[0].token_ids == alone
    assert llm.generate([5, 6, 7], p)[0].token_ids == alone
    # A different seed gives a different sample (20 tokens from ~96: collision is negligible).
    assert llm.generate([5, 6, 7], SamplingParams(temperature=1.0, seed=99, max_tokens=20))[0].token_ids != alone


def test_n_samples_differ_and_are_reproducible(tiny_llama):
    llm = tiny_llm(tiny_llama)
    p = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12)
    first = [o.token_ids for o in llm.generate([3, 4, 5], p)]
    assert len(first) == 3 and len({tuple(t) for t in first}) == 3
    assert [o.token_ids for o in llm.generate([3, 4, 5], p)] == first


def test_top_k_restricts_support():
    logits = torch.randn(2, 50)
    probs = probabilities(logits, torch.tensor([1.0, 0.7]), torch.tensor([5, 1]), torch.tensor([1.0, 1.0]))
    assert (probs[0] > 0).sum() == 5
    assert set(probs[0].nonzero().flatten().tolist()) == set(logits[0].topk(5).indices.tolist())
    assert (probs[1] > 0).sum() == 1 and probs[1].argmax() == logits[1].argmax()
    assert torch.allclose(probs.sum(-1), torch.ones(2))


def test_top_p_keeps_smallest_prefix_reaching_p():
    # probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.7 keeps {0, 1}; 0.8 keeps {0, 1} (0.5+0.3 = 0.8 reached)
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    for top_p, support in [(0.7, {0, 1}), (0.8, {0, 1}), (0.81, {0, 1, 2}), (0.4, {0}), (1.0, {0, 1, 2, 3})]:
        probs = probabilities(logits, torch.tensor([1.0]), torch.tensor([0]), torch.tensor([top_p]))
        assert set(probs[0].nonzero().flatten().tolist()) == support, top_p


def test_sampled_tokens_stay_in_support_and_follow_distribution():
    probs = torch.tensor([[0.0, 0.6, 0.0, 0.4]]).expand(4000, -1)
    gen = torch.Generator().manual_seed(0)
    tokens = sample_from(probs, [None] * 4000, gen)
    counts = torch.bincount(tokens, minlength=4)
    assert counts[0] == 0 and counts[2] == 0
    assert abs(counts[1].item() / 4000 - 0.6) < 0.03


def test_engine_top_k_one_equals_greedy(tiny_llama):
    llm = tiny_llm(tiny_llama)
    greedy = llm.generate([7, 8, 9], SamplingParams(temperature=0.0, max_tokens=15))[0].token_ids
    topk1 = llm.generate([7, 8, 9], SamplingParams(temperature=0.8, top_k=1, max_tokens=15))[0].token_ids
    assert topk1 == greedy


@pytest.mark.parametrize("kwargs", [dict(max_tokens=-1), dict(max_tokens=0), dict(temperature=-0.5),
                                    dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-3), dict(n=0),
                                    dict(stop=[""])])
def test_bad_sampling_params_are_rejected(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)
