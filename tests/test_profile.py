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
    spec = GridSpec(batch_sizes=(1, 2, 4), tokens_per_seq=(1, 3), contexts=(16, 48), repeats=2, lone_drafts=(1, 3))
    grid, drafts = measure_grid(loaded, spec, layer_skip_layers=1, progress=False)
    ceilings = Ceilings(peak_flops=1e11, bandwidth=2e10, device="cpu", dtype="float32", threads=2)
    profile = build_profile(loaded, ceilings, grid, drafts, _measure_cheap_proposers(repeats=16), torch.float32, "cpu")
    return loaded, grid, profile


def test_grid_covers_every_cell(tiny_profile):
    _, grid, profile = tiny_profile
    uniform = grid[grid.drafting == grid.batch_size]
    assert len(uniform) == 3 * 2 * 2
    assert (grid["seconds"] > 0).all()
    assert set(uniform["num_tokens"]) == {b * t for b in (1, 2, 4) for t in (1, 3)}
    # One request drafting k = 1 or 3 beside plain decodes, at B = 2 and 4 (at B = 1 that is uniform):
    # B + k query tokens, which no uniform cell at B = 4 has (4, 12).
    lone = grid[grid.drafting < grid.batch_size]
    assert sorted(zip(lone.batch_size, lone.context, lone.num_tokens)) == sorted(
        (b, ctx, b + k) for b in (2, 4) for ctx in (16, 48) for k in (1, 3))
    assert (lone.drafting == 1).all() and set(lone.tokens_per_seq) == {2, 4}
    assert profile.fit.num_cells == len(grid) == 12 + 8 and profile.fit.num_heldout >= 1
    assert set(profile.draft_costs) == {"ngram", "suffix", "layer-skip"}
    assert profile.predict(StepShape(2, 6, 100)) > 0


def test_each_timed_step_follows_a_step_of_its_own_width(monkeypatch):
    """Serving runs steps of similar widths back to back; a step timed right after another width
    reads a different cost (profiler/run.py), so every timed step must follow one of its width."""
    from specplan.profiler.step_timer import StepTimer

    steps = []  # (width T, timed?) of every step the grid runs through the timer, in order
    real = StepTimer.time_steps

    def spy(self, tokens_per_seq, repeats, warmup=1, drafting=None):
        width = (tokens_per_seq, drafting)
        steps.extend([(width, False)] * warmup + [(width, True)] * repeats)
        return real(self, tokens_per_seq, repeats, warmup, drafting)

    monkeypatch.setattr(StepTimer, "time_steps", spy)
    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=1))
    measure_grid(loaded, GridSpec(batch_sizes=(2,), tokens_per_seq=(1, 3, 2), contexts=(16,), repeats=2, lone_drafts=(1,)),
                 layer_skip_layers=1, progress=False)
    timed = [i for i, (_, is_timed) in enumerate(steps) if is_timed]
    assert len(timed) >= 4 * 3  # four widths (one of them one request drafting), warm-up pass and two repeats
    assert all(i > 0 and steps[i - 1][0] == steps[i][0] for i in timed)


def test_the_contexts_of_one_batch_size_are_measured_back_to_back(monkeypatch):
    """The fit compares contexts within each B: measured a whole pass over B apart, they came from
    different spells of the VM and the fit read the spells' difference as the cost of context."""
    from specplan.profiler.step_timer import StepTimer

    fills = []
    real = StepTimer.fill

    def spy(self, batch_size, context):
        fills.append((batch_size, context))
        return real(self, batch_size, context)

    monkeypatch.setattr(StepTimer, "fill", spy)
    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=1))
    measure_grid(loaded, GridSpec(batch_sizes=(1, 2), tokens_per_seq=(1, 2), contexts=(16, 32), repeats=1),
                 layer_skip_layers=1, progress=False)
    assert fills == [(1, 16), (1, 32), (2, 16), (2, 32)]


