"""Speculative decoding side by side: specplan vs Hugging Face transformers vs llama.cpp.

One run measures, at batch 1, greedy, ``max_new_tokens`` new tokens with EOS ignored (so every
method emits the same number of tokens), on code (HumanEval), summarization (XSum) and chat
(MT-Bench) prompts:

* specplan plain (no speculation) and every proposer x static k (k = 0 included: speculation
  machinery on, no drafts);
* transformers ``generate`` plain and with ``prompt_lookup_num_tokens`` 3 and 10, on the same
  fp32 weights (the Hugging Face directory the loader converted the default GGUF into);
* llama.cpp (``llama-cpp-python``, optional extra ``bench``) on an F32 GGUF of the same weights,
  plain and with its prompt-lookup draft (``LlamaPromptLookupDecoding``, 2 and 10 tokens).

Every method sees the same prompt token ids (the chat template applied by specplan's tokenizer).
Time is the wall time of one generate call, prompt processing included, model loading excluded;
each cell is the median over repeats, and repeats are interleaved across methods (prompt ->
repeat -> method) so drift on a shared machine hits every method alike. specplan's speculative
outputs must be token-for-token identical to its plain greedy output: that is checked, recorded
and, with ``strict``, raised after the report is written.

``run_spec_bench`` measures; ``render_spec_report`` turns the rows into reports/spec-bench.md, a
bar chart per workload, JSON and parquet; ``target_verdicts`` checks the target these runs are
read against: specplan's best static k at least as fast as llama.cpp's best prompt lookup, on
code and on summarization.
"""

from __future__ import annotations

import gc
import hashlib
import json
import math
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from specplan.bench.workloads import KINDS, Prompt, load_workload
from specplan.profiler.machine import describe, load_average, machine_info

BENCH_WORKLOADS = ("humaneval", "xsum", "mtbench")  # code, summarization, chat
TARGET_WORKLOADS = ("humaneval", "xsum")  # code and summarization: where the target above applies
HF_LOOKUPS = (3, 10)  # transformers prompt_lookup_num_tokens
LLAMA_CPP_LOOKUPS = (2, 10)  # LlamaPromptLookupDecoding(num_pred_tokens=...)
F32_GGUF_FORMAT = 1  # part of the F32 GGUF cache key; bump when the conversion changes

# Columns of the rows DataFrame (one row per method x prompt); render_spec_report needs these.
ROW_COLUMNS = (
    "workload", "kind", "prompt_id", "prompt_tokens", "family", "method", "proposer", "k", "new_tokens",
    "seconds", "seconds_all", "tokens_per_s", "acceptance_rate", "mean_accepted_length", "num_drafts",
    "identical_to_plain", "agree_prefix",
)


# --- F32 GGUF for llama.cpp -------------------------------------------------------------------


def _file_key(path: Path) -> str:
    h = hashlib.sha256(f"specplan-f32-gguf-v{F32_GGUF_FORMAT}:".encode())
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def f32_gguf(source: Path | str | None = None, cache_dir: Path | None = None) -> Path:
    """An F32 GGUF of ``source`` (default: the default model's Q4_1 GGUF), made once and cached.

    Every tensor is dequantized with ``gguf.quants.dequantize`` and written as F32; all metadata
    (architecture hyperparameters, tokenizer vocabulary, merges, special tokens, chat template)
    is copied, except ``general.file_type``, which becomes ALL_F32. The file lives under
    ``$SPECPLAN_CACHE`` (or ~/.cache/specplan) in ``gguf-f32/``, named by a hash of the source's bytes.
    """
    from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    from specplan.engine.model.loader import cache_root, default_model_path

    if source is None:
        source = default_model_path()
    source = Path(source)
    stem = source.stem.split(".")[0] if "." in source.stem else source.stem
    target = cache_root(cache_dir) / "gguf-f32" / f"{stem}-{_file_key(source)}.F32.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = GGUFReader(source)
    arch = reader.fields["general.architecture"].contents()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        writer = GGUFWriter(tmp, arch)  # writes general.architecture itself
        for key, fld in reader.fields.items():
            if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
                continue  # the header's own fields, and the two the writer sets
            vtype = fld.types[0]
            sub_type = fld.types[-1] if vtype == GGUFValueType.ARRAY else None
            writer.add_key_value(key, fld.contents(), vtype, sub_type)
        writer.add_file_type(LlamaFileType.ALL_F32)
        for t in reader.tensors:
            # dequantize gives numpy order (the GGUF shape reversed), which add_tensor expects.
            data = dequantize(t.data, t.tensor_type).astype("float32", copy=False)
            writer.add_tensor(t.name, data.reshape(tuple(int(d) for d in reversed(t.shape))))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.chmod(0o644)  # mkstemp makes it private; the cache may be shared (SPECPLAN_CACHE)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


