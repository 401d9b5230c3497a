"""Attention time of one decode or verify step over 30 layers (SmolLM2-135M's 9 query / 3 KV heads
of 64, block size 16, the engine's head-major cache, each request's blocks in order) for a few
(batch size B, context, tokens per request T) shapes: the shapes where a step has too few
(request, KV head) items for the threads and the kernel splits keys into ranges (merge_split in
engine/csrc/paged_attention.cpp). A development benchmark: `python scripts/bench_attention_shapes.py`
from the repo root, on a quiet machine; run it at two commits to compare kernels."""
import statistics
import sys
import time

import torch

from specplan.engine.attention_cpu import load_kernel

H, KVH, D, BLOCK, LAYERS = 9, 3, 64, 16, 30
SHAPES = ((1, 256, 1), (2, 256, 1), (4, 256, 1), (8, 256, 1), (1, 256, 3), (1, 256, 9), (1, 1024, 1), (1, 4096, 1))


def time_step(op, batch: int, context: int, tokens: int, repeats: int = 15) -> float:
    """Median milliseconds of one step's attention over all layers (each layer its own blocks)."""
    gen = torch.Generator().manual_seed(0)
    per_request = -(-context // BLOCK)
    num_blocks = per_request * batch * LAYERS
    # [num_blocks, block_size, KVH, D] views of head-major storage, as model_runner.allocate_kv_cache
    k, v = (torch.randn(num_blocks, KVH, BLOCK, D, generator=gen).transpose(1, 2) for _ in "kv")
    q = torch.randn(batch * tokens, H, D, generator=gen)  # [N, H, D]
    query_start_loc = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    positions = torch.arange(context - tokens, context, dtype=torch.int64).repeat(batch)
    tables = [torch.arange(i * batch * per_request, (i + 1) * batch * per_request, dtype=torch.int32)
              .view(batch, per_request) for i in range(LAYERS)]

    def step():
        for t in tables:
            op(q, k, v, query_start_loc, seq_lens, t, positions, D ** -0.5, 0, None)

    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    op = load_kernel()
    if op is None:
        raise SystemExit("the CPU kernels could not be built here")
    print(f"attention of one step over {LAYERS} layers, {torch.get_num_threads()} threads (ms, median of 15)")
    print("   B  context   T      ms")
    for batch, context, tokens in SHAPES:
        print(f"{batch:4d} {context:8d} {tokens:3d} {time_step(op, batch, context, tokens):7.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
