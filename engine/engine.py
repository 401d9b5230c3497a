"""LLMEngine: requests in, tokens out, one step at a time.

One step: the scheduler picks sequences and query tokens, the model runner runs one forward pass
over all of them, the sampler picks next tokens, and each sequence is checked for its stop
conditions. Used by the offline ``LLM`` API and by the server's engine loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .loader import LoadedModel, load_model
from .model import Model
from .model_runner import ModelRunner, ScheduledSeq
from .sampling import SamplingParams, sample
from .scheduler import Scheduler
from .sequence import Sequence, SequenceStatus


class RequestError(ValueError):
    """A request the engine cannot serve (bad prompt or parameters); the engine stays usable."""


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated tokens
    text: str
    finished: bool
    finish_reason: str | None
    num_preemptions: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class StepStats:
    num_seqs: int
    num_tokens: int
    num_decode_seqs: int
    seconds: float


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None):
        self.config = config
        loaded = loaded or load_model(config.model, dtype=config.dtype)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model = Model(loaded.config, loaded.weights, config.device, config.dtype)
        self.runner = ModelRunner(self.model, config.cache)
        self.block_manager = BlockManager(self.runner.num_blocks, config.cache.block_size)
        self.max_model_len = min(config.scheduler.max_model_len, loaded.config.max_position_embeddings)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self._seq_ids = itertools.count()
        self._by_request: dict[str, list[Sequence]] = {}
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.last_step: StepStats | None = None

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this engine has no tokenizer; pass token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> None:
        """Queue a request (``params.n`` sequences). Raises RequestError for what cannot be served."""
        if request_id in self._by_request:
            raise RequestError(f"request id {request_id!r} is already in use")
        ids = self.tokenize(prompt)
        if not ids:
            raise RequestError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(ids) + params.max_tokens
        if len(ids) >= self.max_model_len:
            raise RequestError(
                f"the prompt has {len(ids)} tokens; this model's context is {self.max_model_len} "
                f"(prompt plus max_tokens must fit)")
        if total > self.max_model_len:
            raise RequestError(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length {self.max_model_len}; lower max_tokens")
        if total > self.block_manager.capacity_tokens:
            raise RequestError(
                f"prompt plus max_tokens ({total} tokens) exceeds the whole KV cache "
                f"({self.block_manager.capacity_tokens} tokens); raise the KV cache budget")
        seqs = []
        for i in range(params.n):
            gen = None
            if params.seed is not None:
                gen = torch.Generator().manual_seed(params.seed + i)
            seqs.append(Sequence(seq_id=next(self._seq_ids), request_id=request_id, prompt_token_ids=ids,
                                 params=params, generator=gen))
        self._by_request[request_id] = seqs
        for seq in seqs:
            self.scheduler.add(seq)

    def abort_request(self, request_id: str) -> None:
        """Cancel a request: its sequences stop and their KV blocks return to the pool."""
        for seq in self._by_request.pop(request_id, []):
            if not seq.is_finished:
                self.scheduler.finish(seq, "abort")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- one step ---------------------------------------------------------------------------
    def step(self) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that got new tokens this step."""
        t0 = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            return []
        work = []
        for seq, n in out.scheduled:
            start = seq.num_computed_tokens
            done_prefill = start + n == seq.num_tokens
            work.append(ScheduledSeq(seq, seq.token_ids[start:start + n], start, 1 if done_prefill else 0))
        batch = self.runner.build_batch(work, self.block_manager)
        logits = self.runner.execute(batch)
        sampling = [w for w in work if w.num_logits]
        tokens = sample(logits, [w.seq.params for w in sampling], [w.seq.generator for w in sampling],
                        self.default_generator).tolist() if sampling else []
        for w in work:
            w.seq.num_computed_tokens += len(w.token_ids)
        now = time.perf_counter()
        for w, token in zip(sampling, tokens):
            self._append_tokens(w.seq, [token], now)
        self.last_step = StepStats(
            num_seqs=len(work), num_tokens=batch.num_tokens,
            num_decode_seqs=sum(1 for w in work if len(w.token_ids) == 1), seconds=now - t0)
        return [w.seq for w in sampling]

    def _append_tokens(self, seq: Sequence, new_tokens: list[int], now: float) -> None:
        """Append accepted tokens one at a time, stopping at the first stop condition."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        for token in new_tokens:
            seq.token_ids.append(token)
            reason = None
            if not p.ignore_eos and token in self.eos_token_ids:
                reason, seq.stop_reason = "stop", None
            elif token in p.stop_token_ids:
                reason, seq.stop_reason = "stop", token
            if p.stop:
                seq.text = self.detokenize(seq)
                hit = _find_stop(seq.text, p.stop)
                if hit is not None:
                    seq.text = seq.text[:hit[0]]
                    reason, seq.stop_reason = "stop", hit[1]
            if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is not None:
                if not p.stop:
                    seq.text = self.detokenize(seq)
                seq.finish_time = now
                self.scheduler.finish(seq, reason)
                return

    def detokenize(self, seq: Sequence) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=seq.params.skip_special_tokens)

    # ---- outputs ----------------------------------------------------------------------------
    def outputs(self, request_id: str) -> list[RequestOutput]:
        return [self._output(seq) for seq in self._by_request.get(request_id, [])]

    def pop_finished(self, request_id: str) -> list[RequestOutput] | None:
        """The request's outputs if all its sequences finished (and forget it), else None."""
        seqs = self._by_request.get(request_id)
        if seqs is None or not all(s.is_finished for s in seqs):
            return None
        del self._by_request[request_id]
        return [self._output(s) for s in seqs]

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.text if seq.is_finished else self.detokenize(seq)
        metrics = {"arrival_time": seq.arrival_time, "first_token_time": seq.first_token_time,
                   "finish_time": seq.finish_time}
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, text,
                             seq.is_finished, seq.finish_reason, seq.num_preemptions, metrics)


def _find_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    hits = [(text.find(s), s) for s in stops if s in text]
    return min(hits) if hits else None
