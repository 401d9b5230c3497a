"""`specplan profile`: measure this machine and model, fit the latency model, write the profile.

Steps: (1) the roofline ceilings; (2) a grid of real engine steps over batch size B, tokens per
sequence T = 1 + k and context length, and steps where one request of B drafts, median of repeats
after warm-up (the widths of one batch taken round-robin); (3) drafting cost per
proposer (a draft model's or EAGLE head's pass per B: the chain prices its head share with it); (4) the fit, with its error on held-out cells next to the pure roofline's error;
(5) the Profile JSON, the raw grid as parquet and a Markdown report with plots.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pandas as pd
import torch
from rich.progress import Progress

from specplan.engine.model.loader import LoadedModel, cache_root, load_model
from specplan.engine.model_runner import ModelRunner, ScheduledSeq
from specplan.engine.proposers.factory import HEAD_PROPOSERS

from .ceilings import Ceilings, measure_ceilings
from .cost_model import grid_row_cost, kv_entry_bytes, layer_costs, step_costs, weight_bytes
from .step_timer import timing_engine
from .fit import fit_grid, mape
from .profile import CeilingsModel, CostConstants, DraftCost, Fingerprint, FitError, Profile, fingerprint
from .step_timer import StepTimer


@dataclass(frozen=True)
class GridSpec:
    batch_sizes: tuple[int, ...]
    tokens_per_seq: tuple[int, ...]  # T = 1 + k, the same for every request of a cell
    contexts: tuple[int, ...]
    repeats: int
    # Draft tokens of one request in a batch whose other requests do not draft (cells at B >= 2
    # only): the steps the planner mostly chooses at large B, which uniform widths never time
    # (their steps at B = 8, 16, 32 hold 8, 16, 24, ... tokens). The fit sees them beside the
    # rest, and the report lists what they measured against what it prices. On the Q4_1 engine
    # (Zen 4 VM, full grid) the fit with them priced one draft at B >= 8 as the fit without them
    # did (2.4% of the plain step, median; the cells measured 3.8%), and predicted these cells
    # within 3.8% (4.2% without): reports/profile-zen4-q4_1-s34.
    lone_drafts: tuple[int, ...] = ()

    def widths(self, batch_size: int) -> list[tuple[int, int | None]]:
        """The cells at one B, as (T of the drafting requests, how many draft: None for all). The
        uniform ones come last: the draft rounds timed after a pass run over every sequence's next
        position, whose KV slot a step reserves only where the sequence verified drafts."""
        lone = [(1 + d, 1) for d in self.lone_drafts if batch_size >= 2 and d >= 1]
        return lone + [(t, None) for t in self.tokens_per_seq]

    @staticmethod
    def quick() -> "GridSpec":
        return GridSpec((1, 2, 4, 8, 16, 32), (1, 2, 3, 5, 9), (128, 512), repeats=5, lone_drafts=(1, 3))

    @staticmethod
    def full() -> "GridSpec":
        return GridSpec((1, 2, 4, 8, 16, 32, 64), tuple(range(1, 10)), (128, 512, 1024), repeats=5, lone_drafts=(1, 3))


def measure_grid(loaded: LoadedModel, spec: GridSpec, layer_skip_layers: int = 8, progress: bool = True,
                 kv_dtype: torch.dtype | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Step times over the grid (one row per cell: column ``drafting`` says how many of its
    ``batch_size`` requests verified ``tokens_per_seq`` tokens, the rest 1), and the per-round time
    at each B of the layer-skip draft and (column ``head_seconds``, when one ships for the model)
    of the EAGLE-3 head."""
    widest = max(t for b in spec.batch_sizes for t, _ in spec.widths(b))
    engine = timing_engine(loaded, max(spec.batch_sizes), widest, max(spec.contexts), kv_dtype)
    timer = StepTimer(engine)
    draft = ModelRunner(engine.model.truncated(layer_skip_layers),
                        engine.runner.kv_cache[:layer_skip_layers], engine.block_manager.block_size)
    head_round = head_pass_timer(engine)
    rows, drafts = [], []
    cells = len(spec.contexts) * sum(len(spec.widths(b)) for b in spec.batch_sizes)
    with Progress(disable=not progress) as bar:
        task = bar.add_task("profiling steps", total=cells)
        # B outer, context inner: the contexts of one B are measured seconds apart, not a whole
        # pass over B (~30 s in the quick grid) apart. Context-outer put every context-128 step in
        # one spell of this VM and every context-512 step in another, and the fit read the spells'
        # difference as the cost of context: held-out error 4.4-12.4% over four quick profiles,
        # where each context alone fitted to 2.1-4.8%; B-outer, four profiles read 6.3-9.4%.
        for b in spec.batch_sizes:
            for ctx in spec.contexts:
                timer.fill(b, ctx)
                # Round-robin over T: the repeats of one cell are spread over the whole pass, so a
                # slow spell of this (shared, 2-core) machine does not land on one cell alone.
                # Pass 0 is the warm-up. Each visit times the second of two steps of its width:
                # a step timed right after a step of another width reads a different cost than in
                # serving, where consecutive steps have similar widths (B=1, T=9: 1.26-1.32x T=1
                # right after a change of width, 1.30-1.45x in a run of T=9 steps).
                widths = spec.widths(b)
                runs: dict[tuple[int, int | None], list] = {w: [] for w in widths}
                for rep in range(spec.repeats + 1):
                    for t, drafting in widths:
                        timing = timer.time_steps(t, repeats=1, warmup=1, drafting=drafting)
                        if rep:
                            runs[t, drafting].append((timing, timer.decider.records[-1]))
                narrowest = runs[min(spec.tokens_per_seq), None]
                narrowest_secs = [timing.seconds[0] for timing, _ in narrowest]
                narrowest_totals = [timing.total_seconds[0] for timing, _ in narrowest]
                for (t, drafting), samples in runs.items():
                    secs = [timing.seconds[0] for timing, _ in samples]
                    totals = [timing.total_seconds[0] for timing, _ in samples]
                    rows.append({"batch_size": b, "tokens_per_seq": t, "context": ctx,
                                 "drafting": b if drafting is None else min(drafting, b),
                                 "num_tokens": samples[-1][1].num_tokens,
                                 "context_tokens": round(statistics.mean(r.context_tokens for _, r in samples)),
                                 "seconds": _drift_free(secs, narrowest_secs),
                                 "total_seconds": _drift_free(totals, narrowest_totals),
                                 "all_seconds": secs})
                    bar.advance(task)
                round_ = {"batch_size": b, "context": ctx, "seconds": _time_rounds(
                    lambda items: draft.execute(draft.build_batch(items, engine.block_manager)).argmax(dim=-1),
                    engine, spec.repeats)}
                if head_round is not None:
                    round_["head_seconds"] = _time_rounds(head_round, engine, spec.repeats)
                drafts.append(round_)
    timer.clear()
    return pd.DataFrame(rows), pd.DataFrame(drafts)


