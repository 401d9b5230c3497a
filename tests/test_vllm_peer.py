"""specplan/bench/vllm_peer.py without vLLM: the arms it builds, the paired summary by hand, and
the report written after every cell (a cut run keeps what it measured)."""

from __future__ import annotations

import json

import pytest

from specplan.bench.vllm_peer import (NULL_CONTROL, OFF, NullControl, available_memory_bytes, check_arms_fit, main,
                                      plugin_counters, plugin_run_summary, render, run_meta, summarize, vllm_arms)


def runs_of(cell: dict[str, list[float]], workload="w", batch=4, same=True) -> list[dict]:
    return [{"workload": workload, "batch_size": batch, "arm": arm, "repeat": rep, "requests": 4,
             "same_as_vllm_off": same, "seconds": 1.0, "output_tokens": int(tps), "tokens_per_s": tps}
            for arm, per_rep in cell.items() for rep, tps in enumerate(per_rep)]


def test_arms_carry_the_exported_table_and_an_all_zero_table_runs_as_off():
    arms = {a.name: a for a in vllm_arms([2], [], None, table=[[1, 1, 3], [2, 4, 2], [5, 32, 0]])}
    assert list(arms) == [OFF, "vllm:static:2", "vllm:table"]
    spec = arms["vllm:table"].speculative_config
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 3
    assert spec["num_speculative_tokens_per_batch_size"] == [(1, 1, 3), (2, 4, 2), (5, 32, 0)]
    zero = {a.name: a for a in vllm_arms([], [], None, table=[[1, 32, 0]])}
    assert zero["vllm:table"].speculative_config is None
    assert "vllm:table" not in {a.name for a in vllm_arms([2], [], None)}


def test_a_plugin_arm_may_run_under_its_own_vllm_k():
    arms = {a.name: a for a in vllm_arms([], ["goodput", "static:2@K2"], None)}
    assert arms["vllm:plugin:goodput"].speculative_config["num_speculative_tokens"] == 8
    k2 = arms["vllm:plugin:static:2@K2"]
    assert k2.speculative_config["num_speculative_tokens"] == 2
    assert k2.env["SPECPLAN_POLICY"] == "static:2"  # the plugin is told the policy, not the arm's name
    assert k2.env["SPECPLAN_MAX_K"] == "2"  # the planner's cap follows K (the plugin refuses a cap above it)
    assert "SPECPLAN_MAX_K" not in arms["vllm:plugin:goodput"].env


def test_two_profiles_compare_in_one_run():
    arms = {a.name: a for a in vllm_arms([], ["goodput"], "new.json", other_profile="old.json")}
    assert arms["vllm:plugin:goodput"].env["SPECPLAN_PROFILE"] == "new.json"
    assert arms["vllm:plugin:goodput~other"].env["SPECPLAN_PROFILE"] == "old.json"
    assert arms["vllm:plugin:goodput~other"].env["SPECPLAN_POLICY"] == "goodput"


def test_summary_pairs_each_repeat_with_the_cells_best_static():
    rows = summarize(runs_of({OFF: [10, 20], "vllm:static:2": [12, 18], "vllm:static:4": [11, 22],
                              "vllm:plugin:goodput": [13, 21]}))
    by_arm = {r["arm"]: r for r in rows}
    assert by_arm[OFF]["best_static"] == "vllm:static:4"  # medians 16.5 (k=4) > 15 (k=2)
    plugin = by_arm["vllm:plugin:goodput"]
    assert plugin["tokens_per_s"] == pytest.approx(17.0)
    assert plugin["vs_vllm_off"] == pytest.approx((13 / 10 + 21 / 20) / 2)
    assert plugin["vs_vllm_best_static"] == pytest.approx((13 / 11 + 21 / 22) / 2)


def test_report_marks_a_partial_run_and_names_the_worst_cell_against_off(tmp_path):
    runs = runs_of({OFF: [10], "vllm:table": [9.0]}, batch=1) + runs_of({OFF: [10], "vllm:table": [10.5]}, batch=32)
    path = render(runs, tmp_path, run_meta("python -m specplan.bench.vllm_peer", "0.32.0", complete=False))
    text = path.read_text()
    assert "Partial" in text and "vllm:table: 0.900x (w B=1) to 1.050x (w B=32)" in text
    doc = json.loads((tmp_path / "vllm-peer.json").read_text())
    assert doc["complete"] is False and len(doc["runs"]) == 4
    render(runs, tmp_path, run_meta("python -m specplan.bench.vllm_peer", "0.32.0"))
    assert "Partial" not in path.read_text() and (tmp_path / "vllm-peer.png").stat().st_size > 0
    # --rerender: the report again from the saved JSON, keeping the run's own date and command
    doc = json.loads((tmp_path / "vllm-peer.json").read_text())
    doc["date"] = "2026-01-02 03:04 UTC"
    (tmp_path / "saved.json").write_text(json.dumps(doc))
    main(["--rerender", str(tmp_path / "saved.json"), "--out", str(tmp_path / "again")])
    assert "on 2026-01-02 03:04 UTC" in (tmp_path / "again" / "vllm-peer.md").read_text()


