"""The cold-start spread bar read over several runs of `specplan bench coldstart` at once.

One report's spread test (specplan/bench/coldstart.py ``spread_test``) pools the four workloads:
16 degrees of freedom for an adaptive arm against 48 for the static k arms. On a VM whose speed
drifts between minutes, two reports of the same command have read the cold arm "wider" raw and
"no wider" paired, then the other way round. Pooled over reports (each report's workload its own
cell: a cell's runs vary about their own mean, so hours of different speed do not add spread),
the test rests on 16 degrees of freedom per report.

    python scripts/coldstart_pooled_spread.py reports/coldstart-xeon-s25 reports/coldstart-xeon-s26 ...

Prints each report's reading and the pooled one (markdown), and with ``--json PATH`` writes them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specplan.bench.coldstart import pooled_cells, report_cells, spread_readings


def readings(cells: dict[str, dict[str, list[float]]]) -> list[dict]:
    return [{"arm": arm, "reading": kind, **test} for arm, by_kind in spread_readings(cells).items()
            for kind, test in by_kind.items() if test is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="folders holding coldstart.json")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {folder.name: json.loads((folder / "coldstart.json").read_text()) for folder in args.reports}
    out = {name: readings(report_cells(result)) for name, result in results.items()}
    out["pooled"] = readings(pooled_cells(results))
    print("| reports | arm | reading | sd | static k's sd | variance ratio | p (wider) | df | deviation ratio | "
          "p (wider), robust |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, rows in out.items():
        for r in rows:
            print(f"| {name} | {r['arm']} | {r['reading']} | {100 * r['sd']:.2f}% | {100 * r['static_sd']:.2f}% | "
                  f"{r['variance_ratio']:.2f} | {r['p_wider']:.3f} | {r['df']}, {r['static_df']} | "
                  f"{r['deviation_ratio']:.2f} | {r['p_wider_robust']:.3f} |")
    if args.json is not None:
        args.json.write_text(json.dumps({"reports": [str(f) for f in args.reports], "readings": out}, indent=1))


if __name__ == "__main__":
    main()
