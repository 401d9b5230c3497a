"""Timing real engine steps of a given shape: B sequences, T query tokens each, a given context.

The profiler's grid and the engine benchmark both measure the same thing the planner predicts:
the wall time of ``LLMEngine.step()`` — scheduling, proposing, building the batch, the forward
pass, verification and bookkeeping — for B decoding sequences that each verify T = 1 + k tokens.
A synthetic proposer supplies exactly k draft tokens per sequence (random ones: almost all get
rejected, so the context stays put), and a fixed decider forces k.
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import torch

from specplan.engine import CacheConfig, DraftTokens, EngineConfig, LLMEngine, LoadedModel, SamplingParams, SchedulerConfig, SpecConfig, StepRecord, StepView


class RandomDraftProposer:
    """k random draft tokens for every sequence: a proposer whose cost is nil and whose drafts
    are (almost) always rejected, so timing sees the verify width without the context growing."""

    name = "synthetic"
    proposes_prefixes = False

    def __init__(self, vocab_size: int, seed: int = 0):
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    def propose(self, seqs, k: list[int]) -> DraftTokens:
        return DraftTokens(token_ids=[[self.rng.randrange(self.vocab_size) for _ in range(ki)] for ki in k])

    def on_finished(self, seq) -> None:
        pass


class ForcedK:
    """A decider that asks for the same k for every request (or for the first ``drafting`` of each
    step and 0 for the rest, to time steps of mixed widths) and keeps the step records."""

    def __init__(self, k: int = 0, drafting: int | None = None):
        self.k = k
        self.drafting = drafting  # None: every request
        self.records: list[StepRecord] = []

    def decide(self, view: StepView) -> list[int]:
        n = len(view.requests)
        drafting = n if self.drafting is None else min(self.drafting, n)
        return [self.k] * drafting + [0] * (n - drafting)

    def observe(self, record: StepRecord) -> None:
        self.records.append(record)


@dataclass(frozen=True)
class StepTiming:
    batch_size: int
    tokens_per_seq: int  # T = 1 + k
    context: int  # mean context length during the timed steps
    seconds: list[float]  # forward + verification, one per timed step (what the latency model predicts)
    total_seconds: list[float]  # the whole engine step (scheduling, proposing, bookkeeping too)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)


class StepTimer:
    """Holds B decoding sequences in an engine and times steps of chosen widths over them."""

    def __init__(self, engine: LLMEngine, seed: int = 0):
        if engine.config.spec is None:
            raise ValueError("the step timer needs an engine built with speculation enabled")
        self.engine = engine
        self.decider = ForcedK()
        engine.set_decider(self.decider)
        engine.set_proposer(RandomDraftProposer(engine.model_config.vocab_size, seed))
        self.rng = random.Random(seed)
        self._ids = 0

    def fill(self, batch_size: int, context: int) -> None:
        """Admit B requests with ``context`` random prompt tokens and run until all decode."""
        self.clear()
        vocab = self.engine.model_config.vocab_size
        params = SamplingParams(temperature=0.0, max_tokens=self.engine.max_model_len - context, ignore_eos=True)
        for _ in range(batch_size):
            self._ids += 1
            prompt = [self.rng.randrange(vocab) for _ in range(context)]
            self.engine.add_request(f"timer-{self._ids}", prompt, params)
        self.decider.k, self.decider.drafting = 0, None
        sched = self.engine.scheduler
        while sched.waiting or any(s.num_uncomputed_tokens > 1 for s in sched.running):
            self.engine.step()

    def time_steps(self, tokens_per_seq: int, repeats: int, warmup: int = 1, drafting: int | None = None) -> StepTiming:
        """Steps where every request verifies ``tokens_per_seq`` tokens, or (``drafting``) only the
        first ``drafting`` requests and the rest 1 (a batch where a few requests speculate)."""
        self.decider.k, self.decider.drafting = tokens_per_seq - 1, drafting
        seconds, totals, contexts = [], [], []
        for i in range(warmup + repeats):
            t0 = time.perf_counter()
            self.engine.step()
            elapsed = time.perf_counter() - t0
            if i >= warmup:
                rec = self.decider.records[-1]
                n = len(rec.requests) if drafting is None else min(drafting, len(rec.requests))
                if sum(r.num_proposed for r in rec.requests) != n * (tokens_per_seq - 1):
                    raise RuntimeError("the engine shrank k (KV cache or token budget too small for this shape)")
                seconds.append(rec.forward_s + rec.verify_s)
                totals.append(elapsed)
                contexts.append(rec.context_tokens / max(rec.num_seqs, 1))
        running = len(self.engine.scheduler.running)
        return StepTiming(running, tokens_per_seq, round(statistics.mean(contexts)), seconds, totals)

    def clear(self) -> None:
        for seq in list(self.engine.scheduler.running) + list(self.engine.scheduler.waiting):
            self.engine.abort_request(seq.request_id)


def timing_engine(loaded: LoadedModel, max_batch: int, max_tokens_per_seq: int, context: int,
                  kv_dtype: torch.dtype | None = None) -> LLMEngine:
    """An engine sized for the grid: room for every sequence's context and verify width.
    ``kv_dtype``: the KV cache's (None: the engine's auto choice, as serving makes it)."""
    per_seq = context + 64 * max_tokens_per_seq
    kv_bytes = 2 * loaded.config.num_layers * loaded.config.num_kv_heads * loaded.config.head_dim * 4
    config = EngineConfig(
        cache=CacheConfig(block_size=16, kv_cache_bytes=int(max_batch * per_seq * kv_bytes * 1.2) + 2**24,
                          kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch * max_tokens_per_seq),
                                  max_model_len=per_seq + 64),
        spec=SpecConfig(proposer="ngram", k=0, max_k=max_tokens_per_seq - 1),
    )
    return LLMEngine(config, loaded)
