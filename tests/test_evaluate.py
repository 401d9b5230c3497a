"""The offline evaluation: cells run every decider on the same requests; the summary's checks."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import loaded_from_hf, tiny_hf_model
from specplan.engine import FixedDecider, NgramProposer
from specplan.bench.evaluate import _engine, paired_ratios, pooled_vs_off, render_evaluation, run_cell, summarize


def synthetic_results() -> pd.DataFrame:
    rows = []
    # memory-bound cell (B=1): k=4 best (2x off); compute-bound cell (B=32): off best, k=4 at 0.8x
    for b, by_k in ((1, {0: 10, 2: 16, 4: 20}), (32, {0: 100, 2: 95, 4: 80})):
        for k, g in by_k.items():
            rows.append({"proposer": "ngram", "workload": "w", "batch_size": b, "decider": f"static:{k}", "goodput": g})
        rows.append({"proposer": "ngram", "workload": "w", "batch_size": b, "decider": "goodput",
                     "goodput": {1: 19.8, 32: 99.0}[b]})
    df = pd.DataFrame(rows)
    df["lossless"] = True
    df["k_zero_share"], df["mean_k"], df["acceptance"] = 0.5, 1.0, 0.5
    return df


def test_summary_checks_by_hand():
    s = summarize(synthetic_results())["ngram"]
    # single best static by geo-mean: k=0: sqrt(10*100)=31.6, k=2: sqrt(16*95)=39.0, k=4: sqrt(20*80)=40
    assert s["best_single_static"] == "static:4"
    g = s["policies"]["goodput"]
    assert g["min_vs_best_static"] == pytest.approx(0.99)  # 19.8/20 and 99/100
    assert g["min_vs_off"] == pytest.approx(0.99)
    assert g["geomean_vs_best_single_static"] == pytest.approx((19.8 * 99) ** 0.5 / 40)
    # per-request adaptivity beats the best single static k: sqrt(19.8 * 99) / 40 = 1.107
    assert g["pass_per_cell"] and g["pass_geomean"]
    # the oracle takes each cell's best static k: sqrt(20 * 100) / 40
    assert s["oracle_geomean_vs_best_single_static"] == pytest.approx((20 * 100) ** 0.5 / 40)


def test_report_renders(tmp_path):
    path = render_evaluation(synthetic_results(), tmp_path, "test")
    text = path.read_text()
    assert "static:4" in text and "| goodput |" in text
    assert (tmp_path / "evaluation-ngram.png").stat().st_size > 1000
    assert "planner ms/step" not in text  # not measured in this frame
    margin = synthetic_results().query("decider == 'goodput'").assign(decider="goodput:0", goodput=[18.0, 101.0])
    text = render_evaluation(pd.concat([synthetic_results(), margin]), tmp_path, "test").read_text()
    assert "| goodput | goodput:0 |" in text and "| 18.0 |" in text  # every policy that ran gets a column
    df = synthetic_results()
    df["decider_ms_per_step"], df["decider_share"] = 0.75, 0.012
    text = render_evaluation(df, tmp_path, "test").read_text()
    assert "planner ms/step" in text and "| 0.75 | 1.2% |" in text
    assert "Measured" not in text
    when = "Measured 2026-11-28 10:28-10:59 UTC. Machine: cpu Some CPU, cores 2."
    assert when in render_evaluation(df, tmp_path, "test", measured=when).read_text()


def test_cells_time_the_decider():
    """What choosing k costs is measured per step: decide() and observe(), nothing else."""
    import time

    class Slow(FixedDecider):
        """Sleeps in decide() and observe(), and times its own sleeps: a loaded machine oversleeps."""

        def __init__(self, k: int):
            super().__init__(k)
            self.slept_s, self.decides, self.observes = 0.0, 0, 0

        def _sleep(self, seconds: float) -> None:
            t0 = time.perf_counter()
            time.sleep(seconds)
            self.slept_s += time.perf_counter() - t0

        def decide(self, view):
            self.decides += 1
            self._sleep(0.002)
            return super().decide(view)

        def observe(self, record):
            self.observes += 1
            self._sleep(0.001)

    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))
    engine = _engine(loaded, "ngram", max_batch=2, draft_layers=1)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5]]
    fixed = run_cell(engine, prompts, FixedDecider(2), max_tokens=8)
    slow_decider = Slow(2)
    slow = run_cell(engine, prompts, slow_decider, max_tokens=8)
    assert fixed["decider_ms_per_step"] < 1.0
    # observe() every step; decide() on every step with a decode: all but the prefill.
    steps = slow_decider.observes
    assert 0 < slow_decider.decides < steps
    slept_ms_per_step = 1000.0 * slow_decider.slept_s / steps
    # The engine's timer wraps every sleep, and adds only the fixed decider's own bookkeeping.
    assert slept_ms_per_step <= slow["decider_ms_per_step"] < slept_ms_per_step + 1.0
    assert slow["decider_ms_per_step"] >= 2.0
    assert 0 < slow["decider_share"] < 1


class _CountingDecider(FixedDecider):
    """A fixed k that remembers how many requests each step decided for."""

    def __init__(self, k: int):
        super().__init__(k)
        self.batch_sizes: list[int] = []

    def decide(self, view):
        self.batch_sizes.append(len(view.requests))
        return super().decide(view)


def test_a_step_the_decider_screens_out_looks_nothing_up():
    """SD off and steps a decider screens out (``may_speculate`` False) skip the proposer's lookup
    and ``decide``; the tokens are SD off's."""

    class CountingNgram(NgramProposer):
        calls = 0

        def propose(self, seqs, k, stop=None):
            CountingNgram.calls += 1
            return super().propose(seqs, k)

    class ScreensAll(_CountingDecider):
        def may_speculate(self, outline):
            assert outline.num_decodes >= 1 and outline.max_k >= 1
            return False

        def decide(self, view):  # only asked where no request may draft (the last token): nothing to screen
            assert all(r.max_k == 0 for r in view.requests)
            return super().decide(view)

    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))
    engine = _engine(loaded, "ngram", max_batch=2, draft_layers=1)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5]]
    off = run_cell(engine, prompts, FixedDecider(0), max_tokens=8, proposer=CountingNgram())
    assert CountingNgram.calls == 0
    screened = ScreensAll(3)
    out = run_cell(engine, prompts, screened, max_tokens=8, proposer=CountingNgram())
    assert CountingNgram.calls == 0 and out["outputs"] == off["outputs"]
    assert out["k_zero_share"] == 1.0
    run_cell(engine, prompts, FixedDecider(2), max_tokens=8, proposer=CountingNgram())
    assert CountingNgram.calls > 0


