"""The CLI's side of planner/beliefs.py: `generate --adaptive` starts from and saves beliefs beside
the cached profile, `--no-beliefs` starts cold, a bad file is one warning, and `specplan profile
--reset-beliefs` forgets them. Runs the embedded model (a few short generations)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from specplan.cli import app

from conftest import flat_profile


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    """(the embedded model's converted directory, a profile for it, where its beliefs go), with a
    cache of the test's own for profiles and beliefs (the model is converted once, in the usual one)."""
    import os

    import torch

    from specplan.engine import load_model
    from specplan.profiler.profile import fingerprint
    from specplan.profiler.run import default_beliefs_path

    from specplan.engine.model.cpu_kernels import load as load_kernels

    model_dir = load_model(None).path  # the GGUF converted (once) into the usual cache
    load_kernels()  # built (once) in the usual cache too; this process keeps them loaded
    cache = tmp_path_factory.mktemp("cache")
    old = os.environ.get("SPECPLAN_CACHE")
    os.environ["SPECPLAN_CACHE"] = str(cache)
    loaded = load_model(str(model_dir))
    profile = cache / "flat-profile.json"
    flat_profile(loaded).save(profile)
    yield str(model_dir), profile, default_beliefs_path(fingerprint(loaded.config, torch.float32, "cpu"))
    if old is None:
        del os.environ["SPECPLAN_CACHE"]
    else:
        os.environ["SPECPLAN_CACHE"] = old


def generate(embedded, *extra: str):
    model, profile, _ = embedded
    result = CliRunner().invoke(app, ["generate", "def add(a, b):\n    return a + b\n\ndef sub(a, b):",
                                      "--model", model, "--adaptive", "--profile", str(profile), "--max-tokens", "6",
                                      *extra])
    assert result.exit_code == 0, result.output
    return [line for line in result.stderr.splitlines() if line.startswith(("[beliefs", "warning"))]


def test_generate_saves_and_loads_beliefs_and_a_bad_file_is_one_warning(embedded):
    beliefs = embedded[2]
    assert generate(embedded) == [] and beliefs.exists()  # a first run: nothing to load, then saved
    assert generate(embedded)[0].startswith(f"[beliefs from {beliefs}:")  # the next run starts from them
    beliefs.write_text('{"format": "specplan-beliefs", "vers')
    assert generate(embedded, "--no-beliefs") == []  # cold: the file is not even read
    lines = generate(embedded)
    assert len(lines) == 1 and lines[0].startswith(f"warning: beliefs file {beliefs} is corrupted or truncated")
    assert generate(embedded)[0].startswith("[beliefs from")  # that run saved good beliefs over it


def test_profile_reset_beliefs(embedded):
    model, beliefs = embedded[0], embedded[2]
    generate(embedded)
    runner = CliRunner()
    result = runner.invoke(app, ["profile", "--reset-beliefs", "--model", model])
    assert result.exit_code == 0 and result.stdout.strip() == f"removed {beliefs}" and not beliefs.exists()
    result = runner.invoke(app, ["profile", "--reset-beliefs", "--model", model])
    assert result.exit_code == 0 and result.stdout.strip() == f"no saved beliefs at {beliefs}"


@pytest.mark.parametrize("argv, fragment", [
    (["bench", "coldstart", "--static-ks", "0"], "--static-ks"),
    (["bench", "coldstart", "--workloads", "poems"], "--workloads"),
    (["bench", "coldstart", "--runs", "0"], "--runs must be at least 1"),
    (["bench", "coldstart", "--calibration-after", "x"], "--calibration-after"),
])
def test_coldstart_bad_input_is_one_line(argv, fragment):
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and fragment in result.stderr and len(result.stderr.strip().splitlines()) == 1
