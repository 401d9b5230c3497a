"""specplan/bench/coldstart.py: cold-start cells, the mixed batch, calibration; the summary by hand."""

from __future__ import annotations

import random

import pytest

from specplan.bench.coldstart import (ADAPTIVE, OFF, WARM, CalibrationRecorder, ChildJob, pooled_cells,
                                      pooled_spread, render, spawn, spread_test, summarize)
from specplan.bench.evaluate import NULL_CONTROL
from specplan.engine.decider import RequestRecord, RequestView, StepRecord, StepView
from specplan.planner import Planner
from specplan.policies import make_policy

from conftest import RidgeLatency, flat_profile


def cold_rows(tok_s: dict[str, list[float]], digest=lambda arm, prompt: f"d{prompt}") -> list[dict]:
    """Rows of one workload: per arm and run, two prompts of 10 tokens each at the given tok/s."""
    rows = []
    for arm, per_run in tok_s.items():
        for run, speed in enumerate(per_run):
            for prompt in range(2):
                rows.append({"workload": "w", "arm": arm, "run": run, "prompt": prompt, "tokens": 10,
                             "seconds": 10 / speed, "digest": digest(arm, prompt), "mean_k": 1.0,
                             "k_zero_share": 0.0})
    return rows


def test_cold_start_summary_by_hand():
    rows = cold_rows({OFF: [10, 12, 11], "static:2": [13, 12, 14], ADAPTIVE: [13, 13, 12], WARM: [14, 14, 14]})
    s = summarize(rows, [], [])["cold_start"]["w"]
    assert s["best_static"] == "static:2" and s["lossless"]
    assert s["tok_s_median"][ADAPTIVE] == pytest.approx(13.0)
    assert s["spread"]["static:2"] == pytest.approx(2 / 13)
    # evaluate.py paired_ratios' worked example: vs off 1.09 (median of 13/10, 13/12, 12/11), vs best 1.0
    assert s[ADAPTIVE]["paired_vs_off"] == pytest.approx(12 / 11)
    assert s[ADAPTIVE]["paired_vs_best_static"] == pytest.approx(1.0)
    assert s[ADAPTIVE]["meets_bar"] and s[WARM]["meets_bar"]
    assert s[WARM]["spread_no_wider_than_best_static"]  # 0 vs 2/13
    assert s[ADAPTIVE]["spread_no_wider_than_best_static"]  # 1/13 vs 2/13
    changed = summarize(cold_rows({OFF: [10], ADAPTIVE: [11]}, digest=lambda arm, p: f"{arm}{p}"), [], [])
    assert not changed["cold_start"]["w"]["lossless"]


def test_paired_spread_cancels_the_machine_drift_common_to_a_run():
    # Run 1 is 20% slower for every arm: the raw spreads see it, the paired ones do not.
    rows = cold_rows({OFF: [10, 12, 10], "static:2": [13, 15.6, 13], ADAPTIVE: [13, 15, 14],
                      NULL_CONTROL: [10, 12.6, 9.5]})
    s = summarize(rows, [], [])["cold_start"]["w"]
    assert s["spread"]["static:2"] == pytest.approx(2.6 / 13)
    assert s["paired_spread"]["static:2"] == pytest.approx(0.0)  # 1.3 every run
    # ratios 1.3, 1.25, 1.4 -> (1.4 - 1.25) / 1.3
    assert s["paired_spread"][ADAPTIVE] == pytest.approx(0.15 / 1.3)
    assert OFF not in s["paired_spread"]  # 1.0 by construction
    assert not s[ADAPTIVE]["paired_spread_no_wider_than_best_static"]
    assert s["null_control_vs_off"] == pytest.approx(1.0)  # median of 1.0, 1.05, 0.95
    # Where SD off is the best static k, the null control's paired spread is the yardstick.
    rows = cold_rows({OFF: [10, 12, 10], "static:2": [9, 10, 9], ADAPTIVE: [10, 12, 10.2], NULL_CONTROL: [10, 12.6, 9.5]})
    s = summarize(rows, [], [])["cold_start"]["w"]
    assert s["best_static"] == OFF
    assert s[ADAPTIVE]["paired_spread_no_wider_than_best_static"]  # 0.02 vs the control's 0.10
    without_control = summarize(cold_rows({OFF: [10, 12], ADAPTIVE: [10, 12]}), [], [])["cold_start"]["w"]
    assert without_control[ADAPTIVE]["paired_spread_no_wider_than_best_static"] is None  # nothing to compare with


