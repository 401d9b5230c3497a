"""The server's published contract: the OpenAPI 3.1 document served at ``/openapi.json`` (``/docs``).

The POST endpoints parse their bodies by hand (protocol.py: strict, precise 400s), so FastAPI
cannot see their request or response types; this module describes them instead:

- request bodies are protocol.py's own models (``model_json_schema``), so a field added there
  appears here with no edit;
- response bodies are the models below, used for documentation only (the handlers build plain
  dicts); ``logprobs`` is a loose ``object | null`` so richer logprobs need no schema change;
- every status an operation can answer is listed, errors with the OpenAI error object.

All schemas live under ``components/schemas`` and are generated in one pydantic pass, so every
``$ref`` below resolves.
"""

from __future__ import annotations

from importlib import metadata
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict
from pydantic.json_schema import models_json_schema

from .protocol import ChatCompletionRequest, CompletionRequest

_REF = "#/components/schemas/{model}"


def _version() -> str:
    # From the installed distribution: the engine imports nothing of the rest of specplan.
    try:
        return metadata.version("specplan")
    except metadata.PackageNotFoundError:
        return "0.0.0"


VERSION = _version()


# ---- response bodies (documentation only) ---------------------------------------------------------
class _Doc(BaseModel):
    # Responses may grow fields (as OpenAI's do): clients must ignore what they don't know.
    model_config = ConfigDict(extra="allow")


class ErrorObject(_Doc):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(_Doc):
    """Every 4xx/5xx body (except /health's 503), and the last event of a stream that fails."""

    error: ErrorObject


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Doc):
    index: int
    text: str
    logprobs: dict[str, Any] | None
    finish_reason: str | None  # "stop", "length"; null only in stream chunks


class Completion(_Doc):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(Completion):
    """One ``data:`` event of a streamed completion (``usage`` only with stream_options.include_usage)."""

    usage: Usage | None = None


class ChatCompletionMessage(_Doc):
    role: Literal["assistant"]
    content: str | None


class ChatChoice(_Doc):
    index: int
    message: ChatCompletionMessage
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletion(_Doc):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(_Doc):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Doc):
    index: int
    delta: ChatDelta
    logprobs: dict[str, Any] | None
    finish_reason: str | None


