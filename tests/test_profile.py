"""The profiler end to end on a tiny model, the Profile JSON round trip, and bad profile files."""

from __future__ import annotations

import pytest
import torch

from conftest import loaded_from_hf, tiny_hf_model
from specplan.profiler.ceilings import Ceilings
from specplan.profiler.latency_model import StepShape
from specplan.profiler.profile import Profile, ProfileError, check_matches, fingerprint
from specplan.profiler.report import render_profile_report
from specplan.profiler.run import GridSpec, _measure_cheap_proposers, build_profile, measure_grid


@pytest.fixture(scope="module")
def tiny_profile():
    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=3))
    spec = GridSpec(batch_sizes=(1, 2, 4), tokens_per_seq=(1, 3), contexts=(16, 48), repeats=2)
    grid, drafts = measure_grid(loaded, spec, layer_skip_layers=1, progress=False)
    ceilings = Ceilings(peak_flops=1e11, bandwidth=2e10, device="cpu", dtype="float32", threads=2)
    profile = build_profile(loaded, ceilings, grid, drafts, _measure_cheap_proposers(repeats=16), torch.float32, "cpu")
    return loaded, grid, profile


def test_grid_covers_every_cell(tiny_profile):
    _, grid, profile = tiny_profile
    assert len(grid) == 3 * 2 * 2
    assert (grid["seconds"] > 0).all()
    assert set(grid["num_tokens"]) == {b * t for b in (1, 2, 4) for t in (1, 3)}
    assert profile.fit.num_cells == 12 and profile.fit.num_heldout >= 1
    assert set(profile.draft_costs) == {"ngram", "suffix", "layer-skip"}
    assert profile.predict(StepShape(2, 6, 100)) > 0


def test_profile_round_trips_and_report_renders(tiny_profile, tmp_path):
    loaded, grid, profile = tiny_profile
    path = tmp_path / "p.json"
    profile.save(path)
    again = Profile.load(path)
    assert again == profile
    assert again.predict(StepShape(4, 12, 200)) == profile.predict(StepShape(4, 12, 200))
    report = render_profile_report(profile, grid, loaded, tmp_path / "profile-tiny-cpu.md", "test", 1.0, True)
    text = report.read_text()
    assert "held-out" in text and "ridge" in text
    assert (tmp_path / "profile-tiny-cpu-roofline.png").stat().st_size > 1000
    assert (tmp_path / "profile-tiny-cpu-itl.png").stat().st_size > 1000


def test_corrupted_or_truncated_profile_gets_one_line(tiny_profile, tmp_path):
    _, _, profile = tiny_profile
    path = tmp_path / "p.json"
    profile.save(path)
    path.write_text(path.read_text()[:200])  # truncated
    with pytest.raises(ProfileError) as e:
        Profile.load(path)
    assert "\n" not in str(e.value) and "specplan profile" in str(e.value)
    path.write_text("not json at all")
    with pytest.raises(ProfileError, match="corrupted"):
        Profile.load(path)
    with pytest.raises(ProfileError, match="does not exist"):
        Profile.load(tmp_path / "missing.json")


def test_profile_for_another_model_is_refused(tiny_profile):
    loaded, _, profile = tiny_profile
    other = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=2)).config
    with pytest.raises(ProfileError, match="does not match"):
        check_matches(profile, fingerprint(other, torch.float32, "cpu"), "p.json")
    assert check_matches(profile, fingerprint(loaded.config, torch.float32, "cpu"), "p.json") == []


def test_planner_from_profile_steers_the_engine(tiny_profile):
    from conftest import tiny_llm
    from specplan.engine import SamplingParams
    from specplan.planner.from_profile import planner_from_profile

    loaded, _, profile = tiny_profile
    for policy in ("goodput", "roofline", "static:3"):
        planner = planner_from_profile(profile, policy, proposer="ngram", max_k=4)
        from specplan.engine import LLM

        llm = LLM(loaded=loaded, dtype=torch.float32, kv_cache_bytes=2**22, block_size=4,
                  speculative_config={"proposer": "ngram", "k": 4}, decider=planner)
        plain = LLM(loaded=loaded, dtype=torch.float32, kv_cache_bytes=2**22, block_size=4)
        prompt = [5, 6, 7, 8] * 4
        params = SamplingParams(temperature=0.0, max_tokens=20)
        assert llm.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
        assert planner.num_decisions > 0