def test_pooled_spread_by_hand():
    # pooled_spread's worked example: log deviations about each cell's own mean, pooled.
    cells = {"a": {ADAPTIVE: [10, 11, 12]}, "b": {ADAPTIVE: [20, 22]}, "c": {OFF: [5, 6]}}
    variance, df = pooled_spread(cells, ADAPTIVE)
    assert df == 3 and variance == pytest.approx(0.021174 / 3, rel=1e-3)
    # Paired: a run that is slower for both arms cancels.
    cells = {"a": {OFF: [10, 8, 10], ADAPTIVE: [12, 9.6, 12]}}
    assert pooled_spread(cells, ADAPTIVE, paired=True) == (pytest.approx(0.0), 2)
    assert pooled_spread(cells, ADAPTIVE)[0] > 0.005


def test_spread_test_tells_a_wider_arm_from_an_equal_one():
    """Four workloads x 5 runs: an arm whose runs spread like static k's is not read as wider; one
    that spreads 3x as wide is, although the ranges of single cells overlap."""
    rng = random.Random(3)

    def cell(sd_adaptive: float) -> dict[str, list[float]]:
        off = [10 * (1 + rng.gauss(0, 0.02)) for _ in range(5)]
        return {OFF: off, "static:1": [12 * (1 + rng.gauss(0, 0.02)) for _ in range(5)],
                "static:2": [13 * (1 + rng.gauss(0, 0.02)) for _ in range(5)],
                ADAPTIVE: [13 * (1 + rng.gauss(0, sd_adaptive)) for _ in range(5)]}

    equal = spread_test({w: cell(0.02) for w in "abcd"}, ADAPTIVE)
    assert equal["df"] == 16 and equal["static_df"] == 32
    assert equal["p_wider"] > 0.05 and 0.3 < equal["variance_ratio"] < 3
    wider = spread_test({w: cell(0.06) for w in "abcd"}, ADAPTIVE)
    assert wider["p_wider"] < 0.01 and wider["variance_ratio"] > 3
    assert spread_test({"a": {OFF: [1, 2], ADAPTIVE: [1, 2]}}, ADAPTIVE) is None  # no static k to compare with
    flat = {"a": {"static:1": [2.0, 2.0, 2.0], ADAPTIVE: [3.0, 3.0, 3.0]}}  # nothing spreads: not wider
    assert spread_test(flat, ADAPTIVE)["variance_ratio"] == 1.0 and spread_test(flat, ADAPTIVE)["p_wider"] > 0.4
    s = summarize(cold_rows({OFF: [10, 12, 11], "static:2": [13, 12, 14], ADAPTIVE: [13, 13, 12]}), [], [])
    assert set(s["spread_pooled"][ADAPTIVE]) == {"raw", "paired"} and WARM not in s["spread_pooled"]


def test_the_robust_reading_is_not_carried_by_one_slow_run():
    """An arm whose runs spread like static k's but for one run 12% slow (a process that met a busy
    minute): the F-test reads it wider, the Brown-Forsythe reading does not; an arm 3x as wide in
    every run is wider in both."""
    rng = random.Random(5)

    def cell(sd_adaptive: float, slow_run: bool) -> dict[str, list[float]]:
        runs = {OFF: [10 * (1 + rng.gauss(0, 0.02)) for _ in range(5)]}
        for k in (1, 2, 4):
            runs[f"static:{k}"] = [12 * (1 + rng.gauss(0, 0.02)) for _ in range(5)]
        runs[ADAPTIVE] = [13 * (1 + rng.gauss(0, sd_adaptive)) for _ in range(5)]
        if slow_run:
            runs[ADAPTIVE][2] *= 0.88
        return runs

    one_slow = spread_test({w: cell(0.02, w == "a") for w in "abcd"}, ADAPTIVE)
    assert one_slow["p_wider"] < 0.05 < one_slow["p_wider_robust"]
    wider = spread_test({w: cell(0.06, False) for w in "abcd"}, ADAPTIVE)
    assert wider["p_wider"] < 0.01 and wider["p_wider_robust"] < 0.05 and wider["deviation_ratio"] > 2


