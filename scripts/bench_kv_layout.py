"""Attention time of one B=32 decode step (context 256, 30 layers, SmolLM2-135M's 9 query / 3 KV
heads of 64) for two storage orders of the same logical KV cache [num_blocks, block_size, KVH, D]:
token-major (the heads of one slot side by side) and head-major (each block's slots of one head
side by side; the engine's, see model_runner.allocate_kv_cache), at several block sizes, with each
request's blocks in order or scattered. A development benchmark: `python scripts/bench_kv_layout.py`
from the repo root, on a quiet machine."""
import statistics
import time

import torch

from specplan.engine.model.attention_cpu import load_kernel

B, CONTEXT, H, KVH, D, LAYERS = 32, 256, 9, 3, 64, 30


def caches(block_size: int, head_major: bool, scattered: bool, gen: torch.Generator):
    """One (k_cache, v_cache, block_tables) per layer; every cache has the logical index order."""
    per_request = CONTEXT // block_size
    num_blocks = per_request * B
    out = []
    for _ in range(LAYERS):
        if head_major:
            k, v = (torch.randn(num_blocks, KVH, block_size, D, generator=gen).transpose(1, 2) for _ in "kv")
        else:
            k, v = (torch.randn(num_blocks, block_size, KVH, D, generator=gen) for _ in "kv")
        order = torch.randperm(num_blocks, generator=gen) if scattered else torch.arange(num_blocks)
        out.append((k, v, order.to(torch.int32).view(B, per_request)))
    return out


def time_step(op, layers, *, batch: int = B, context: int = CONTEXT, tokens: int = 1, repeats: int = 9) -> float:
    """Median milliseconds of one step's attention over ``layers`` ((k_cache, v_cache, block_tables)
    each): ``batch`` requests of ``context`` keys, the last ``tokens`` of each as queries."""
    q = torch.randn(batch * tokens, H, D)  # [N, H, D]
    query_start_loc = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32)
    positions = torch.arange(context - tokens, context, dtype=torch.int64).repeat(batch)

    def step():
        for k, v, tables in layers:
            op(q, k, v, query_start_loc, seq_lens, tables, positions, D ** -0.5, 0, None)

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
    gen = torch.Generator().manual_seed(0)
    print(f"attention of one B={B} decode step, context {CONTEXT}, {LAYERS} layers (ms, median of 9)")
    print("block_size  blocks     token-major  head-major")
    for block_size in (16, 32, 64):
        for scattered in (False, True):
            ms = [time_step(op, caches(block_size, hm, scattered, gen)) for hm in (False, True)]
            print(f"{block_size:10d}  {'scattered' if scattered else 'in order':9s}  {ms[0]:11.1f}  {ms[1]:10.1f}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
