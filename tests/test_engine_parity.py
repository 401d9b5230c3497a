"""Greedy output of our engine equals Hugging Face transformers' generate, token for token."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import hf_greedy, tiny_hf_model, tiny_llm
from specplan.engine import SamplingParams


def prompts(n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_greedy_matches_transformers(arch):
    model = tiny_hf_model(arch)
    llm = tiny_llm(model)
    ps = prompts(4, model.config.vocab_size)
    outs = llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=24))
    for p, o in zip(ps, outs):
        assert o.token_ids == hf_greedy(model, p, 24)
        assert o.finish_reason == "length"


def test_rope_scaling_and_untied_head_match_transformers():
    model = tiny_hf_model("llama", tie_word_embeddings=False,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    llm = tiny_llm(model)
    p = prompts(1, model.config.vocab_size, seed=3)[0]
    out = llm.generate(p, SamplingParams(temperature=0.0, max_tokens=80))[0]
    assert out.token_ids == hf_greedy(model, p, 80)


def test_float32_matches_transformers(tiny_llama):
    model = tiny_hf_model("llama", dtype=torch.float32)
    llm = tiny_llm(model, dtype=torch.float32)
    ps = prompts(3, model.config.vocab_size, seed=5)
    for p, o in zip(ps, llm.generate(ps, SamplingParams(temperature=0.0, max_tokens=16))):
        assert o.token_ids == hf_greedy(model, p, 16)
