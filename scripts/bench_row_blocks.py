"""A/B the register block of packed_linear (MR: rows per block) in one process, interleaved.

Builds one variant of engine/model/csrc/packed_linear.cpp per MR (its op renamed so they load side by
side), then times one step's products of SmolLM2-135M (30 layers of qkv, o, gate_up, down and the
LM head) at each row count M, the variants in alternating order, and prints medians and the ratio
to the first MR. AVX-512 builds only (the MR the kernel picks without AVX-512 is not touched).

    python scripts/bench_row_blocks.py --mr 8,12,10 --rows 9,10,12,16,20,32
"""

from __future__ import annotations

import argparse
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from specplan.engine.model.cpu_kernels import build_config

CSRC = Path(__file__).resolve().parent.parent / "engine" / "model" / "csrc"
KERNELS, CFLAGS = build_config()  # the engine's own build: the widest ISA this CPU has
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]  # (K, N) of one step


def build(mr: int, workdir: Path):
    """packed_linear with MR = mr under the op namespace rows_mr<mr>."""
    src = (CSRC / "packed_linear.cpp").read_text()
    src, n = re.subn(r"^constexpr int MR = \d+;", f"constexpr int MR = {mr};", src, count=1, flags=re.M)
    if n != 1:
        raise SystemExit("could not find the AVX-512 MR in packed_linear.cpp")
    name = f"rows_mr{mr}"
    src = (src.replace("namespace specplan {", f"namespace {name} {{")
              .replace("&specplan::packed_linear", f"&{name}::packed_linear")
              .replace("specplan_linear", name))
    path = workdir / f"{name}.cpp"
    path.write_text(src)
    build_dir = workdir / name
    build_dir.mkdir()
    cpp_extension.load(name=name, sources=[str(path)], extra_include_paths=[str(CSRC)], extra_cflags=CFLAGS,
                       extra_ldflags=["-fopenmp"], is_python_module=False, build_directory=str(build_dir))
    return getattr(torch.ops, name).packed_linear


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mr", default="8,12", help="comma-separated MR values; ratios are to the first")
    ap.add_argument("--rows", default="1,4,8,9,12,16,24,32")
    ap.add_argument("--rounds", type=int, default=6)
    args = ap.parse_args()
    if "avx512" not in KERNELS:
        raise SystemExit(f"this CPU builds {KERNELS}: the MR under test is the AVX-512 one")
    mrs = [int(x) for x in args.mr.split(",")]
    rows = [int(x) for x in args.rows.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        ops = {mr: build(mr, Path(tmp)) for mr in mrs}
        packed = [(torch.randn((n + 31) // 32, k, 32), n) for k, n in SHAPES]
        times: dict[tuple[int, int], list[float]] = {(mr, m): [] for mr in mrs for m in rows}
        for r in range(args.rounds):
            for m in rows:
                xs = {k: torch.randn(m, k) for k in (576, 1536)}
                for mr in (mrs if r % 2 == 0 else mrs[::-1]):
                    op = ops[mr]
                    for rep in range(4):  # the first is a warm-up
                        t0 = time.perf_counter()
                        for (k, _), (w, n) in zip(SHAPES, packed):
                            op(xs[k], w, n, None)
                        if rep:
                            times[(mr, m)].append(time.perf_counter() - t0)
    print(f"one step's products, {torch.get_num_threads()} threads, median ms (ratio to MR={mrs[0]})")
    for m in rows:
        base = statistics.median(times[(mrs[0], m)])
        cells = [f"MR={mr}: {1000 * statistics.median(times[(mr, m)]):.1f} ({statistics.median(times[(mr, m)]) / base:.2f})"
                 for mr in mrs]
        print(f"M={m:3d}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
