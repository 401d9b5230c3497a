"""The evaluation grid's goodput policy against the same grid run by another source tree (issue #32:
"the existing grid: no cell worse than before this change beyond its null control").

``run``: one repeat of the grid (SD off, the goodput planner cold, SD off again as the null
control; fp32, n-gram, each cell max(B, --min-requests) requests closed-loop at concurrency B,
64 tokens, greedy) with whatever tree ``specplan`` imports from, each tree with the profile it
would use itself (cached or a fresh quick one). Run it alternately from both trees, so the
machine's slow spells fall on both alike:

    for r in 0 1 2; do
        PYTHONPATH=/path/to/old-tree-as-package python scripts/grid_against_tree.py run --out runs/old-$r.parquet
        python scripts/grid_against_tree.py run --out runs/new-$r.parquet
    done
    python scripts/grid_against_tree.py compare runs/ --out reports/FOLDER

One cell, more repeats, static k beside it (``run --workloads gsm8k --batch-sizes 1 --static-ks 0,4
--repeats 5``): prints each arm's ratio to SD off per repeat.

``compare``: per cell, each tree's goodput over its own SD off in the same repeat (the engines of
the two trees need not be equally fast), the median over repeats, their ratio (new / old), and
the null control of each tree (SD off again over SD off).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

OFF, PLANNER, NULL = "static:0", "goodput", "control:off"


def run(args: argparse.Namespace) -> None:
    from specplan.adaptive import load_or_make_profile
    from specplan.bench.evaluate import evaluate
    from specplan.engine import load_model

    loaded = load_model(None)
    profile = load_or_make_profile(loaded, None)
    static_ks = tuple(int(k) for k in args.static_ks.split(","))
    df = evaluate(loaded, profile, workloads=tuple(args.workloads.split(",")),
                  batch_sizes=tuple(int(b) for b in args.batch_sizes.split(",")), static_ks=static_ks,
                  policies=(PLANNER,), repeats=args.repeats, min_requests=args.min_requests,
                  null_control=args.repeats == 1, clairvoyant=False, progress=False)
    for (w, b), cell in df.groupby(["workload", "batch_size"]):
        runs = dict(zip(cell["decider"], cell["goodput_all"]))
        print(f"{w} B={b}: x off per repeat " + "; ".join(
            f"{arm} " + " ".join(f"{x / o:.3f}" for x, o in zip(runs[arm], runs[OFF]))
            for arm in runs if arm != OFF), flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        df.to_parquet(args.out)
        print(f"wrote {args.out}: {len(df)} rows", flush=True)


def compare(runs: Path, out: Path | None) -> dict:
    import pandas as pd

    def ratios(paths: list[Path]) -> dict[tuple[str, int], dict[str, list[float]]]:
        cells: dict[tuple[str, int], dict[str, list[float]]] = {}
        for path in paths:
            df = pd.read_parquet(path)
            for (w, b), cell in df.groupby(["workload", "batch_size"]):
                tok_s = dict(zip(cell["decider"], cell["goodput"]))
                entry = cells.setdefault((w, int(b)), {PLANNER: [], NULL: []})
                for arm in (PLANNER, NULL):
                    entry[arm].append(tok_s[arm] / tok_s[OFF])
        return cells

    old = ratios(sorted(runs.glob("old-*.parquet")))
    new = ratios(sorted(runs.glob("new-*.parquet")))
    rows = []
    for cell in sorted(new):
        o, n = old[cell], new[cell]
        rows.append({"workload": cell[0], "batch": cell[1], "repeats": len(n[PLANNER]),
                     "new_over_off": statistics.median(n[PLANNER]), "old_over_off": statistics.median(o[PLANNER]),
                     "new_over_old": statistics.median(n[PLANNER]) / statistics.median(o[PLANNER]),
                     "null_new": statistics.median(n[NULL]), "null_old": statistics.median(o[NULL])})
    lines = ["| workload | B | goodput × off, new tree | goodput × off, old tree | new / old | null control new / old |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['workload']} | {r['batch']} | {r['new_over_off']:.3f} | {r['old_over_off']:.3f} | "
              f"{r['new_over_old']:.3f} | {r['null_new']:.3f} / {r['null_old']:.3f} |" for r in rows]
    print("\n".join(lines))
    report = {"cells": rows}
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "grid-against-tree.json").write_text(json.dumps(report, indent=1))
        (out / "grid-against-tree.md").write_text("\n".join(lines) + "\n")
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", type=Path, default=None)
    r.add_argument("--min-requests", type=int, default=4)
    r.add_argument("--workloads", default="humaneval,gsm8k,mtbench,xsum")
    r.add_argument("--batch-sizes", default="1,4,16,32")
    r.add_argument("--static-ks", default="0", help="static k arms (0 = SD off, always first)")
    r.add_argument("--repeats", type=int, default=1, help="more than 1: no null control (the repeats pair instead)")
    c = sub.add_parser("compare")
    c.add_argument("runs", type=Path)
    c.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.command == "run":
        run(args)
    else:
        compare(args.runs, args.out)


if __name__ == "__main__":
    main()
