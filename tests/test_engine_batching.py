"""Batching changes nothing: continuous batching, chunked prefill and preemption keep outputs exact."""

from __future__ import annotations

import random

import pytest

from conftest import tiny_llm
from specplan.engine import SamplingParams
from specplan.engine.model_runner import kv_bytes_per_block


def mixed_requests(vocab: int, n: int = 16, seed: int = 7):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 60))]
        reqs.append((prompt, rng.randint(1, 30)))
    return reqs


def run_alone(model, reqs):
    llm = tiny_llm(model)
    return [llm.generate(p, SamplingParams(temperature=0.0, max_tokens=m))[0].token_ids for p, m in reqs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    reqs = mixed_requests(tiny_llama.config.vocab_size)
    return reqs, run_alone(tiny_llama, reqs)


def test_sixteen_mixed_requests_together_equal_alone(tiny_llama, reference):
    reqs, alone = reference
    # A small token budget forces chunked prefill and prefills mixed with decodes in one step.
    llm = tiny_llm(tiny_llama, max_num_batched_tokens=32)
    outs = llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0.0, max_tokens=m) for _, m in reqs])
    assert [o.token_ids for o in outs] == alone
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_preemption_under_small_kv_budget_keeps_outputs(tiny_llama, reference):
    reqs, alone = reference
    block_size = 4
    per_block = kv_bytes_per_block(tiny_llm(tiny_llama).engine.model_config, block_size, __import__("torch").float64)
    longest = max(len(p) + m for p, m in reqs)
    # Room for about two of the longest requests: sixteen at once must preempt.
    llm = tiny_llm(tiny_llama, block_size=block_size, kv_cache_bytes=per_block * (2 * longest // block_size + 2))
    outs = llm.generate([p for p, _ in reqs], [SamplingParams(temperature=0.0, max_tokens=m) for _, m in reqs])
    assert [o.token_ids for o in outs] == alone
    assert sum(o.num_preemptions for o in outs) > 0, "the test meant to force preemption"
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_max_num_seqs_limits_running(tiny_llama, reference):
    reqs, alone = reference
    llm = tiny_llm(tiny_llama, max_num_seqs=3)
    engine = llm.engine
    for i, (p, m) in enumerate(reqs):
        engine.add_request(f"r{i}", p, SamplingParams(temperature=0.0, max_tokens=m))
    peak = 0
    while engine.has_unfinished:
        engine.step()
        peak = max(peak, len(engine.scheduler.running))
    assert peak == 3
    assert [engine.pop_finished(f"r{i}")[0].token_ids for i in range(len(reqs))] == alone
