"""SLA sweeps: the load generator's metrics against a hand-computed example, the report from a
small synthetic results file (and its pass/fail logic), and a few-second sweep end to end on a
tiny random model served in-process."""

from __future__ import annotations

import dataclasses
import json
import math

import pandas as pd
import pytest
import torch

from conftest import chat_tokenizer, loaded_from_hf, tiny_hf_model
from specplan.bench.arrivals import arrival_times
from specplan.bench.client import StreamResult, parse_sse_line
from specplan.bench.sla import SLA, is_good, max_load_meeting, meets_itl_sla, request_timings, summarize_level
from specplan.bench.sweep_report import evaluate_checks, render_report


def _sse(obj) -> str:
    return "data: " + (obj if isinstance(obj, str) else json.dumps(obj))


def _chunk(text, finish=None):
    return _sse({"id": "cmpl-abc", "object": "text_completion",
                 "choices": [{"index": 0, "text": text, "finish_reason": finish}]})


# ---- the metrics, by hand ------------------------------------------------------------------------------
def test_stream_metrics_match_a_hand_computed_example():
    # Sent at t=10.00 s; chunks at 10.25 (2 tokens), 10.30 (1), 10.45 (3), 10.50 (1 + finish);
    # then the usage-only chunk (7 tokens) and [DONE], neither of which is a chunk for timing.
    s = StreamResult()
    for t, line in [(10.25, _chunk("ab")), (10.26, ""), (10.30, _chunk("c")), (10.45, _chunk("def")),
                    (10.50, _chunk("g", "length")),
                    (10.51, _sse({"id": "cmpl-abc", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7,
                                                                             "total_tokens": 12}})),
                    (10.52, ": ping"), (10.53, _sse("[DONE]"))]:
        parse_sse_line(line, t, s)
    assert s.chunk_times == [10.25, 10.30, 10.45, 10.50] and s.output_tokens == 7 and s.prompt_tokens == 5
    assert s.response_id == "cmpl-abc" and s.done and s.error is None
    t = request_timings(10.0, s.chunk_times, s.output_tokens)
    assert t["ttft_s"] == pytest.approx(0.25)  # first chunk - send
    assert t["itl_s"] == pytest.approx([0.05, 0.15, 0.05])  # gaps between chunks
    assert t["e2el_s"] == pytest.approx(0.50)  # last chunk - send
    assert t["tpot_s"] == pytest.approx((0.50 - 0.25) / (7 - 1))  # 41.67 ms

    # An error event in the stream.
    e = StreamResult()
    parse_sse_line(_sse({"error": {"message": "boom", "type": "x"}}), 1.0, e)
    assert e.error == "boom" and not e.chunk_times


