"""Bad input on the command line: one line on stderr, ``error: <what is wrong>; <how to fix it>``,
and exit code 2 (click's code for usage errors), never a traceback.

Commands check cheap things (numbers, names, paths) up front with the helpers below, before a
model loads or a measurement starts; ``reports_errors`` wraps every command and turns the project's
known exceptions (CliError, ModelLoadError, ProfileError, WorkloadUnavailableError, ValueError,
OSError) into that one line. ``SPECPLAN_DEBUG=1`` re-raises them instead, with the traceback.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import socket
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Annotated, NoReturn

import typer

EXIT_BAD_INPUT = 2

# The built-in engine's weights option, shared by every command that loads the model.
Quantize = Annotated[str, typer.Option(help="Weights: none (float32) | gguf (a GGUF's Q8_0/Q4_0/Q4_1 blocks as stored) | int8 | q4 (quantized at load).")]
# The built-in engine's KV cache element type (engine/model_runner.py kv_cache_dtype).
KvCacheDtype = Annotated[str, typer.Option(help="KV cache element type: auto (float16 with quantized weights, as llama.cpp; else float32) | float32 | float16.")]


class CliError(Exception):
    """Bad input; the message is one line saying what is wrong and how to fix it."""


def fail(message: str) -> NoReturn:
    raise CliError(message)


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return " ".join(lines) if lines else type(e).__name__


def _message(e: Exception) -> str | None:
    """The line for a known bad-input exception, else None (a bug: let it raise)."""
    if isinstance(e, CliError):
        return str(e)
    if isinstance(e, OSError):
        where = f"{e.filename}: " if e.filename else ""
        what = (e.strerror or _one_line(e)).lower()
        return f"{where}{what}; check the path exists and is writable, or choose another"
    if isinstance(e, ValueError):  # ProfileError, RequestError, UnsupportedModelError, config checks
        return _one_line(e)
    from specplan.bench.workloads import WorkloadUnavailableError
    from specplan.engine import ModelLoadError

    if isinstance(e, (ModelLoadError, WorkloadUnavailableError)):
        return _one_line(e)
    return None


def reports_errors(command: Callable) -> Callable:
    """Wrap a typer command: bad input becomes one ``error:`` line on stderr and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as e:  # anything not recognised as bad input re-raises
            message = _message(e)
            if message is None or os.environ.get("SPECPLAN_DEBUG"):
                raise
        typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
        raise typer.Exit(EXIT_BAD_INPUT)

    return wrapper


# ---- numbers -------------------------------------------------------------------------------------
def at_least(value: float | None, minimum: float, option: str) -> None:
    """``value >= minimum`` (None: not given, fine)."""
    if value is not None and not value >= minimum:
        fail(f"{option} must be at least {minimum}, got {value}; pass {option} {max(minimum, 1)} or more")


def positive(value: float | None, option: str) -> None:
    """``value > 0`` (None: not given, fine)."""
    if value is not None and not value > 0:
        fail(f"{option} must be greater than 0, got {value}; pass a positive number")


def in_range(value: int, lo: int, hi: int, option: str, example: int) -> None:
    if not lo <= value <= hi:
        fail(f"{option} must be between {lo} and {hi}, got {value}; pass e.g. {option} {example}")


def items(text: str, option: str) -> list[str]:
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        fail(f"{option} is empty; give comma-separated values, e.g. {option} 1,2,4")
    if not all(items):
        fail(f"{option} {text!r} has an empty item; give comma-separated values without gaps, e.g. 1,2,4")
    return items


def int_list(text: str, option: str, minimum: int) -> tuple[int, ...]:
    """Comma-separated whole numbers, each at least ``minimum``."""
    values = []
    for x in items(text, option):
        try:
            values.append(int(x))
        except ValueError:
            fail(f"{option} must be comma-separated whole numbers, got {x!r} in {text!r}; e.g. {option} 1,2,4")
    bad = [v for v in values if v < minimum]
    if bad:
        fail(f"{option} values must be at least {minimum}, got {bad[0]}; e.g. {option} 1,2,4")
    return tuple(values)


def float_list(text: str, option: str) -> tuple[float, ...]:
    """Comma-separated numbers > 0 ('inf' allowed)."""
    values = []
    for x in items(text, option):
        try:
            value = float(x)
        except ValueError:
            fail(f"{option} must be comma-separated numbers, got {x!r} in {text!r}; e.g. {option} 1,2,4")
        if math.isnan(value) or not value > 0:
            fail(f"{option} values must be greater than 0, got {x}; e.g. {option} 1,2,4")
        values.append(value)
    return tuple(values)