def test_the_grid_keeps_each_pass_ratios_when_the_machine_slows_mid_pass(monkeypatch):
    """The machine halves its speed in the middle of the third pass (after T=1's step, before
    T=2's): plain per-width medians would read T=2 and T=3 at twice their cost relative to T=1."""
    import dataclasses

    from specplan.profiler.step_timer import StepTimer

    real = StepTimer.time_steps
    calls = []

    def synthetic(self, tokens_per_seq, repeats, warmup=1, drafting=None):
        timing = real(self, tokens_per_seq, repeats, warmup, drafting)
        calls.append(tokens_per_seq)
        level = 1.0 if len(calls) <= 3 * 3 + 1 else 2.0  # warm-up pass + 2 passes + T=1 of pass 3
        cost = level * (1.0 + 0.1 * (tokens_per_seq - 1))
        return dataclasses.replace(timing, seconds=[cost], total_seconds=[cost + 0.5 * level])

    monkeypatch.setattr(StepTimer, "time_steps", synthetic)
    loaded = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=1))
    grid, _ = measure_grid(loaded, GridSpec(batch_sizes=(1,), tokens_per_seq=(1, 2, 3), contexts=(16,), repeats=4),
                           layer_skip_layers=1, progress=False)
    secs = dict(zip(grid.tokens_per_seq, grid.seconds))
    assert secs[2] / secs[1] == pytest.approx(1.1) and secs[3] / secs[1] == pytest.approx(1.2)
    assert secs[1] == pytest.approx(1.0)  # T=1's own median: passes 1-3 at 1.0, pass 4 at 2.0
    totals = dict(zip(grid.tokens_per_seq, grid.total_seconds))
    assert totals[3] / totals[1] == pytest.approx(1.7 / 1.5)


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
    assert "## One request drafting" in text and "| 4 | 48 | 3 |" in text  # the lone-draft cells' own table
    assert "| 4 | 4 | 48 |" not in text  # and not as T = 4 in the floor table (every request at T = 4)
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
    from specplan.engine import SamplingParams
    from specplan.planner.from_profile import planner_from_profile
    from specplan.policies import make_policy

    loaded, _, profile = tiny_profile
    for policy in ("goodput", "roofline", "static:3"):
        planner = planner_from_profile(profile, make_policy(policy), proposer="ngram", max_k=4)
        from specplan.engine import LLM

        llm = LLM(loaded=loaded, dtype=torch.float32, kv_cache_bytes=2**22, block_size=4,
                  speculative_config={"proposer": "ngram", "k": 4}, decider=planner)
        plain = LLM(loaded=loaded, dtype=torch.float32, kv_cache_bytes=2**22, block_size=4)
        prompt = [5, 6, 7, 8] * 4
        params = SamplingParams(temperature=0.0, max_tokens=20)
        assert llm.generate(prompt, params)[0].token_ids == plain.generate(prompt, params)[0].token_ids
        assert planner.num_decisions > 0


def test_a_cached_profile_from_an_older_profiler_is_measured_again(tiny_profile, tmp_path, monkeypatch):
    import specplan.adaptive as adaptive
    from specplan.profiler.profile import PROFILE_VERSION

    loaded, _, profile = tiny_profile
    cached = tmp_path / "cached.json"
    monkeypatch.setattr(adaptive, "default_profile_path", lambda current: cached)
    fresh = []
    monkeypatch.setattr(adaptive, "run_profile", lambda **kw: fresh.append(kw) or (profile, cached, tmp_path / "r.md"))
    profile.model_copy(update={"version": PROFILE_VERSION}).save(cached)
    assert adaptive.load_or_make_profile(loaded, None).version == PROFILE_VERSION and not fresh  # reused
    profile.model_copy(update={"version": PROFILE_VERSION - 1}).save(cached)
    adaptive.load_or_make_profile(loaded, None)
    assert len(fresh) == 1  # measured again