def test_level_metrics_and_goodput_match_a_hand_computed_example():
    def row(ttft, itl, out, success=True):
        e2el = ttft + sum(itl)
        return {"success": success, "prompt_tokens": 10, "output_tokens": out, "ttft_s": ttft, "itl_s": itl,
                "e2el_s": e2el, "tpot_s": (e2el - ttft) / (out - 1) if out > 1 else math.nan}

    rows = [row(0.10, [0.04, 0.04], 5),  # TPOT 80/4 = 20 ms, E2EL 180 ms
            row(0.30, [0.10], 3),  # TPOT 100/2 = 50 ms, E2EL 400 ms
            row(0.20, [], 1),  # one token: no TPOT sample (TPOT 0 for goodput), E2EL 200 ms
            {**row(0.05, [0.01], 2), "success": False}]  # failed: ignored everywhere but the count
    sla = SLA(ttft_ms=250, itl_ms=30)  # goodput: TTFT <= 250 ms and TPOT <= 30 ms
    assert [is_good(r, sla) for r in rows] == [True, False, True, False]
    m = summarize_level(rows, duration_s=2.0, sla=sla)
    assert (m["completed"], m["failed"], m["total_output"], m["total_input"]) == (3, 1, 9, 30)
    assert m["request_throughput"] == pytest.approx(1.5)  # 3 / 2 s
    assert m["output_throughput"] == pytest.approx(4.5)  # 9 tokens / 2 s
    assert m["total_token_throughput"] == pytest.approx(19.5)  # (30 + 9) / 2 s
    assert m["request_goodput"] == pytest.approx(1.0)  # 2 good / 2 s
    # TTFT samples 100, 300, 200 ms: mean 200, median 200, p90 = 200 + 0.8 * (300 - 200) = 280.
    assert m["mean_ttft_ms"] == pytest.approx(200) and m["median_ttft_ms"] == pytest.approx(200)
    assert m["p90_ttft_ms"] == pytest.approx(280)
    # TPOT samples 20 and 50 ms (the one-token request has none): mean 35, p90 = 20 + 0.9 * 30 = 47.
    assert m["mean_tpot_ms"] == pytest.approx(35) and m["p90_tpot_ms"] == pytest.approx(47)
    # ITL samples 40, 40, 100 ms: mean 60, median 40, p90 = 40 + 0.8 * 60 = 88, p99 = 40 + 0.98 * 60 = 98.8.
    assert m["mean_itl_ms"] == pytest.approx(60) and m["median_itl_ms"] == pytest.approx(40)
    assert m["p90_itl_ms"] == pytest.approx(88) and m["p99_itl_ms"] == pytest.approx(98.8)
    # E2EL samples 180, 400, 200 ms: mean 260, median 200.
    assert m["mean_e2el_ms"] == pytest.approx(260) and m["median_e2el_ms"] == pytest.approx(200)
    assert not meets_itl_sla(m, SLA(itl_ms=100))  # a failed request: the level does not meet the SLA
    ok = summarize_level(rows[:3], 2.0, sla)
    assert meets_itl_sla(ok, SLA(itl_ms=90)) and not meets_itl_sla(ok, SLA(itl_ms=80))


def test_arrivals_and_max_load_rule():
    a = arrival_times(4.0, duration_s=30.0, seed=1)
    assert a == arrival_times(4.0, duration_s=30.0, seed=1) and a[0] == 0.0 and max(a) < 30.0
    assert 80 < len(a) < 160  # Poisson with mean 120
    assert len(arrival_times(2.0, num_requests=7, seed=0)) == 7
    assert arrival_times(float("inf"), num_requests=3) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        arrival_times(1.0)
    assert max_load_meeting([1, 2, 4, 8], [True, True, False, True]) == 2  # every lower load must pass too
    assert max_load_meeting([1, 2], [False, True]) is None


# ---- the report from synthetic results ------------------------------------------------------------------
POLICIES = ["off", "static:4", "goodput"]
LOADS = [0.5, 1.0, 2.0]