# --- measuring --------------------------------------------------------------------------------


@dataclass
class Method:
    family: str  # specplan | hf | llama.cpp
    name: str  # the label in tables and charts
    run: Callable[[list[int], int], "Result"]  # (prompt ids, max new tokens) -> result
    proposer: str | None = None
    k: int | None = None


@dataclass
class Result:
    token_ids: list[int]
    seconds: float
    spec: dict = field(default_factory=dict)


def _timed(fn: Callable[[], tuple[list[int], dict]]) -> Result:
    gc.collect()
    t0 = time.perf_counter()
    ids, spec = fn()
    return Result(list(ids), time.perf_counter() - t0, spec)


def _specplan_methods(loaded: Any, ks: Sequence[int], proposers: Sequence[str]) -> list[Method]:
    """specplan plain, then one engine per proposer whose per-request k is forced to each static k.

    ``SamplingParams.num_speculative_tokens`` overrides the decider for that request exactly as
    a fixed-k engine would (the same cap by remaining tokens and KV), so one engine per proposer
    serves every k. The suffix proposer learns from finished requests; its cross-request cache is
    reset before every measured request, or a repeat of the same prompt would find its own
    earlier output there.
    """
    from specplan.engine import LLM, SamplingParams

    kv_bytes = 96 * 1024**2  # ~2,000 tokens of KV for the default model: one prompt plus its output
    max_k = max([8, *ks])

    def runner(llm: Any, k: int | None) -> Callable[[list[int], int], Result]:
        def run(ids: list[int], n: int) -> Result:
            spec = llm.engine.config.spec
            if spec is not None and spec.proposer in ("ngram", "suffix"):
                llm.engine.set_proposer()  # a fresh one: an empty suffix cache
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, num_speculative_tokens=k)

            def go():
                (out,) = llm.generate([ids], params)
                return out.token_ids, out.metrics.get("spec", {}) if k else {}
            return _timed(go)
        return run

    methods = []
    plain = LLM(loaded=loaded, kv_cache_bytes=kv_bytes)
    methods.append(Method("specplan", "specplan plain", runner(plain, None), None, 0))
    for p in proposers:
        llm = LLM(loaded=loaded, kv_cache_bytes=kv_bytes,
                  speculative_config={"proposer": p, "k": max_k, "max_k": max_k})
        for k in ks:
            if k == 0 and p != proposers[0]:
                continue  # k = 0 never calls the proposer: one k = 0 row (spec machinery on) is enough
            label = f"specplan {p} k={k}" if k else "specplan spec-on k=0"
            methods.append(Method("specplan", label, runner(llm, k), p if k else None, k))
    return methods


def _hf_methods(path: Path, pad_token_id: int) -> list[Method]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    # generate() fills unset fields from the model's generation config: clearing its EOS there is
    # what makes generation run on through EOS, like specplan's ignore_eos.
    model.generation_config.eos_token_id = None

    def runner(lookup: int | None) -> Callable[[list[int], int], Result]:
        def run(ids: list[int], n: int) -> Result:
            cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=pad_token_id,
                                   eos_token_id=None, prompt_lookup_num_tokens=lookup)
            x = torch.tensor([ids])

            def go():
                with torch.inference_mode():
                    out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=cfg)
                return out[0, len(ids):].tolist(), {}
            return _timed(go)
        return run

    methods = [Method("hf", "transformers plain", runner(None))]
    methods += [Method("hf", f"transformers prompt-lookup {n}", runner(n), "prompt-lookup", n) for n in HF_LOOKUPS]
    return methods