def test_cells_are_lossless_across_deciders():
    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))
    engine = _engine(loaded, "ngram", max_batch=4, draft_layers=1)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5], [7] * 9, [9, 8, 7]]
    a = run_cell(engine, prompts, FixedDecider(0), max_tokens=12)
    b = run_cell(engine, prompts, FixedDecider(4), max_tokens=12)
    assert a["outputs"] == b["outputs"] and a["output_tokens"] == 48
    counting = _CountingDecider(2)
    c = run_cell(engine, prompts, counting, max_tokens=12, concurrency=2)  # closed loop at B = 2
    assert c["outputs"] == a["outputs"] and max(counting.batch_sizes) == 2
    assert a["k_zero_share"] == 1.0 and b["mean_k"] > 0
    given = NgramProposer(max_n=2)  # a run can bring its own proposer (as A/Bs of proposers do)
    d = run_cell(engine, prompts, FixedDecider(4), max_tokens=12, proposer=given)
    assert engine.speculator.proposer is given and d["outputs"] == a["outputs"] and d["mean_k"] > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_output_lengths_are_equal_or_spread_the_same_way_for_every_decider():
    from specplan.bench.evaluate import output_lengths

    assert output_lengths(64, 0, 3) == [64, 64, 64]
    spread = output_lengths(64, 32, 200)
    assert spread == output_lengths(64, 32, 200)  # seeded: every decider of a cell gets these
    assert min(spread) >= 32 and max(spread) <= 96 and len(set(spread)) > 20
    assert output_lengths(64, 32, 200, seed=1) != spread
    for bad in (-1, 64):
        with pytest.raises(ValueError, match="spread"):
            output_lengths(64, bad, 3)


