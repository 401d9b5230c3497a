"""The engine benchmark's report: targets computed from the grid, pass and fail both shown."""

from __future__ import annotations

import json

import pandas as pd
import torch
from conftest import loaded_from_hf, tiny_hf_model

from specplan.profiler.ceilings import BandwidthProbe, Ceilings, measure_bandwidth, measure_peak_flops
from specplan.bench.engine_bench import render_engine_report, run_step_grid


def _grid(b1t1_ms: float, b1t8_ms: float) -> pd.DataFrame:
    rows = []
    for b, t, ours, hf in ((1, 1, b1t1_ms, 50.0), (1, 8, b1t8_ms, 140.0), (32, 1, 60.0, 200.0)):
        rows.append({"batch_size": b, "tokens_per_seq": t, "tokens": b * t, "context": 256, "specplan_ms": ours,
                     "hf_ms": hf, "floor_ms": 25.0, "bandwidth_alongside": 2.5e10, "floor_alongside_ms": 20.0,
                     "intensity": 1.0, "bound": "memory",
                     "specplan_all_ms": [ours], "hf_all_ms": [hf]})
    return pd.DataFrame(rows)


def test_report_checks_each_target(tmp_path):
    ceilings = Ceilings(peak_flops=2e11, bandwidth=3e10, device="cpu", dtype="float32", threads=2)
    generation = pd.DataFrame([{"engine": "specplan", "seconds": 2.0, "tokens_per_s": 64.0, "all_seconds": [2.0]},
                               {"engine": "transformers", "seconds": 8.0, "tokens_per_s": 16.0, "all_seconds": [8.0]}])
    path = render_engine_report(_grid(22.0, 33.0), generation, ceilings, "tiny", tmp_path, "specplan bench engine")
    text = path.read_text()
    assert "| B=1, T=1 step <= 1.2x roofline floor (bandwidth read between its steps) | 1.100x | yes |" in text
    assert "Against the ceiling read before the grid, B=1, T=1 is 0.880x the floor." in text
    assert "| B=1, T=8 step <= 1.4x own B=1, T=1 | 1.500x | no |" in text
    assert "| B=32, T=1 throughput >= 3x transformers | 3.333x | yes |" in text
    assert "| single-stream >= 2.4x transformers | 4.000x | yes |" in text
    assert (tmp_path / "engine-speed.png").stat().st_size > 0
    assert len(json.loads((tmp_path / "engine-speed.json").read_text())["grid"]) == 3
    # Just over a bound reads as over it, not as a rounded "1.20x | no".
    text = render_engine_report(_grid(24.12, 30.0), generation, ceilings, "tiny", tmp_path, "x").read_text()
    assert "| B=1, T=1 step <= 1.2x roofline floor (bandwidth read between its steps) | 1.206x | no |" in text


def test_bandwidth_is_positive_and_plausible():
    bw = measure_bandwidth(megabytes=64, repeats=3)
    assert 1e9 < bw < 1e13  # between 1 GB/s and 10 TB/s


def test_another_engines_ceilings_use_torch_alone():
    """vLLM's profile measures the machine as torch reaches it: no engine kernel is read with."""
    probe = BandwidthProbe(megabytes=16, engine_kernels=False)
    assert probe.linear is None and 1e9 < probe.read() < 1e13
    assert 1e8 < measure_peak_flops(n=256, repeats=1, engine_kernels=False) < 1e14


def test_step_grid_times_every_width_of_every_batch_size():
    ceilings = Ceilings(peak_flops=2e11, bandwidth=3e10, device="cpu", dtype="float32", threads=2)
    hf = tiny_hf_model("llama", dtype=torch.float32)
    grid = run_step_grid(loaded_from_hf(hf), hf, ceilings, batch_sizes=(1, 3), tokens_per_seq=(1, 4), context=20,
                         repeats=3, progress=False, probe=BandwidthProbe(megabytes=16))
    assert sorted(zip(grid.batch_size, grid.tokens_per_seq)) == [(1, 1), (1, 4), (3, 1), (3, 4)]
    assert all(len(ours) == 3 and len(theirs) == 3 for ours, theirs in zip(grid.specplan_all_ms, grid.hf_all_ms))
    assert (grid.specplan_ms > 0).all() and (grid.hf_ms > 0).all() and (grid.floor_ms > 0).all()
    assert (grid.floor_alongside_ms > 0).all() and (grid.bandwidth_alongside > 1e9).all()
    assert (grid.tokens == grid.batch_size * grid.tokens_per_seq).all()
