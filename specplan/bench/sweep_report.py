"""`specplan report <out>`: render a sweep's ``report.md`` and PNG plots from its stored results
(``sweep.json``, ``levels.parquet``, ``requests.parquet``); no re-run needed.

The written summary is computed from the data: which policy wins at each load and by how much,
the highest load each policy sustains within the ITL SLA, and three checks of the goodput
policy against SD off and static k — it sustains the highest load within the p90 ITL SLA; at the
lowest load its mean TPOT is at most 0.8x off's; at the highest load its throughput is at least
0.98x off's while static:4 falls below that — each marked PASS / FAIL (or N/A when the sweep
lacks what a check needs) with the numbers. It reads only stored results and ``sla``'s metrics.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from specplan.bench.sla import SLA, max_load_meeting, meets_itl_sla, summarize_level

PLOTS = {
    "latency": "latency.png",
    "throughput": "throughput.png",
    "goodput": "goodput.png",
    "max_load": "max_load.png",
    "k": "k_distribution.png",
    "acceptance": "acceptance.png",
}
TPOT_RATIO = 0.8  # at the lowest load the goodput policy's mean TPOT must be <= 0.8 x off's
THROUGHPUT_RATIO = 0.98  # at the highest load: goodput >= 0.98 x off; static:4 "measurably below": < 0.98 x off


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASS | FAIL | N/A
    detail: str


def is_adaptive(policy: str) -> bool:
    p = policy.strip().lower()
    return not (p == "off" or p.startswith("static:"))


def goodput_policy(policies: Sequence[str]) -> str | None:
    return next((p for p in policies if p.strip().lower().split(":")[0] == "goodput"), None)


def load_results(out_dir: str | Path):
    """(config dict, levels DataFrame, requests DataFrame) of a sweep folder."""
    import pandas as pd

    out = Path(out_dir)
    missing = [n for n in ("sweep.json", "levels.parquet", "requests.parquet") if not (out / n).exists()]
    if missing:
        raise FileNotFoundError(f"{out} is not a sweep folder (missing {', '.join(missing)}); "
                                f"run `specplan sweep --out {out}` first")
    config = json.loads((out / "sweep.json").read_text())
    return config, pd.read_parquet(out / "levels.parquet"), pd.read_parquet(out / "requests.parquet")


def recompute_levels(levels, requests, sla: SLA):
    """Level aggregates under another SLA (goodput and the SLA flags change; durations are kept)."""
    import pandas as pd

    rows = []
    for lv in levels.to_dict("records"):
        reqs = requests[(requests["policy"] == lv["policy"]) & (requests["load"] == lv["load"])]
        recs = reqs.to_dict("records")
        for r in recs:
            r["itl_s"] = list(r["itl_s"]) if r.get("itl_s") is not None else []
        new = dict(lv)
        new.update(summarize_level(recs, lv["duration_s"], sla))
        new["meets_itl_sla"] = meets_itl_sla(new, sla)
        rows.append(new)
    return pd.DataFrame(rows)


def _policies(config: dict, levels) -> list[str]:
    order = [p for p in config.get("policies", []) if p in set(levels["policy"])]
    return order + sorted(set(levels["policy"]) - set(order))


def _level(levels, policy: str, load: float) -> dict | None:
    sel = levels[(levels["policy"] == policy) & (levels["load"] == load)]
    return sel.iloc[0].to_dict() if len(sel) else None


def max_loads(levels, policies: Sequence[str], sla: SLA) -> dict[str, float | None]:
    out = {}
    for p in policies:
        sel = levels[levels["policy"] == p].sort_values("load")
        out[p] = max_load_meeting(sel["load"].tolist(), [meets_itl_sla(r, sla) for r in sel.to_dict("records")])
    return out


def _fmt_load(x: float | None, unit: str) -> str:
    if x is None:
        return "none"
    return f"{x:g} {unit}"


def evaluate_checks(levels, policies: Sequence[str], sla: SLA, unit: str = "req/s") -> list[Check]:
    """The goodput policy's three targets (see the module docstring) on this sweep's data."""
    checks = []
    gp = goodput_policy(policies)
    loads = sorted(set(levels["load"]))
    # 1. max load meeting the p90 ITL SLA
    name = "goodput's highest load meeting the p90 ITL SLA ≥ every other policy's"
    if gp is None or sla.itl_ms is None:
        checks.append(Check(name, "N/A", "needs the goodput policy and an ITL SLA in the sweep"))
    else:
        ml = max_loads(levels, policies, sla)
        others = {p: v for p, v in ml.items() if p != gp}
        if all(v is None for v in ml.values()):
            checks.append(Check(name, "N/A", f"no policy meets p90 ITL ≤ {sla.itl_ms:g} ms even at the lowest load"))
        else:
            val = ml[gp] if ml[gp] is not None else -math.inf
            beaten = [p for p, v in others.items() if v is not None and v > val]
            detail = "; ".join(f"{p}: {_fmt_load(v, unit)}" for p, v in ml.items())
            checks.append(Check(name, "FAIL" if beaten else "PASS",
                                detail + (f" — higher than goodput: {', '.join(beaten)}" if beaten else "")))
    # 2. lowest load TPOT
    name = f"at the lowest load, goodput's mean TPOT ≤ {TPOT_RATIO:g}× off's"
    both = [x for x in loads if gp is not None and _level(levels, gp, x) and _level(levels, "off", x)]
    if not both:
        checks.append(Check(name, "N/A", "needs the goodput and off policies at a common load"))
    else:
        lo = both[0]
        glv, olv = _level(levels, gp, lo), _level(levels, "off", lo)
        if olv["completed"] == 0:
            checks.append(Check(name, "N/A", f"off completed no request at {lo:g} {unit}"))
        else:
            g = glv["mean_tpot_ms"] if glv["completed"] > 0 else math.inf
            o = olv["mean_tpot_ms"]
            ratio = g / o if o > 0 else math.inf
            checks.append(Check(name, "PASS" if ratio <= TPOT_RATIO else "FAIL",
                                f"at {lo:g} {unit}: {gp} {g:.1f} ms vs off {o:.1f} ms = {ratio:.2f}×"))
    # 3. highest load throughput
    name = (f"at the highest load, goodput's throughput ≥ {THROUGHPUT_RATIO:g}× off's while static:4 "
            f"falls below off (< {THROUGHPUT_RATIO:g}×)")
    if not both:
        checks.append(Check(name, "N/A", "needs the goodput and off policies at a common load"))
    elif _level(levels, "off", both[-1])["output_throughput"] <= 0:
        checks.append(Check(name, "N/A", f"off completed no request at {both[-1]:g} {unit}"))
    else:
        hi = both[-1]
        g = _level(levels, gp, hi)["output_throughput"]
        o = _level(levels, "off", hi)["output_throughput"]
        rg = g / o if o > 0 else math.inf
        parts = [f"at {hi:g} {unit}: {gp} {g:.1f} tok/s vs off {o:.1f} tok/s = {rg:.3f}×"]
        ok = rg >= THROUGHPUT_RATIO
        s4 = _level(levels, "static:4", hi)
        if s4 is None:
            parts.append("static:4 not in the sweep at this load")
            status = "N/A" if ok else "FAIL"
        else:
            r4 = s4["output_throughput"] / o if o > 0 else math.inf
            parts.append(f"static:4 {s4['output_throughput']:.1f} tok/s = {r4:.3f}× off")
            ok = ok and r4 < THROUGHPUT_RATIO
            status = "PASS" if ok else "FAIL"
        checks.append(Check(name, status, "; ".join(parts)))
    return checks


def _pct(a: float, b: float) -> str:
    if not b:
        return "n/a"
    return f"{(a / b - 1) * 100:+.0f}%"


def summary_lines(levels, policies: Sequence[str], sla: SLA, unit: str) -> list[str]:
    """Who wins where and by how much, from the level aggregates."""
    lines = []
    loads = sorted(set(levels["load"]))
    for load in loads:
        sel = levels[levels["load"] == load]
        if sel.empty:
            continue
        recs = {r["policy"]: r for r in sel.to_dict("records")}
        parts = []
        best_tp = max(recs.values(), key=lambda r: r["output_throughput"])
        second = sorted((r["output_throughput"] for r in recs.values()), reverse=True)[1:2]
        s = f"throughput: **{best_tp['policy']}** {best_tp['output_throughput']:.1f} tok/s"
        if second:
            s += f" ({_pct(best_tp['output_throughput'], second[0])} vs the next best"
            if "off" in recs and best_tp["policy"] != "off":
                s += f", {_pct(best_tp['output_throughput'], recs['off']['output_throughput'])} vs off"
            s += ")"
        parts.append(s)
        tp = [r for r in recs.values() if r["completed"] > 0]
        if tp:
            best_tpot = min(tp, key=lambda r: r["mean_tpot_ms"])
            s = f"mean TPOT: **{best_tpot['policy']}** {best_tpot['mean_tpot_ms']:.1f} ms"
            if "off" in recs and best_tpot["policy"] != "off":
                s += f" ({_pct(best_tpot['mean_tpot_ms'], recs['off']['mean_tpot_ms'])} vs off)"
            parts.append(s)
        if sla.goodput_thresholds():
            best_gp = max(recs.values(), key=lambda r: r["request_goodput"])
            parts.append(f"goodput: **{best_gp['policy']}** {best_gp['request_goodput']:.2f} req/s "
                         f"({best_gp['good_fraction']:.0%} of requests within the SLA)")
        lines.append(f"- at {load:g} {unit}: " + "; ".join(parts) + ".")
    if sla.itl_ms is not None:
        ml = max_loads(levels, policies, sla)
        ranked = sorted(ml.items(), key=lambda kv: -1 if kv[1] is None else kv[1], reverse=True)
        lines.append(f"- highest load meeting p90 ITL ≤ {sla.itl_ms:g} ms (every lower load too, no failed "
                     f"request): " + ", ".join(f"{p} {_fmt_load(v, unit)}" for p, v in ranked) + ".")
    return lines


# ---- plots ---------------------------------------------------------------------------------------------
def _colors(policies: Sequence[str]) -> dict[str, Any]:
    import matplotlib

    cmap = matplotlib.colormaps["tab10"]
    return {p: cmap(i % 10) for i, p in enumerate(policies)}


def _xaxis(ax, loads: Sequence[float], unit: str) -> None:
    ax.set_xticks(range(len(loads)), [f"{x:g}" for x in loads])
    ax.set_xlabel(f"load ({unit})")
    ax.grid(alpha=0.3)


def _series(levels, policy: str, loads: Sequence[float], col: str) -> list[float]:
    out = []
    for x in loads:
        lv = _level(levels, policy, x)
        out.append(lv[col] if lv is not None and lv.get("completed", 0) > 0 else math.nan)
    return out


def plot_latency(levels, policies, loads, sla: SLA, unit: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    colors = _colors(policies)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    tpot_sla = sla.tpot_ms if sla.tpot_ms is not None else sla.itl_ms
    for ax, metric, title, line in ((axes[0], "ttft", "TTFT", sla.ttft_ms), (axes[1], "itl", "ITL (gap between chunks)", sla.itl_ms),
                                    (axes[2], "tpot", "TPOT", tpot_sla)):
        xs = range(len(loads))
        for p in policies:
            ax.plot(xs, _series(levels, p, loads, f"p50_{metric}_ms"), "-o", color=colors[p], label=f"{p} p50", ms=4)
            ax.plot(xs, _series(levels, p, loads, f"p90_{metric}_ms"), "--^", color=colors[p], label=f"{p} p90", ms=4)
        if line is not None:
            ax.axhline(line, color="red", lw=1.5, ls=":", label=f"SLA {line:g} ms")
        ax.set_title(f"{title}: p50 (solid), p90 (dashed)")
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        _xaxis(ax, loads, unit)
    handles, labels = axes[1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, ncol=1)
    fig.tight_layout(rect=(0, 0, 0.88, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_metric(levels, policies, loads, col: str, ylabel: str, title: str, unit: str, path: Path,
                diagonal: bool = False) -> None:
    import matplotlib.pyplot as plt

    colors = _colors(policies)
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for p in policies:
        ax.plot(range(len(loads)), _series(levels, p, loads, col), "-o", color=colors[p], label=p)
    if diagonal and unit == "req/s":
        ax.plot(range(len(loads)), [x if math.isfinite(x) else math.nan for x in loads], ":", color="gray",
                label="offered load")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    _xaxis(ax, loads, unit)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_max_load(ml: dict[str, float | None], sla: SLA, unit: str, path: Path) -> None:
    import matplotlib.pyplot as plt

    policies = list(ml)
    colors = _colors(policies)
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    vals = [v if v is not None else 0.0 for v in ml.values()]
    bars = ax.bar(range(len(policies)), vals, color=[colors[p] for p in policies])
    for b, v in zip(bars, ml.values()):
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), "none" if v is None else f"{v:g}",
                ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(policies)), policies, rotation=20)
    ax.set_ylabel(f"highest load ({unit})")
    ax.set_title(f"highest load meeting p90 ITL ≤ {sla.itl_ms:g} ms")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def k_shares(requests, policy: str, load: float) -> dict[int, float]:
    """Share of request-steps run with each k, for one policy and level."""
    sel = requests[(requests["policy"] == policy) & (requests["load"] == load) & requests["success"]]
    hist: dict[int, int] = {}
    for h in sel["k_hist"]:
        for k, v in json.loads(h or "{}").items():
            hist[int(k)] = hist.get(int(k), 0) + int(v)
    total = sum(hist.values())
    return {k: v / total for k, v in sorted(hist.items())} if total else {}


def plot_k_distribution(requests, policies, loads, unit: str, path: Path) -> bool:
    import matplotlib.pyplot as plt

    adaptive = [p for p in policies if is_adaptive(p)]
    if not adaptive:
        return False
    all_k = sorted({k for p in adaptive for x in loads for k in k_shares(requests, p, x)})
    if not all_k:
        return False
    cmap = plt.get_cmap("viridis", max(len(all_k), 2))
    fig, axes = plt.subplots(1, len(adaptive), figsize=(4.2 * len(adaptive) + 1.5, 4.2), squeeze=False)
    for ax, p in zip(axes[0], adaptive):
        bottom = [0.0] * len(loads)
        shares = [k_shares(requests, p, x) for x in loads]
        for i, k in enumerate(all_k):
            h = [s.get(k, 0.0) for s in shares]
            ax.bar(range(len(loads)), h, bottom=bottom, color=cmap(i), label=f"k={k}")
            bottom = [a + b for a, b in zip(bottom, h)]
        ax.set_title(p)
        ax.set_ylim(0, 1)
        ax.set_ylabel("share of request-steps")
        _xaxis(ax, loads, unit)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=8)
    fig.suptitle("chosen k vs load (adaptive policies)")
    fig.tight_layout(rect=(0, 0, 0.9, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def acceptance_table(requests, policies) -> dict[str, dict[str, tuple[float, int]]]:
    """policy -> workload -> (acceptance rate, draft tokens), over every level."""
    out: dict[str, dict[str, tuple[float, int]]] = {}
    ok = requests[requests["success"]]
    for p in policies:
        sel = ok[ok["policy"] == p]
        per = {}
        for w, g in sel.groupby("workload"):
            proposed = int(g["num_draft_tokens"].sum())
            if proposed:
                per[str(w)] = (float(g["num_accepted_tokens"].sum()) / proposed, proposed)
        if per:
            out[p] = per
    return out


def plot_acceptance(table, path: Path) -> bool:
    import matplotlib.pyplot as plt

    if not table:
        return False
    policies = list(table)
    workloads = sorted({w for per in table.values() for w in per})
    colors = _colors(policies)
    width = 0.8 / len(policies)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.6 * len(workloads) + 2), 4.2))
    for i, p in enumerate(policies):
        xs = [j + (i - (len(policies) - 1) / 2) * width for j in range(len(workloads))]
        ax.bar(xs, [table[p].get(w, (math.nan, 0))[0] for w in workloads], width, color=colors[p], label=p)
    ax.set_xticks(range(len(workloads)), workloads)
    ax.set_ylabel("accepted / proposed draft tokens")
    ax.set_ylim(0, 1)
    ax.set_title("draft acceptance per workload (all loads)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---- the report -----------------------------------------------------------------------------------------
def _num(x: Any, fmt: str = ".1f") -> str:
    try:
        if x is None or (isinstance(x, float) and math.isnan(x)):
            return "–"
        return format(x, fmt)
    except (TypeError, ValueError):
        return str(x)


def render_report(out_dir: str | Path, sla: SLA | None = None) -> Path:
    """Write ``<out>/report.md`` and its PNGs from the stored results. ``sla``: re-judge under
    other targets (goodput is recomputed from the per-request rows; nothing is re-run)."""
    import matplotlib

    matplotlib.use("Agg")
    out = Path(out_dir)
    config, levels, requests = load_results(out)
    stored = SLA(**config.get("sla", {}))
    if sla is not None and sla != stored:
        levels = recompute_levels(levels, requests, sla)
    else:
        sla = stored
    policies = _policies(config, levels)
    loads = sorted(set(levels["load"]))
    unit = config.get("load_unit", "req/s")

    plot_latency(levels, policies, loads, sla, unit, out / PLOTS["latency"])
    plot_metric(levels, policies, loads, "output_throughput", "output tokens / s", "output token throughput vs load",
                unit, out / PLOTS["throughput"])
    gp_title = "goodput: requests/s within " + (", ".join(f"{k} ≤ {v:g} ms" for k, v in sla.goodput_thresholds().items())
                                                 or "no SLA (= request throughput)")
    plot_metric(levels, policies, loads, "request_goodput", "good requests / s", gp_title, unit, out / PLOTS["goodput"],
                diagonal=True)
    ml = max_loads(levels, policies, sla)
    has_max = sla.itl_ms is not None
    if has_max:
        plot_max_load(ml, sla, unit, out / PLOTS["max_load"])
    has_k = plot_k_distribution(requests, policies, loads, unit, out / PLOTS["k"])
    acc = acceptance_table(requests, policies)
    has_acc = plot_acceptance(acc, out / PLOTS["acceptance"])

    checks = evaluate_checks(levels, policies, sla, unit)
    L: list[str] = []
    name = out.name
    L.append(f"# SLA sweep: {name}\n")
    wl = config.get("workload")
    size = (f"{config['duration_s']:g} s of arrivals per level" if config.get("duration_s") is not None
            else f"{config.get('num_requests')} requests per level")
    weights = f" ({config['weights']} weights)" if config.get("weights") else ""  # sweeps before it: float32
    L.append(f"Model **{config.get('model')}**{weights}, proposer **{config.get('proposer')}**, workload **{wl}**, "
             f"{config.get('mode')} levels {', '.join(f'{x:g}' for x in loads)} {unit}, {size}, "
             f"max {config.get('max_tokens')} output tokens (temperature {config.get('temperature')}), "
             f"{config.get('warmup_requests')} warm-up requests per level.")
    sla_bits = [f"{k} {v:g} ms" for k, v in (("TTFT", sla.ttft_ms), ("ITL", sla.itl_ms), ("TPOT", sla.tpot_ms),
                                             ("E2EL", sla.e2el_ms)) if v is not None]
    L.append(f"SLA: {', '.join(sla_bits) or 'none'}" + (" (re-judged at render time)" if sla != stored else "") + ".")
    m = config.get("machine", {})  # older sweeps named the core count cpu_count
    L.append(f"Run {config.get('started')} – {config.get('finished', '(unfinished)')}, status {config.get('status')}; "
             f"{m.get('cores', m.get('cpu_count'))} CPUs, torch {m.get('torch')} with {m.get('torch_threads')} threads, "
             f"1-min load average at start {_num(m.get('load_avg_1m_at_start'), '.2f')}.")
    if config.get("command"):
        L.append(f"\nCommand: `{config['command']}`")
    L.append("")
    L.append("## Summary\n")
    L.append("| check | result | numbers |\n|---|---|---|")
    for c in checks:
        L.append(f"| {c.name} | **{c.status}** | {c.detail} |")
    L.append("")
    L.extend(summary_lines(levels, policies, sla, unit))
    missed = [c for c in checks if c.status == "FAIL"]
    if missed:
        L.append(f"\n{len(missed)} target(s) missed on this run: see the numbers above and the tables below.")
    L.append("\n## Plots\n")
    L.append(f"![latency]({PLOTS['latency']})\n")
    L.append(f"![throughput]({PLOTS['throughput']})\n")
    L.append(f"![goodput]({PLOTS['goodput']})\n")
    if has_max:
        L.append(f"![max load]({PLOTS['max_load']})\n")
    if has_k:
        L.append(f"![chosen k]({PLOTS['k']})\n")
    if has_acc:
        L.append(f"![acceptance]({PLOTS['acceptance']})\n")
    L.append("## Per level\n")
    L.append("| policy | load | done / sent | p50 / p90 ITL ms | mean / p90 TPOT ms | p90 TTFT ms | p90 E2EL ms "
             "| out tok/s | goodput req/s | mean k | k=0 share | acceptance | mean batch | mean step ms | p90 ITL ≤ SLA |")
    L.append("|" + "---|" * 15)
    for p in policies:
        for r in levels[levels["policy"] == p].sort_values("load").to_dict("records"):
            L.append(f"| {p} | {r['load']:g} | {r['completed']} / {r['num_requests']} "
                     f"| {_num(r['p50_itl_ms'])} / {_num(r['p90_itl_ms'])} "
                     f"| {_num(r['mean_tpot_ms'])} / {_num(r['p90_tpot_ms'])} | {_num(r['p90_ttft_ms'])} "
                     f"| {_num(r['p90_e2el_ms'])} | {_num(r['output_throughput'])} | {_num(r['request_goodput'], '.2f')} "
                     f"| {_num(r.get('mean_k'), '.2f')} | {_num(r.get('k0_share'), '.0%')} "
                     f"| {_num(r.get('acceptance_rate'), '.0%')} | {_num(r.get('mean_decode_batch'), '.1f')} "
                     f"| {_num(r.get('mean_step_ms'))} | {'yes' if meets_itl_sla(r, sla) else 'no'} |")
    if acc:
        L.append("\n## Acceptance per workload\n")
        workloads = sorted({w for per in acc.values() for w in per})
        L.append("| policy | " + " | ".join(workloads) + " |")
        L.append("|" + "---|" * (len(workloads) + 1))
        for p, per in acc.items():
            L.append(f"| {p} | " + " | ".join(f"{per[w][0]:.0%} ({per[w][1]} drafts)" if w in per else "–"
                                               for w in workloads) + " |")
    L.append("\n## How the numbers are defined\n")
    L.append("As vLLM's serving benchmark: a *chunk* is one streamed SSE event carrying choices (with "
             "speculation one chunk may carry several tokens). TTFT = first chunk − send; ITL = gaps between "
             "a request's successive chunks (percentiles over all gaps); E2EL = last chunk − send; TPOT = "
             "(E2EL − TTFT) / (output tokens − 1), tokens from the response's usage; throughput = successful "
             "requests' output tokens / level duration (first send to last completion); goodput = requests "
             "meeting every goodput threshold (" + (", ".join(f"{k} ≤ {v:g} ms" for k, v in
                                                                sla.goodput_thresholds().items()) or "none")
             + ") / level duration. A level meets the ITL SLA when its p90 ITL is within the target and no "
             "request failed or timed out. k is what the engine ran per request-step (the decider's choice "
             "after the engine's caps); off and static:K run fixed deciders, the other policies the planner. "
             "Data: `requests.parquet` (one row per request), `levels.parquet` (one row per policy and "
             "level), `sweep.json` (configuration); re-render with `specplan report " + str(out) + "`.")
    path = out / "report.md"
    path.write_text("\n".join(L) + "\n")
    return path


__all__ = ["Check", "evaluate_checks", "max_loads", "summary_lines", "render_report", "load_results",
           "recompute_levels", "k_shares", "acceptance_table"]
