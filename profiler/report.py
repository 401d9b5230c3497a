"""The profile report: roofline plot, ITL curves per batch size, per-layer intensity table."""

from __future__ import annotations

import time
from pathlib import Path

import pandas as pd

from specplan.engine import LoadedModel

from .cost_model import decode_step_cost, grid_row_cost, kv_entry_bytes, layer_costs
from .latency_model import StepShape
from .machine import describe, machine_info
from .profile import Profile


def _row_tile_lines(profile: Profile) -> list[str]:
    """The row tile the fit found, if any (profiler/fit.py ``ROW_TILES``): what it means for drafts."""
    model = profile.model()
    if not model.row_tile:
        return []
    tile, block_ms = model.row_tile, 1e3 * model.per_row_block
    if model.row_block_limit == 1:
        priced = (f"a single edge in query tokens, **{block_ms:.1f} ms more once a step passes {tile} tokens** (as a "
                  f"GEMM that computes {tile} rows at a time and streams the weights again for more would): drafts "
                  f"that fill a small batch's first {tile} tokens are priced nearly free, the one past them is not")
    else:
        priced = (f"a staircase in query tokens, **{block_ms:.1f} ms more for every {tile} tokens past the first "
                  f"{tile}** (as a GEMM that computes {tile} rows at a time would): drafts that fill a batch's last "
                  f"block are priced nearly free, the one that starts a new block is not")
    return ["", f"Row tile: the fit prices the step as {priced}."]


def _lone_draft_lines(lone: pd.DataFrame, uniform: pd.DataFrame) -> list[str]:
    """What one request's drafts add to a step of B plain decodes, measured and as the fit prices
    it: the planner's choice at large B (``GridSpec.lone_drafts``)."""
    if lone.empty:
        return []
    plain = uniform[uniform.tokens_per_seq == 1].set_index(["batch_size", "context"])
    lines = ["", "## One request drafting", "",
             "Steps of B requests where one drafts k tokens and the rest decode 1: what the drafts add to the plain "
             "step (T = 1), measured and as the fit prices it.", "",
             "| B | context | k | plain step (ms) | measured + ms | fit + ms |", "|---|---|---|---|---|---|"]
    for r in lone.sort_values(["context", "batch_size", "tokens_per_seq"]).itertuples():
        if (r.batch_size, r.context) not in plain.index:
            continue
        base = plain.loc[(r.batch_size, r.context)]
        lines.append(f"| {r.batch_size} | {r.context} | {r.tokens_per_seq - 1} | {base.ms:.1f} | {r.ms - base.ms:+.2f} | "
                     f"{r.predicted_ms - base.predicted_ms:+.2f} |")
    return lines


def _ridge_crossing(profile: Profile, loaded: LoadedModel, context: int, weight_itemsize: float) -> int | None:
    """Smallest tokens-per-step (B*T, T=1) whose analytic intensity passes the ridge."""
    for tokens in range(1, 4097):
        cost = decode_step_cost(loaded.config, tokens, 1, context, weight_itemsize=weight_itemsize,
                                kv_itemsize=kv_entry_bytes(profile.fingerprint.kv_cache))
        if cost.intensity > profile.ceilings.ridge:
            return tokens
    return None