def _drift_free(seconds: list[float], narrowest: list[float]) -> float:
    """A width's step time from its passes: its median ratio to the narrowest width's step in the
    same pass, times the narrowest width's median. One pass over the widths takes well under a
    second, so the machine's drift between passes cancels in the ratios. Plain medians per width
    mixed passes from different spells of this VM (bandwidth moves 2x within minutes): in one
    quick profile (B=1, context 128) T=1's median came from a fast pass and T=2's from a slow one,
    and the grid read T=2 at 1.44x T=1, where the passes' own ratios had a median of 1.08x."""
    ratios = [s / n for s, n in zip(seconds, narrowest, strict=True)]
    return statistics.median(narrowest) * statistics.median(ratios)


def _time_rounds(run_round: Callable[[list[ScheduledSeq]], object], engine, repeats: int) -> float:
    """Median seconds of ``run_round`` (one draft pass: batch building, forward, the pick) over
    the running sequences, 1 token each, after one warm-up."""
    seqs = list(engine.scheduler.running)
    items = [ScheduledSeq(s, [s.token_ids[-1]], s.num_tokens - 1, 1) for s in seqs]
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        run_round(items)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def head_pass_timer(engine, head_dir: str | Path | None = None) -> Callable[[list[ScheduledSeq]], object] | None:
    """One pass of an EAGLE-3 head (``head_dir``; None: the one shipped for the engine's model, and
    None back when none ships): what each draft position of ``--proposer eagle`` or ``chain``
    costs besides verifying. The features are random (a pass costs the same whatever it reads);
    its K/V goes to a cache of its own."""
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches
    from specplan.engine.proposers.eagle import EagleHead, HeadError

    try:
        head = EagleHead.load(head_dir, engine.model)
    except HeadError:
        if head_dir is not None:
            raise
        return None
    bm = engine.block_manager
    kv = layer_caches(allocate_kv_cache(head.kv_config, bm.num_blocks, bm.block_size, head.dtype, head.device))[0]
    features = torch.randn(max(engine.scheduler.config.max_num_seqs, 1), engine.model.config.hidden_size,
                           generator=torch.Generator().manual_seed(0)).to(head.device, head.dtype)  # [B, H]

    def run_round(items: list[ScheduledSeq]) -> object:
        batch = engine.runner.build_batch(items, bm)
        normed, _ = head.forward(batch, features[:len(items)], kv, bm.block_size)  # [B, H]
        return head.draft_logits(normed).softmax(dim=-1).max(dim=-1)

    return run_round


