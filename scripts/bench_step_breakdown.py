"""Where one decode step's time goes, against the roofline: the whole step beside its parts.

For each (B, T) shape, in one engine over SmolLM2-135M at context 256, round by round:

    step        LLMEngine.step() forward + verify (what `specplan bench engine` reports)
    products    the same step's 121 matrix products alone, on the engine's own packed weights
    attn cold   30 layers' attention over 30 distinct KV caches of this shape (engine layout):
                the KV of a layer comes from memory, as in a step
    attn hot    the same 30 calls over one layer's KV cache: the KV comes from L2/L3, so this is
                attention's arithmetic without its memory traffic
    rest        step - products - attn cold (norms, RoPE, SiLU, embedding, argmax, batch building)

and the floors: the step's FLOPs at the peak matmul rate, the weights' bytes at the bandwidth read
in that round, the KV cache's bytes at the same bandwidth. The roofline floor of the step is the
larger of its compute and its bytes; a step that runs attention (memory-bound at large B) after
the products (compute-bound there) cannot go below their sum without overlapping the two.

A development benchmark: `.venv/bin/python scripts/bench_step_breakdown.py [--quantize gguf] [B,T ...]`
from the repo root (default: 1,1 8,1 32,1), on a quiet machine. With ``--quantize`` (load_model's
schemes: gguf keeps the embedded model's Q4_1 blocks) the weights floor is at the bytes per weight
the kernels stream.
"""
import statistics
import sys
import time

import torch

from specplan.engine.model.attention_cpu import load_kernel
from specplan.engine import load_model
from specplan.profiler.ceilings import BandwidthProbe, measure_peak_flops
from specplan.profiler.cost_model import decode_step_cost
from specplan.profiler.step_timer import StepTimer, timing_engine

CONTEXT, BLOCK, ROUNDS = 256, 16, 5


def median_ms(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def attention_calls(op, cfg, batch: int, tokens: int, distinct_layers: int):
    """30 layers' attention calls over ``distinct_layers`` KV caches of [blocks, block, KVH, D]
    (head-major storage, each request's blocks in order, as the engine allocates them)."""
    kvh, d = cfg.num_kv_heads, cfg.head_dim
    per_request = -(-(CONTEXT + tokens) // BLOCK)
    blocks = per_request * batch
    caches = [tuple(torch.randn(blocks, kvh, BLOCK, d).transpose(1, 2) for _ in "kv") for _ in range(distinct_layers)]
    tables = torch.arange(blocks, dtype=torch.int32).view(batch, per_request)
    q = torch.randn(batch * tokens, cfg.num_heads, d)  # [N, H, D]
    starts = torch.arange(0, batch * tokens + 1, tokens, dtype=torch.int32)
    seq_lens = torch.full((batch,), CONTEXT + tokens, dtype=torch.int32)
    positions = torch.arange(CONTEXT, CONTEXT + tokens, dtype=torch.int64).repeat(batch)

    def run():
        for layer in range(cfg.num_layers):
            k, v = caches[layer % distinct_layers]
            op(q, k, v, starts, seq_lens, tables, positions, d ** -0.5, 0, None)
    return run


def in_features(lin) -> int:
    """K of a projection: packed fp32 is [P, K, 32], quantized blocks [P, K / 32, bytes per block]."""
    return lin.packed.shape[1] * (32 if hasattr(lin, "fmt") else 1)


def main(shapes: list[tuple[int, int]], quantize: str = "none") -> None:
    loaded = load_model(None, quantize=quantize)
    cfg = loaded.config
    attention_op = load_kernel()
    if attention_op is None:
        raise SystemExit("the CPU kernels could not be built here")
    peak = measure_peak_flops(weight_formats=loaded.weight_formats())
    probe = BandwidthProbe()
    print(f"weights: {quantize} ({loaded.bytes_per_weight():.4f} bytes per weight); peak matmul {peak / 1e9:.0f} GFLOP/s, {torch.get_num_threads()} threads; medians of {ROUNDS} rounds (ms)")
    print("   B  T  GB/s   step  products  attn cold  attn hot  rest | compute floor  weights floor  KV floor  roofline floor  step/floor")
    for batch, tokens in shapes:
        timer = StepTimer(timing_engine(loaded, max_batch=batch, max_tokens_per_seq=max(tokens, 2), context=CONTEXT))
        timer.fill(batch, CONTEXT)
        model = timer.engine.runner.model
        linears = [lin for layer in model.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
        linears.append(model.lm_head)
        rows = batch * tokens
        inputs = {in_features(lin): torch.randn(rows, in_features(lin)) for lin in linears}  # [rows, K]

        def products():
            for lin in linears:
                lin(inputs[in_features(lin)])
        cold = attention_calls(attention_op, cfg, batch, tokens, cfg.num_layers)
        hot = attention_calls(attention_op, cfg, batch, tokens, 1)
        timer.time_steps(tokens, repeats=1, warmup=1)
        per_round = {name: [] for name in ("gbs", "step", "products", "cold", "hot")}
        for _ in range(ROUNDS):
            per_round["gbs"].append(probe.read() / 1e9)
            per_round["step"].append(1e3 * statistics.median(timer.time_steps(tokens, repeats=3, warmup=0).seconds))
            per_round["products"].append(median_ms(products))
            per_round["cold"].append(median_ms(cold))
            per_round["hot"].append(median_ms(hot))
        m = {name: statistics.median(values) for name, values in per_round.items()}
        cost = decode_step_cost(cfg, batch, tokens, CONTEXT, weight_itemsize=loaded.bytes_per_weight())
        bandwidth = m["gbs"] * 1e9
        weights_ms, kv_ms = 1e3 * cost.weight_bytes / bandwidth, 1e3 * cost.kv_bytes / bandwidth
        compute_ms = 1e3 * cost.flops / peak
        floor = 1e3 * cost.roofline_seconds(peak, bandwidth)
        print(f"{batch:4d} {tokens:2d} {m['gbs']:5.1f} {m['step']:6.1f} {m['products']:9.1f} {m['cold']:10.1f}"
              f" {m['hot']:9.1f} {m['step'] - m['products'] - m['cold']:5.1f} | {compute_ms:13.1f} {weights_ms:14.1f}"
              f" {kv_ms:9.1f} {floor:15.1f} {m['step'] / floor:11.2f}", flush=True)
        timer.clear()


if __name__ == "__main__":
    args = sys.argv[1:]
    quantize = "none"
    if args[:1] == ["--quantize"]:
        quantize, args = args[1], args[2:]
    with torch.inference_mode():
        main([tuple(int(x) for x in a.split(",")) for a in args or ["1,1", "8,1", "32,1"]], quantize)
