"""specplan's OpenAI-compatible HTTP server (FastAPI + uvicorn).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with SSE streaming),
``GET /v1/models``, ``GET /v1/models/{id}``, ``GET /health``, ``GET /metrics`` (Prometheus text)
and ``GET /debug/engine`` (JSON: KV blocks free/total, running/waiting, active jobs). The
contract is published at ``GET /openapi.json`` (OpenAPI 3.1, see openapi.py) and ``GET /docs``.

One engine thread serves every request (see loop.py). Speculation is steered by the
engine's decider: a fixed k by default; ``build_engine(decider=...)`` / ``serve(decider=...)``
is where an adaptive planner plugs in. A decider that predicts its step time
(``decider.PredictsStepTime``) fills the ``specplan:step_time_predicted_seconds`` gauge.

Extension: ``"spec": {"k": N}`` in a request body forces that request's speculative tokens per
step (``SamplingParams.num_speculative_tokens``; 0 = never speculate).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import logging
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from ..config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from ..decider import SpecDecider
from ..engine import LLMEngine
from ..sampling import SamplingParams
from . import openapi as api_doc
from .logprobs import TokenStrings, chat_content, completion_logprobs, joined
from .loop import Accepted, ChoiceResult, Delta, EngineLoop, Failed, Finished, Job, LoopStopped, Progress, QueueFull
from .metrics import ServerMetrics
from .protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_request

logger = logging.getLogger("specplan.server")

MAX_BODY_BYTES = 8 * 1024 * 1024
MAX_SEQS_PER_REQUEST = 256
DEFAULT_MAX_QUEUED = 256
_ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/debug/engine")


class _StatusCounter:
    """ASGI middleware counting responses by endpoint and status (does not wrap receive)."""

    def __init__(self, app: Any, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        endpoint = path if path in _ENDPOINTS else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting_send(message):
            if message["type"] == "http.response.start":
                self.metrics.http_responses.labels(endpoint=endpoint, status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counting_send)


class _JobStream(StreamingResponse):
    """A streaming response that cancels its job however the response ends (disconnect included)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n"