def _draft_stats(full: list[int], calls: list[tuple[int, list[int]]]) -> dict:
    """Acceptance of recorded greedy drafts, from the output itself.

    ``calls``: (history length h, draft tokens) per draft call; the draft guesses the tokens at
    positions h, h+1, ... of ``full`` (prompt + output). Verification is greedy, so a draft's
    accepted length is its common prefix with what was actually generated there. Draft tokens
    beyond the end of the output were never verified and are not counted.
    """
    drafted = accepted = events = 0
    for h, draft in calls:
        d = draft[:max(0, len(full) - h)]
        if not d:
            continue
        events += 1
        drafted += len(d)
        accepted += _prefix_agreement(d, full[h:h + len(d)])
    if not events:
        return {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0, "acceptance_rate": 0.0,
                "mean_accepted_length": 1.0}
    return {"num_drafts": events, "num_draft_tokens": drafted, "num_accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4), "mean_accepted_length": round(1 + accepted / events, 4)}


def _llama_cpp_methods(gguf_path: Path) -> list[Method]:
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaDraftModel, LlamaPromptLookupDecoding

    class Recording(LlamaDraftModel):
        """Passes the prompt-lookup drafts through and records them, to compute acceptance."""

        def __init__(self, inner: Any):
            self.inner = inner
            self.calls: list[tuple[int, list[int]]] = []

        def __call__(self, input_ids, /, **kwargs):
            out = self.inner(input_ids, **kwargs)
            self.calls.append((len(input_ids), [int(t) for t in out]))
            return out

    def runner(llm: Any) -> Callable[[list[int], int], Result]:
        recorder = llm.draft_model

        def run(ids: list[int], n: int) -> Result:
            if recorder is not None:
                recorder.calls.clear()

            def go():
                llm.reset()  # no reuse of the previous call's KV: prompt processing counts every time
                toks = []
                # generate() yields tokens until told to stop; it does not stop at EOS itself.
                for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0,
                                        reset=True):
                    toks.append(int(tok))
                    if len(toks) >= n:
                        break
                return toks, {}
            res = _timed(go)
            if recorder is not None:
                res.spec = _draft_stats(list(ids) + res.token_ids, recorder.calls)
            return res
        return run

    def make(draft: Any) -> Any:
        # A draft model needs logits for every position. llama-cpp-python (0.3.36) turns that on by
        # itself but sizes its score buffer from the logits_all argument (n_batch rows, not n_ctx),
        # so once prompt + output pass n_batch (512) tokens generate() fails with a broadcast
        # error; passing logits_all=True sizes the buffer for the whole context.
        return Llama(model_path=str(gguf_path), n_threads=2, n_threads_batch=2, n_ctx=2048, verbose=False,
                     draft_model=draft, logits_all=draft is not None)

    methods = [Method("llama.cpp", "llama.cpp plain", runner(make(None)))]
    for n in LLAMA_CPP_LOOKUPS:
        draft = Recording(LlamaPromptLookupDecoding(num_pred_tokens=n))
        methods.append(Method("llama.cpp", f"llama.cpp prompt-lookup {n}", runner(make(draft)), "prompt-lookup", n))
    return methods