def test_plugin_arms_report_what_the_plugin_did_per_run(tmp_path):
    arms = {a.name: a for a in vllm_arms([], ["goodput"], "p.json", stats_dir=tmp_path)}
    stats = arms["vllm:plugin:goodput"].env["SPECPLAN_VLLM_STATS"]
    assert stats == str(tmp_path / "plugin-goodput.json")
    assert arms["vllm:plugin:goodput"].env["SPECPLAN_VLLM_STATS_EVERY_S"] == "1.0"
    assert "SPECPLAN_VLLM_STATS" not in arms[OFF].env
    assert plugin_counters(None) is None
    before = plugin_counters(stats)  # nothing written yet: zeros
    assert before == dict.fromkeys(before, 0.0)
    # The plugin's stats file after a run of 10 calls over 40 request-steps, 20 drafts, 5 accepted.
    (tmp_path / "plugin-goodput.json").write_text(json.dumps(
        {"calls": 10, "request_steps": 40, "decisions": 6, "drafts_proposed": 20, "drafts_accepted": 5,
         "own_s": 0.02, "phase_s": {}}))
    did = plugin_run_summary(before, plugin_counters(stats))
    assert did == pytest.approx({"calls": 10, "drafts_per_request_step": 0.5, "accepted_per_draft": 0.25,
                                 "own_ms_per_call": 2.0})
    quiet = plugin_run_summary(before, dict(before, calls=3.0, request_steps=12.0))
    assert quiet["accepted_per_draft"] is None and quiet["drafts_per_request_step"] == 0.0
    runs = runs_of({OFF: [10, 10], "vllm:plugin:goodput": [9, 11]})
    runs[2]["plugin"], runs[3]["plugin"] = did, quiet
    row = {r["arm"]: r for r in summarize(runs)}["vllm:plugin:goodput"]
    assert row["plugin"]["accepted_per_draft"] == pytest.approx(0.25)  # the repeat without drafts has none
    assert row["plugin"]["own_ms_per_call"] == pytest.approx((2.0 + 0.0) / 2)
    text = render(runs, tmp_path / "out", run_meta("cmd", "0.32.0")).read_text()
    assert "| w | 4 | vllm:plugin:goodput | 1.000 | 0.25 | 0.25 | 1.00 |" in text


def test_null_control_reruns_vllm_off_and_is_reported_against_it(tmp_path):
    class Off:
        def run(self, prompts, batch, max_tokens):
            return {"tokens_per_s": float(len(prompts) * batch * max_tokens)}

    control = NullControl(Off())
    assert control.name == NULL_CONTROL and control.run([[1], [2]], 2, 3) == {"tokens_per_s": 12.0}
    runs = runs_of({OFF: [10, 10], NULL_CONTROL: [11, 9]})
    text = render(runs, tmp_path, run_meta("cmd", "0.32.0")).read_text()
    assert f"{NULL_CONTROL}: 1.000x (w B=4)" in text  # the median of the paired 1.1 and 0.9


def test_engine_arms_load_the_weights_asked_for_and_say_so(monkeypatch):
    import torch

    import specplan.engine as engine_pkg
    from conftest import loaded_from_hf, tiny_hf_model
    from specplan.bench.vllm_peer import engine_arms

    asked = []

    def fake_load(model, quantize="none"):
        asked.append(quantize)
        return loaded_from_hf(tiny_hf_model("llama", dtype=torch.float32))

    monkeypatch.setattr(engine_pkg, "load_model", fake_load)
    assert [a.name for a in engine_arms(None, [], 2, None)] == ["engine:off"]
    quantized = engine_arms(None, [], 2, None, quantize="q4")
    assert [a.name for a in quantized] == ["engine:q4:off"] and asked == ["none", "q4"]
    r = quantized[0].run([[1, 2, 3, 1, 2, 3]], 1, 4)
    assert r["output_tokens"] == 4 and len(r["outputs"][0]) == 4


def test_a_run_whose_arms_do_not_fit_in_memory_stops_before_measuring():
    gb = 10**9
    check_arms_fit(20 * gb, 16.5 * gb, arms_left=3)  # 3.5 GB each: 6 GB left after them
    with pytest.raises(SystemExit, match="do not fit in memory: each takes ~3.5 GB") as e:
        check_arms_fit(20 * gb, 16.5 * gb, arms_left=4, headroom=3 * gb)  # 2.5 GB left: under the headroom
    assert "\n" not in str(e.value) and "--static-ks" in str(e.value)
    check_arms_fit(None, 1, arms_left=9)  # no /proc/meminfo: nothing to check
    check_arms_fit(20 * gb, 1 * gb, arms_left=0)  # the last arm: nothing more to load
    available = available_memory_bytes()
    assert available is None or available > 0
