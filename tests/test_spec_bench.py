"""The spec benchmark's report, from a small synthetic result table (the real run takes the model for minutes)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from specplan.bench.spec_bench import ROW_COLUMNS, render_spec_report, summarize, target_verdicts
from specplan.bench.workloads import KINDS

# tokens/s per (workload, method); every prompt emits 128 tokens.
SPEEDS = {
    "humaneval": {"specplan plain": 32.0, "specplan ngram k=4": 120.0, "transformers plain": 12.5,
                  "transformers prompt-lookup 10": 17.0, "llama.cpp plain": 30.0, "llama.cpp prompt-lookup 2": 50.0,
                  "llama.cpp prompt-lookup 10": 106.0},
    "xsum": {"specplan plain": 32.0, "specplan ngram k=4": 80.0, "transformers plain": 12.5,
             "transformers prompt-lookup 10": 26.0, "llama.cpp plain": 30.0, "llama.cpp prompt-lookup 2": 60.0,
             "llama.cpp prompt-lookup 10": 104.0},
    "mtbench": {"specplan plain": 32.0, "specplan ngram k=4": 30.0, "transformers plain": 12.5,
                "transformers prompt-lookup 10": 8.4, "llama.cpp plain": 30.0, "llama.cpp prompt-lookup 2": 28.0,
                "llama.cpp prompt-lookup 10": 24.0},
}


def _family(method: str) -> str:
    return {"specplan": "specplan", "transformers": "hf", "llama.cpp": "llama.cpp"}[method.split()[0]]


def synthetic_rows(speeds=SPEEDS, prompts_per_workload: int = 1, drop=()) -> pd.DataFrame:
    rows = []
    for w, methods in speeds.items():
        for i in range(prompts_per_workload):
            for m, tps in methods.items():
                if m in drop:
                    continue
                spec = m.startswith("specplan ngram")
                # The second prompt of a workload runs twice as fast, to test aggregation.
                secs = 128 / (tps * (1 + i))
                rows.append({
                    "workload": w, "kind": KINDS[w], "prompt_id": f"{w}/{i}", "prompt_tokens": 100,
                    "family": _family(m), "method": m, "proposer": "ngram" if spec else (
                        "prompt-lookup" if "lookup" in m else None),
                    "k": 4 if spec else (int(m.split()[-1]) if "lookup" in m else 0), "new_tokens": 128,
                    "seconds": secs, "seconds_all": [secs], "tokens_per_s": 128 / secs,
                    "acceptance_rate": 0.6 if spec else None, "mean_accepted_length": 3.4 if spec else None,
                    "num_drafts": 30 if spec else None,
                    "identical_to_plain": True if m.startswith("specplan") else None,
                    "agree_prefix": 128 if m.startswith("specplan") else 40,
                })
    return pd.DataFrame(rows, columns=list(ROW_COLUMNS))


def test_verdicts_pass_and_fail_from_the_data():
    v = {x["workload"]: x for x in target_verdicts(synthetic_rows())}
    assert set(v) == {"humaneval", "xsum"}  # the target is on code and summarization only
    code, summ = v["humaneval"], v["xsum"]
    assert code["passed"] is True and code["specplan_method"] == "specplan ngram k=4"
    assert code["peer_method"] == "llama.cpp prompt-lookup 10"
    assert code["ratio"] == pytest.approx(120 / 106)
    assert summ["passed"] is False and summ["ratio"] == pytest.approx(80 / 104)
    assert "PASS" in code["line"] and "FAIL" in summ["line"]


def test_verdict_counts_plain_as_k0_and_ties_pass():
    speeds = {"humaneval": {"specplan plain": 50.0, "specplan ngram k=4": 40.0, "llama.cpp prompt-lookup 10": 50.0}}
    (v,) = target_verdicts(synthetic_rows(speeds), workloads=("humaneval",))
    assert v["passed"] is True and v["specplan_method"] == "specplan plain"


def test_verdict_na_without_llama_cpp():
    df = synthetic_rows(drop=("llama.cpp plain", "llama.cpp prompt-lookup 2", "llama.cpp prompt-lookup 10"))
    for v in target_verdicts(df):
        assert v["passed"] is None and "n/a" in v["line"]


def test_summary_aggregates_prompts_and_speedups():
    s = summarize(synthetic_rows(prompts_per_workload=2)).set_index(["workload", "method"])
    # Prompt 0 at 32 tok/s and prompt 1 at 64 tok/s: 256 tokens in 4 + 2 s.
    assert s.loc[("humaneval", "specplan plain"), "tokens_per_s"] == pytest.approx(256 / 6)
    assert s.loc[("humaneval", "specplan ngram k=4"), "x_specplan_plain"] == pytest.approx(120 / 32)
    assert s.loc[("xsum", "llama.cpp prompt-lookup 10"), "x_llama_cpp_plain"] == pytest.approx(104 / 30)
    assert s.loc[("mtbench", "transformers prompt-lookup 10"), "x_transformers_plain"] == pytest.approx(8.4 / 12.5)
    assert s.loc[("humaneval", "specplan ngram k=4"), "acceptance_rate"] == pytest.approx(0.6)
    assert bool(s.loc[("humaneval", "specplan ngram k=4"), "identical_to_plain"]) is True


def test_render_writes_markdown_charts_json_parquet(tmp_path):
    df = synthetic_rows()
    meta = {"command": "specplan bench spec --repeats 3", "machine": {"cpu": "test cpu", "cores": 2},
            "settings": {"max_new_tokens": 128, "prompts_per_workload": 1, "repeats": 3},
            "load_average_before": [0.1, 0.1, 0.1], "load_average_after": [0.2, 0.1, 0.1],
            "notes": ["a note"], "date": "2025-01-01 00:00:00 UTC", "wall_seconds": 12.0}
    paths = render_spec_report(df, tmp_path, meta)
    names = {p.name for p in paths}
    assert {"spec-bench.md", "spec-bench.json", "spec-bench.parquet", "spec-bench-humaneval.png",
            "spec-bench-xsum.png", "spec-bench-mtbench.png"} <= names
    for w in SPEEDS:
        assert (tmp_path / f"spec-bench-{w}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md = (tmp_path / "spec-bench.md").read_text()
    assert "specplan bench spec --repeats 3" in md and "test cpu" in md and "a note" in md
    assert "## code (humaneval: humaneval/0 (100 prompt tokens))" in md and "## summarization (xsum" in md and "## chat (mtbench" in md
    assert "PASS - best static k specplan ngram k=4 120.0 tok/s vs best llama.cpp prompt-lookup 10 106.0" in md
    assert "FAIL" in md
    # The ngram row on code: 120 tok/s, 3.75x specplan plain, 9.60x transformers, 4.00x llama.cpp plain.
    assert "| specplan ngram k=4 | 120.0 | 3.75 | 9.60 | 4.00 | 0.60 | 3.40 | yes | 128/128 |" in md
    assert "| transformers plain | 12.5 | 0.39 | 1.00 | 0.42 | n/a | n/a |  | 40/128 |" in md
    data = json.loads((tmp_path / "spec-bench.json").read_text())
    assert len(data["rows"]) == len(df) and data["meta"]["command"] == meta["command"]
    assert [v["passed"] for v in data["verdicts"]] == [True, False]
    back = pd.read_parquet(tmp_path / "spec-bench.parquet")
    assert len(back) == len(df) and list(back.columns) == list(ROW_COLUMNS)


def test_render_flags_a_lossless_failure(tmp_path):
    df = synthetic_rows()
    df.loc[(df["workload"] == "xsum") & (df["method"] == "specplan ngram k=4"), "identical_to_plain"] = False
    render_spec_report(df, tmp_path)
    md = (tmp_path / "spec-bench.md").read_text()
    assert "| **NO** |" in md
    assert "(not recorded)" in md  # no meta: the report still renders


def test_llama_cpp_draft_acceptance_from_recorded_drafts():
    from specplan.bench.spec_bench import _draft_stats

    full = [1, 2, 3, 4, 5, 6, 7, 8]  # prompt [1, 2, 3] + output [4, 5, 6, 7, 8]
    calls = [
        (3, [4, 5, 9]),  # 2 of 3 accepted
        (6, []),  # no match: not a draft event
        (6, [7, 8, 9, 9]),  # 2 accepted; only 2 positions left to verify
    ]
    s = _draft_stats(full, calls)
    assert (s["num_drafts"], s["num_draft_tokens"], s["num_accepted_tokens"]) == (2, 5, 4)
    assert s["acceptance_rate"] == pytest.approx(0.8) and s["mean_accepted_length"] == pytest.approx(3.0)
    assert _draft_stats(full, [(8, [1, 2])])["num_drafts"] == 0  # past the end: never verified