def _prefix_agreement(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def run_spec_bench(
    out_dir: Path = Path("reports"),
    prompts_per_workload: int = 1,
    max_new_tokens: int = 128,
    repeats: int = 3,
    ks: Sequence[int] = (0, 1, 2, 4, 8),
    proposers: Sequence[str] = ("ngram", "suffix", "layer-skip"),
    include_hf: bool = True,
    include_llama_cpp: bool = True,
    progress: bool = True,
    workloads: Sequence[str] = BENCH_WORKLOADS,
    seed: int = 0,
    strict: bool = True,
    command: str | None = None,
) -> pd.DataFrame:
    """Measure every method side by side and write the report; returns one row per method x prompt.

    ``command``: the command line to print in the report (default: this Python call). ``strict``:
    raise AssertionError (after writing the report) if a specplan speculative output differs
    from its plain greedy output.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from specplan.engine import load_model

    console = Console(stderr=True, quiet=not progress)
    started = time.time()
    load_before = load_average()
    notes: list[str] = []
    ks = tuple(dict.fromkeys(int(k) for k in ks))
    if any(k < 0 for k in ks):
        raise ValueError(f"every k must be >= 0, got {ks}")
    if not ks:
        raise ValueError("ks is empty: give at least one static k (0 = no drafts)")
    if repeats < 1 or prompts_per_workload < 1 or max_new_tokens < 1:
        raise ValueError("repeats, prompts_per_workload and max_new_tokens must be >= 1")

    console.log("loading the default model and the prompts")
    loaded = load_model(None)
    tok = loaded.tokenizer
    prompts: list[Prompt] = [p for w in workloads for p in load_workload(w, prompts_per_workload, seed)]
    prompt_ids = {p.id: p.render(tok) for p in prompts}

    console.log("building specplan engines")
    methods = _specplan_methods(loaded, ks, proposers)
    if include_hf:
        console.log("loading the transformers model")
        pad = tok.pad_token_id if tok.pad_token_id is not None else (tok.eos_token_id or 0)
        methods += _hf_methods(loaded.path, pad)
    if include_llama_cpp:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            notes.append("llama.cpp skipped: `llama-cpp-python` is not installed "
                         "(`pip install -e '.[bench]'`; it builds from source, about 9 minutes here).")
            console.log(notes[-1])
        else:
            console.log("preparing the F32 GGUF and loading llama.cpp")
            try:
                methods += _llama_cpp_methods(f32_gguf())
            except Exception as e:  # the optional peer: report it, measure the rest
                notes.append(f"llama.cpp skipped: it failed to load: {type(e).__name__}: {e}")
                console.log(notes[-1])

    # Warm-up: one short untimed call per method (first-call allocations, thread pools, caches).
    warm_ids = prompt_ids[prompts[0].id]
    failed: dict[str, str] = {}  # method -> the error that dropped it
    for m in methods:
        try:
            m.run(warm_ids, min(8, max_new_tokens))
        except Exception as e:
            if m.family == "specplan":
                raise
            failed[m.name] = f"warm-up: {type(e).__name__}: {e}"
    times: dict[tuple[str, str], list[float]] = {}
    outputs: dict[tuple[str, str], list[list[int]]] = {}
    specs: dict[tuple[str, str], dict] = {}
    total = len(prompts) * repeats * len(methods)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, disable=not progress, transient=False) as bar:
        task = bar.add_task("spec bench", total=total)
        for p in prompts:
            ids = prompt_ids[p.id]
            for r in range(repeats):
                for m in methods:
                    bar.update(task, description=f"{p.id} rep {r + 1}/{repeats}: {m.name}")
                    if m.name in failed:
                        bar.advance(task)
                        continue
                    try:
                        res = m.run(ids, max_new_tokens)
                    except Exception as e:  # a peer's failure should not lose the rest of a long run
                        if m.name == "specplan plain":
                            raise  # the reference for every lossless check
                        failed[m.name] = f"{p.id}: {type(e).__name__}: {e}"
                        console.log(f"[red]{m.name} failed, dropped from the run: {failed[m.name]}")
                        bar.advance(task)
                        continue
                    key = (p.id, m.name)
                    times.setdefault(key, []).append(res.seconds)
                    outputs.setdefault(key, []).append(res.token_ids)
                    if res.spec:
                        specs[key] = res.spec  # deterministic (greedy): every repeat proposes the same
                    bar.advance(task)

    rows = []
    mismatches = []
    for p in prompts:
        ref = outputs[(p.id, "specplan plain")][0]
        for m in methods:
            if m.name in failed:
                continue
            key = (p.id, m.name)
            outs = outputs[key]
            secs = times[key]
            med = statistics.median(secs)
            n_new = len(outs[0])
            identical = None
            if m.family == "specplan":
                identical = all(o == ref for o in outs)
                if not identical:
                    mismatches.append(f"{p.id} {m.name}: first difference at token "
                                      f"{min(_prefix_agreement(o, ref) for o in outs)}")
            spec = specs.get(key, {})
            rows.append({
                "workload": p.workload, "kind": KINDS[p.workload], "prompt_id": p.id, "prompt_tokens": len(prompt_ids[p.id]),
                "family": m.family, "method": m.name, "proposer": m.proposer, "k": m.k, "new_tokens": n_new,
                "seconds": med, "seconds_all": [round(s, 4) for s in secs],
                "tokens_per_s": n_new / med if med > 0 else float("nan"),
                "acceptance_rate": spec.get("acceptance_rate") if spec else None,
                "mean_accepted_length": spec.get("mean_accepted_length") if spec else None,
                "num_drafts": spec.get("num_drafts") if spec else None,
                "identical_to_plain": identical,
                "agree_prefix": _prefix_agreement(outs[0], ref),
            })
    df = pd.DataFrame(rows, columns=list(ROW_COLUMNS))
    notes += [f"{name} failed and was dropped from every workload: {err}" for name, err in failed.items()]
    if mismatches:
        notes.append("NOT LOSSLESS: specplan speculative output differs from plain greedy: " + "; ".join(mismatches))
    short = df[df["new_tokens"] != max_new_tokens]
    if len(short):
        notes.append("some methods emitted fewer than max_new_tokens tokens: "
                     + ", ".join(f"{r.prompt_id} {r.method} ({r.new_tokens})" for r in short.itertuples()))
    meta = {
        "command": command or _default_command(out_dir, prompts_per_workload, max_new_tokens, repeats, ks, proposers,
                                               include_hf, include_llama_cpp),
        "machine": machine_info(libraries=("transformers", "llama_cpp")),
        "settings": {"prompts_per_workload": prompts_per_workload, "max_new_tokens": max_new_tokens,
                     "repeats": repeats, "ks": list(ks), "proposers": list(proposers), "seed": seed,
                     "workloads": list(workloads), "batch_size": 1, "greedy": True, "ignore_eos": True},
        "load_average_before": load_before,
        "load_average_after": load_average(),
        "wall_seconds": round(time.time() - started, 1),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "notes": notes,
    }
    paths = render_spec_report(df, out_dir, meta)
    for v in target_verdicts(df):
        console.print(v["line"], highlight=False)
    console.log(f"wrote {', '.join(str(p) for p in paths)}")
    del methods
    gc.collect()
    if strict and mismatches:
        raise AssertionError("specplan speculation was not lossless: " + "; ".join(mismatches))
    return df


def _default_command(out_dir, prompts_per_workload, max_new_tokens, repeats, ks, proposers, include_hf,
                     include_llama_cpp) -> str:
    args = (f"out_dir=Path({str(out_dir)!r}), prompts_per_workload={prompts_per_workload}, "
            f"max_new_tokens={max_new_tokens}, repeats={repeats}, ks={tuple(ks)!r}, proposers={tuple(proposers)!r}, "
            f"include_hf={include_hf}, include_llama_cpp={include_llama_cpp}")
    code = f"from pathlib import Path; from specplan.bench.spec_bench import run_spec_bench; run_spec_bench({args})"
    return f'python -c "{code}"' if '"' not in code and "$" not in code else f"python -c {shlex.quote(code)}"


# --- the report -------------------------------------------------------------------------------


def summarize(df: pd.DataFrame) -> pd.DataFrame:
    """One row per workload x method: tokens/s over the workload's prompts (total tokens / total
    median seconds), mean acceptance, identical flag, and speedups vs specplan plain and each
    peer's plain run."""
    aggregated = []
    for (workload, method), g in df.groupby(["workload", "method"], sort=False):
        first = g.iloc[0]
        secs = float(g["seconds"].sum())
        acc = g["acceptance_rate"].dropna()
        mal = g["mean_accepted_length"].dropna()
        ident = g["identical_to_plain"].dropna()
        aggregated.append({
            "workload": workload, "kind": first["kind"], "family": first["family"], "method": method,
            "proposer": first["proposer"], "k": first["k"], "prompts": len(g),
            "tokens_per_s": float(g["new_tokens"].sum()) / secs if secs > 0 else float("nan"),
            "acceptance_rate": float(acc.mean()) if len(acc) else None,
            "mean_accepted_length": float(mal.mean()) if len(mal) else None,
            "identical_to_plain": bool(ident.all()) if len(ident) else None,
        })
    s = pd.DataFrame(aggregated)
    if s.empty:
        return s
    for col, ref in (("x_specplan_plain", "specplan plain"), ("x_transformers_plain", "transformers plain"),
                     ("x_llama_cpp_plain", "llama.cpp plain")):
        base = s[s["method"] == ref].set_index("workload")["tokens_per_s"]
        s[col] = [r.tokens_per_s / base[r.workload] if r.workload in base.index else None for r in s.itertuples()]
    return s