# ---- names ---------------------------------------------------------------------------------------
def choice(value: str, choices: Sequence[str], option: str) -> str:
    if value not in choices:
        fail(f"unknown {option} {value!r}; choose one of {', '.join(choices)}")
    return value


def kv_cache_dtype(value: str, option: str = "--kv-cache-dtype"):
    """The torch dtype --kv-cache-dtype names, or None for auto (the engine's choice)."""
    from specplan.engine.model_runner import KV_CACHE_DTYPES

    choice(value, ("auto", *KV_CACHE_DTYPES), option)
    return KV_CACHE_DTYPES.get(value)


def choices(text: str, known: Sequence[str], option: str) -> tuple[str, ...]:
    return tuple(choice(x, known, option) for x in items(text, option))


def policy(spec: str, option: str = "--policy") -> str:
    from specplan.policies import make_policy

    try:
        make_policy(spec)
    except ValueError as e:
        fail(f"{option}: {_one_line(e)}")
    return spec


# ---- paths ---------------------------------------------------------------------------------------
def input_file(path: str | Path | None, option: str, example: str) -> None:
    """An existing file (None: not given, fine). ``example``: what to pass instead."""
    if path is None:
        return
    p = Path(path).expanduser()
    if not p.exists():
        fail(f"{option} {p} does not exist; {example}")
    if p.is_dir():
        fail(f"{option} {p} is a directory, not a file; {example}")


def profile_file(path: str | None, option: str = "--profile") -> None:
    """A readable profile JSON (None: not given, fine); whether it matches the model is checked later."""
    if path is None:
        return
    input_file(path, option, "give a profile JSON written by `specplan profile`")
    from specplan.profiler.profile import Profile

    Profile.load(path)  # ProfileError (one line) for a corrupted or foreign file


def model_path(path: str | None, option: str = "--model") -> None:
    """An existing HF directory or .gguf file (None: the default model). The loader checks the rest."""
    if path is None:
        return
    p = Path(path).expanduser()
    if not p.exists():
        fail(f"{option} {p} does not exist; pass a local Hugging Face model directory or .gguf file "
             "(nothing is downloaded)")
    if p.is_file() and p.suffix.lower() != ".gguf":
        fail(f"{option} {p} is neither a directory nor a .gguf file; pass a Hugging Face model directory "
             "(config.json + *.safetensors + tokenizer) or a .gguf file")


def _writable_dir(d: Path, option: str, shown: Path) -> None:
    """Create ``d`` if missing and check a file can be written in it."""
    for parent in (d, *d.parents):
        if parent.exists():
            if not parent.is_dir():
                fail(f"{option} {shown}: {parent} is a file, not a folder; choose a path under a folder")
            break
    try:
        d.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=d):
            pass
    except OSError as e:
        fail(f"{option} {shown}: cannot write in {d} ({(e.strerror or str(e)).lower()}); choose a writable location")


def output_file(path: Path | None, option: str, example_name: str) -> None:
    """A file path that can be written (None: the default, fine)."""
    if path is None:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        fail(f"{option} {p} is a directory; give a file path such as {p / example_name}")
    _writable_dir(p.parent, option, p)


def output_dir(path: Path, option: str) -> None:
    """A folder that exists or can be made, and can be written in."""
    p = Path(path).expanduser()
    if p.exists() and not p.is_dir():
        fail(f"{option} {p} is a file; give a folder path such as {p.with_suffix('')}-out")
    _writable_dir(p, option, p)


# ---- environment ---------------------------------------------------------------------------------
def installed(module: str, what: str, fix: str) -> None:
    if importlib.util.find_spec(module) is None:
        fail(f"{what} is not installed; {fix}")


def listen_address(host: str, port: int) -> None:
    """The server can bind ``host:port`` (checked before the model loads)."""
    in_range(port, 1, 65535, "--port", 8000)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        fail(f"--host {host!r} is not an address of this machine ({e.strerror}); use e.g. 127.0.0.1 or 0.0.0.0")
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            fail(f"cannot listen on {host}:{port} ({(e.strerror or str(e)).lower()}); "
                 f"choose another --port or stop what uses it")
