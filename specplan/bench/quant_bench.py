"""`specplan bench quant`: specplan's quantized weights (Q8_0, Q4_1) against its float32 engine
and llama.cpp on the same GGUF, side by side in one run.

Engines: specplan fp32 (the GGUF dequantized), specplan Q8_0 (quantized at load from the float
weights), specplan Q4_1 (the GGUF's own blocks, as stored); when llama_cpp is importable,
llama.cpp on the shipped Q4_1 GGUF, on a Q8_0 GGUF made from the F32 one by llama.cpp's own
quantizer, and on the F32 GGUF.

- Speed: single-stream greedy tok/s (prompt included) and B concurrent streams (specplan's
  continuous batching), every engine once per round, the order rotated each round; medians.
- Quality, teacher-forced over held-out text (XSum articles, the same token ids for every engine):
  perplexity, and greedy agreement (how often the argmax equals specplan fp32's).
- Roofline: specplan Q4_1's B=1 decode step against the floor of streaming its weights once at
  4.5 bits per weight (and at the bytes it actually packs), with the read bandwidth measured here.
"""

from __future__ import annotations

import json
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from rich.progress import Progress

from specplan.engine import LLM, LoadedModel, SamplingParams, load_model
from specplan.engine.model.linear import QuantLinear
from specplan.engine.model_runner import kv_cache_dtype
from specplan.engine.model.transformer import Model
from specplan.profiler.machine import describe, machine_info

FLOOR_BITS_PER_WEIGHT = 4.5


def specplan_variants(model: str | None) -> dict[str, LoadedModel]:
    """fp32, Q8_0 (quantized at load) and Q4_1 (a GGUF's blocks as stored; quantized at load for
    a Hugging Face directory)."""
    gguf = model is None or str(model).lower().endswith(".gguf")
    return {"specplan fp32": load_model(model), "specplan Q8_0": load_model(model, quantize="int8"),
            "specplan Q4_1": load_model(model, quantize="gguf" if gguf else "q4")}


def llama_cpp_ggufs(source: Path | None = None) -> dict[str, Path]:
    """llama.cpp's files: the shipped Q4_1 GGUF, a Q8_0 one quantized by llama.cpp from the F32
    GGUF (made once, cached beside it), and the F32 one."""
    import llama_cpp

    from specplan.bench.spec_bench import f32_gguf
    from specplan.engine.model.loader import default_model_path

    source = Path(source) if source is not None else default_model_path()
    f32 = f32_gguf(source)
    q8 = f32.with_name(f32.name.replace(".F32.gguf", ".Q8_0.gguf"))
    if not q8.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
        tmp = q8.with_suffix(".tmp")
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(tmp).encode(), params) != 0:
            raise RuntimeError(f"llama.cpp could not quantize {f32} to Q8_0")
        tmp.rename(q8)
    return {"llama.cpp Q4_1": source, "llama.cpp Q8_0": q8, "llama.cpp F32": f32}


def _interleaved(runners: dict[str, Callable[[], int]], repeats: int, label: str,
                 progress: bool) -> dict[str, list[float]]:
    """Tokens per second of each runner (a call returns the tokens it made), once per round in a
    rotated order, so drift on a shared machine hits every engine alike."""
    rates: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners.items())
    with Progress(disable=not progress) as bar:
        task = bar.add_task(label, total=repeats * len(order))
        for rep in range(repeats):
            for name, fn in order[rep % len(order):] + order[:rep % len(order)]:
                t0 = time.perf_counter()
                tokens = fn()
                rates[name].append(tokens / (time.perf_counter() - t0))
                bar.advance(task)
    return rates


def _specplan_runner(llm: LLM, prompts: list[list[int]], new_tokens: int) -> Callable[[], int]:
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)  # warm-up

    def run() -> int:
        return sum(len(o.token_ids) for o in llm.generate(prompts, params))
    return run


def _llama_cpp_runner(cpp, prompt: list[int], new_tokens: int) -> Callable[[], int]:
    def run() -> int:
        cpp.reset()
        out = cpp.create_completion(prompt, max_tokens=new_tokens, temperature=0.0, top_k=1)
        return out["usage"]["completion_tokens"]
    run()  # warm-up
    return run