def test_a_fresh_profile_that_fits_badly_says_so(tiny_profile, tmp_path, monkeypatch, capsys):
    """A quick profile measured on a busy machine is named in one warning; a good one is not."""
    import specplan.adaptive as adaptive

    loaded, _, profile = tiny_profile
    monkeypatch.setattr(adaptive, "default_profile_path", lambda current: tmp_path / "none.json")
    for heldout, warned in ((3.4, False), (27.7, True)):
        made = profile.model_copy(update={"fit": profile.fit.model_copy(update={"heldout_mape": heldout})})
        monkeypatch.setattr(adaptive, "run_profile", lambda made=made, **kw: (made, tmp_path / "p.json", tmp_path / "r.md"))
        adaptive.load_or_make_profile(loaded, None)
        err = capsys.readouterr().err
        assert ("off by 27.7% on held-out cells" in err and "`specplan profile`" in err) == warned, err
        assert ("warning:" in err) == warned
    assert profile.fit.model_copy(update={"heldout_mape": 10.0}).busy_machine_warning() is None  # the bar itself is quiet


def test_forced_k_drafts_for_the_first_requests_only_when_asked():
    """ForcedK gives k to every request, or (``drafting``) to the first n and 0 to the rest: the
    mixed-width steps scripts/bench_mixed_drafts.py times against the profile's price."""
    from types import SimpleNamespace

    from specplan.profiler.step_timer import ForcedK

    view = SimpleNamespace(requests=[object()] * 4)
    assert ForcedK(2).decide(view) == [2, 2, 2, 2]
    assert ForcedK(1, drafting=3).decide(view) == [1, 1, 1, 0]
    assert ForcedK(1, drafting=9).decide(view) == [1, 1, 1, 1]
    assert ForcedK(1, drafting=0).decide(view) == [0, 0, 0, 0]


def test_profiles_are_cached_under_the_one_cache_root(tmp_path, monkeypatch):
    from specplan.engine.model.loader import cache_root
    from specplan.profiler.run import profile_cache_dir

    monkeypatch.setenv("SPECPLAN_CACHE", str(tmp_path))
    assert cache_root() == tmp_path and profile_cache_dir() == tmp_path / "profiles"
    assert cache_root(tmp_path / "given") == tmp_path / "given"


def test_machine_info_names_the_machine_and_missing_libraries():
    from specplan.profiler.machine import describe, machine_info

    info = machine_info(libraries=("specplan_no_such_library",))
    assert info["cpu"] and info["cores"] >= 1 and info["torch_threads"] >= 1
    assert info["specplan_no_such_library"] is None
    assert describe(info).startswith(f"Machine: cpu {info['cpu']}, cores {info['cores']}, ")
    assert "specplan_no_such_library" not in describe(info)


def test_a_grid_measured_on_another_engine_builds_without_our_weights(tiny_profile, tmp_path):
    """vLLM's profile (profiler/vllm_timer.py) describes the model without loading its weights:
    the roofline then reads the bytes per weight it is given, not the (empty) weights."""
    from specplan.engine import LoadedModel

    loaded, grid, profile = tiny_profile
    described = LoadedModel(config=loaded.config, weights={}, tokenizer=None, path=loaded.path, name=loaded.name)
    ceilings = Ceilings(peak_flops=1e11, bandwidth=2e10, device="cpu", dtype="float32", threads=2)
    other = build_profile(described, ceilings, grid, None, _measure_cheap_proposers(repeats=16), torch.float32, "cpu",
                          weight_itemsize=4.0)
    assert other.fit.num_cells == profile.fit.num_cells
    assert other.cost.weight_bytes == pytest.approx(profile.cost.weight_bytes)  # fp32 both ways
    report = render_profile_report(other, grid, described, tmp_path / "profile.md", command="test", seconds=1.0,
                                   quick=True, weight_itemsize=4.0)
    assert "Ceilings" in report.read_text()
    with pytest.raises(KeyError):  # what the vLLM profile hit before it passed the weights' size
        build_profile(described, ceilings, grid, None, {}, torch.float32, "cpu")