def test_reports_pool_as_cells_of_their_own():
    """Two reports of the same workload measured in hours of different speed (the second 30%
    slower): pooled, each stays its own cell, so the hours' difference adds no spread and the
    degrees of freedom add up; run together as one cell they would read a wide arm."""
    fast = {OFF: [10, 10.2, 9.8], "static:2": [12, 12.2, 11.8], ADAPTIVE: [13, 13.3, 12.7]}
    slow = {arm: [0.7 * x for x in xs] for arm, xs in fast.items()}
    results = {name: {"summary": summarize(cold_rows(runs), [], [])} for name, runs in (("s1", fast), ("s2", slow))}
    cells = pooled_cells(results)
    assert set(cells) == {"s1/w", "s2/w"}
    one = spread_test({"w": fast}, ADAPTIVE)
    pooled = spread_test(cells, ADAPTIVE)
    assert pooled["df"] == 2 * one["df"] and pooled["static_df"] == 2 * one["static_df"]
    assert pooled["variance_ratio"] == pytest.approx(one["variance_ratio"], rel=1e-6)
    merged = {arm: fast[arm] + slow[arm] for arm in fast}
    assert spread_test({"w": merged}, ADAPTIVE)["sd"] > 5 * pooled["sd"]


def test_mixed_and_calibration_summary_by_hand():
    mixed = [{"arm": arm, "run": run, "batch": 16, "goodput": g, "digest": "x"}
             for arm, gs in ((OFF, [100, 100]), ("static:2", [90, 95]), (ADAPTIVE, [99, 101])) for run, g in enumerate(gs)]
    m = summarize([], mixed, [])["mixed"]
    assert m["paired_vs_off"] == pytest.approx(1.0) and m["lossless"]
    assert m["meets_bar"]  # >= 0.98 x off and >= the best static k (off here)
    assert m["null_control_vs_off"] is None  # no null-control arm ran
    null = [{"arm": NULL_CONTROL, "run": run, "batch": 16, "goodput": g, "digest": "x"} for run, g in enumerate([90, 104])]
    m = summarize([], mixed + null, [])["mixed"]
    assert m["null_control_vs_off"] == pytest.approx((0.9 + 1.04) / 2)  # median of the per-run ratios
    assert m["paired_vs_best_static"] == pytest.approx(1.0)  # the control is not a static k
    calibration = [{"workload": "w", "requests_seen": seen, "bucket": "1", "predicted_first": p, "first_accepted": a,
                    "predicted_accepted": p, "accepted": a, "k": 1}
                   for seen, p, a in ((0, 0.2, 1.0), (1, 0.4, 0.0), (10, 0.5, 1.0), (50, 0.9, 1.0))]
    c = summarize([], [], calibration, after=(0, 10), window=5)["calibration"]["w"]
    assert c["0"]["1"] == {"steps": 2, "predicted_first": pytest.approx(0.3), "first_accepted": 0.5,
                           "predicted_accepted": pytest.approx(0.3), "accepted": 0.5}
    assert c["10"]["1"]["steps"] == 1  # request 50 is in no window


def test_calibration_error_weights_buckets_by_steps():
    """The docstring's worked example, and buckets listed in length order in the report."""
    from specplan.bench.coldstart import calibration_error

    buckets = {"16+": {"steps": 10, "predicted_first": 0.9, "first_accepted": 0.5, "predicted_accepted": 2.0,
                       "accepted": 1.0},
               "2": {"steps": 30, "predicted_first": 0.3, "first_accepted": 0.4, "predicted_accepted": 0.5,
                     "accepted": 0.7}}
    e = calibration_error(buckets)
    assert e["steps"] == 40
    assert e["drafts_abs_error"] == pytest.approx(0.4)
    assert e["first_abs_error"] == pytest.approx((10 * 0.4 + 30 * 0.1) / 40)
    assert e["predicted_over_measured"] == pytest.approx(35 / 31)
    none_accepted = {"1": {**buckets["2"], "accepted": 0.0}}
    assert calibration_error(none_accepted)["predicted_over_measured"] is None