def test_a_cell_can_give_each_request_its_own_length():
    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))
    engine = _engine(loaded, "ngram", max_batch=4, draft_layers=1)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5], [7] * 9]
    off = run_cell(engine, prompts, FixedDecider(0), [3, 9, 5], concurrency=2)
    assert [len(o) for o in off["outputs"]] == [3, 9, 5] and off["output_tokens"] == 17
    records = []
    drafted = run_cell(engine, prompts, FixedDecider(4), [3, 9, 5], concurrency=2, on_step=records.append)
    assert drafted["outputs"] == off["outputs"]
    # every step's record reached on_step, once: their decodes emitted every output token but each
    # request's first (sampled right after its prompt, in a step whose record lists no decode for it)
    assert len({id(r) for r in records}) == len(records) > 0
    assert sum(rr.num_emitted for r in records for rr in r.requests) == 17 - 3
    with pytest.raises(ValueError, match="2 output lengths for 3 prompts"):
        run_cell(engine, prompts, FixedDecider(0), [3, 9])


class _Ids:
    """A workload prompt already tokenized."""

    def __init__(self, ids):
        self.ids = ids

    def render(self, tokenizer):
        return self.ids


@pytest.fixture
def ev_with_tiny_workloads(monkeypatch):
    """specplan.evaluate with every workload made of short repetitive prompts, and a tiny model."""
    import specplan.bench.evaluate as ev

    monkeypatch.setattr(ev, "load_workload", lambda w, n, seed: [_Ids([1 + i, 2, 3, 1 + i, 2, 3]) for i in range(n)])
    return ev, loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))


def test_evaluate_reports_medians_of_interleaved_repeats(ev_with_tiny_workloads, monkeypatch):
    ev, loaded = ev_with_tiny_workloads
    monkeypatch.setattr(ev, "planner_from_profile", lambda *a, **k: FixedDecider(2))
    df = ev.evaluate(loaded, profile=None, workloads=("w",), batch_sizes=(1, 2), static_ks=(0, 3),
                     policies=("goodput",), max_tokens=6, repeats=3, progress=False)
    assert len(df) == 2 * 4 and set(df.repeats) == {3}  # static:0, static:3, goodput, the null control
    assert set(df.decider) == {"static:0", "static:3", "goodput", "control:off"}
    assert set(df.requests) == {4}  # min_requests: B = 1 and B = 2 both run 4 requests
    assert df.lossless.all()
    row = df.iloc[0]
    assert row.goodput == sorted(row.goodput_all)[1]  # the median of three


def test_evaluate_hands_over_every_finished_cell_and_the_partial_report_says_so(ev_with_tiny_workloads, tmp_path):
    ev, loaded = ev_with_tiny_workloads
    seen: list[pd.DataFrame] = []
    df = ev.evaluate(loaded, profile=None, workloads=("w",), batch_sizes=(1, 2), static_ks=(0, 2), policies=(),
                     max_tokens=6, repeats=1, null_control=False, progress=False, on_cell=seen.append)
    assert [len(s) for s in seen] == [2, 4]  # two deciders per cell, rows accumulate cell by cell
    assert list(seen[0].batch_size) == [1, 1] and seen[-1].equals(df)
    partial = render_evaluation(seen[0], tmp_path, "specplan evaluate", complete=False).read_text()
    assert "**Partial" in partial and "| w | 1 |" in partial and "| w | 2 |" not in partial
    done = render_evaluation(df, tmp_path, "specplan evaluate").read_text()
    assert "Partial" not in done and "| w | 2 |" in done


def test_paired_ratios_worked_example():
    runs = {"static:0": [10, 12, 11], "static:2": [13, 12, 14], "goodput": [13, 13, 12]}
    vs_off, vs_best = paired_ratios(runs, "goodput")
    assert vs_off == pytest.approx(12 / 11)
    assert vs_best == pytest.approx(1.0)