@torch.inference_mode()
def prefill_logits(model: Model, ids: list[int], block_size: int = 16, kv_dtype: torch.dtype = torch.float32
                   ) -> torch.Tensor:
    """Logits [T, V] at every position of one sequence (teacher forcing), prefilled in one step,
    over a KV cache of ``kv_dtype``."""
    from specplan.engine.batch import TokenBatch
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches

    t = len(ids)
    blocks = -(-t // block_size)
    batch = TokenBatch(input_ids=torch.tensor(ids), positions=torch.arange(t),
                       query_start_loc=torch.tensor([0, t], dtype=torch.int32),
                       seq_lens=torch.tensor([t], dtype=torch.int32), slot_mapping=torch.arange(t),
                       block_tables=torch.arange(blocks, dtype=torch.int32)[None],
                       logits_indices=torch.arange(t), query_lens_host=[t], seq_lens_host=[t])
    cache = allocate_kv_cache(model.config, blocks, block_size, kv_dtype, torch.device("cpu"))
    return model.compute_logits(model.forward(batch, layer_caches(cache), block_size))


def _nll_and_argmax(logits: torch.Tensor, ids: list[int]) -> tuple[float, torch.Tensor]:
    """logits [T, V] -> (summed negative log-likelihood of ids[1:], argmax [T - 1])."""
    logp = torch.log_softmax(logits[:-1].double(), dim=-1)  # [T - 1, V]
    target = torch.tensor(ids[1:])
    return float(-logp.gather(1, target[:, None]).sum()), logits[:-1].argmax(-1)


def heldout_texts(tokenizer, docs: int, tokens: int) -> list[list[int]]:
    """Token ids of XSum articles (specplan/bench/workloads.py), each cut to ``tokens``."""
    from specplan.bench.workloads import XSUM_INSTRUCTION, load_workload

    prompts = load_workload("xsum", n=docs, seed=1)
    return [tokenizer.encode(p.text.removeprefix(XSUM_INSTRUCTION))[:tokens] for p in prompts]


def quality(variants: dict[str, LoadedModel], ggufs: dict[str, Path], texts: list[list[int]],
            progress: bool) -> dict[str, dict]:
    """Perplexity and greedy agreement with specplan fp32 per engine, over the same token ids;
    each specplan variant over the KV cache its engine runs with (float16 for quantised weights)."""
    argmaxes: dict[str, list[torch.Tensor]] = {}
    nll: dict[str, float] = {}
    count = sum(len(ids) - 1 for ids in texts)
    with Progress(disable=not progress) as bar:
        task = bar.add_task("perplexity", total=len(texts) * (len(variants) + len(ggufs)))
        for name, loaded in variants.items():
            model = Model(loaded.config, loaded.weights, "cpu", torch.float32)
            kv_dtype = kv_cache_dtype(loaded.config, torch.float32, "cpu")
            nll[name], argmaxes[name] = 0.0, []
            for ids in texts:
                total, top = _nll_and_argmax(prefill_logits(model, ids, kv_dtype=kv_dtype), ids)
                nll[name] += total
                argmaxes[name].append(top)
                bar.advance(task)
        for name, path in ggufs.items():
            from llama_cpp import Llama

            cpp = Llama(model_path=str(path), n_ctx=max(len(ids) for ids in texts) + 8, logits_all=True,
                        n_threads=torch.get_num_threads(), verbose=False)
            nll[name], argmaxes[name] = 0.0, []
            for ids in texts:
                cpp.reset()
                cpp.eval(ids)
                logits = torch.from_numpy(np.array(cpp.scores[:len(ids)], dtype=np.float32))  # [T, V]
                total, top = _nll_and_argmax(logits, ids)
                nll[name] += total
                argmaxes[name].append(top)
                bar.advance(task)
    ref = torch.cat(argmaxes["specplan fp32"])
    return {name: {"perplexity": float(np.exp(nll[name] / count)), "tokens": count,
                   "greedy_agreement_vs_fp32": float((torch.cat(argmaxes[name]) == ref).float().mean())}
            for name in nll}


def roofline_line(loaded: LoadedModel, repeats: int, rounds: int = 5) -> dict:
    """B = 1, T = 1 decode step of ``loaded`` against its weight floor, in ``rounds`` rounds of
    (``repeats`` steps, then the read bandwidth), each round's step weighed against the bandwidth
    measured beside it (the ratio: the rounds' median). The bandwidth is this process's: on the
    Zen 4 VM the same probe read 35 GB/s in some processes and 61 GB/s in others (2026-11-30,
    huge pages granted in both), and the step moved far less than the bandwidth between them."""
    from specplan.profiler.ceilings import BandwidthProbe, measure_bandwidth
    from specplan.profiler.step_timer import StepTimer, timing_engine

    engine = timing_engine(loaded, max_batch=1, max_tokens_per_seq=1, context=256)
    timer = StepTimer(engine)
    timer.fill(1, 256)
    linears = [engine.model.lm_head] + [lin for layer in engine.model.layers
                                       for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
    params = sum(lin.out_features * _in_features(lin) for lin in linears)
    packed_bytes = sum(lin.packed.numel() for lin in linears if isinstance(lin, QuantLinear))
    floor_bytes = params * FLOOR_BITS_PER_WEIGHT / 8
    probe = BandwidthProbe("cpu")
    steps, bandwidths = [], []
    for _ in range(rounds):
        steps.append(timer.time_steps(1, repeats, warmup=2).median)
        bandwidths.append(measure_bandwidth(probe=probe, repeats=3))
    step, bandwidth = statistics.median(steps), statistics.median(bandwidths)
    return {"step_ms": 1e3 * step, "step_round_ms": [1e3 * s for s in steps], "weights": params,
            "kv_cache": str(engine.kv_dtype).removeprefix("torch."),
            "bandwidth_gb_s": bandwidth / 1e9, "bandwidth_round_gb_s": [b / 1e9 for b in bandwidths],
            "floor_ms_at_4.5_bits": 1e3 * floor_bytes / bandwidth, "packed_bytes": packed_bytes,
            "floor_ms_packed": 1e3 * packed_bytes / bandwidth,
            "step_over_floor_4.5": statistics.median(s * b / floor_bytes for s, b in zip(steps, bandwidths)),
            "step_over_floor_packed": statistics.median(s * b / packed_bytes for s, b in zip(steps, bandwidths))}


def _in_features(lin) -> int:
    return lin.packed.shape[1] * 32 if isinstance(lin, QuantLinear) else lin.packed.shape[1]


KERNEL_SHAPES = {"gate_up 576->3072": (3072, 576), "down 1536->576": (576, 1536), "lm_head 576->49152": (49152, 576)}


def kernel_times(rows: tuple[int, ...] = (1, 8, 32), repeats: int = 20, progress: bool = True) -> list[dict]:
    """One projection of the default model's shapes, fp32 packed vs Q8_0 / Q4_0 / Q4_1: the best
    of ``repeats`` calls each, formats interleaved call by call (random weights: speed only)."""
    from specplan.engine.model import cpu_kernels
    from specplan.engine.model.linear import PackedLinear
    from specplan.engine.model.quant import FORMATS, QuantWeight

    if not cpu_kernels.load():
        raise RuntimeError("the CPU kernels did not build here: nothing to time")
    out = []
    with Progress(disable=not progress) as bar:
        task = bar.add_task("kernels", total=len(KERNEL_SHAPES) * len(rows))
        for shape_name, (n, k) in KERNEL_SHAPES.items():
            w = torch.randn(n, k) * 0.05  # [N, K]
            linears = {"fp32": PackedLinear(w), **{f: QuantLinear(QuantWeight.quantize(w, f)) for f in FORMATS}}
            for m in rows:
                x = torch.randn(m, k)  # [M, K]
                best = {name: float("inf") for name in linears}
                for _ in range(repeats):
                    for name, lin in linears.items():
                        t0 = time.perf_counter()
                        lin(x)
                        best[name] = min(best[name], time.perf_counter() - t0)
                out.append({"shape": shape_name, "rows": m, **{f"{name}_us": 1e6 * t for name, t in best.items()}})
                bar.advance(task)
    return out


def run_quant_bench(out: Path, model: str | None = None, repeats: int = 3, new_tokens: int = 128,
                    batch_size: int = 32, ppl_docs: int = 8, ppl_tokens: int = 512, llama_cpp: bool = True,
                    command: str = "specplan bench quant", progress: bool = True) -> Path:
    variants = specplan_variants(model)
    tokenizer = variants["specplan fp32"].tokenizer
    ggufs = llama_cpp_ggufs(None if model is None else Path(model)) if llama_cpp else {}
    llms = {name: LLM(loaded=loaded, max_num_seqs=max(batch_size, 1)) for name, loaded in variants.items()}
    prompt_ids = llms["specplan fp32"].apply_chat_template(
        [{"role": "user", "content": "Write a short story about a robot who learns to paint."}])

    single = {name: _specplan_runner(llm, [prompt_ids], new_tokens) for name, llm in llms.items()}
    cpps = {}
    for name, path in ggufs.items():
        from llama_cpp import Llama

        cpps[name] = Llama(model_path=str(path), n_threads=torch.get_num_threads(),
                           n_threads_batch=torch.get_num_threads(), n_ctx=2048, verbose=False)
        single[name] = _llama_cpp_runner(cpps[name], prompt_ids, new_tokens)
    single_rates = _interleaved(single, repeats, "single-stream", progress)
    cpps.clear()  # llama.cpp's contexts hold their KV caches: free them before the batched runs

    texts = heldout_texts(tokenizer, batch_size, 48)  # B different prompts
    batched = {name: _specplan_runner(llm, texts, new_tokens) for name, llm in llms.items()}
    batched_cpps = []
    for name, path in ggufs.items():  # llama.cpp's batched decode: B sequences in one context
        from specplan.bench.llama_cpp_batched import LlamaCppBatched

        cpp = LlamaCppBatched(path, batch_size, max(map(len, texts)) + new_tokens, torch.get_num_threads())
        batched_cpps.append(cpp)
        cpp.run(texts[:2], 4)  # warm-up
        batched[name] = lambda cpp=cpp: cpp.run(texts, new_tokens)
    batched_rates = _interleaved(batched, repeats, f"B={batch_size}", progress)
    for cpp in batched_cpps:
        cpp.close()
    llms.clear()

    qual = quality(variants, ggufs, heldout_texts(tokenizer, ppl_docs, ppl_tokens), progress)
    roof = roofline_line(variants["specplan Q4_1"], repeats=max(20, repeats))
    kernels = kernel_times(progress=progress)
    info = machine_info(libraries=("llama_cpp",))
    result = {
        "command": command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": info,
        "new_tokens": new_tokens, "batch_size": batch_size, "repeats": repeats,
        "single_stream_tok_s": {k: {"median": statistics.median(v), "all": v} for k, v in single_rates.items()},
        "batched_tok_s": {k: {"median": statistics.median(v), "all": v} for k, v in batched_rates.items()},
        "quality": qual, "roofline_b1": roof, "kernels": kernels,
        "kv_cache": {name: str(kv_cache_dtype(v.config, torch.float32, "cpu")).removeprefix("torch.")
                     for name, v in variants.items()},
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "quant-bench.json").write_text(json.dumps(result, indent=2))
    path = out / "quant-bench.md"
    path.write_text(render_report(result, out / "quant-bench.png"))
    return path


def render_report(r: dict, png: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    single, batched = r["single_stream_tok_s"], r["batched_tok_s"]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = list(single)
    ax.barh(names, [single[n]["median"] for n in names])
    ax.set_xlabel(f"single-stream tok/s ({r['new_tokens']} greedy tokens, median of {r['repeats']})")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)

    def ratio(a: str, b: str, table: dict) -> str:
        return f"{table[a]['median'] / table[b]['median']:.2f}x" if a in table and b in table else "n/a"

    lines = [
        "# Quantized weights: specplan vs llama.cpp", "",
        f"`{r['command']}`, {r['date']}. {describe(r['machine'])}", "",
        f"![single-stream tok/s]({png.name})", "",
        f"| engine | single-stream tok/s | B={r['batch_size']} tok/s | perplexity | greedy agreement vs fp32 |",
        "|---|---:|---:|---:|---:|",
    ]
    kv = r.get("kv_cache")
    if kv:  # runs from before the float16 cache ran every specplan engine over float32
        lines[4:4] = ["KV caches: " + ", ".join(f"{name} {dtype}" for name, dtype in kv.items())
                      + "; llama.cpp F16 (its default).", ""]
    for name in single:
        q = r["quality"].get(name, {})
        b = batched.get(name, {}).get("median")
        lines.append(f"| {name} | {single[name]['median']:.1f} | {'' if b is None else f'{b:.1f}'} | "
                     f"{q.get('perplexity', float('nan')):.3f} | {q.get('greedy_agreement_vs_fp32', float('nan')):.3f} |")
    roof = r["roofline_b1"]
    lines += [
        "", "Ratios (same run, medians): "
        f"specplan Q4_1 / llama.cpp Q4_1 = {ratio('specplan Q4_1', 'llama.cpp Q4_1', single)}, "
        f"specplan Q8_0 / llama.cpp Q8_0 = {ratio('specplan Q8_0', 'llama.cpp Q8_0', single)}, "
        f"specplan Q4_1 / specplan fp32 = {ratio('specplan Q4_1', 'specplan fp32', single)}; "
        f"at B={r['batch_size']} (llama.cpp's batched decode: every stream in one llama_decode per step, "
        f"specplan/bench/llama_cpp_batched.py) specplan Q4_1 / llama.cpp Q4_1 = "
        f"{ratio('specplan Q4_1', 'llama.cpp Q4_1', batched)}, "
        f"specplan Q8_0 / llama.cpp Q8_0 = {ratio('specplan Q8_0', 'llama.cpp Q8_0', batched)}.", "",
        f"B=1 decode step (specplan Q4_1, 256 tokens of context): {roof['step_ms']:.2f} ms; floor at "
        f"{FLOOR_BITS_PER_WEIGHT} bits/weight ({roof['weights'] / 1e6:.0f} M weights, read bandwidth "
        f"{roof['bandwidth_gb_s']:.1f} GB/s) {roof['floor_ms_at_4.5_bits']:.2f} ms: "
        f"{roof['step_over_floor_4.5']:.2f}x the floor; at the bytes it packs "
        f"({roof['packed_bytes'] / 1e6:.0f} MB) the floor is {roof['floor_ms_packed']:.2f} ms"
        + (f" ({roof['step_over_floor_packed']:.2f}x)" if "step_over_floor_packed" in roof else "")
        + (f". Each of {len(roof['step_round_ms'])} rounds timed the step, then the bandwidth beside it "
           f"({min(roof['bandwidth_round_gb_s']):.1f}-{max(roof['bandwidth_round_gb_s']):.1f} GB/s); the ratios "
           "are the rounds' medians." if "step_round_ms" in roof else "."), "",
        f"Perplexity over {next(iter(r['quality'].values()))['tokens']} tokens of XSum articles, "
        "teacher-forced, the same token ids for every engine.", "",
        f"One projection, best of 20 calls, {r['machine'].get('torch_threads')} threads (µs; formats interleaved):", "",
        "| shape | rows | fp32 | Q8_0 | Q4_0 | Q4_1 |", "|---|---:|---:|---:|---:|---:|",
    ]
    lines += [f"| {k['shape']} | {k['rows']} | {k['fp32_us']:.0f} | {k['q8_0_us']:.0f} | {k['q4_0_us']:.0f} | "
              f"{k['q4_1_us']:.0f} |" for k in r["kernels"]]
    return "\n".join(lines) + "\n"


__all__ = ["run_quant_bench", "prefill_logits", "specplan_variants", "llama_cpp_ggufs"]