def _synthetic(tmp_path, goodput_tput_at_high=99.0, static4_tput_at_high=90.0, goodput_tpot_low=30.0):
    """levels/requests/sweep.json for 3 policies x 3 loads with chosen numbers."""
    # p90 ITL (ms) per policy per load; SLA 100 ms -> max loads: off 1.0, static:4 0.5, goodput 2.0.
    itl = {"off": [50, 80, 150], "static:4": [90, 120, 200], "goodput": [60, 85, 95]}
    tpot = {"off": [45, 60, 120], "static:4": [25, 50, 150], "goodput": [goodput_tpot_low, 45, 100]}
    tput = {"off": [30, 55, 100], "static:4": [40, 60, static4_tput_at_high], "goodput": [40, 60, goodput_tput_at_high]}
    levels, reqs = [], []
    for p in POLICIES:
        for i, load in enumerate(LOADS):
            lv = {"policy": p, "mode": "rate", "load": load, "level_index": i, "num_requests": 4, "completed": 4,
                  "failed": 0, "duration_s": 8.0, "total_input": 40, "total_output": 64,
                  "request_throughput": 0.5, "request_goodput": 0.4 - 0.1 * i, "output_throughput": tput[p][i],
                  "total_token_throughput": tput[p][i] + 5, "good_fraction": 0.8, "spec_steps": 40,
                  "mean_k": 0.0 if p == "off" else 2.0, "k0_share": 1.0 if p == "off" else 0.3,
                  "num_draft_tokens": 0 if p == "off" else 80, "num_accepted_tokens": 0 if p == "off" else 40,
                  "acceptance_rate": 0.0 if p == "off" else 0.5, "engine_steps": 50, "mean_decode_batch": 2.0,
                  "mean_step_ms": 40.0}
            for m in ("ttft", "tpot", "itl", "e2el"):
                base = {"itl": itl[p][i], "tpot": tpot[p][i], "ttft": 100.0, "e2el": 900.0}[m]
                lv.update({f"mean_{m}_ms": base * 0.9, f"median_{m}_ms": base * 0.8, f"std_{m}_ms": 1.0,
                           f"p50_{m}_ms": base * 0.8, f"p90_{m}_ms": base, f"p99_{m}_ms": base * 1.2})
            lv["mean_tpot_ms"] = tpot[p][i]
            lv["meets_itl_sla"] = itl[p][i] <= 100
            levels.append(lv)
            for j in range(4):
                k = {"off": {"0": 10}, "static:4": {"4": 10}, "goodput": {"0": 2 * i + 1, "2": 5, "4": 4 - i}}[p]
                reqs.append({"policy": p, "mode": "rate", "load": load, "level_index": i, "index": j,
                             "workload": ["humaneval", "gsm8k"][j % 2], "prompt_id": f"x/{j}", "prompt_tokens": 10,
                             "max_tokens": 16, "success": True, "error": "", "output_tokens": 16, "ttft_s": 0.1,
                             "tpot_s": 0.04, "e2el_s": 0.7, "itl_s": [0.04] * 15, "num_chunks": 16,
                             "response_id": f"cmpl-{j}", "start_s": 0.0, "end_s": 0.7, "send_at": 0.0,
                             "spec_steps": 10, "k_sum": 0 if p == "off" else 20, "k0_steps": 10 if p == "off" else 2,
                             "num_draft_tokens": 0 if p == "off" else 20,
                             "num_accepted_tokens": 0 if p == "off" else (12 if j % 2 == 0 else 6),
                             "num_emitted_tokens": 16, "mean_k": 2.0, "acceptance_rate": 0.5, "k_hist": json.dumps(k)})
    out = tmp_path / "synthetic"
    out.mkdir()
    pd.DataFrame(levels).to_parquet(out / "levels.parquet")
    pd.DataFrame(reqs).to_parquet(out / "requests.parquet")
    (out / "sweep.json").write_text(json.dumps({
        "policies": POLICIES, "mode": "rate", "loads": LOADS, "load_unit": "req/s", "workload": "mix",
        "sla": {"ttft_ms": 1000.0, "itl_ms": 100.0, "tpot_ms": None, "e2el_ms": None}, "duration_s": 8.0,
        "num_requests": None, "max_tokens": 16, "temperature": 0.0, "warmup_requests": 1, "model": "synthetic",
        "proposer": "ngram", "status": "complete", "started": "now", "machine": {}}))
    return out


def test_report_renders_from_synthetic_results_and_all_checks_pass(tmp_path):
    out = _synthetic(tmp_path)
    path = render_report(out)
    text = path.read_text()
    for png in ("latency.png", "throughput.png", "goodput.png", "max_load.png", "k_distribution.png", "acceptance.png"):
        assert (out / png).stat().st_size > 5000, png
        assert f"]({png})" in text
    assert text.count("**PASS**") == 3 and "**FAIL**" not in text
    assert "off: 1 req/s; static:4: 0.5 req/s; goodput: 2 req/s" in text  # max loads
    assert "0.67×" in text  # lowest-load TPOT ratio 30 / 45
    assert "0.990×" in text and "static:4 90.0 tok/s = 0.900× off" in text
    assert "goodput 2 req/s, off 1 req/s, static:4 0.5 req/s" in text  # the ranked summary line
    # Acceptance per workload over all levels: humaneval 3 x 24/40, gsm8k 3 x 12/40; off proposes nothing.
    assert "| goodput | 30% (120 drafts) | 60% (120 drafts) |" in text and "| off | " not in text.split("per workload")[1]
    # Re-rendering with another SLA re-judges without a re-run: at 160 ms every policy passes every load.
    text2 = render_report(out, sla=SLA(ttft_ms=1000.0, itl_ms=160.0)).read_text()
    assert "off: 2 req/s" in text2 and "re-judged" in text2