def test_paired_best_static_is_chosen_on_held_out_repeats():
    # Two statics with equal truth, each lucky once: the best of the per-repeat maxima would make an
    # equally good policy look 17% slower; held-out choice does not reward the lucky run.
    runs = {"static:0": [10, 10, 10], "static:1": [12, 10, 10], "static:2": [10, 12, 10],
            "goodput": [10, 10, 10]}
    _, vs_best = paired_ratios(runs, "goodput")
    assert vs_best == pytest.approx(1.0)
    # a policy truly slower than one static k still fails, by that much
    runs = {"static:0": [10, 10, 11], "static:3": [13, 13, 13], "goodput": [12, 12, 12]}
    assert paired_ratios(runs, "goodput")[1] == pytest.approx(12 / 13)


def test_pooled_vs_off_worked_example():
    """The docstring's example, its interval, and the reading in the summary and the report."""
    import pandas as pd

    idx = pd.MultiIndex.from_tuples([("a", 1, "static:0"), ("a", 1, "goodput"), ("b", 1, "static:0"),
                                     ("b", 1, "goodput")], names=["workload", "batch_size", "decider"])
    runs = pd.Series([[10, 20], [11, 18], [10, 10], [10, 12]], index=idx)
    p = pooled_vs_off(runs, "goodput")
    assert p["geomean"] == pytest.approx((1.1 * 0.9 * 1.0 * 1.2) ** 0.25) and p["ratios"] == 4
    assert 0.9 <= p["interval_90"][0] <= p["geomean"] <= p["interval_90"][1] <= 1.2
    assert pooled_vs_off(runs, "control:off") == {}  # a decider that did not run


def test_summary_pairs_repeats_per_cell():
    df = synthetic_results()
    df["goodput_all"] = df["goodput"].apply(lambda g: [g * 1.1, g, g * 0.9])  # one slow spell hits all alike
    g = summarize(df)["ngram"]["policies"]["goodput"]
    assert g["paired_min_vs_best_static"] == pytest.approx(0.99)
    assert g["paired_min_vs_off"] == pytest.approx(0.99)
    assert g["pass_per_cell_paired"]
    assert set(g["paired_per_cell"]) == {"w/B=1", "w/B=32"}


def test_null_control_reads_off_against_itself_and_is_not_a_policy(tmp_path):
    df = synthetic_results()
    df["goodput_all"] = df["goodput"].apply(lambda g: [g * 1.1, g, g * 0.9])
    # SD off run again: 4% slow on every repeat at B=1, 2% fast at B=32
    control = df[df.decider == "static:0"].assign(decider="control:off")
    control["goodput_all"] = [[x * f for x in xs] for xs, f in zip(control.goodput_all, (0.96, 1.02))]
    control["goodput"] = control.goodput_all.map(lambda xs: xs[1])
    df = pd.concat([df, control], ignore_index=True)
    s = summarize(df)["ngram"]
    assert set(s["policies"]) == {"goodput"}  # neither a static k (the bar) nor a policy
    assert s["best_single_static"] == "static:4"
    null = s["null_control"]
    assert null["paired_vs_off"] == pytest.approx({"w/B=1": 0.96, "w/B=32": 1.02})
    assert (null["min_vs_off"], null["max_vs_off"]) == pytest.approx((0.96, 1.02))
    text = render_evaluation(df, tmp_path, "test").read_text()
    assert "0.960-1.020x `static:0`" in text and "| 0.960 |" in text


def test_accepted_lengths_worked_example():
    """specplan/bench/clairvoyant.py's example: drafts that match the reference, per output length."""
    from specplan.bench.clairvoyant import accepted_lengths

    table = accepted_lengths(NgramProposer(), [[1, 5, 7, 9]], [[5, 7, 2]], max_k=8)
    # p=0: 9 never occurred before: no drafts. p=1: 5 -> [7, 9, 5] vs [7, 2]: 1. p=2: 5 7 -> [9, 5, 7] vs [2]: 0.
    assert table == [[0, 1, 0]]
    from specplan.bench.clairvoyant import Replayed, replay

    # what a measurement by match length reads: drafts judged (cut at the output's end), accepted
    assert replay(NgramProposer(), [[1, 5, 7, 9]], [[5, 7, 2]], max_k=8) == [
        [Replayed(0, 0, 0), Replayed(1, 2, 1), Replayed(2, 1, 0)]]
    # a capped proposal cannot be accepted past the cap; drafts running past the output stop there
    assert accepted_lengths(NgramProposer(), [[3, 4, 3, 4, 3, 4]], [[3, 4, 3, 4]], max_k=2) == [[2, 2, 2, 1]]
    from specplan.engine import SuffixProposer

    with pytest.raises(ValueError, match="own tokens"):
        accepted_lengths(SuffixProposer(), [[1, 2]], [[3]], max_k=4)


