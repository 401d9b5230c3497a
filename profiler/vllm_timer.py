"""`specplan profile --engine vllm`: vLLM's own step time per batch size and tokens per step.

The same measurement as profiler/run.py makes of specplan's engine, made of vLLM: B decoding
requests, each step verifying T = 1 + k tokens per request, at a few context lengths; the same
fit (profiler/fit.py) with its error on held-out cells, the same Profile JSON and report. The
profile's kernels field names the engine (``vllm-<version>-<device>``), so the vLLM plugin can
tell a vLLM profile from one of specplan's engine, and refuse the latter.

How k is forced: vLLM loads ``ForcedDrafts`` below as its ``custom_class`` drafter. It gives every
decoding request exactly k random draft tokens (almost all rejected, so the context stays put
as in the engine's profiler), k cycling through the grid's values in pairs of steps: the first
step of a pair follows a step of another width (warm-up), the second one is timed. One cycle
through the values is a pass; each width's time is its median ratio to the narrowest width in
the same pass, times the narrowest width's median (``run._drift_free``: the VM's drift cancels).
A step's time is from the end of one ``propose`` call to the start of the next: all of vLLM's
step (scheduling, forward, sampling, verification, bookkeeping) and none of the drafter's.

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
from typing import Any

import numpy as np

# What a vLLM profile's fingerprint names as its kernels: "vllm-0.32.0-cpu".
VLLM_KERNELS_PREFIX = "vllm-"
TIMING_OUT_ENV = "SPECPLAN_VLLM_TIMING_OUT"
TIMING_KS_ENV = "SPECPLAN_VLLM_TIMING_KS"
FORCED_DRAFTS = "specplan.profiler.vllm_timer.ForcedDrafts"


def vllm_kernels(version: str, device: str) -> str:
    """The kernels field of a profile measured on vLLM ``version`` on ``device``."""
    return f"{VLLM_KERNELS_PREFIX}{version}-{device}"


class ForcedDrafts:
    """A vLLM ``custom_class`` drafter for timing: k random drafts for every decoding request,
    k from ``SPECPLAN_VLLM_TIMING_KS`` (comma-separated), two steps per value, round-robin."""

    def __init__(self, vllm_config: Any):
        import torch
        import vllm

        from specplan.engine.config import ModelConfig

        from .profile import model_config_hash

        self.ks = [int(k) for k in os.environ.get(TIMING_KS_ENV, "0,1,2,4,8").split(",")]
        self.out = open(os.environ[TIMING_OUT_ENV], "a", buffering=1)  # line-buffered: the driver reads it
        model = vllm_config.model_config
        self.vocab = int(model.get_vocab_size())
        self.rng = np.random.default_rng(0)
        self.calls = 0
        self._end: float | None = None  # perf_counter when the previous call returned
        self._k = 0  # drafts per request the previous call returned
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
        c = self.calls
        if self._end is not None:  # the step that just ran verified the previous call's drafts
            prev = c - 1
            self.out.write(json.dumps({
                "rows": rows, "decoding": decoding, "k": self._k, "seconds": start - self._end,
                "warm": prev % 2 == 1, "pass": prev // (2 * len(self.ks)),
                "query_tokens": scheduled_tokens(slot_mappings),
                # KV tokens the step read, its drafts aside (cell_rows adds them): each request's
                # committed tokens, the one the step fed included.
                "context_tokens": int(np.asarray(num_tokens_no_spec[:rows]).sum()),
            }) + "\n")
        k = self.ks[(c // 2) % len(self.ks)]
        drafts = self.rng.integers(0, self.vocab, size=(rows, k)).tolist() if k else [[] for _ in range(rows)]
        for i, s in enumerate(sampled_token_ids):
            if not s:
                drafts[i] = []  # still prefilling
        self.calls = c + 1
        self._k = k
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
    """The cells: batch sizes x draft lengths (T = 1 + k) x prompt lengths, passes per cell."""

    batch_sizes: tuple[int, ...]
    tokens_per_seq: tuple[int, ...]
    contexts: tuple[int, ...]
    passes: int  # timed passes; one more runs first as warm-up

    @staticmethod
    def quick() -> "VllmGrid":
        return VllmGrid((1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9), (128, 512), passes=4)

    @staticmethod
    def full() -> "VllmGrid":
        return VllmGrid((1, 2, 4, 8, 16, 32, 64), tuple(range(1, 10)), (128, 512, 1024), passes=6)

    @property
    def steps_per_cell(self) -> int:
        return (self.passes + 1) * 2 * len(self.tokens_per_seq)


def cell_rows(samples: list[dict], batch: int, context: int, tokens_per_seq: tuple[int, ...]) -> list[dict]:
    """One grid row per T from one (B, context) run's step samples: warm steps where all B
    requests decoded (no prompt chunk beside them), drift-free medians over the passes (the first
    pass is the warm-up). Empty when some T has no timed step in a pass with the narrowest one."""
    from .run import _drift_free

    by_pass: dict[int, dict[int, dict]] = {}
    for s in samples:
        t = 1 + s["k"]
        if not s["warm"] or s["decoding"] != batch or s["rows"] != batch or t not in tokens_per_seq:
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
                      progress: bool = True, seed: int = 0, extra_llm_args: dict | None = None):
    """Run vLLM over the grid; returns (grid DataFrame, the timing drafter's header line)."""
    import random
    import tempfile

    import pandas as pd
    from rich.progress import Progress
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    ks = [t - 1 for t in grid.tokens_per_seq]
    out = Path(tempfile.mkdtemp(prefix="specplan-vllm-timing-")) / "steps.jsonl"
    os.environ[TIMING_OUT_ENV] = str(out)
    os.environ[TIMING_KS_ENV] = ",".join(map(str, ks))
    max_b, max_t, max_ctx = max(grid.batch_sizes), max(grid.tokens_per_seq), max(grid.contexts)
    steps = grid.steps_per_cell + 4 * len(grid.tokens_per_seq)  # and a margin for the pass boundary
    # Random drafts are (almost) never accepted: a request grows by about one token a step.
    max_len = max_ctx + steps + max_t + 64
    kv_gib = -(-3 * max_b * max_len * kv_bytes_per_token // (2 * 2**30))  # 1.5x what the grid holds, rounded up
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, kv_gib)))
    args = dict(model=str(model_dir), dtype="float32", max_model_len=max_len, max_num_seqs=max_b, seed=seed,
                max_num_batched_tokens=max(2048, max_b * max_t), skip_tokenizer_init=True,
                speculative_config={"method": "custom_class", "model": FORCED_DRAFTS,
                                    "num_speculative_tokens": max(ks) or 1})
    args.update(extra_llm_args or {})
    llm = LLM(**args)
    rng = random.Random(seed)
    rows = []
    cells = len(grid.batch_sizes) * len(grid.contexts)
    params = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True, detokenize=False)
    with Progress(disable=not progress) as bar:
        task = bar.add_task("profiling vLLM steps", total=cells)
        for b in grid.batch_sizes:
            for ctx in grid.contexts:
                done = out.stat().st_size if out.exists() else 0
                prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab_size) for _ in range(ctx)]) for _ in range(b)]
                llm.generate(prompts, params, use_tqdm=False)
                samples = _read_samples(out, done)
                cell = cell_rows(samples, b, ctx, grid.tokens_per_seq)
                if not cell:
                    raise RuntimeError(f"no complete pass of timed steps at B={b}, context {ctx}: vLLM did not run "
                                       f"the forced drafts (is num_speculative_tokens >= {max(ks)}?)")
                rows.extend(cell)
                bar.advance(task)
    header = _read_header(out)
    del llm
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
    grid, header = measure_vllm_grid(model_dir, grid_spec, vocab_size=config.vocab_size, kv_bytes_per_token=kv_bytes,
                                     progress=progress, extra_llm_args=extra_llm_args)
    ceilings = measure_ceilings()
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
                                   seconds=time.perf_counter() - t0, quick=quick, weight_itemsize=itemsize)
    return profile, out, report