def target_verdicts(df: pd.DataFrame, workloads: Sequence[str] = TARGET_WORKLOADS) -> list[dict]:
    """The target per workload: specplan's best static k (any proposer, any k measured)
    against llama.cpp's best prompt-lookup tokens/s. ``passed`` is None when either is missing."""
    s = summarize(df)
    out = []
    for w in workloads:
        sw = s[s["workload"] == w] if not s.empty else s
        kind = KINDS.get(w, w)
        # k = 0 is one of the static choices, so plain decoding counts as specplan's k = 0.
        spec = sw[sw["family"] == "specplan"] if len(sw) else sw
        peer = sw[(sw["family"] == "llama.cpp") & (sw["proposer"] == "prompt-lookup")] if len(sw) else sw
        if len(spec) == 0 or len(peer) == 0:
            missing = ("this workload" if len(sw) == 0 else "specplan" if len(spec) == 0
                       else "llama.cpp prompt lookup")
            out.append({"workload": w, "kind": kind, "passed": None, "specplan_method": None, "specplan_tps": None,
                        "peer_method": None, "peer_tps": None, "ratio": None,
                        "line": f"target on {kind} ({w}): n/a ({missing} not measured)"})
            continue
        best = spec.loc[spec["tokens_per_s"].idxmax()]
        rival = peer.loc[peer["tokens_per_s"].idxmax()]
        ratio = best["tokens_per_s"] / rival["tokens_per_s"]
        passed = bool(best["tokens_per_s"] >= rival["tokens_per_s"])
        out.append({
            "workload": w, "kind": kind, "passed": passed, "specplan_method": best["method"],
            "specplan_tps": float(best["tokens_per_s"]), "peer_method": rival["method"],
            "peer_tps": float(rival["tokens_per_s"]), "ratio": float(ratio),
            "line": (f"target on {kind} ({w}): {'PASS' if passed else 'FAIL'} - best static k "
                     f"{best['method']} {best['tokens_per_s']:.1f} tok/s vs best "
                     f"{rival['method']} {rival['tokens_per_s']:.1f} tok/s ({ratio:.2f}x)"),
        })
    return out