def render_profile_report(profile: Profile, grid: pd.DataFrame, loaded: LoadedModel, path: Path, command: str,
                          seconds: float, quick: bool, weight_itemsize: float | None = None,
                          phases: dict[str, float] | None = None) -> Path:
    """The profile's Markdown report and plots. ``weight_itemsize``: bytes per weight when the
    weights are another engine's (run.py ``build_profile``; default: what ``loaded`` holds);
    ``phases``: where the seconds went (name -> seconds), listed after them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    c = profile.ceilings
    cfg = loaded.config
    w_item = weight_itemsize if weight_itemsize is not None else loaded.bytes_per_weight()
    g = grid.copy()
    kv_item = kv_entry_bytes(profile.fingerprint.kv_cache)  # a float16 cache: 2 bytes an entry
    costs = [grid_row_cost(cfg, r, weight_itemsize=w_item, kv_itemsize=kv_item) for r in g.itertuples()]
    g["intensity"] = [x.intensity for x in costs]
    g["gflops"] = [x.flops / s / 1e9 for x, s in zip(costs, g["seconds"])]
    g["floor_ms"] = [1e3 * x.roofline_seconds(c.peak_flops, c.bandwidth) for x in costs]
    g["ms"] = 1e3 * g["seconds"]
    g["predicted_ms"] = [1e3 * profile.predict(StepShape(int(r.batch_size), int(r.num_tokens), int(r.context_tokens)))
                         for r in g.itertuples()]
    # Cells where one request drafts (``GridSpec.lone_drafts``) get a table of their own; the plots
    # and the floor table are over cells where every request verifies T tokens.
    lone = g[g.drafting < g.batch_size] if "drafting" in g else g.iloc[:0]
    g = g.drop(lone.index)
    stem = path.with_suffix("")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    xs = np.logspace(np.log10(max(g["intensity"].min() / 2, 0.05)), np.log10(g["intensity"].max() * 2), 200)
    ax.plot(xs, np.minimum(c.peak_flops, c.bandwidth * xs) / 1e9, "k-", lw=2, label="roofline (measured ceilings)")
    ax.axvline(c.ridge, color="gray", ls=":", label=f"ridge {c.ridge:.1f} FLOP/B")
    sc = ax.scatter(g["intensity"], g["gflops"], c=g["tokens_per_seq"], cmap="viridis", s=18 + 2 * g["batch_size"])
    fig.colorbar(sc, ax=ax, label="T (tokens per sequence)")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved GFLOP/s")
    ax.set_title(f"{loaded.name}: measured steps on the roofline (size = B)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(f"{stem}-roofline.png", dpi=120)
    plt.close(fig)

    ctx0 = int(g["context"].min())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for b, gb in g[g.context == ctx0].groupby("batch_size"):
        gb = gb.sort_values("tokens_per_seq")
        line, = ax.plot(gb["tokens_per_seq"], gb["ms"], "o-", label=f"B={b}")
        ax.plot(gb["tokens_per_seq"], gb["predicted_ms"], "--", color=line.get_color(), alpha=0.6)
        ax.plot(gb["tokens_per_seq"], gb["floor_ms"], ":", color=line.get_color(), alpha=0.6)
    ax.set_yscale("log")
    ax.set_xlabel("T = 1 + k (tokens verified per sequence)")
    ax.set_ylabel("step time = ITL (ms)")
    ax.set_title(f"ITL per batch size, context {ctx0} (solid measured, dashed fit, dotted floor)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(f"{stem}-itl.png", dpi=120)
    plt.close(fig)

    crossing = _ridge_crossing(profile, loaded, ctx0, w_item)
    f = profile.fit
    lines = [
        f"# Profile: {loaded.name} on {profile.fingerprint.device} ({profile.fingerprint.cpu})", "",
        f"Made by `{command}` in {seconds:.0f} s ({'quick' if quick else 'full'} grid, {f.num_cells} cells; "
        f"{profile.fingerprint.threads} threads, torch {profile.fingerprint.torch_version}, {profile.fingerprint.dtype}, "
        f"KV cache {profile.fingerprint.kv_cache})"
        + ("; of the time: " + ", ".join(f"{name} {s:.0f} s" for name, s in phases.items()) if phases else "") + ".",
        "", f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}. {describe(machine_info())}",
        "", "## Ceilings", "",
        f"- peak matmul: {c.peak_flops / 1e9:.0f} GFLOP/s; read bandwidth: {c.bandwidth / 1e9:.1f} GB/s; "
        f"ridge: {c.ridge:.1f} FLOP/byte",
        f"- one step reads {profile.cost.weight_bytes / 1e6:.0f} MB of weights: floor {1e3 * profile.cost.weight_bytes / c.bandwidth:.1f} ms",
        f"- the analytic intensity of a decode step (T=1, context {ctx0}) passes the ridge at "
        f"B·T = {crossing} tokens per step" if crossing else "- the ridge is not reached below 4096 tokens per step",
        "", "## Latency model", "",
        f"Fitted form: convex piecewise-linear in tokens per step + KV tokens + sequences + query tokens x context per sequence (profiler/fit.py). "
        f"Error on {f.num_heldout} held-out cells: **{f.heldout_mape:.1f}%** MAPE (train {f.train_mape:.1f}%); "
        f"the pure roofline prediction: {f.roofline_mape:.1f}%.",
        *_row_tile_lines(profile),
        "", "Drafting cost per proposer:", "",
        "| proposer | per step (ms) | per token or sequence (ms) |", "|---|---|---|",
    ]
    for name, d in profile.draft_costs.items():
        lines.append(f"| {name} | {1e3 * d.per_pass_s:.3f} | {1e3 * d.per_token_s:.4f} |")
    lines += ["", "## Measured steps on the roofline", "", f"![roofline]({stem.name}-roofline.png)", "",
              f"![ITL]({stem.name}-itl.png)", "",
              "## Distance from the floor", "",
              "| B | T | context | measured (ms) | fit (ms) | floor (ms) | measured / floor | intensity | bound |",
              "|---|---|---|---|---|---|---|---|---|"]
    for r in g.sort_values(["context", "batch_size", "tokens_per_seq"]).itertuples():
        bound = "compute" if r.intensity > c.ridge else "memory"
        lines.append(f"| {r.batch_size} | {r.tokens_per_seq} | {r.context} | {r.ms:.1f} | {r.predicted_ms:.1f} | "
                     f"{r.floor_ms:.1f} | {r.ms / r.floor_ms:.2f} | {r.intensity:.1f} | {bound} |")
    lines += _lone_draft_lines(lone, g)
    lines += ["", "## Per-layer intensity (one decoder layer, context 256)", "",
              "| shape | component | MFLOP | weight MB | KV MB | act. MB | FLOP/byte | bound |",
              "|---|---|---|---|---|---|---|---|"]
    for b, t in ((1, 1), (1, 9), (32, 1), (32, 9)):
        for name, x in layer_costs(cfg, [t] * b, [256 + t] * b, weight_itemsize=w_item, kv_itemsize=kv_item).items():
            lines.append(f"| B={b}, T={t} | {name} | {x.flops / 1e6:.1f} | {x.weight_bytes / 1e6:.2f} | "
                         f"{x.kv_bytes / 1e6:.2f} | {x.activation_bytes / 1e6:.2f} | {x.intensity:.1f} | "
                         f"{x.bound(c.ridge)} |")
    path.write_text("\n".join(lines) + "\n")
    return path