def test_refit_fits_the_saved_grid_again_and_names_a_missing_grid(tiny_profile, tmp_path):
    """``specplan profile --refit P``: a profile made before a change to the fit gets this
    version's fit from the grid it measured, without timing anything; no grid: one line."""
    from typer.testing import CliRunner

    from specplan.cli import app
    from specplan.profiler.fit import fit_latency_model
    from specplan.profiler.profile import refit_profile

    _, grid, profile = tiny_profile
    path = tmp_path / "p.json"
    grid.to_parquet(tmp_path / "p.grid.parquet")
    stale = profile.model_copy(update={"grid_file": "p.grid.parquet",
                                       "latency_model": {**profile.latency_model, "intercept": 1.0}})
    stale.save(path)
    again = refit_profile(path)
    shapes = [StepShape(int(r.batch_size), int(r.num_tokens), int(r.context_tokens)) for r in grid.itertuples()]
    assert again.latency_model == fit_latency_model(shapes, grid["seconds"].tolist()).to_dict()
    assert again.fingerprint == profile.fingerprint and again.fit.heldout_mape == pytest.approx(profile.fit.heldout_mape)
    out = tmp_path / "elsewhere" / "q.json"
    result = CliRunner().invoke(app, ["profile", "--refit", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert Profile.load(out).latency_model == again.latency_model and (out.parent / "p.grid.parquet").exists()
    (tmp_path / "p.grid.parquet").unlink()
    with pytest.raises(ProfileError, match="no measured grid") as e:
        refit_profile(path)
    assert "\n" not in str(e.value)


def test_a_grid_row_costs_the_step_its_cell_ran():
    """The roofline of a grid row (profiler/cost_model.py ``grid_row_cost``): a cell where one of B
    requests drafts is B - 1 plain decodes beside one verify of T tokens; a row without the
    ``drafting`` column (an older grid, vLLM's) or with it missing (NaN, grids joined) is uniform."""
    from types import SimpleNamespace

    from specplan.profiler.cost_model import decode_step_cost, grid_row_cost, step_cost

    cfg = loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32, num_hidden_layers=1)).config
    lone = grid_row_cost(cfg, SimpleNamespace(batch_size=4, tokens_per_seq=3, context=100, drafting=1))
    assert lone == step_cost(cfg, [3, 1, 1, 1], [103, 101, 101, 101], logits_rows=6)
    uniform = decode_step_cost(cfg, 4, 3, 100)
    assert uniform.flops > lone.flops
    for row in (SimpleNamespace(batch_size=4, tokens_per_seq=3, context=100),
                SimpleNamespace(batch_size=4, tokens_per_seq=3, context=100, drafting=float("nan")),
                SimpleNamespace(batch_size=4, tokens_per_seq=3, context=100, drafting=4)):
        assert grid_row_cost(cfg, row) == uniform


def test_the_kv_cache_is_in_the_fingerprint_and_the_cached_profiles_key(tmp_path, monkeypatch):
    """A float16 KV cache times another step: quantised weights (auto: float16) get their own cached
    profile ("-kv_float16" in its name), float32 ones keep the name they had; asking for a float32
    cache with quantised weights keys that too. A profile from before the field ("unknown") is a
    warning, not an error (the planner corrects step times online)."""
    from conftest import loaded_from_hf, tiny_hf_model
    from specplan.engine.model.loader import quantize_model
    from specplan.profiler.profile import check_matches, fingerprint
    from specplan.profiler.run import default_profile_path

    monkeypatch.setenv("SPECPLAN_CACHE", str(tmp_path))
    hf = tiny_hf_model("llama", dtype=torch.float32, hidden_size=128, num_attention_heads=2, num_key_value_heads=1)
    plain, quant = loaded_from_hf(hf).config, quantize_model(loaded_from_hf(hf), "q4").config
    fp_plain, fp_quant = fingerprint(plain, torch.float32, "cpu"), fingerprint(quant, torch.float32, "cpu")
    assert (fp_plain.kv_cache, fp_quant.kv_cache) == ("float32", "float16")
    assert "-kv_" not in default_profile_path(fp_plain).name
    assert "float32-q4_1+q8_0-kv_float16-t" in default_profile_path(fp_quant).name
    fp_quant32 = fingerprint(quant, torch.float32, "cpu", torch.float32)
    assert fp_quant32.kv_cache == "float32" and "-kv_" not in default_profile_path(fp_quant32).name
    old = Profile.model_construct(fingerprint=fp_quant.model_copy(update={"kv_cache": "unknown"}))
    warnings = check_matches(old, fp_quant, "old.json")
    assert any("kv_cache 'unknown', now 'float16'" in w for w in warnings)