def measure_head_cost(loaded: LoadedModel, batch_sizes=(1, 2, 4, 8, 16, 32), context: int = 256,
                      repeats: int = 7, head_dir: str | Path | None = None) -> DraftCost | None:
    """A head's ``DraftCost`` alone (a + b x B per pass), for a profile measured before the
    profiler timed heads; None when no head ships for the model (and none is given). Under a
    minute here, most of it filling the batches' prompts."""
    engine = timing_engine(loaded, max(batch_sizes), 2, context)
    run_round = head_pass_timer(engine, head_dir)
    if run_round is None:
        return None
    timer = StepTimer(engine)
    rows = []
    for b in batch_sizes:
        timer.fill(b, context)
        timer.time_steps(2, repeats=1)  # as in the grid: the next position's slot is reserved
        rows.append({"batch_size": b, "seconds": _time_rounds(run_round, engine, repeats)})
    timer.clear()
    return _fit_draft_rounds(pd.DataFrame(rows))


def _measure_cheap_proposers(repeats: int = 200) -> dict[str, DraftCost]:
    """n-gram and suffix proposing cost per sequence, on 1,000-token sequences with repeats."""
    import random

    from specplan.engine import NgramProposer, SamplingParams, Sequence, SuffixProposer

    rng = random.Random(0)
    costs = {}
    for proposer in (NgramProposer(), SuffixProposer()):
        seqs = [Sequence(seq_id=i, request_id=str(i), params=SamplingParams(),
                         prompt_token_ids=[rng.randrange(200) for _ in range(1000)]) for i in range(8)]
        proposer.propose(seqs, [4] * len(seqs))
        times = []
        for _ in range(repeats // 8):
            for s in seqs:
                s.token_ids.append(rng.randrange(200))
            t0 = time.perf_counter()
            proposer.propose(seqs, [4] * len(seqs))
            times.append((time.perf_counter() - t0) / len(seqs))
        costs[proposer.name] = DraftCost(per_token_s=statistics.median(times) / 4)
    return costs


def _fit_draft_rounds(drafts: pd.DataFrame, column: str = "seconds") -> DraftCost:
    """A draft model's round (layer-skip, a head) costs a + b * B; per_token_s is b (per
    sequence, per round)."""
    import numpy as np

    b = drafts["batch_size"].to_numpy(dtype=float)
    s = drafts[column].to_numpy(dtype=float)
    slope, intercept = np.polyfit(b, s, 1) if len(set(b)) > 1 else (0.0, float(s.mean()))
    return DraftCost(per_pass_s=max(float(intercept), 0.0), per_token_s=max(float(slope), 0.0))


def build_profile(loaded: LoadedModel, ceilings: Ceilings, grid: pd.DataFrame, drafts: pd.DataFrame | None,
                  draft_costs: dict[str, DraftCost], dtype: torch.dtype, device: str,
                  fingerprint_override: Fingerprint | None = None, weight_itemsize: float | None = None,
                  kv_dtype: torch.dtype | None = None) -> Profile:
    """The profile of a measured grid. ``drafts``: the layer-skip draft's rounds (None: another
    engine's grid, profiler/vllm_timer.py); ``fingerprint_override``: what was measured, when it
    is not specplan's engine here; ``weight_itemsize``: bytes a step streams per weight, when the
    weights are another engine's (default: what ``loaded`` holds)."""
    cfg = loaded.config
    fitted = fit_grid(grid)
    secs = grid["seconds"].tolist()
    w_item = weight_itemsize if weight_itemsize is not None else loaded.bytes_per_weight()  # 4 for float32 weights; 0.625 for Q4_1 blocks
    fp = fingerprint_override or fingerprint(cfg, dtype, device, kv_dtype)
    kv_item = kv_entry_bytes(fp.kv_cache)  # 2 for a float16 cache; None: 4, as the activations
    roofline = [grid_row_cost(cfg, r, weight_itemsize=w_item, kv_itemsize=kv_item
                              ).roofline_seconds(ceilings.peak_flops, ceilings.bandwidth) for r in grid.itertuples()]
    one = layer_costs(cfg, [1], [1])
    flops_per_token = sum(c.flops for k, c in one.items() if k != "attention") * cfg.num_layers
    costs = dict(draft_costs)
    if drafts is not None:
        costs["layer-skip"] = _fit_draft_rounds(drafts)
        if "head_seconds" in drafts:
            costs.update(dict.fromkeys(HEAD_PROPOSERS, _fit_draft_rounds(drafts, "head_seconds")))
    return Profile(
        fingerprint=fp,
        ceilings=CeilingsModel(peak_flops=ceilings.peak_flops, bandwidth=ceilings.bandwidth, ridge=ceilings.ridge),
        cost=CostConstants(
            weight_bytes=weight_bytes(cfg, weight_itemsize=w_item), flops_per_token=flops_per_token,
            lm_head_flops_per_row=2.0 * cfg.hidden_size * cfg.vocab_size,
            kv_bytes_per_token=2.0 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * (kv_item or 4),
            attention_flops_per_token_pair=4.0 * cfg.num_heads * cfg.head_dim * cfg.num_layers),
        latency_model=fitted.model.to_dict(),
        fit=FitError(heldout_mape=fitted.heldout_mape, train_mape=fitted.train_mape,
                     roofline_mape=mape(roofline, secs), num_cells=len(secs), num_heldout=fitted.num_heldout),
        draft_costs=costs,
        max_batch=int(grid["batch_size"].max()), max_tokens_per_seq=int(grid["tokens_per_seq"].max()),
    )


def run_profile(model: str | None = None, quick: bool = True, out: Path | None = None,
                report_dir: Path = Path("reports"), progress: bool = True, layer_skip_layers: int = 8,
                command: str = "specplan profile", loaded: LoadedModel | None = None,
                kv_dtype: torch.dtype | None = None) -> tuple[Profile, Path, Path]:
    """Measure, fit and write; returns (profile, profile path, report path). ``kv_dtype``: the
    engine's KV cache (None: its auto choice, as serving makes it)."""
    t0 = time.perf_counter()
    loaded = loaded or load_model(model)
    ceilings = measure_ceilings(weight_formats=loaded.weight_formats())
    spec = GridSpec.quick() if quick else GridSpec.full()
    grid, drafts = measure_grid(loaded, spec, layer_skip_layers, progress, kv_dtype)
    profile = build_profile(loaded, ceilings, grid, drafts, _measure_cheap_proposers(), torch.float32, "cpu",
                            kv_dtype=kv_dtype)
    slug = f"{loaded.name}-{profile.fingerprint.device}".replace("/", "_")
    out = out or default_profile_path(profile.fingerprint)
    grid_path = out.with_suffix(".grid.parquet")
    grid_path.parent.mkdir(parents=True, exist_ok=True)
    grid.to_parquet(grid_path)
    profile.grid_file = grid_path.name
    profile.save(out)
    from .report import render_profile_report

    report = render_profile_report(profile, grid, loaded, report_dir / f"profile-{slug}.md",
                                   command=command, seconds=time.perf_counter() - t0, quick=quick)
    return profile, out, report


def profile_cache_dir() -> Path:
    return cache_root() / "profiles"


def default_profile_path(fp) -> Path:
    # The kernels are in the name: a new engine build measures a fresh profile instead of reusing
    # one; so is a KV cache narrower than the weights' compute (a float16 one: "-kv_float16").
    kv = f"-kv_{fp.kv_cache}" if fp.kv_cache not in ("unknown", fp.dtype.split("-")[0]) else ""
    return profile_cache_dir() / f"{fp.model}-{fp.model_config_hash}-{fp.device}-{fp.dtype}{kv}-t{fp.threads}-{fp.kernels}.json"


def default_beliefs_path(fp) -> Path:
    """Where the planner's learned beliefs for this model and machine live (planner/beliefs.py):
    beside the cached profile, under the same key."""
    profile = default_profile_path(fp)
    return profile.with_name(profile.stem + ".beliefs.json")


__all__ = ["GridSpec", "measure_grid", "measure_head_cost", "build_profile", "run_profile", "default_profile_path", "default_beliefs_path",
           "step_costs"]
