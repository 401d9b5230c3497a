"""The server's engine loop: ONE background thread owns the LLMEngine.

HTTP handlers (on the asyncio event loop) never touch the engine. They hand a ``Job`` to the
loop through a thread-safe command queue (``submit`` / ``abort``) and read the job's results from
its own ``asyncio.Queue``, which the engine thread fills through ``loop.call_soon_threadsafe``.

The engine thread drains the command queue, runs one engine step over everything admitted
(continuous batching: all HTTP requests share the step), turns the new tokens into per-choice
text deltas, and sleeps on the command queue when there is nothing to do (no busy spin).

Events a job receives, in order: ``Accepted`` or ``Failed``; then (streaming jobs only)
``Progress`` events; then ``Finished`` (or ``Failed`` if the engine broke or the server stops).
An aborted job (the client went away) receives nothing more.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass, field

from ..decider import predicted_step_s
from ..detokenizer import IncrementalDetokenizer
from ..engine import LLMEngine, RequestError
from ..sampling import SamplingParams, TokenLogprob
from ..sequence import Sequence
from .metrics import ServerMetrics
from .protocol import ApiError

logger = logging.getLogger("specplan.server")


# ---- events: engine thread -> one request's asyncio queue -------------------------------------
@dataclass
class Accepted:
    prompt_tokens: int


@dataclass
class Failed:
    error: ApiError


@dataclass
class Delta:
    index: int  # choice index: prompt_index * n + sample_index
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None  # of the tokens new since the last delta (when asked)
    # A choice's first delta, when prompt logprobs were asked: the prompt and its logprobs (for echo).
    prompt: PromptLogprobs | None = None


@dataclass
class PromptLogprobs:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # the first is None


@dataclass
class Progress:
    deltas: list[Delta]


@dataclass
class ChoiceResult:
    index: int
    text: str
    finish_reason: str | None
    num_tokens: int
    logprobs: list[TokenLogprob] | None = None  # per output token, when asked
    prompt: PromptLogprobs | None = None  # when prompt logprobs were asked


@dataclass
class Finished:
    choices: list[ChoiceResult]
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Track:
    """Engine-thread bookkeeping of one choice (one sequence)."""

    num_tokens: int = 0  # output tokens seen so far
    last_time: float | None = None  # when it last got tokens
    finish_reason: str | None = None
    text: str = ""  # the final text, once finished
    detok: IncrementalDetokenizer = field(default_factory=IncrementalDetokenizer)  # text decoded so far
    sent_chars: int = 0  # characters already sent as deltas
    sent_logprobs: int = 0  # output tokens whose logprobs were already sent as deltas
    sent_prompt: bool = False  # the prompt's logprobs were sent (streaming echo)
    logprobs: list[TokenLogprob] | None = None  # the final per-token logprobs, once finished
    prompt: PromptLogprobs | None = None  # the prompt's logprobs, once finished


@dataclass(eq=False)
class Job:
    """One HTTP request: one or more prompts (or one chat), ``params.n`` choices each."""

    id: str
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    prompts: list[str | list[int]] = field(default_factory=list)
    messages: list[dict] | None = None  # a chat: the prompt is the chat template applied to these
    max_tokens: int | None = None  # None: as many as the context allows (chat default)
    stream: bool = False
    echo: bool = False  # completions: the choices' text (and logprobs) start with the prompt's
    arrival: float = field(default_factory=time.perf_counter)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    # Set by the asyncio side (the engine thread reads abort_requested to skip a job whose client left).
    done: bool = False
    abort_requested: bool = False
    # Touched by the engine thread only.
    rids: list[str] = field(default_factory=list)
    num_rids_done: int = 0
    tracks: list[_Track] = field(default_factory=list)  # one per choice
    slots: list[dict[int, int]] = field(default_factory=list)  # per prompt: seq_id -> sample index
    num_finished: list[int] = field(default_factory=list)  # per prompt: finished sequences
    prompt_tokens: int = 0
    first_token_time: float | None = None

    @property
    def num_prompts(self) -> int:
        return 1 if self.messages is not None else len(self.prompts)

    @property
    def num_seqs(self) -> int:
        return self.num_prompts * self.params.n


class QueueFull(Exception):
    """Admission refused: too many sequences are already waiting."""


class LoopStopped(Exception):
    """The engine thread is not running."""


_STOP = object()


class EngineLoop:
    def __init__(self, engine: LLMEngine, metrics: ServerMetrics, max_queued: int):
        self.engine = engine
        self.metrics = metrics
        self.max_queued = max_queued
        self.max_num_seqs = engine.config.scheduler.max_num_seqs
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        # Shared with the asyncio side, under the lock.
        self._lock = threading.Lock()
        self._pending = 0  # sequences handed over, not yet added to the engine
        self._state = dict(running=0, waiting=0, free_blocks=engine.block_manager.num_free_blocks,
                           total_blocks=engine.block_manager.num_blocks, active_jobs=0, steps=0,
                           last_error=None)
        # Engine thread only.
        self._jobs: dict[str, Job] = {}
        self._by_rid: dict[str, tuple[Job, int]] = {}
        self._steps = 0
        self._last_error: str | None = None
        self._stalled = False
        self.metrics.set_engine_state(self._state["free_blocks"], self._state["total_blocks"], 0, 0)

    # ---- asyncio side -------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="specplan-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def submit(self, job: Job) -> None:
        """Hand a job to the engine thread, or raise QueueFull when the backlog is over max_queued.

        The backlog counts sequences: those handed over but not yet added, plus the engine's
        waiting queue, less the free places in the running batch.
        """
        if not self.alive:
            raise LoopStopped()
        with self._lock:
            free_places = max(0, self.max_num_seqs - self._state["running"])
            backlog = self._pending + self._state["waiting"] + job.num_seqs - free_places
            if backlog > self.max_queued:
                raise QueueFull()
            self._pending += job.num_seqs
        self._commands.put(("add", job))

    def abort(self, job: Job) -> None:
        """Cancel a job (its client went away); idempotent, no more events arrive for it."""
        if job.done or job.abort_requested:
            return
        job.abort_requested = True
        self._commands.put(("abort", job))

    def snapshot(self) -> dict:
        with self._lock:
            state = dict(self._state)
            state["pending"] = self._pending
        state["alive"] = self.alive
        return state

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if self._iteration():
                    return
            except Exception as e:  # a bug in the loop itself: fail what is in flight, keep serving
                logger.exception("engine loop iteration failed")
                self._last_error = f"{type(e).__name__}: {e}"
                self._fail_all(ApiError(500, f"internal error in the engine loop: {e}", type="internal_error"))
                self._stalled = True

    def _iteration(self) -> bool:
        """Drain the command queue, run one step if there is work; True when told to stop."""
        engine = self.engine
        commands = []
        try:
            if not engine.has_unfinished:
                commands.append(self._commands.get())  # idle: sleep until work arrives
            elif self._stalled:
                commands.append(self._commands.get(timeout=0.01))
        except queue.Empty:
            pass
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        stop = False
        for command in commands:
            if command is _STOP:
                stop = True
            else:
                self._handle(*command)
        if stop:
            self._stopping = True
            self._fail_all(ApiError(503, "the server is shutting down", type="service_unavailable"))
            self._publish()
            return True
        self._publish()
        self._stalled = False
        if engine.has_unfinished:
            self._step()
            self._publish()
        return False

    def _handle(self, kind: str, job: Job) -> None:
        if kind == "abort":
            try:
                self._abort(job)
            except Exception:
                logger.exception("aborting %s failed", job.id)
            return
        try:
            self._add(job)
        except Exception as e:  # a bug, not the client's fault
            logger.exception("adding request %s failed", job.id)
            try:
                self._drop(job)
            finally:
                self._send(job, Failed(ApiError(500, f"internal error while adding the request: {e}",
                                                type="internal_error")))
        finally:
            with self._lock:  # handed over -> in the engine (or rejected): no longer pending
                self._pending -= job.num_seqs
                self._state["waiting"] = len(self.engine.scheduler.waiting)
                self._state["running"] = len(self.engine.scheduler.running)

    def _send(self, job: Job, event: object) -> None:
        try:
            job.loop.call_soon_threadsafe(job.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed (server shutting down)
            pass

    def _tokenize(self, job: Job, prompt: str | list[int] | None) -> list[int]:
        tok = self.engine.tokenizer
        if job.messages is None:
            if isinstance(prompt, str):
                return self.engine.tokenize(prompt)
            return list(prompt or [])
        if tok is None or not getattr(tok, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        try:
            text = tok.apply_chat_template(job.messages, add_generation_prompt=True, tokenize=False)
        except Exception as e:  # a template may raise on messages it does not accept
            raise RequestError(f"cannot apply the chat template to these messages: {e}") from e
        return list(tok.encode(text, add_special_tokens=False))

    def _add(self, job: Job) -> None:
        if job.abort_requested:  # the client left before we got to it
            return
        engine = self.engine
        try:
            prompts = job.prompts if job.messages is None else [None]
            all_ids = [self._tokenize(job, p) for p in prompts]
            for p_idx, ids in enumerate(all_ids):
                params = job.params
                if job.max_tokens is None:
                    room = min(engine.max_model_len, engine.block_manager.capacity_tokens) - len(ids)
                    params = dataclasses.replace(params, max_tokens=max(1, room))
                rid = f"{job.id}-{p_idx}"
                engine.add_request(rid, ids, params)
                job.rids.append(rid)
                self._by_rid[rid] = (job, p_idx)
        except (RequestError, ValueError, TypeError) as e:
            self._drop(job)
            self._send(job, Failed(ApiError(400, str(e))))
            return
        job.prompt_tokens = sum(len(ids) for ids in all_ids)
        job.tracks = [_Track() for _ in range(job.num_seqs)]
        job.slots = [{} for _ in range(job.num_prompts)]
        job.num_finished = [0] * job.num_prompts
        self._jobs[job.id] = job
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        self._send(job, Accepted(job.prompt_tokens))

    def _drop(self, job: Job) -> None:
        """Forget a job and cancel whatever of it the engine still runs (frees its KV blocks)."""
        for rid in job.rids:
            self.engine.abort_request(rid)
            self._by_rid.pop(rid, None)
        self._jobs.pop(job.id, None)

    def _abort(self, job: Job) -> None:
        if job.id not in self._jobs:
            return
        for t in job.tracks:
            if t.finish_reason is None:
                self.metrics.request_success.labels(finished_reason="abort").inc()
        self._drop(job)

    def _fail_all(self, error: ApiError) -> None:
        """Cancel every job in flight (their KV blocks return to the pool) and tell their clients."""
        for job in list(self._jobs.values()):
            try:
                self._drop(job)
            except Exception:
                logger.exception("cancelling %s failed", job.id)
                self._jobs.pop(job.id, None)
            self._send(job, Failed(error))

    def _publish(self) -> None:
        engine = self.engine
        bm = engine.block_manager
        running, waiting = len(engine.scheduler.running), len(engine.scheduler.waiting)
        with self._lock:
            self._state.update(running=running, waiting=waiting, free_blocks=bm.num_free_blocks,
                               total_blocks=bm.num_blocks, active_jobs=len(self._jobs), steps=self._steps,
                               last_error=self._last_error)
            pending = self._pending
        self.metrics.set_engine_state(bm.num_free_blocks, bm.num_blocks, running, waiting + pending)

    def _step(self) -> None:
        engine = self.engine
        before = engine.last_step
        try:
            seqs = engine.step()
        except Exception as e:
            logger.exception("engine step failed")
            self._last_error = f"{type(e).__name__}: {e}"
            self._fail_all(ApiError(500, f"internal error in the engine step: {e}", type="internal_error"))
            return
        now = time.perf_counter()
        record = engine.last_step
        if record is not None and record is not before:
            self._steps += 1
            spec = engine.speculator
            self.metrics.observe_step(record, predicted_step_s(spec.decider) if spec is not None else None)
        elif not seqs:
            self._stalled = True  # nothing could be scheduled: wait a little instead of spinning
        by_rid: dict[str, list[Sequence]] = {}
        for seq in seqs:
            by_rid.setdefault(seq.request_id, []).append(seq)
        for rid, group in by_rid.items():
            entry = self._by_rid.get(rid)
            if entry is not None:
                self._progress(entry[0], entry[1], rid, group, now)

    def _progress(self, job: Job, p_idx: int, rid: str, seqs: list[Sequence], now: float) -> None:
        """Turn one engine request's new tokens into deltas, metrics and, when done, its result."""
        m = self.metrics
        n = job.params.n
        slots = job.slots[p_idx]
        deltas, new_total = [], 0
        for seq in sorted(seqs, key=lambda s: s.seq_id):
            if seq.seq_id not in slots:  # choices are numbered in the order their sequences start
                slots[seq.seq_id] = len(slots)
            index = p_idx * n + slots[seq.seq_id]
            track = job.tracks[index]
            if track.finish_reason is not None:
                continue
            out_ids = seq.output_token_ids
            new = len(out_ids) - track.num_tokens
            if new > 0:
                if job.first_token_time is None:
                    job.first_token_time = now
                    m.ttft.observe(now - job.arrival)
                if track.last_time is not None:
                    gap = (now - track.last_time) / new
                    for _ in range(new):
                        m.itl.observe(gap)
                track.last_time = now
                track.num_tokens = len(out_ids)
                new_total += new
            finish = None
            if seq.is_finished:
                finish = track.finish_reason = seq.finish_reason or "stop"
                track.text = seq.text
                track.logprobs = seq.logprobs
                if seq.prompt_logprobs is not None:
                    track.prompt = PromptLogprobs(seq.prompt_token_ids, seq.prompt_logprobs)
                text = _final_delta(track)
                m.request_success.labels(finished_reason=finish).inc()
                job.num_finished[p_idx] += 1
            else:
                text = _running_delta(track, self.engine.tokenizer, out_ids, seq.params)
            if not job.stream:
                continue
            logprobs = prompt = None
            if seq.logprobs is not None and len(seq.logprobs) > track.sent_logprobs:
                logprobs = seq.logprobs[track.sent_logprobs:]
                track.sent_logprobs = len(seq.logprobs)
            # The prompt is scored once its prefill is done, which is before any delta.
            if seq.prompt_logprobs is not None and not track.sent_prompt:
                prompt = PromptLogprobs(seq.prompt_token_ids, seq.prompt_logprobs)
                track.sent_prompt = True
            if text or finish or logprobs or prompt:
                deltas.append(Delta(index, text, finish, logprobs, prompt))
        if new_total:
            m.generation_tokens.inc(new_total)
        if job.num_finished[p_idx] == n and self.engine.pop_finished(rid) is not None:
            self._by_rid.pop(rid, None)
            job.num_rids_done += 1
        if deltas and job.stream:
            self._send(job, Progress(deltas))
        if job.num_rids_done == len(job.rids):
            self._jobs.pop(job.id, None)
            m.e2e.observe(now - job.arrival)
            choices = [ChoiceResult(i, t.text, t.finish_reason, t.num_tokens, t.logprobs, t.prompt)
                       for i, t in enumerate(job.tracks)]
            self._send(job, Finished(choices, job.prompt_tokens, sum(c.num_tokens for c in choices)))


def _running_delta(track: _Track, tokenizer, out_ids: list[int], params: SamplingParams) -> str:
    """New text of a running sequence that is safe to send now.

    Detokenizes incrementally (engine/detokenizer.py: a short window of tokens each step, waiting
    while it ends inside a UTF-8 character), then holds back any tail that could be the start of
    a stop string (the engine cuts the text at a stop string only once it completes).
    """
    if tokenizer is None:
        return ""
    track.detok.update(tokenizer, out_ids, params.skip_special_tokens)
    decoded = track.detok.text
    end = len(decoded)
    if params.stop:
        end -= _stop_prefix_len(decoded, params.stop)
    if end <= track.sent_chars:
        return ""
    piece = decoded[track.sent_chars:end]
    track.sent_chars = end
    return piece


def _final_delta(track: _Track) -> str:
    """The rest of a finished sequence's final text (the engine's, cut at a stop string)."""
    final = track.text
    if final[:track.sent_chars] != track.detok.text[:track.sent_chars]:
        logger.debug("incremental detokenization diverged from the final text")
    piece = final[track.sent_chars:]
    track.sent_chars = max(track.sent_chars, len(final))
    return piece


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
