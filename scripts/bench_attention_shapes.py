"""Attention time of one decode or verify step over 30 layers (SmolLM2-135M's 9 query / 3 KV heads
of 64, block size 16, the engine's head-major cache, each request's blocks in order) for a few
(batch size B, context, tokens per request T) shapes: the shapes where a step has too few
(request, KV head) items for the threads (the kernel once split those items' keys into ranges,
which broke batch invariance; see engine/model/csrc/paged_attention.cpp). A development benchmark: `python scripts/bench_attention_shapes.py`
from the repo root, on a quiet machine; run it at two commits to compare kernels."""
import sys

import torch

from bench_kv_layout import D, KVH, LAYERS, time_step  # the same model shapes and timing loop
from specplan.engine.model.attention_cpu import load_kernel

BLOCK = 16
SHAPES = ((1, 256, 1), (2, 256, 1), (4, 256, 1), (8, 256, 1), (1, 256, 3), (1, 256, 9), (1, 1024, 1), (1, 4096, 1))


def time_shape(op, batch: int, context: int, tokens: int) -> float:
    """Median milliseconds of one step's attention over all layers (each layer its own blocks)."""
    gen = torch.Generator().manual_seed(0)
    per_request = -(-context // BLOCK)
    num_blocks = per_request * batch * LAYERS
    # [num_blocks, block_size, KVH, D] views of head-major storage, as model_runner.allocate_kv_cache
    k, v = (torch.randn(num_blocks, KVH, BLOCK, D, generator=gen).transpose(1, 2) for _ in "kv")
    layers = [(k, v, torch.arange(i * batch * per_request, (i + 1) * batch * per_request, dtype=torch.int32)
               .view(batch, per_request)) for i in range(LAYERS)]
    return time_step(op, layers, batch=batch, context=context, tokens=tokens, repeats=15)


def main() -> None:
    op = load_kernel()
    if op is None:
        raise SystemExit("the CPU kernels could not be built here")
    print(f"attention of one step over {LAYERS} layers, {torch.get_num_threads()} threads (ms, median of 15)")
    print("   B  context   T      ms")
    for batch, context, tokens in SHAPES:
        print(f"{batch:4d} {context:8d} {tokens:3d} {time_shape(op, batch, context, tokens):7.2f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