def test_clairvoyant_decider_drafts_only_what_is_accepted():
    from specplan.bench.clairvoyant import ClairvoyantDecider, accepted_lengths
    from specplan.bench.evaluate import _request_index

    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))
    engine = _engine(loaded, "ngram", max_batch=4, draft_layers=1)
    prompts = [[1, 2, 3, 4, 1, 2, 3], [5, 6, 5, 6, 5], [7] * 9, [9, 8, 7]]
    off = run_cell(engine, prompts, FixedDecider(0), max_tokens=16)
    table = accepted_lengths(NgramProposer(), prompts, off["outputs"], max_k=8)
    seen = run_cell(engine, prompts, ClairvoyantDecider(table, _request_index), max_tokens=16, concurrency=2)
    assert seen["outputs"] == off["outputs"]
    assert seen["mean_k"] > 0 and seen["acceptance"] == 1.0  # it drafted, and never a rejected token
    guess = run_cell(engine, prompts, FixedDecider(8), max_tokens=16, concurrency=2)
    assert guess["acceptance"] < 1.0  # the same proposer asked blindly wastes drafts


@pytest.mark.parametrize("proposer", ["ngram", "suffix"])
def test_evaluate_runs_the_clairvoyant_ceiling(ev_with_tiny_workloads, proposer):
    """For a proposer whose drafts depend on other requests too (suffix), as for n-gram: the
    accepted lengths recorded at max_k hold in the clairvoyant's own runs (same schedule)."""
    ev, loaded = ev_with_tiny_workloads
    kw = dict(profile=None, workloads=("w",), batch_sizes=(2,), static_ks=(0, 2), policies=(), max_tokens=8,
              repeats=2, null_control=False, clairvoyant=True, progress=False)
    df = ev.evaluate(loaded, proposer=proposer, **kw)
    assert set(df.decider) == {"static:0", "static:2", "clairvoyant"} and df.lossless.all()
    top = df.set_index("decider").loc["clairvoyant"]
    assert top.mean_k > 0 and top.acceptance == 1.0 and top.repeats == 2


def test_summary_and_report_show_the_clairvoyant_ceiling(tmp_path):
    df = synthetic_results()
    top = df[df.decider == "goodput"].assign(decider="clairvoyant", goodput=[22.0, 104.0])
    df = pd.concat([df, top], ignore_index=True)
    s = summarize(df)["ngram"]
    assert set(s["policies"]) == {"goodput"}  # a bound, not a policy
    assert s["clairvoyant"]["geomean_vs_best_single_static"] == pytest.approx((22 * 104) ** 0.5 / 40)
    assert s["clairvoyant"]["paired_per_cell"]["w/B=1"]["vs_best_static"] == pytest.approx(22 / 20)
    assert s["policies"]["goodput"]["geomean_vs_clairvoyant"] == pytest.approx((19.8 * 99 / (22 * 104)) ** 0.5)
    text = render_evaluation(df, tmp_path, "test").read_text()
    assert "| goodput | clairvoyant |" in text
    assert f"reaches {(22 * 104) ** 0.5 / 40:.3f}x the best single static k" in text
    assert "gets far past it" in text and "not a ceiling" not in text
    # with a draft model, what asks for exactly the accepted drafts is named a reference, not a ceiling
    chain = render_evaluation(df.assign(proposer="chain"), tmp_path / "chain", "test").read_text()
    assert "not a ceiling" in chain and "gets far past it" not in chain