def _error_response(err: ApiError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class _Server:
    """Per-app state: the engine loop, metrics and static facts about the served model."""

    def __init__(self, engine: LLMEngine, served_model_name: str, max_queued: int):
        self.name = served_model_name
        self.created = int(time.time())
        spec = engine.config.spec
        self.speculative = engine.speculator is not None
        self.max_k = spec.max_k if spec is not None else 0
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(max_k=max(self.max_k, 1))
        decider = type(engine.speculator.decider).__name__ if engine.speculator is not None else "none"
        self.metrics.info.labels(model=served_model_name, proposer=spec.proposer if spec else "none",
                                 k=str(spec.k) if spec else "0", decider=decider).set(1)
        self.loop = EngineLoop(engine, self.metrics, max_queued)

    # ---- request -> job -------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.name:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def sampling_params(self, req: CompletionRequest | ChatCompletionRequest, max_tokens: int | None) -> SamplingParams:
        k = req.spec.k if req.spec is not None else None
        if k:
            if not self.speculative:
                raise ApiError(400, "spec.k > 0 needs speculation, which this server runs without "
                                    "(start it with --proposer)", param="spec")
            if k > self.max_k:
                raise ApiError(400, f"spec.k must be at most {self.max_k} (the server's max_k), got {k}",
                               param="spec")
        top_k = req.top_k if req.top_k is not None else 0
        logprobs, prompt_logprobs = self._logprob_params(req, max_tokens)
        try:
            return SamplingParams(
                n=req.n, temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p, top_k=0 if top_k == -1 else top_k,
                seed=req.seed, max_tokens=max_tokens if max_tokens is not None else 1,
                stop=req.stop_strings(), stop_token_ids=tuple(req.stop_token_ids or ()),
                ignore_eos=req.ignore_eos, skip_special_tokens=req.skip_special_tokens,
                num_speculative_tokens=k, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise ApiError(400, str(e)) from None

    @staticmethod
    def _logprob_params(req: CompletionRequest | ChatCompletionRequest,
                        max_tokens: int | None) -> tuple[int | None, int | None]:
        """(SamplingParams.logprobs, prompt_logprobs) for a request: chat's logprobs + top_logprobs,
        completions' logprobs (+ echo: the prompt's too)."""
        if isinstance(req, ChatCompletionRequest):
            if req.top_logprobs is not None and not req.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
            return (req.top_logprobs or 0) if req.logprobs else None, None
        prompt_logprobs = req.logprobs if req.echo else None
        if max_tokens == 0:
            if not req.echo:
                raise ApiError(400, "max_tokens 0 needs echo: true (it scores the prompt)", param="max_tokens")
            if prompt_logprobs is None:  # the engine runs a prompt-only request to score it
                prompt_logprobs = 0
        return req.logprobs, prompt_logprobs

    def make_job(self, req: CompletionRequest | ChatCompletionRequest, chat: bool) -> Job:
        self.check_model(req.model)
        if req.stream_options is not None and not req.stream:
            raise ApiError(400, "stream_options is only allowed when stream is true", param="stream_options")
        if req.seed is not None and not -(2**63) <= req.seed < 2**63 - MAX_SEQS_PER_REQUEST:
            raise ApiError(400, "seed must fit in a signed 64-bit integer", param="seed")
        max_tokens = req.output_limit() if chat else req.max_tokens
        params = self.sampling_params(req, max_tokens)
        prefix = "chatcmpl-" if chat else "cmpl-"
        job = Job(id=prefix + uuid.uuid4().hex, params=params, loop=asyncio.get_running_loop(),
                  max_tokens=max_tokens, stream=bool(req.stream))
        if chat:
            job.messages = [m.as_template_input() for m in req.messages]
        else:
            job.prompts = req.prompts()
            job.echo = req.echo
            if not job.prompts:
                raise ApiError(400, "prompt must not be empty", param="prompt")
        limit = min(MAX_SEQS_PER_REQUEST, self.loop.max_num_seqs + self.loop.max_queued)
        if job.num_seqs > limit:  # could never be admitted: not a "retry later"
            raise ApiError(400, f"this server takes at most {limit} sequences per request "
                                f"(prompts × n), got {job.num_seqs}", param="n")
        return job

    def submit(self, job: Job) -> None:
        try:
            self.loop.submit(job)
        except QueueFull:
            raise ApiError(429, "the server is at capacity (too many requests waiting); retry shortly",
                           type="rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": "1"}) from None
        except LoopStopped:
            raise ApiError(503, "the engine is not running", type="service_unavailable",
                           headers={"Retry-After": "5"}) from None

    # ---- responses -------------------------------------------------------------------------------
    async def handle(self, request: Request, chat: bool) -> Response:
        try:
            body = await request.body()
        except ClientDisconnect:
            raise ApiError(499, "the client closed the connection", code="client_closed_request") from None
        if len(body) > MAX_BODY_BYTES:
            raise ApiError(400, f"the request body is larger than {MAX_BODY_BYTES} bytes")
        req = parse_request(body, ChatCompletionRequest if chat else CompletionRequest)
        job = self.make_job(req, chat)
        self.submit(job)
        watcher = asyncio.create_task(self._watch_disconnect(request, job))
        streaming = False  # once the stream response exists, it owns the job's cancellation
        try:
            first = await job.events.get()
            if isinstance(first, Failed):
                job.done = True
                raise first.error
            assert isinstance(first, Accepted)
            if job.stream:
                include_usage = bool(req.stream_options and req.stream_options.include_usage)
                watcher.cancel()  # from here the streaming response watches the connection
                streaming = True
                return _JobStream(self._stream(job, chat, include_usage), on_close=lambda: self.loop.abort(job))
            while True:
                event = await job.events.get()
                if isinstance(event, Failed):
                    job.done = True
                    raise event.error
                if isinstance(event, Finished):
                    job.done = True
                    return JSONResponse(self._full_response(job, event, chat))
        finally:
            watcher.cancel()
            if not job.done and not streaming:
                self.loop.abort(job)

    async def _watch_disconnect(self, request: Request, job: Job) -> None:
        """Until the response starts: a client that leaves cancels its job and wakes its handler."""
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                self.loop.abort(job)
                job.events.put_nowait(Failed(ApiError(499, "the client closed the connection",
                                                      code="client_closed_request")))
                return

    def _full_response(self, job: Job, fin: Finished, chat: bool) -> dict:
        usage = {"prompt_tokens": fin.prompt_tokens, "completion_tokens": fin.completion_tokens,
                 "total_tokens": fin.prompt_tokens + fin.completion_tokens}
        if chat:
            choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                        "logprobs": self._chat_logprobs(c.logprobs), "finish_reason": c.finish_reason}
                       for c in fin.choices]
            obj = "chat.completion"
        else:
            choices = [self._completion_choice(job, c) for c in fin.choices]
            obj = "text_completion"
        return {"id": job.id, "object": obj, "created": int(time.time()), "model": self.name,
                "system_fingerprint": None, "choices": choices, "usage": usage}

    # ---- logprobs in OpenAI's formats (engine/server/logprobs.py) ----------------------------------
    def _token_strings(self) -> TokenStrings:
        if getattr(self, "_strings", None) is None:
            self._strings = TokenStrings(self.loop.engine.tokenizer)
        return self._strings

    def _chat_logprobs(self, entries) -> dict | None:
        return {"content": chat_content(entries, self._token_strings())} if entries is not None else None

    def _echo_text(self, job: Job, index: int) -> str:
        """The prompt of choice ``index`` as text (echo)."""
        prompt = job.prompts[index // job.params.n]
        if isinstance(prompt, str):
            return prompt
        tok = self.loop.engine.tokenizer
        return tok.decode(prompt, skip_special_tokens=False) if tok is not None else ""

    def _completion_piece(self, job: Job, index: int, text: str, entries, prompt, offset: int,
                          first: bool) -> tuple[str, dict | None]:
        """Choice ``index``'s text and logprobs for the tokens ``entries``, whose text starts at
        ``offset`` of the choice's text. ``first``: the choice's first piece, which echo starts
        with the prompt (and its logprobs, from ``prompt``)."""
        strings = self._token_strings()
        head_text, head = "", None
        if job.echo and first:
            head_text = self._echo_text(job, index)
            if job.params.logprobs is not None and prompt is not None:
                head = completion_logprobs(prompt.token_ids, prompt.logprobs, strings, offset)
        logprobs = None
        if job.params.logprobs is not None:
            entries = entries or []
            logprobs = completion_logprobs([e.token_id for e in entries], entries, strings, offset + len(head_text))
            if head is not None:
                logprobs = joined(head, logprobs)
        return head_text + text, logprobs

    def _completion_choice(self, job: Job, c: ChoiceResult) -> dict:
        text, logprobs = self._completion_piece(job, c.index, c.text, c.logprobs, c.prompt, 0, first=True)
        return {"index": c.index, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}

    async def _stream(self, job: Job, chat: bool, include_usage: bool):
        created = int(time.time())
        obj = "chat.completion.chunk" if chat else "text_completion"

        def chunk(choices: list[dict], usage: dict | None = None) -> str:
            payload = {"id": job.id, "object": obj, "created": created, "model": self.name,
                       "system_fingerprint": None, "choices": choices}
            if include_usage:
                payload["usage"] = usage
            return _sse(payload)

        def choice(index: int, text: str | None, finish_reason: str | None, role: bool = False,
                   logprobs: dict | None = None) -> dict:
            if chat:
                delta: dict = {}
                if role:
                    delta["role"] = "assistant"
                if text is not None:
                    delta["content"] = text
                return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}

        sent: dict[int, int] = {}  # completions: choice index -> characters of its text sent so far

        def delta_choice(d: Delta) -> dict:
            """A delta's choice: with speculation, its logprobs may hold several tokens."""
            if chat:
                return choice(d.index, d.text if d.text else None, d.finish_reason,
                              logprobs=self._chat_logprobs(d.logprobs))
            offset = sent.get(d.index)
            text, logprobs = self._completion_piece(job, d.index, d.text, d.logprobs, d.prompt, offset or 0,
                                                    first=offset is None)
            sent[d.index] = (offset or 0) + len(text)
            return choice(d.index, text, d.finish_reason, logprobs=logprobs)

        if chat:
            for i in range(job.num_seqs):
                yield chunk([choice(i, "", None, role=True)])
        while True:
            event = await job.events.get()
            if isinstance(event, Progress):
                for d in event.deltas:
                    yield chunk([delta_choice(d)])
            elif isinstance(event, Finished):
                job.done = True
                if include_usage:
                    yield chunk([], {"prompt_tokens": event.prompt_tokens, "completion_tokens": event.completion_tokens,
                                     "total_tokens": event.prompt_tokens + event.completion_tokens})
                yield _sse("[DONE]")
                return
            elif isinstance(event, Failed):
                job.done = True
                yield _sse(event.error.body())
                yield _sse("[DONE]")
                return