def _fmt(x: Any, spec: str = ".2f", none: str = "n/a") -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return none
    return format(x, spec)


def _chart(s: pd.DataFrame, workload: str, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"specplan": "#1f77b4", "hf": "#ff7f0e", "llama.cpp": "#2ca02c"}
    sw = s[s["workload"] == workload]
    fig, ax = plt.subplots(figsize=(9, max(2.5, 0.32 * len(sw) + 1.2)))
    y = range(len(sw))
    ax.barh(list(y), sw["tokens_per_s"], color=[colors.get(f, "#7f7f7f") for f in sw["family"]])
    ax.set_yticks(list(y), list(sw["method"]), fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("tokens/s (batch 1, greedy; prompt processing included)")
    ax.set_title(title, fontsize=10)
    for i, v in zip(y, sw["tokens_per_s"]):
        ax.text(v, i, f" {v:.1f}", va="center", fontsize=7)
    base = sw[sw["method"] == "specplan plain"]["tokens_per_s"]
    if len(base):
        ax.axvline(float(base.iloc[0]), color="#1f77b4", linestyle=":", linewidth=1)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.set_xlim(0, 1.18 * max(float(sw["tokens_per_s"].max()), 1e-9))
    ax.legend(handles, ["specplan", "transformers", "llama.cpp"], fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def render_spec_report(df: pd.DataFrame, out_dir: Path = Path("reports"), meta: dict | None = None) -> list[Path]:
    """Write spec-bench.md (tables per workload), spec-bench-<workload>.png, spec-bench.json and
    spec-bench.parquet under ``out_dir``; returns the paths written."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = dict(meta or {})
    s = summarize(df)
    verdicts = target_verdicts(df)
    settings = meta.get("settings", {})
    machine = meta.get("machine", {})
    paths: list[Path] = []

    lines = ["# Speculative decoding benchmark: specplan vs transformers vs llama.cpp", ""]
    if meta.get("date"):
        lines.append(f"Measured {meta['date']}" + (f" in {meta['wall_seconds']:.0f} s." if meta.get("wall_seconds") else "."))
        lines.append("")
    lines += ["Command:", "", "```", meta.get("command", "(not recorded)"), "```", ""]
    if machine:
        lines.append(describe(machine))
        lines.append("")
    if meta.get("load_average_before") is not None:
        lines.append(f"Load average (1/5/15 min) before: {meta['load_average_before']}, after: "
                     f"{meta.get('load_average_after')}. Anything above ~0.5 on these 2 cores means other "
                     "processes shared the CPU and the absolute numbers are noisy; ratios measured side by "
                     "side hold up better.")
        lines.append("")
    lines += [
        "Method: batch 1, greedy, "
        f"{settings.get('max_new_tokens', '?')} new tokens with EOS ignored (every method emits the same count), "
        f"{settings.get('prompts_per_workload', '?')} prompt(s) per workload, median of "
        f"{settings.get('repeats', '?')} repeat(s), repeats interleaved across methods. Time is the wall time "
        "of one generate call, prompt processing included, model loading excluded; a workload's tokens/s is "
        "its total new tokens over the sum of its prompts' medians. All methods get the same prompt token ids "
        "(chat prompts through the model's chat template). specplan runs one engine per proposer with the "
        "static k forced per request; `spec-on k=0` is speculation enabled with no drafts. The suffix "
        "proposer's cross-request cache is reset before every request. transformers: fp32 weights of the "
        "same model, `generate` with `prompt_lookup_num_tokens`. llama.cpp: `llama-cpp-python` on an F32 GGUF "
        "dequantized from the Q4_1 file, 2 threads, with `LlamaPromptLookupDecoding(num_pred_tokens=N)`. "
        "Acceptance and mean accepted length (bonus token included) come from specplan's metrics; for "
        "llama.cpp they are computed from its recorded drafts against the greedy output it produced "
        "(a draft token counts as accepted when it equals the token generated there); transformers does "
        "not expose its drafts (n/a). `identical` checks specplan's speculative output against its plain "
        "greedy output token for token; `agree` is how many leading tokens match specplan plain "
        "(peers differ in floating-point summation order, so they may diverge after a near-tie).",
        "",
        "## Target (issue 3): specplan's best static k >= llama.cpp's best prompt lookup",
        "",
    ]
    lines += [f"- {v['line']}" for v in verdicts]
    lines.append("")
    notes = meta.get("notes") or []
    if notes:
        lines += ["## Notes", ""] + [f"- {n}" for n in notes] + [""]

    for w in dict.fromkeys(s["workload"]) if not s.empty else []:
        sw = s[s["workload"] == w]
        dw = df[df["workload"] == w].drop_duplicates("prompt_id")
        ids = ", ".join(f"{r.prompt_id} ({r.prompt_tokens} prompt tokens)" for r in dw.itertuples())
        kind = KINDS.get(w, w)
        lines += [f"## {kind} ({w}: {ids})", ""]
        lines.append("| method | tok/s | x specplan plain | x transformers plain | x llama.cpp plain "
                     "| acceptance | mean accepted len | identical | agree |")
        lines.append("|---|---:|---:|---:|---:|---:|---:|:-:|---:|")
        agree = df[df["workload"] == w].groupby("method")["agree_prefix"].min()
        toks = df[df["workload"] == w].groupby("method")["new_tokens"].min()
        for r in sw.itertuples():
            ident = "" if r.identical_to_plain is None else ("yes" if r.identical_to_plain else "**NO**")
            lines.append(
                f"| {r.method} | {r.tokens_per_s:.1f} | {_fmt(r.x_specplan_plain)} | {_fmt(r.x_transformers_plain)} "
                f"| {_fmt(r.x_llama_cpp_plain)} | {_fmt(r.acceptance_rate)} | {_fmt(r.mean_accepted_length)} "
                f"| {ident} | {agree.get(r.method, 0)}/{toks.get(r.method, 0)} |")
        png = out_dir / f"spec-bench-{w}.png"
        _chart(s, w, png, f"{kind} ({w}), batch 1, greedy: tokens/s by method")
        paths.append(png)
        lines += ["", f"![{w}]({png.name})", ""]

    md = out_dir / "spec-bench.md"
    md.write_text("\n".join(lines) + "\n")
    paths.insert(0, md)
    records = json.loads(df.to_json(orient="records"))
    js = out_dir / "spec-bench.json"
    js.write_text(json.dumps({"meta": meta, "verdicts": verdicts, "summary": json.loads(s.to_json(orient="records")),
                              "rows": records}, indent=1, default=str))
    paths.append(js)
    try:
        pq = out_dir / "spec-bench.parquet"
        df.to_parquet(pq, index=False)
        paths.append(pq)
    except (ImportError, ValueError) as e:  # pyarrow missing or a column it cannot store
        print(f"spec-bench.parquet not written: {e}", file=sys.stderr)
    return paths