def test_resampled_geomean_ratios_keep_pairs_and_rechoose_the_best_static():
    from itertools import product

    from specplan.bench.evaluate import resampled_geomean_ratios

    def runs(cells: dict) -> pd.Series:
        return pd.Series({(w, b, dec): xs for (w, b), by in cells.items() for dec, xs in by.items()}).rename_axis(
            ["workload", "batch_size", "decider"])

    # A policy 1.2x static:1 in every repeat, under a slow spell that hits both: pairing keeps it at 1.2.
    spell = [10.0, 7.0, 13.0]
    steady = resampled_geomean_ratios(runs({("w", 1): {"static:0": [5, 5, 5], "static:1": spell,
                                                       "goodput": [1.2 * x for x in spell]}}), "goodput")
    assert steady.shape == (2000,) and steady == pytest.approx(1.2)
    # The docstring's example: every draw is the median ratio of some pick of three repeats.
    one = {"static:1": [10.0, 11.0, 12.0], "goodput": [12.0, 12.0, 15.0]}
    feasible = {round(sorted(one["goodput"][i] for i in p)[1] / sorted(one["static:1"][i] for i in p)[1], 9)
                for p in product(range(3), repeat=3)}
    draws = resampled_geomean_ratios(runs({("w", 1): one}), "goodput", draws=500)
    assert set(np.round(draws, 9)) <= feasible and draws.min() < draws.max()
    # Two cells, two statics: the bar is whichever static has the larger geo-mean on that draw.
    cells = {("w", 1): {"static:0": [10.0] * 3, "static:2": [20.0] * 3, "goodput": [20.0] * 3},
             ("w", 32): {"static:0": [100.0] * 3, "static:2": [80.0] * 3, "goodput": [100.0] * 3}}
    # static:0: sqrt(10 * 100) = 31.6, static:2: sqrt(20 * 80) = 40, goodput sqrt(20 * 100) = 44.7
    assert resampled_geomean_ratios(runs(cells), "goodput") == pytest.approx((20 * 100) ** 0.5 / 40)


def test_summary_and_report_give_geomean_intervals(tmp_path):
    df = synthetic_results()
    df["goodput_all"] = df["goodput"].apply(lambda g: [g * 1.1, g, g * 0.9])
    df.loc[df.decider == "goodput", "goodput_all"] = df.loc[df.decider == "goodput", "goodput"].apply(
        lambda g: [g * 0.9, g, g * 1.1])  # the policy's noise runs against the statics'
    top = df[df.decider == "goodput"].assign(decider="clairvoyant", goodput=[22.0, 104.0])
    top["goodput_all"] = top["goodput"].apply(lambda g: [g, g, g])
    s = summarize(pd.concat([df, top], ignore_index=True))["ngram"]
    lo, hi = s["policies"]["goodput"]["geomean_interval_90"]
    assert lo < s["policies"]["goodput"]["geomean_vs_best_single_static"] < hi and hi - lo > 0.05
    assert 0.0 < s["policies"]["goodput"]["share_of_resamples_at_target"] < 1.0
    assert s["clairvoyant"]["geomean_interval_90"][0] < s["clairvoyant"]["geomean_vs_best_single_static"]
    text = render_evaluation(pd.concat([df, top], ignore_index=True), tmp_path, "test").read_text()
    assert f"({'yes' if s['policies']['goodput']['pass_geomean'] else 'no'}; {lo:.3f}-{hi:.3f})" in text
    assert "of resamples)" in text
    pooled = s["policies"]["goodput"]["pooled_vs_off"]
    assert pooled["ratios"] == 6 and f"`goodput` {pooled['geomean']:.3f}x off" in text


def test_held_out_prompts_avoid_the_evaluation_pool():
    import specplan.bench.evaluate as ev
    from specplan.bench.workloads import load_workload

    class Bytes:  # a tokenizer stand-in: one id per UTF-8 byte of the prompt's text
        chat_template = None

        def encode(self, text, add_special_tokens=True):
            return list(text.encode())

    tok = Bytes()
    held = ev.held_out_prompts(tok, "gsm8k", 24)
    used = {tuple(p.render(tok)) for p in load_workload("gsm8k", ev.EVALUATION_POOL, 0)}
    assert len(held) == 24 and len({tuple(h) for h in held}) == 24
    assert not used & {tuple(h) for h in held}
