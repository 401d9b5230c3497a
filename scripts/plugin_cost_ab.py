"""The vLLM plugin's cost per call, two (or more) variants side by side: each round runs every arm
once (``scripts/vllm_plugin_cost.py`` in a process of its own, the order reversed every other
round so that a drifting machine does not favour one arm), then writes the runs to JSON and plots
them. Offline (``--fixed-clocks`` by default: every arm makes the same decisions, checked by the
drafts digest) or inside vLLM (``--vllm``, from vLLM's environment; the decisions there follow
measured step times, so the arms' drafts differ a little).

    /work/vllm-venv/bin/python scripts/plugin_cost_ab.py --out reports/X --rounds 3
    /work/vllm-venv/bin/python scripts/plugin_cost_ab.py --out reports/X --vllm --workloads xsum \\
        --profile reports/vllm-peer-zen4/profile-staircase.json

Arms are ``name=flags`` for vllm_plugin_cost.py, separated by ``;`` (default: the n-gram lookup's
compiled scan against its index). Ratios are of medians over rounds, arm / first arm.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specplan.profiler.machine import machine_info

HERE = Path(__file__).resolve().parent
DEFAULT_ARMS = "scan=--ngram-scan;index=--no-ngram-scan"


def parse_arms(text: str) -> list[tuple[str, list[str]]]:
    arms = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, flags = part.partition("=")
        arms.append((name.strip(), shlex.split(flags)))
    if len(arms) < 2 or len({n for n, _ in arms}) != len(arms):
        raise SystemExit(f"--arms needs two or more arms with distinct names, got {text!r}")
    return arms


def run_arm(flags: list[str], args, scratch: Path) -> dict:
    out = scratch / "run.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(HERE / "vllm_plugin_cost.py"), "--batch", str(args.batch), "--steps", str(args.steps),
           "--json", str(out), *flags]
    if args.profile:
        cmd += ["--profile", args.profile]
    if args.vllm:
        cmd += ["--vllm"] + (["--workloads", args.workloads] if args.workloads else [])
    else:
        cmd += ["--flush-mib", str(args.flush_mib)] + (["--fixed-clocks"] if args.fixed_clocks else [])
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
    if args.vllm:  # vLLM leaves its engine processes behind when its parent exits at once
        subprocess.run(["pkill", "-9", "-f", "VLLM::"], capture_output=True)
    return json.loads(out.read_text())


def plot(runs: list[dict], arms: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    colors = dict(zip(arms, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for i, arm in enumerate(arms):
        ys = [r["yardsticks"] for r in runs if r["arm"] == arm]
        left.scatter([i] * len(ys), ys, color=colors[arm])
        left.hlines(statistics.median(ys), i - 0.25, i + 0.25, color=colors[arm])
    left.set_xticks(range(len(arms)), arms)
    left.set_ylim(bottom=0)
    left.set_ylabel("median call / median yardstick")
    left.set_title("cost per call, in yardsticks (each dot a run)")
    phases = list(runs[0]["phase_ms"])
    if any(any(r["phase_ms"].values()) for r in runs):  # real clocks: where each arm's time goes
        bottom = [0.0] * len(arms)
        for phase in phases:
            heights = [statistics.median(r["phase_ms"][phase] for r in runs if r["arm"] == a) for a in arms]
            right.bar(arms, heights, bottom=bottom, label=phase)
            bottom = [b + h for b, h in zip(bottom, heights)]
        right.set_ylabel("ms per call (mean over the run, median over rounds)")
        right.legend()
        right.set_title("by phase")
    else:
        for i, arm in enumerate(arms):
            ys = [r["median_ms"] for r in runs if r["arm"] == arm]
            right.scatter([i] * len(ys), ys, color=colors[arm])
        right.set_xticks(range(len(arms)), arms)
        right.set_ylim(bottom=0)
        right.set_ylabel("median ms per call")
        right.set_title("cost per call, ms (the machine's speed moves)")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for plugin-cost-ab.json and .png")
    ap.add_argument("--arms", default=DEFAULT_ARMS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=None, help="default 600 offline, 128 tokens with --vllm")
    ap.add_argument("--profile", default=None)
    ap.add_argument("--vllm", action="store_true")
    ap.add_argument("--workloads", default=None, help="with --vllm: the prompts' workloads")
    ap.add_argument("--flush-mib", type=int, default=32)
    ap.add_argument("--fixed-clocks", action=argparse.BooleanOptionalAction, default=True)
    args = ap.parse_args()
    args.steps = args.steps or (128 if args.vllm else 600)
    arms = parse_arms(args.arms)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for name, flags in (arms if round_ % 2 == 0 else arms[::-1]):
                run = {"arm": name, "round": round_, **run_arm(flags, args, Path(scratch))}
                runs.append(run)
                print(f"round {round_ + 1} {name:>8s}: {run['yardsticks']:.2f} yardsticks, median "
                      f"{run['median_ms']:.3f} ms a call" + (f", digest {run['digest']}" if run.get("digest") else ""))
    names = [n for n, _ in arms]
    summary = {}
    for name in names:
        mine = [r for r in runs if r["arm"] == name]
        summary[name] = {"yardsticks": statistics.median(r["yardsticks"] for r in mine),
                         "median_ms": statistics.median(r["median_ms"] for r in mine),
                         "mean_ms": statistics.median(r["mean_ms"] for r in mine)}
    base = summary[names[0]]["yardsticks"]
    for name in names:
        summary[name]["ratio_to_" + names[0]] = summary[name]["yardsticks"] / base
    digests = {r.get("digest") for r in runs}
    result = {"command": " ".join(sys.argv), "started": started, "machine": machine_info(["numpy", "numba", "vllm"]),
              "python": sys.executable, "arms": dict((n, f) for n, f in arms), "summary": summary,
              "same_decisions": len(digests) == 1 and None not in digests, "runs": runs}
    (out / "plugin-cost-ab.json").write_text(json.dumps(result, indent=1))
    where = "inside vLLM" if args.vllm else "offline" + (", fixed clocks" if args.fixed_clocks else "")
    plot(runs, names, out / "plugin-cost-ab.png", f"the vLLM plugin at B = {args.batch}, {where} ({started})")
    for name in names:
        s = summary[name]
        print(f"{name:>8s}: {s['yardsticks']:.2f} yardsticks ({s['ratio_to_' + names[0]]:.3f}x {names[0]}), "
              f"median {s['median_ms']:.3f} ms, mean {s['mean_ms']:.3f} ms")
    print("same decisions in every run (drafts digest)" if result["same_decisions"] else "")


if __name__ == "__main__":
    main()
