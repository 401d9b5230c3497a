"""`specplan export`: the batch-size -> k table from a profile (specplan/export.py)."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from specplan.export import best_uniform_k, k_table, prior_estimate, render, trtllm_schedule
from specplan.profiler.fit import HingeLatencyModel

# Flat (memory-bound) up to 32 query tokens, then each token adds 10% of the step: compute-bound.
RIDGE = HingeLatencyModel(0.01, (32.0,), (1e-3,), 0.0, 0.0)


def test_memory_bound_speculates_and_compute_bound_does_not():
    est = prior_estimate("ngram", 8, acceptance=0.8)
    k1, gain1 = best_uniform_k(RIDGE, est, 1, max_k=8, context_tokens=256)
    k32, gain32 = best_uniform_k(RIDGE, est, 32, max_k=8, context_tokens=256)
    assert k1 > 0 and gain1 > 1.02
    assert k32 == 0 and gain32 == 1.0
    # Higher acceptance never asks for fewer drafts at B = 1.
    assert best_uniform_k(RIDGE, prior_estimate("ngram", 8, 0.95), 1, max_k=8, context_tokens=256)[0] >= k1


@pytest.mark.parametrize("acceptance", [None, 0.3, 0.9])
def test_ranges_cover_every_batch_size_without_gaps(acceptance):
    rows = k_table(RIDGE, prior_estimate("ngram", 8, acceptance), max_batch=40, max_k=8, context_tokens=256)
    assert rows[0][0] == 1 and rows[-1][1] == 40
    assert all(a[1] + 1 == b[0] for a, b in zip(rows, rows[1:]))
    assert all(s <= e and 0 <= k <= 8 for s, e, k in rows)
    assert all(a[2] != b[2] for a, b in zip(rows, rows[1:]))  # equal neighbours merged
    assert rows[-1][2] == 0  # B = 33..40 is past the ridge before any draft
    # k never grows with the batch on this ridge: each draft costs more as the batch fills it.
    ks = [k for _, _, k in rows]
    assert ks == sorted(ks, reverse=True)


def test_formats():
    rows = [(1, 2, 4), (3, 8, 2), (9, 16, 0)]
    doc, snippet = render("vllm", rows, {"profile": "p.json"})
    assert doc["num_speculative_tokens_per_batch_size"] == [[1, 2, 4], [3, 8, 2], [9, 16, 0]]
    assert doc["num_speculative_tokens"] == 4 and "num_speculative_tokens_per_batch_size" in snippet
    assert trtllm_schedule(rows) == {2: 4, 8: 2}  # past the last key TensorRT-LLM runs k = 0
    doc, snippet = render("trtllm", rows, {})
    assert doc["draft_len_schedule"] == {"2": 4, "8": 2} and "draft_len_schedule={2: 4, 8: 2}" in snippet
    assert "never pays" in render("vllm", [(1, 4, 0)], {})[1]
    with pytest.raises(ValueError, match="unknown format"):
        render("sglang", rows, {})


def test_vllm_accepts_the_table_it_is_given():
    """vLLM's own validator, when vLLM is here (its rules are restated in specplan/export.py)."""
    utils = pytest.importorskip("vllm.v1.spec_decode.dynamic.utils", reason="vLLM is not installed")
    rows = k_table(RIDGE, prior_estimate("ngram", 8), max_batch=64, max_k=8, context_tokens=256)
    dense = utils.build_dynamic_sd_schedule_lookup([list(r) for r in rows], 64, max(k for _, _, k in rows))
    assert dense[1:] == [k for s, e, k in rows for _ in range(s, e + 1)]


def test_cli_prints_json_and_says_what_is_wrong(tmp_path):
    from test_vllm_plugin import synthetic_profile, tiny_llama_config

    from specplan.cli import app

    path = synthetic_profile(tiny_llama_config(), tmp_path / "p.json")
    runner = CliRunner()
    result = runner.invoke(app, ["export", str(path), "--format", "vllm", "--max-batch", "32"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    table = doc["num_speculative_tokens_per_batch_size"]
    assert table[0][0] == 1 and table[-1][1] == 32 and doc["proposer"] == "ngram"
    result = runner.invoke(app, ["export", str(path), "--format", "trtllm", "--acceptance", "0.9"])
    assert result.exit_code == 0 and "draft_len_schedule" in json.loads(result.stdout)
    bad = runner.invoke(app, ["export", str(tmp_path / "missing.json")])
    assert bad.exit_code == 2 and "does not exist" in bad.output and "Traceback" not in bad.output
    bad = runner.invoke(app, ["export", str(path), "--acceptance", "1.5"])
    assert bad.exit_code == 2 and "acceptance must be in [0, 1]" in bad.output
    bad = runner.invoke(app, ["export", str(path), "--format", "sglang"])
    assert bad.exit_code == 2 and "not one of vllm, trtllm" in bad.output