class ChatCompletionChunk(_Doc):
    """One ``data:`` event of a streamed chat completion (``usage`` only with stream_options.include_usage)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    system_fingerprint: str | None
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Health(_Doc):
    status: str  # "ok", or why not


class EngineState(_Doc):
    """A debugging snapshot of the engine loop; its fields may change between versions."""

    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    active_jobs: int
    steps: int
    last_error: str | None
    pending: int
    alive: bool


_REQUEST_MODELS = (CompletionRequest, ChatCompletionRequest)
_RESPONSE_MODELS = (ErrorResponse, Completion, CompletionChunk, ChatCompletion, ChatCompletionChunk,
                    ModelList, ModelCard, Health, EngineState)


def component_schemas() -> dict[str, Any]:
    """``components/schemas``: requests as validated, responses as serialized."""
    _, top = models_json_schema([(m, "validation") for m in _REQUEST_MODELS]
                                + [(m, "serialization") for m in _RESPONSE_MODELS], ref_template=_REF)
    return top["$defs"]


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _json(description: str, model: type[BaseModel]) -> dict:
    return {"description": description, "content": {"application/json": {"schema": _ref(model)}}}


def _error(description: str, retry_after: bool | None = None) -> dict:
    """An error response; ``retry_after``: True if it always carries Retry-After, False if only sometimes."""
    response = _json(description, ErrorResponse)
    if retry_after is not None:
        response["headers"] = {"Retry-After": {"required": retry_after, "schema": {"type": "integer", "minimum": 0},
                                               "description": "Seconds to wait before retrying."}}
    return response


# ---- per-route keyword arguments for app.get / app.post -------------------------------------------------
def _sse_event(chunk: type[BaseModel]) -> dict:
    """One server-sent event of a stream (OpenAPI 3.1 reads a ``text/event-stream`` schema per event):
    ``data`` is a JSON chunk, an error object (a failure after the stream began), or ``[DONE]``."""
    json_data = {"contentMediaType": "application/json",
                 "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}
    return {"type": "object", "required": ["data"],
            "description": f"`data: <{chunk.__name__} JSON>` events, then `data: [DONE]`.",
            # if/else rather than anyOf: "[DONE]" must never be parsed as JSON.
            "properties": {"data": {"type": "string", "if": {"const": "[DONE]"}, "else": json_data}}}


def completion_route(chat: bool) -> dict:
    request, response, chunk = ((ChatCompletionRequest, ChatCompletion, ChatCompletionChunk) if chat
                                else (CompletionRequest, Completion, CompletionChunk))
    return dict(
        operation_id="createChatCompletion" if chat else "createCompletion",
        summary="Create a chat completion" if chat else "Create a completion",
        # The handler reads the raw body (protocol.parse_request), so the body is declared here.
        openapi_extra={"requestBody": {"required": True,
                                       "content": {"application/json": {"schema": _ref(request)}}}},
        responses={
            200: {"description": "The completion (JSON), or a stream of chunks (SSE) when `stream` is true.",
                  "content": {"application/json": {"schema": _ref(response)},
                              "text/event-stream": {"schema": _sse_event(chunk)}}},
            # No 413 (a body over 8 MiB is a 400) and no 422 (validation errors are 400s, as OpenAI's);
            # 499 (the client left) is only logged and counted: no client ever reads it.
            400: _error("Invalid request: malformed JSON, a wrong type or value (`param` names the field), "
                        "an unsupported option set to a non-default value, a prompt longer than the context, "
                        "a body over 8 MiB."),
            404: _error("`model` names a model this server does not serve (`code`: `model_not_found`)."),
            429: _error("Too many requests waiting (`code`: `rate_limit_exceeded`).", retry_after=True),
            500: _error("Internal error in the engine."),
            503: _error("The engine is not running (with Retry-After) or is shutting down.", retry_after=False),
        },
    )


LIST_MODELS = dict(operation_id="listModels", summary="List the served model",
                   responses={200: _json("The served model (exactly one).", ModelList)})
RETRIEVE_MODEL = dict(operation_id="retrieveModel", summary="Describe a model",
                      responses={200: _json("The served model.", ModelCard),
                                 404: _error("Not the served model (`code`: `model_not_found`).")})
HEALTH = dict(operation_id="health", summary="Liveness of the engine",
              responses={200: _json("The engine runs: `{\"status\": \"ok\"}`.", Health),
                         503: _json("The engine thread is not running.", Health)})
METRICS = dict(operation_id="metrics", summary="Prometheus metrics",
               responses={200: {"description": "Prometheus text exposition format.",
                                "content": {"text/plain": {"schema": {"type": "string"}}}}})
DEBUG_ENGINE = dict(operation_id="debugEngine", summary="Engine loop state (debugging)",
                    responses={200: _json("KV blocks free/total, running/waiting sequences, active jobs.",
                                          EngineState)})


def install(app: FastAPI) -> None:
    """Make ``app.openapi()`` (hence ``/openapi.json``) return the document described here."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description,
                              routes=app.routes)
            # FastAPI adds a 422 to every route with a path parameter; this server answers invalid
            # requests with 400 (and a path string cannot be invalid), so the 422 would be a lie.
            for path in doc["paths"].values():
                for operation in path.values():
                    operation["responses"].pop("422", None)
            schemas = doc.setdefault("components", {}).setdefault("schemas", {})
            schemas.pop("HTTPValidationError", None)
            schemas.pop("ValidationError", None)
            schemas.update(component_schemas())
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
