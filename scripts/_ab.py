"""What the A/B scripts share: arms run on the same requests in one engine, interleaved, and
paired ratios. Each arm is a decider and a proposer, both made fresh for every run."""
import json
import statistics
from typing import Callable

from specplan.bench import evaluate as ev
from specplan.bench.workloads import load_workload

Arm = tuple[Callable[[], object], Callable[[], object]]  # (make decider, make proposer)


def run_arms(engine, prompts: list[list[int]], arms: dict[str, Arm], batch: int, repeats: int,
             max_tokens: int = 64) -> dict[str, list[dict]]:
    """Every arm once per repeat, in an order rotated by one each repeat; per arm, its runs in
    repeat order (so runs[a][r] and runs[b][r] ran minutes apart, under the same machine)."""
    names = list(arms)
    runs: dict[str, list[dict]] = {name: [] for name in names}
    for rep in range(repeats):
        shift = rep % len(names)
        for name in names[shift:] + names[:shift]:
            make_decider, make_proposer = arms[name]
            r = ev.run_cell(engine, prompts, make_decider(), max_tokens, concurrency=batch, proposer=make_proposer())
            runs[name].append({key: r[key] for key in ("goodput", "mean_k", "k_zero_share", "acceptance")})
    return runs


def median_goodput(runs: dict[str, list[dict]]) -> dict[str, float]:
    return {name: statistics.median(r["goodput"] for r in rs) for name, rs in runs.items()}


def paired(runs: dict[str, list[dict]], a: str, b: str) -> float:
    """Median over repeats of a's goodput over b's in the same repeat."""
    return statistics.median(x["goodput"] / y["goodput"] for x, y in zip(runs[a], runs[b]))


def run_grid(loaded, engine, workloads: list[str], batch_sizes: list[int], repeats: int,
             arms_for: Callable[[list[list[int]], int], dict[str, Arm]],
             summary: Callable[[str, int, dict[str, list[dict]]], str], out: str) -> None:
    """Every (workload, B) cell: max(B, 4) prompts (the evaluation's), the arms ``arms_for(prompts,
    B)`` gives, a summary line printed as each cell ends, and every run written to ``out`` (JSON)."""
    results = []
    for w in workloads:
        pool = [p.render(loaded.tokenizer) for p in load_workload(w, max(*batch_sizes, 4), 0)]
        for b in batch_sizes:
            prompts = pool[:max(b, 4)]
            runs = run_arms(engine, prompts, arms_for(prompts, b), b, repeats)
            results.append({"workload": w, "batch_size": b, "runs": runs})
            print(summary(w, b, runs), flush=True)
    with open(out, "w") as f:
        json.dump(results, f)
    print(f"wrote {out}")
