"""LLMEngine: requests in, tokens out, one step at a time.

One step (``LLMEngine.step``) reads as its parts: schedule (the scheduler picks sequences and
query tokens), plan (the decider picks k per decoding request, the proposer drafts), forward (the
model runner runs one pass over everything), verify (the target's logits against the drafts:
spec_decode/), commit (keep the accepted K/V and tokens, check stop conditions, return rejected
lookahead slots) and record (the StepRecord the decider learns from). Used by the offline ``LLM``
API and by the server's engine loop.
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
from .model_runner import ModelRunner, ScheduledSeq, allocate_kv_cache, kv_bytes_per_block, kv_cache_dtype
from .proposers.base import Proposer
from .proposers.draft_model import DraftModelProposer
from .proposers.chain import ChainProposer
from .proposers.eagle import EagleProposer
from .proposers.factory import draft_kv_config, make_draft_model, make_proposer
from .sampling import SamplingParams, TokenLogprob, token_logprobs
from .scheduler import Scheduler
from .sequence import Sequence
from .spec_decode.speculator import Proposal, Speculator
from .spec_decode.verifier import Verdict, verify


class RequestError(ValueError):
    """A request the engine cannot serve (bad prompt or parameters); the engine stays usable."""


@dataclass(frozen=True)
class _StepParts:
    """What one step did, for its record (``LLMEngine._record``)."""

    work: list[ScheduledSeq]  # every scheduled sequence's share, in batch order; decodes with their drafts
    decodes: list[int]  # indices into work of the decode items (the decider's requests, in order)
    proposal: Proposal | None  # None: no speculation this step
    items: list[ScheduledSeq]  # the work items that sampled, aligned with verdicts
    verdicts: list[Verdict]
    emitted: dict[int, int]  # seq_id -> tokens appended this step
    num_tokens: int  # query tokens in the forward pass
    propose_s: float  # scheduling and planning (decide, reserve lookahead slots, propose)
    forward_s: float  # building the batch and the forward pass
    verify_s: float
    total_s: float  # the whole step, commit included, before recording


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
    # When the request asked (SamplingParams.logprobs / prompt_logprobs): per generated token, and
    # per prompt token (the first is None); the target's raw log-softmax, see SamplingParams.
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None


class LLMEngine:
    def __init__(self, config: EngineConfig = EngineConfig(), loaded: LoadedModel | None = None,
                 decider: SpecDecider | None = None, draft_loaded: LoadedModel | None = None):
        self.config = config
        loaded = loaded or load_model(config.model, dtype=config.dtype, quantize=config.quantize)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.model = Model(loaded.config, loaded.weights, config.device, config.dtype)
        block_size = config.cache.block_size
        spec = config.spec
        draft = make_draft_model(spec, self.model, config, draft_loaded) if spec is not None else None
        self.kv_dtype = kv_cache_dtype(loaded.config, config.dtype, config.device, config.cache.kv_dtype)
        per_block = kv_bytes_per_block(loaded.config, block_size, self.kv_dtype)
        if (draft_kv := draft_kv_config(draft)) is not None:  # a draft's own cache stays in the engine's dtype
            per_block += kv_bytes_per_block(draft_kv, block_size, config.dtype)
        num_blocks = config.cache.kv_cache_bytes // per_block
        self.block_manager = BlockManager(num_blocks, block_size)
        kv = allocate_kv_cache(loaded.config, num_blocks, block_size, self.kv_dtype, self.model.device)
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
        if params.top_k >= vocab:  # keeping the whole vocabulary is no limit (and fits any tensor dtype)
            params = replace(params, top_k=0)
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
            draft = old.draft if isinstance(old, DraftModelProposer | EagleProposer | ChainProposer) else None
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

    # ---- one step: schedule -> plan -> forward -> verify -> commit -> record ---------------
    def step(self) -> list[Sequence]:
        """Run one forward pass. Returns the sequences that got new tokens this step."""
        t0 = time.perf_counter()
        work = self._schedule()
        if not work:
            return []
        decodes = [i for i, w in enumerate(work) if w.num_logits and len(w.token_ids) == 1]
        proposal = self._plan(work, decodes)
        t1 = time.perf_counter()
        logits, num_tokens = self._forward(work)
        t2 = time.perf_counter()
        items = [w for w in work if w.num_logits]  # the items that sample: logits' row groups, in order
        num_sampling_rows = sum(w.num_logits for w in items)
        verdicts = self._verify(logits[:num_sampling_rows], items)
        if num_sampling_rows < logits.shape[0]:  # rows after the sampling ones score prompts
            self._score_prompts(work, logits[num_sampling_rows:])
        t3 = time.perf_counter()
        emitted = self._commit(work, items, verdicts, now=t3)
        total_s = time.perf_counter() - t0
        self._record(_StepParts(work, decodes, proposal, items, verdicts, emitted, num_tokens,
                                propose_s=t1 - t0, forward_s=t2 - t1, verify_s=t3 - t2, total_s=total_s))
        # Prompt-only requests (max_tokens=0) that finished this step changed too.
        return [w.seq for w in items] + [w.seq for w in work if not w.num_logits and w.seq.is_finished]

    def _schedule(self) -> list[ScheduledSeq]:
        """The scheduler's picks as work items, in batch order. A chunk that reaches the end of its
        sequence's known tokens wants one logit (the next token is sampled after it); a prefill
        chunk short of the end wants none, and so does a prompt-only request (max_tokens=0). A
        request with prompt logprobs also wants the rows of the chunk's positions that predict a
        prompt token not scored yet (a recompute after preemption scores nothing twice)."""
        work = []
        for seq, n in self.scheduler.schedule().scheduled:
            start = seq.num_computed_tokens
            samples = start + n == seq.num_tokens and seq.params.max_tokens > 0
            scored = range(0)
            if seq.prompt_logprobs is not None:  # position p's logits predict token p + 1
                scored = range(max(start, len(seq.prompt_logprobs) - 1), min(start + n, seq.num_prompt_tokens - 1))
            work.append(ScheduledSeq(seq, seq.token_ids[start:start + n], start, 1 if samples else 0,
                                     scored_positions=scored))
        return work

    def _plan(self, work: list[ScheduledSeq], decodes: list[int]) -> Proposal | None:
        """Speculate for the decode items ``work[i], i in decodes``: the decider picks k, lookahead
        slots are reserved and the drafts proposed; each of those items in ``work`` is replaced by
        one that feeds its drafts too (or its draft tree). None: no speculation this step."""
        if self.speculator is None or not decodes:
            return None
        is_decode = set(decodes)
        prefills = [w for i, w in enumerate(work) if i not in is_decode]
        num_prefill_tokens = sum(len(w.token_ids) for w in prefills)
        extra = dict(num_prefill_tokens=num_prefill_tokens, num_prefill_seqs=len(prefills),
                     context_tokens=sum(w.start_position + len(w.token_ids) for w in work))
        # The drafts share what the scheduled tokens left of the step's budget (a decode feeds one).
        budget = self.config.scheduler.max_num_batched_tokens - num_prefill_tokens - len(decodes)
        ready = [work[i] for i in decodes]
        proposal = self.speculator.plan(ready, extra, budget, self.max_model_len)
        for i, item in zip(decodes, Speculator.draft_items(ready, proposal)):
            work[i] = item
        return proposal

    def _forward(self, work: list[ScheduledSeq]) -> tuple[torch.Tensor, int]:
        """One forward pass over all the work: logits [sum(num_logits), V] fp32, and the number of
        query tokens it fed."""
        batch = self.runner.build_batch(work, self.block_manager)
        reader = self.speculator.feature_reader if self.speculator is not None else None
        if reader is not None:  # an EAGLE-3 head drafts from this pass's features
            logits, captured = self.runner.execute_capturing(batch, reader.target_layers)
            reader.observe_target(work, captured)
            return logits, batch.num_tokens
        return self.runner.execute(batch), batch.num_tokens

    def _verify(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[Verdict]:
        """Per sampling item, the tokens it emits: its accepted drafts, then one bonus or recovered
        token (no drafts: just the next token); spec_decode/verifier.py."""
        return verify(logits, items, self.default_generator)

    def _score_prompts(self, work: list[ScheduledSeq], logits: torch.Tensor) -> None:
        """Prompt logprobs from logits [sum(len(scored_positions)), V] (the items' scored rows, in
        order): the row of position p scores prompt token p + 1."""
        scoring = [w for w in work if w.scored_positions]
        tokens = [w.seq.token_ids[p + 1] for w in scoring for p in w.scored_positions]
        num_top = [w.seq.params.prompt_logprobs for w in scoring for _ in w.scored_positions]
        scored = iter(token_logprobs(logits, tokens, num_top))
        for w in scoring:
            w.seq.prompt_logprobs.extend(next(scored) for _ in w.scored_positions)

    def _commit(self, work: list[ScheduledSeq], items: list[ScheduledSeq], verdicts: list[Verdict],
                now: float) -> dict[int, int]:
        """Make the verdicts the sequences' state: the K/V they keep, the tokens they gain, the
        lookahead slots they give back. Returns seq_id -> tokens appended (stop conditions may cut
        a verdict short)."""
        for w in work:
            if not w.num_logits:  # a prefill chunk short of the prompt's end: its K/V is all kept
                w.seq.num_computed_tokens += len(w.token_ids)
                if w.seq.num_computed_tokens == w.seq.num_tokens:  # a prompt-only request is done
                    w.seq.finish_time = now
                    self._finish(w.seq, "length")
        emitted: dict[int, int] = {}
        for w, v in zip(items, verdicts):
            seq = w.seq
            if w.tree is not None and v.path:
                self._keep_tree_branch(w, v.path)
            # K/V is valid for the fed tokens up to the last accepted draft.
            seq.num_computed_tokens = w.start_position + len(w.token_ids) - w.num_drafts + v.num_accepted
            emitted[seq.seq_id] = self._append_tokens(seq, v.tokens, now)
            if v.logprobs is not None:  # cut alike when a stop condition cut the tokens
                seq.logprobs.extend(v.logprobs[:emitted[seq.seq_id]])
            if not seq.is_finished:
                self.block_manager.trim(seq, seq.num_tokens)  # roll back rejected lookahead slots
        return emitted

    def _keep_tree_branch(self, w: ScheduledSeq, path: list[int]) -> None:
        """Move the accepted branch's K/V to where a chain of those tokens would have written it.

        Tree node t was fed at slot position c + t (c = w.start_position, the root's), but the
        j-th accepted node belongs at position c + 1 + j. Example: root r with children x (node 1)
        and y (node 2), y with child z (node 3); accepting y, z gives path [2, 3], so the K/V of
        positions c + 2, c + 3 moves to c + 1, c + 2."""
        slot = self.block_manager.slot
        self.runner.copy_slots([slot(w.seq, w.start_position + t) for t in path],
                               [slot(w.seq, w.start_position + 1 + j) for j in range(len(path))])

    def _record(self, step: _StepParts) -> None:
        """The step's StepRecord: kept as ``last_step``, counted in the engine's and each request's
        statistics, and shown to the decider (which learns from the timings)."""
        proposal = step.proposal
        drafts = proposal.drafts if proposal is not None else None
        natural_k = drafts.natural_k if drafts is not None else None
        match_length = drafts.match_length if drafts is not None else None
        confidence = drafts.confidence if drafts is not None else None
        verdict_of = {w.seq.seq_id: v for w, v in zip(step.items, step.verdicts)}
        reqs = []
        for j, i in enumerate(step.decodes):
            seq, num_drafts = step.work[i].seq, step.work[i].num_drafts
            reqs.append(RequestRecord(
                seq_id=seq.seq_id, request_id=seq.request_id,
                k=proposal.k[j] if proposal is not None else 0, num_proposed=num_drafts,
                num_accepted=verdict_of[seq.seq_id].num_accepted, num_emitted=step.emitted[seq.seq_id],
                natural_k=natural_k[j] if natural_k is not None else None,
                match_length=match_length[j] if match_length is not None else None,
                confidence=tuple(confidence[j][:num_drafts]) if confidence is not None and step.work[i].tree is None
                else None,
                stop_rule=proposal is not None and proposal.stopped))
        is_decode = set(step.decodes)
        record = StepRecord(
            requests=tuple(reqs), num_seqs=len(step.work), num_tokens=step.num_tokens,
            num_prefill_tokens=sum(len(w.token_ids) for i, w in enumerate(step.work) if i not in is_decode),
            context_tokens=sum(w.start_position + len(w.token_ids) for w in step.work),
            propose_s=step.propose_s, forward_s=step.forward_s, verify_s=step.verify_s, total_s=step.total_s,
            draft_passes=drafts.passes if drafts is not None else None)
        self.last_step = record
        self.stats.add(record)
        for r, i in zip(reqs, step.decodes):
            step.work[i].seq.spec.add(r)
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
                             seq.is_finished, seq.finish_reason, seq.num_preemptions, metrics,
                             logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                             prompt_logprobs=list(seq.prompt_logprobs) if seq.prompt_logprobs is not None else None)


def _find_stop(text: str, stops: tuple[str, ...], seen: int = 0) -> tuple[int, str] | None:
    """The earliest stop string in ``text`` (position, string). ``text[:seen]`` was searched before,
    so only a match ending after it can be new: each stop is looked for from seen - len(stop) + 1."""
    hits = []
    for s in stops:
        at = text.find(s, max(0, seen - len(s) + 1))
        if at >= 0:
            hits.append((at, s))
    return min(hits) if hits else None