def create_app(engine: LLMEngine, served_model_name: str | None = None,
               max_queued: int = DEFAULT_MAX_QUEUED) -> FastAPI:
    """The FastAPI app serving ``engine``; its engine thread starts and stops with the app's lifespan.

    ``max_queued``: how many sequences may wait for a place in the running batch before new
    requests get 429 with Retry-After.
    """
    server = _Server(engine, served_model_name or engine.model_name, max_queued)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # Everything alive at startup (the model, the tokenizer, the routes, the decider) lives as
        # long as the server, and every full garbage collection walks it all again: one took ~150
        # ms inside one step of a B = 1 decode loop here (a token stalled that long). Frozen, the
        # collector walks only what serving allocates (vLLM's engine core freezes its startup heap
        # too; under 4 req/s the longest collection went from 4.3 to 1.3 ms); thawed at shutdown,
        # so a server stopped inside a longer-lived process is collected as before.
        gc.collect()
        gc.freeze()
        server.loop.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, server.loop.stop)
            gc.unfreeze()

    app = FastAPI(title="specplan", version=api_doc.VERSION, lifespan=lifespan, docs_url="/docs", redoc_url=None,
                  openapi_url="/openapi.json",
                  description="An OpenAI-compatible server for specplan's speculative-decoding engine.")
    api_doc.install(app)
    app.state.server = server
    app.add_middleware(_StatusCounter, metrics=server.metrics)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError):
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError):
        return _error_response(ApiError(400, f"invalid request: {exc.errors()[:1]}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        detail = exc.detail if isinstance(exc.detail, str) else str(exc.detail)
        if exc.status_code == 404:
            detail = f"no route {request.method} {request.url.path}"
        return _error_response(ApiError(exc.status_code, detail, type=kind, headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception):
        logger.exception("unhandled error on %s", request.url.path)
        server.metrics.http_responses.labels(endpoint="other", status="500").inc()
        return _error_response(ApiError(500, f"internal server error: {type(exc).__name__}", type="internal_error"))

    @app.post("/v1/completions", **api_doc.completion_route(chat=False))
    async def completions(request: Request):
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions", **api_doc.completion_route(chat=True))
    async def chat_completions(request: Request):
        return await server.handle(request, chat=True)

    def model_card() -> dict:
        return {"id": server.name, "object": "model", "created": server.created, "owned_by": "specplan",
                "max_model_len": server.max_model_len}

    @app.get("/v1/models", **api_doc.LIST_MODELS)
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}", **api_doc.RETRIEVE_MODEL)
    async def model(model_id: str):
        server.check_model(model_id)
        return model_card()

    @app.get("/health", **api_doc.HEALTH)
    async def health():
        if not server.loop.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics", response_class=PlainTextResponse, **api_doc.METRICS)
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/engine", **api_doc.DEBUG_ENGINE)
    async def debug_engine():
        return server.loop.snapshot()

    return app


# ---- building and serving ---------------------------------------------------------------------------
def build_engine(model: str | None = None, *, proposer: str | None = None, spec_k: int = 4, max_k: int | None = None,
                 draft_model: str | None = None, draft_layers: int = 4, draft_head: str | None = None,
                 max_num_seqs: int = 64, max_num_batched_tokens: int = 512, max_model_len: int = 2048, kv_cache_bytes: int = 512 * 1024**2,
                 block_size: int = 16, seed: int = 0, decider: SpecDecider | None = None, loaded=None,
                 dtype=None, kv_dtype=None) -> LLMEngine:
    """The engine a server runs. ``decider``: who picks k per request per step (None: fixed ``spec_k``);
    ``kv_dtype``: the KV cache's element type (None: the engine's auto choice)."""
    import torch

    spec = None
    if proposer is not None:
        spec = SpecConfig(proposer=proposer, k=spec_k, max_k=max_k if max_k is not None else max(spec_k, 8),
                          draft_model=draft_model, draft_layers=draft_layers, draft_head=draft_head)
    config = EngineConfig(
        model=model, dtype=dtype or torch.float32, seed=seed, spec=spec,
        cache=CacheConfig(block_size=block_size, kv_cache_bytes=kv_cache_bytes, kv_dtype=kv_dtype),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  max_model_len=max_model_len))
    return LLMEngine(config, loaded, decider)


def serve(model: str | None = None, *, host: str = "127.0.0.1", port: int = 8000,
          served_model_name: str | None = None, max_queued: int = DEFAULT_MAX_QUEUED,
          log_level: str = "info", engine: LLMEngine | None = None, **engine_kwargs: Any) -> None:
    """Build the engine (unless given) and serve it with uvicorn until interrupted.

    ``engine_kwargs`` go to ``build_engine`` (proposer, spec_k, decider, max_num_seqs, ...).
    """
    import uvicorn

    if engine is None:
        engine = build_engine(model, **engine_kwargs)
    app = create_app(engine, served_model_name or engine.model_name, max_queued=max_queued)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=10)
