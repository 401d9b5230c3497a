"""LLMEngine: requests in, tokens out, one step at a time.

One step: the scheduler picks sequences and query tokens, the model runner runs one forward pass
over all of them, the sampler picks next tokens, and each sequence is checked for its stop
conditions. Used by the offline ``LLM`` API and by the server's engine loop.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field, replace

import torch

from .block_manager import BlockManager
from .config import EngineConfig
from .decider import FixedDecider, RequestRecord, SpecDecider, StepRecord
from .model.loader import LoadedModel, load_model
from .metrics import SpecStats
from .model.transformer import Model
from .model_runner import ModelRunner, ScheduledSeq, allocate_kv_cache, kv_bytes_per_block
from .proposers.base import Proposer
from .proposers.draft_model import DraftModelProposer
from .proposers.factory import make_draft_model, make_proposer
from .sampling import SamplingParams
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_decode.speculator import Speculator
from .spec_decode.verifier import verify


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


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None,
                 decider: SpecDecider | None = None, draft_loaded: LoadedModel | None = None):
        self.config = config
        loaded = loaded or load_model(config.model, dtype=config.dtype)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model = Model(loaded.config, loaded.weights, config.device, config.dtype)
        block_size = config.cache.block_size
        spec = config.spec
        draft = make_draft_model(spec, self.model, config, draft_loaded) if spec is not None else None
        per_block = kv_bytes_per_block(loaded.config, block_size, config.dtype)
        if draft is not None and not draft.shares_target_kv:
            per_block += kv_bytes_per_block(draft.model.config, block_size, config.dtype)
        num_blocks = config.cache.kv_cache_bytes // per_block
        self.block_manager = BlockManager(num_blocks, block_size)
        kv = allocate_kv_cache(loaded.config, num_blocks, block_size, config.dtype, self.model.device)
        self.runner = ModelRunner(self.model, kv, block_size)
        self.max_model_len = min(config.scheduler.max_model_len, loaded.config.max_position_embeddings)
        self.scheduler = Scheduler(config.scheduler, self.block_manager)
        self.default_generator = torch.Generator().manual_seed(config.seed)
        self.speculator: Speculator | None = None
        if spec is not None:
            proposer = make_proposer(spec, draft, self.runner, self.block_manager, self.default_generator)
            self.speculator = Speculator(proposer, decider or FixedDecider(spec.k), spec.max_k, self.block_manager)
        elif decider is not None:
            raise ValueError("a decider needs speculation enabled (EngineConfig.spec)")
        self._seq_ids = itertools.count()
        self._by_request: dict[str, list[Sequence]] = {}
        self.eos_token_ids = set(loaded.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(self.tokenizer.eos_token_id)
        self.last_step: StepRecord | None = None
        self.stats = SpecStats()

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
                self._finish(seq, "abort")

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # ---- the door for harnesses (evaluation, profiling): swap parts between runs ------------
    def set_decider(self, decider: SpecDecider) -> None:
        """Who picks k per request from the next step on (needs speculation enabled)."""
        self._require_speculation("a decider")
        self.speculator.decider = decider

    def set_proposer(self, proposer: Proposer | None = None) -> None:
        """Drafts come from ``proposer`` from the next step on; None: a fresh proposer of the
        configured kind (a suffix cache or a draft's KV state filled by one run never helps the next)."""
        self._require_speculation("a proposer")
        if proposer is None:
            spec = self.config.spec
            old = self.speculator.proposer
            draft = old.draft if isinstance(old, DraftModelProposer) else None
            if draft is None:
                draft = make_draft_model(spec, self.model, self.config)
            proposer = make_proposer(spec, draft, self.runner, self.block_manager, self.default_generator)
        self.speculator.proposer = proposer

    def set_max_num_seqs(self, max_num_seqs: int) -> None:
        """How many sequences may run at once (the batch size of closed-loop runs)."""
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
        self.scheduler.config = replace(self.scheduler.config, max_num_seqs=max_num_seqs)

    def reset_stats(self) -> SpecStats:
        """Start counting speculation statistics afresh; returns the counts so far."""
        old, self.stats = self.stats, SpecStats()
        return old

    def _require_speculation(self, what: str) -> None:
        if self.speculator is None:
            raise ValueError(f"{what} needs an engine built with speculation enabled (EngineConfig.spec)")

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
            samples = start + n == seq.num_tokens  # the chunk ends the known tokens: sample after it
            work.append(ScheduledSeq(seq, seq.token_ids[start:start + n], start, 1 if samples else 0))
        ready = [i for i, w in enumerate(work) if w.num_logits and len(w.token_ids) == 1]  # decode steps
        proposal = None
        if self.speculator is not None and ready:
            others = [w for i, w in enumerate(work) if i not in set(ready)]
            extra = dict(num_prefill_tokens=sum(len(w.token_ids) for w in others), num_prefill_seqs=len(others),
                         context_tokens=sum(w.start_position + len(w.token_ids) for w in work))
            budget = self.config.scheduler.max_num_batched_tokens - out.num_tokens
            proposal = self.speculator.plan([work[i] for i in ready], extra, budget, self.max_model_len)
            for i, item in zip(ready, Speculator.draft_items([work[i] for i in ready], proposal)):
                work[i] = item
        t1 = time.perf_counter()
        batch = self.runner.build_batch(work, self.block_manager)
        logits = self.runner.execute(batch)
        t2 = time.perf_counter()
        items = [w for w in work if w.num_logits]
        verdicts = verify(logits, items, self.default_generator)
        t3 = time.perf_counter()
        emitted: dict[int, int] = {}
        for w in work:
            if not w.num_logits:  # a prefill chunk that does not reach the end of the prompt
                w.seq.num_computed_tokens += len(w.token_ids)
        for w, v in zip(items, verdicts):
            seq = w.seq
            if w.tree is not None and v.path:
                # Keep the accepted branch's K/V: node t's slot (c + t) moves to position c + depth.
                self.runner.copy_slots([self.block_manager.slot(seq, w.start_position + t) for t in v.path],
                                       [self.block_manager.slot(seq, w.start_position + 1 + j)
                                        for j in range(len(v.path))])
            # K/V is valid for the fed tokens up to the last accepted draft.
            seq.num_computed_tokens = w.start_position + len(w.token_ids) - w.num_drafts + v.num_accepted
            emitted[seq.seq_id] = self._append_tokens(seq, v.tokens, t3)
            if not seq.is_finished:
                self.block_manager.trim(seq, seq.num_tokens)  # roll back rejected lookahead slots
        total = time.perf_counter() - t0
        self._record(work, ready, proposal, verdicts, items, emitted, batch.num_tokens,
                     (t1 - t0, t2 - t1, t3 - t2, total))
        return [w.seq for w in items]

    def _record(self, work, ready, proposal, verdicts, items, emitted, num_tokens, times) -> None:
        by_seq = {w.seq.seq_id: v for w, v in zip(items, verdicts)}
        reqs = []
        for j, i in enumerate(ready):
            w = work[i]
            v = by_seq[w.seq.seq_id]
            drafts = proposal.drafts if proposal is not None else None
            natural = drafts.natural_k[j] if drafts is not None and drafts.natural_k is not None else None
            matched = drafts.match_length[j] if drafts is not None and drafts.match_length is not None else None
            reqs.append(RequestRecord(
                seq_id=w.seq.seq_id, request_id=w.seq.request_id,
                k=proposal.k[j] if proposal is not None else 0, num_proposed=w.num_drafts,
                num_accepted=v.num_accepted, num_emitted=emitted[w.seq.seq_id], natural_k=natural,
                match_length=matched))
        propose_s, forward_s, verify_s, total_s = times
        record = StepRecord(
            requests=tuple(reqs), num_seqs=len(work), num_tokens=num_tokens,
            num_prefill_tokens=sum(len(w.token_ids) for i, w in enumerate(work) if i not in set(ready)),
            context_tokens=sum(w.start_position + len(w.token_ids) for w in work),
            propose_s=propose_s, forward_s=forward_s, verify_s=verify_s, total_s=total_s)
        self.last_step = record
        self.stats.add(record)
        for r, i in zip(reqs, ready):
            work[i].seq.spec.add(r)
        if self.speculator is not None:
            t0 = time.perf_counter()
            self.speculator.decider.observe(record)
            self.stats.decider_s += time.perf_counter() - t0 + (proposal.decide_s if proposal is not None else 0.0)

    def _append_tokens(self, seq: Sequence, new_tokens: list[int], now: float) -> int:
        """Append accepted tokens one at a time, stopping at the first stop condition; returns how many."""
        if seq.first_token_time is None:
            seq.first_token_time = now
        p = seq.params
        check_stop_strings = bool(p.stop) and self.tokenizer is not None
        for n, token in enumerate(new_tokens, start=1):
            seq.token_ids.append(token)
            reason = None
            if not p.ignore_eos and token in self.eos_token_ids:
                reason, seq.stop_reason = "stop", None
            elif token in p.stop_token_ids:
                reason, seq.stop_reason = "stop", token
            if check_stop_strings:
                seen = len(seq.detok.text)
                if seq.detok.update(self.tokenizer, seq.output_token_ids, p.skip_special_tokens):
                    hit = _find_stop(seq.detok.text, p.stop, seen)
                    if hit is not None:
                        reason, seq.stop_reason = "stop", hit[1]
            if reason is None and (seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len):
                reason = "length"
            if reason is not None:
                seq.text = self.detokenize(seq)  # once, in full: the incremental text only finds stops
                if isinstance(seq.stop_reason, str):  # cut at the stop string (its first occurrence)
                    text = seq.text if seq.stop_reason in seq.text else seq.detok.text
                    seq.text = text[:text.find(seq.stop_reason)]
                seq.finish_time = now
                self._finish(seq, reason)
                return n
        return len(new_tokens)

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.scheduler.finish(seq, reason)
        if self.speculator is not None:
            self.speculator.proposer.on_finished(seq)

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
                   "finish_time": seq.finish_time, "spec": seq.spec.as_dict()}
        return RequestOutput(seq.request_id, seq.prompt_token_ids, seq.output_token_ids, text,
                             seq.is_finished, seq.finish_reason, seq.num_preemptions, metrics)


def _find_stop(text: str, stops: tuple[str, ...], seen: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` (position, string). ``text[:seen]`` was searched before,
    so only a match ending after it can be new: each stop is looked for from seen - len(stop) + 1."""
    hits = []
    for s in stops:
        at = text.find(s, max(0, seen - len(s) + 1))
        if at >= 0:
            hits.append((at, s))
    return min(hits) if hits else None