@pytest.mark.parametrize("change,failing", [
    (dict(goodput_tput_at_high=97.0), "at the highest load"),  # 0.97 x off < 0.98
    (dict(static4_tput_at_high=99.0), "at the highest load"),  # static:4 not measurably below off
    (dict(goodput_tpot_low=40.0), "at the lowest load"),  # 40 / 45 = 0.89 > 0.8
])
def test_report_checks_fail_when_a_target_is_missed(tmp_path, change, failing):
    out = _synthetic(tmp_path, **change)
    levels = pd.read_parquet(out / "levels.parquet")
    checks = evaluate_checks(levels, POLICIES, SLA(ttft_ms=1000.0, itl_ms=100.0))
    assert [c.name for c in checks if c.status == "FAIL"] == [c.name for c in checks if c.name.startswith(failing)]
    assert "**FAIL**" in render_report(out).read_text()


def test_max_load_check_fails_when_another_policy_sustains_more(tmp_path):
    out = _synthetic(tmp_path)
    levels = pd.read_parquet(out / "levels.parquet")
    levels.loc[levels["policy"] == "off", "p90_itl_ms"] = 10.0  # off now meets the SLA at every load
    (c1, *_) = evaluate_checks(levels, POLICIES, SLA(itl_ms=100.0))
    assert c1.status == "PASS"  # a tie (2 req/s each) still meets ">= every other policy's"
    levels.loc[(levels["policy"] == "goodput") & (levels["load"] == 2.0), "p90_itl_ms"] = 150.0
    (c1, *_) = evaluate_checks(levels, POLICIES, SLA(itl_ms=100.0))
    assert c1.status == "FAIL" and "goodput: 1 req/s" in c1.detail and "higher than goodput: off" in c1.detail


# ---- a short sweep end to end ----------------------------------------------------------------------------
TEXTS = ["def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n",
         "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
         "Write a short poem about the sea and the sky and the sea again.",
         "Summarize: the quick brown fox jumps over the lazy dog; the lazy dog sleeps."]


def _tiny_loaded():
    tok = chat_tokenizer(TEXTS, vocab_size=300)
    model = tiny_hf_model("llama", dtype=torch.float32, vocab_size=len(tok), max_position_embeddings=256, seed=5)
    return dataclasses.replace(loaded_from_hf(model, name="tiny-sweep"), tokenizer=tok)


def _synthetic_profile(loaded):
    from specplan.profiler.fit import HingeLatencyModel
    from specplan.profiler.profile import (CeilingsModel, CostConstants, DraftCost, FitError, Profile,
                                           fingerprint)

    latency = HingeLatencyModel(0.002, (4.0, 16.0), (1e-5, 1e-4), 1e-7, 1e-5)
    return Profile(fingerprint=fingerprint(loaded.config, torch.float32, "cpu"),
                   ceilings=CeilingsModel(peak_flops=1e11, bandwidth=2e10, ridge=5.0),
                   cost=CostConstants(weight_bytes=1e6, flops_per_token=1e5, lm_head_flops_per_row=4e4,
                                      kv_bytes_per_token=1e3, attention_flops_per_token_pair=1e3),
                   latency_model=latency.to_dict(),
                   fit=FitError(heldout_mape=5, train_mape=4, roofline_mape=50, num_cells=8, num_heldout=2),
                   draft_costs={"ngram": DraftCost(per_token_s=1e-6)}, max_batch=16, max_tokens_per_seq=9)


