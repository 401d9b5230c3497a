"""Bad requests get a clear error and leave the engine usable; cancellation frees KV blocks."""

from __future__ import annotations

import pytest

from conftest import tiny_llm
from specplan.engine import RequestError, SamplingParams


def test_bad_requests_leave_engine_usable(tiny_llama):
    llm = tiny_llm(tiny_llama, max_model_len=64)
    engine = llm.engine
    good = llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids
    with pytest.raises(RequestError, match="empty"):
        engine.add_request("a", [], SamplingParams())
    with pytest.raises(RequestError, match="context"):
        engine.add_request("b", list(range(70)), SamplingParams())
    with pytest.raises(RequestError, match="max_tokens"):
        engine.add_request("c", [1, 2], SamplingParams(max_tokens=63))
    with pytest.raises(RequestError, match="token ids"):
        engine.add_request("d", [1, 10_000], SamplingParams())
    assert not engine.has_unfinished
    assert llm.generate([1, 2, 3], SamplingParams(temperature=0.0, max_tokens=8))[0].token_ids == good


def test_cancel_frees_blocks_and_others_finish(tiny_llama):
    llm = tiny_llm(tiny_llama)
    engine, bm = llm.engine, llm.engine.block_manager
    engine.add_request("keep", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=10))
    engine.add_request("drop", list(range(30)), SamplingParams(temperature=0.0, max_tokens=30))
    engine.step()
    engine.step()
    assert bm.num_free_blocks < bm.num_blocks
    engine.abort_request("drop")
    while engine.has_unfinished:
        engine.step()
    assert len(engine.pop_finished("keep")[0].token_ids) == 10
    assert bm.num_free_blocks == bm.num_blocks


def test_stop_token_and_max_tokens(tiny_llama):
    llm = tiny_llm(tiny_llama)
    full = llm.generate([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert full.finish_reason == "length" and len(full.token_ids) == 12
    stop_at = full.token_ids[5]
    first = full.token_ids.index(stop_at)
    out = llm.generate([4, 5, 6], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == full.token_ids[:first + 1] and out.finish_reason == "stop"
