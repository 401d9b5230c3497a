"""The OpenAI-compatible request schema (pydantic, validated at the edge) and its error bodies.

Requests are parsed from the raw body in JSON mode and strictly: ``"max_tokens": "5"`` is a type
error, not a coercion. Fields the engine does not implement (logprobs, penalties, tools, ...) are
rejected with a 400 naming the field when they ask for something non-default, so a client never
gets a silently different behaviour. Unknown fields are ignored, as OpenAI-compatible servers do.
Logprobs are the target model's raw log-softmax (before temperature / top-k / top-p; see
``SamplingParams``): chat ``logprobs`` + ``top_logprobs``, completions ``logprobs`` + ``echo``.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..sampling import MAX_LOGPROBS


class ApiError(Exception):
    """An error answered with an OpenAI-style body: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False)


class SpecOptions(BaseModel):
    """specplan's extension: ``"spec": {"k": 3}`` forces this request's speculative tokens per step."""

    model_config = ConfigDict(strict=True, extra="forbid")
    k: int = Field(ge=0)


class StreamOptions(_Strict):
    include_usage: bool = False


# Parameters we accept only at their "off" value: name -> predicate saying the value is harmless.
def _off(value: Any) -> bool:
    return value is None or value is False or value == 0 or value == {} or value == []


_UNSUPPORTED_COMMON = {
    "presence_penalty": _off,
    "frequency_penalty": _off,
    "repetition_penalty": lambda v: v is None or v == 1,
    "logit_bias": _off,
    "min_tokens": _off,
}
_UNSUPPORTED_COMPLETION = {
    "suffix": lambda v: v is None or v == "",
    "best_of": lambda v: v is None or v == 1,
}
_UNSUPPORTED_CHAT = {
    "tools": _off,
    "functions": _off,
    "tool_choice": lambda v: v is None or v == "none",
    "function_call": lambda v: v is None or v == "none",
    "response_format": lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"),
    "audio": _off,
    "modalities": lambda v: v is None or v == ["text"],
    "prediction": _off,
}


def _reject_unsupported(data: Any, table: dict) -> Any:
    if isinstance(data, dict):
        for name, harmless in table.items():
            if name in data and not harmless(data[name]):
                raise ValueError(f"UNSUPPORTED:{name}")
    return data


class _SamplingFields(_Strict):
    model: str | None = None
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=128)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    spec: SpecOptions | None = None
    # vLLM-style extensions that cost nothing to support.
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class CompletionRequest(_SamplingFields):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    # The chosen token's logprob and the `logprobs` most likely per token (OpenAI caps it at 5).
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # prepend the prompt (and, with logprobs, its tokens' logprobs)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _reject_unsupported(_reject_unsupported(data, _UNSUPPORTED_COMMON), _UNSUPPORTED_COMPLETION)

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            return []
        if isinstance(p[0], int):
            return [p]  # type: ignore[list-item]
        return list(p)  # type: ignore[arg-type]


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # needs logprobs: true
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _unsupported(cls, data: Any) -> Any:
        return _reject_unsupported(_reject_unsupported(data, _UNSUPPORTED_COMMON), _UNSUPPORTED_CHAT)

    def output_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


_FRIENDLY = {
    "prompt": "prompt must be a string, a list of token ids, or a list of these",
    "stop": "stop must be a string or a list of strings",
}


def parse_request(body: bytes, model: type[_SamplingFields]) -> _SamplingFields:
    """Parse and validate a request body; every problem becomes an ApiError(400)."""
    if not body.strip():
        raise ApiError(400, "the request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(e) from None


def _validation_error(e: ValidationError) -> ApiError:
    errors = e.errors(include_url=False)
    first = errors[0]
    if first["type"] == "json_invalid":
        return ApiError(400, f"malformed JSON in the request body: {first.get('ctx', {}).get('error', first['msg'])}")
    if first["type"] == "model_type":
        return ApiError(400, "the request body must be a JSON object")
    msg = str(first.get("msg", ""))
    if first["type"] == "value_error" and "UNSUPPORTED:" in msg:
        name = msg.split("UNSUPPORTED:", 1)[1].strip()
        return ApiError(400, f"'{name}' is not supported by this server; leave it unset", param=name)
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    if first["type"] == "missing":
        return ApiError(400, f"'{'.'.join(loc)}' is required", param=param)
    if param in _FRIENDLY and len([x for x in errors if x["loc"][:1] == (param,)]) > 1:
        return ApiError(400, _FRIENDLY[param], param=param)
    # Keep field names and list indices, drop pydantic's union-member tags such as 'list[int]'.
    path = ".".join(p for p in loc if "[" not in p and p not in ("str", "int", "float", "bool"))
    where = f"'{path}'" if path else "the request body"
    return ApiError(400, f"invalid value for {where}: {msg}", param=param)