def test_report_renders(tmp_path):
    rows = cold_rows({OFF: [10, 12], "static:2": [13, 12], ADAPTIVE: [13, 13], WARM: [14, 14]})
    mixed = [{"arm": arm, "run": 0, "batch": 16, "goodput": g, "digest": "x"}
             for arm, g in ((OFF, 100), (ADAPTIVE, 99), (NULL_CONTROL, 97))]
    calibration = [{"workload": "w", "requests_seen": 0, "bucket": b, "predicted_first": 0.7, "first_accepted": 1.0,
                    "predicted_accepted": 2.0, "accepted": 3, "k": 4} for b in ("16+", "4-7", "2")]
    result = {"command": "test", "date": "today", "machine": "Machine: test.",
              "config": {"proposer": "ngram", "max_tokens": 16, "runs": 2, "prompts": 2, "train_prompts": 2,
                         "calibration_after": [0], "calibration_window": 5},
              "summary": summarize(rows, mixed, calibration, after=(0,), window=5)}
    text = render(result, tmp_path).read_text()
    assert "| w | static:2 | adaptive |" in text and "Mixed batch, B = 16" in text and "| w | 0 | 4-7 | 1 |" in text
    assert "reads 0.970x SD off" in text  # the mixed cell's null control
    assert text.index("| w | 0 | 2 |") < text.index("| w | 0 | 4-7 |") < text.index("| w | 0 | 16+ |")
    assert "| w | 0 | 3 | 0.300 | 1.00 | 0.67 |" in text  # the checkpoint's error line
    assert "| adaptive | paired |" in text  # the pooled spread against static k's
    assert (tmp_path / "coldstart.png").stat().st_size > 1000


def test_calibration_recorder_pairs_predictions_with_outcomes():
    planner = Planner(make_policy("static:3"), RidgeLatency(a=0.03), proposer="ngram")
    recorder = CalibrationRecorder(planner)
    rng = random.Random(0)
    for step in range(6):
        recorder.requests_seen = step // 3
        view = StepView((RequestView(0, "r0", 500, 10, 8, True, 8, 5 if step % 2 else 1),), 0, 0, 500, "ngram")
        ks = recorder.decide(view)
        gains = planner.last_state.requests[0].acceptance.gains
        acc = rng.randint(0, ks[0])
        recorder.observe(StepRecord((RequestRecord(0, "r0", ks[0], ks[0], acc, acc + 1, 8, view.requests[0].match_length),),
                                    1, 1 + ks[0], 0, 500, 0.0, 0.03, 0.0, 0.031))
        row = recorder.rows[-1]
        assert row["predicted_accepted"] == pytest.approx(sum(gains[:3])) and row["accepted"] == acc
        assert row["bucket"] == ("4-7" if step % 2 else "1") and row["requests_seen"] == step // 3
    assert len(recorder.rows) == 6


def test_a_child_process_runs_one_cold_request(tmp_path):
    """One request in a fresh process, on the embedded model: what every cold-start cell is made of."""
    from specplan.engine import load_model

    loaded = load_model(None)
    ids = loaded.tokenizer.encode("def add(a, b):\n    return a + b\n\ndef sub(a, b):")
    profile = tmp_path / "p.json"
    flat_profile(loaded).save(profile)
    learned = tmp_path / "b.json"
    adaptive = spawn(ChildJob(ADAPTIVE, [ids, ids], 6, str(profile), save_beliefs=str(learned)))
    assert adaptive["tokens"] == [6, 6] and min(adaptive["seconds"]) > 0
    assert learned.exists()  # what the cold-start cells' adaptive+beliefs arm starts from
    warm = spawn(ChildJob(WARM, [ids], 6, str(profile), beliefs=str(learned)))
    assert warm["digests"] == adaptive["digests"][:1]  # the same tokens, whatever the planner knew
    with pytest.raises(RuntimeError, match="coldstart child"):
        spawn(ChildJob(OFF, [ids], 6, str(tmp_path / "missing.json")))
    assert adaptive["bytes_per_weight"] == 4.0  # float32 unless asked
    # --quantize gguf: the embedded GGUF's own 4.5-bit blocks, and speculation lossless on them.
    q_off = spawn(ChildJob(OFF, [ids], 6, str(profile), quantize="gguf"))
    q_static = spawn(ChildJob("static:2", [ids], 6, str(profile), quantize="gguf"))
    assert q_off["bytes_per_weight"] < 1.0 and q_static["digests"] == q_off["digests"]