def test_short_sweep_runs_end_to_end(tmp_path):
    from specplan.bench.workloads import Prompt
    from specplan.bench.sweep import run_sweep

    loaded = _tiny_loaded()
    prompts = [Prompt("humaneval", "h/0", TEXTS[0]),
               Prompt("gsm8k", "g/0", TEXTS[1], [{"role": "user", "content": TEXTS[1]}]),
               Prompt("mtbench", "m/0", TEXTS[2], [{"role": "user", "content": TEXTS[2]}]),
               Prompt("xsum", "x/0", TEXTS[3], [{"role": "user", "content": TEXTS[3]}])]
    out = run_sweep(["off", "goodput"], rates=[2.0, 6.0], workload=prompts, sla_ttft_ms=2000, sla_itl_ms=200,
                    duration_s=2.0, out_dir=tmp_path / "sweep", proposer="ngram", profile=_synthetic_profile(loaded),
                    seed=1, max_tokens=24, warmup_requests=1, drain_timeout_s=20, loaded=loaded,
                    engine_kwargs=dict(block_size=4, kv_cache_bytes=4 * 1024**2, max_model_len=256, max_num_seqs=16,
                                       max_num_batched_tokens=256),
                    progress=False, command="test")
    reqs = pd.read_parquet(out / "requests.parquet")
    levels = pd.read_parquet(out / "levels.parquet")
    config = json.loads((out / "sweep.json").read_text())
    assert config["status"] == "complete" and config["deciders"]["off"] == "FixedDecider(k=0)"
    assert config["weights"] == "float32"
    assert len(levels) == 4 and set(levels["policy"]) == {"off", "goodput"} and set(levels["load"]) == {2.0, 6.0}
    assert reqs["success"].all(), reqs[~reqs["success"]]["error"].tolist()
    # The same requests (prompt and send time) for both policies at a level.
    for load in (2.0, 6.0):
        a, b = (reqs[(reqs["policy"] == p) & (reqs["load"] == load)].sort_values("index") for p in ("off", "goodput"))
        assert a["prompt_id"].tolist() == b["prompt_id"].tolist() and a["send_at"].tolist() == b["send_at"].tolist()
    assert (reqs["output_tokens"] > 0).all() and (reqs["spec_steps"] > 0).all()
    assert (reqs["ttft_s"] > 0).all() and (reqs["e2el_s"] >= reqs["ttft_s"]).all()
    assert (reqs["num_chunks"] == reqs["itl_s"].map(len) + 1).all()
    off = reqs[reqs["policy"] == "off"]
    assert (off["k_sum"] == 0).all() and (off["num_draft_tokens"] == 0).all()
    assert (levels["output_throughput"] > 0).all() and (levels["completed"] == levels["num_requests"]).all()
    text = (out / "report.md").read_text()  # run_sweep renders the report
    assert "## Summary" in text and (out / "latency.png").exists()
    assert "Model **tiny-sweep** (float32 weights)" in text


def test_the_sweep_loads_the_weights_it_is_asked_for_and_writes_nothing_when_it_cannot(tmp_path, monkeypatch):
    """``specplan sweep --quantize`` reaches the loader; a load that fails writes nothing (the CLI's
    check of --out made the folder, nothing more)."""
    from typer.testing import CliRunner

    from specplan.cli import app
    from specplan.engine.model.loader import ModelLoadError

    asked = []

    def refuse(model=None, quantize="none", **_):
        asked.append(quantize)
        raise ModelLoadError("no model here")

    monkeypatch.setattr("specplan.engine.load_model", refuse)  # run_sweep imports it when it runs
    out = tmp_path / "sweep"
    result = CliRunner().invoke(app, ["sweep", "--rates", "1", "--policies", "off", "--workload", "gsm8k",
                                      "--quantize", "int8", "--out", str(out)])
    assert asked == ["int8"] and "no model here" in result.stderr and result.exit_code == 2
    assert list(out.iterdir()) == []
