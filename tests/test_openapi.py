"""The published contract: ``/openapi.json`` is a valid OpenAPI 3.1 document describing every
endpoint, and a property-based fuzzer (schemathesis) driven by that document finds the live server
keeping it: no 5xx, only documented status codes and media types, bodies (stream events included)
matching their schemas, and schema-invalid requests rejected.

The server is a real uvicorn on 127.0.0.1 serving a tiny random-weight model with a short context,
so any generated request answers in milliseconds; the fuzzing is seeded and bounded (well under a
minute on 2 cores).
"""

from __future__ import annotations

import copy
import dataclasses
from datetime import timedelta

import httpx
import pytest

from conftest import loaded_from_hf, tiny_hf_model
from test_server import NAME, ServerThread, make_engine, make_tokenizer, wait_pool_full

_MISSING = "install the test extra: .venv/bin/pip install -e '.[test]'"
schemathesis = pytest.importorskip("schemathesis", reason=f"schemathesis (the API fuzzer) is missing; {_MISSING}")
openapi_spec_validator = pytest.importorskip("openapi_spec_validator",
                                             reason=f"openapi-spec-validator is missing; {_MISSING}")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402 (installed with schemathesis)
from hypothesis import strategies as st  # noqa: E402
from schemathesis import GenerationMode, checks  # noqa: E402

MAX_MODEL_LEN = 128  # short: a generated max_tokens of 10**20 still ends after a few dozen steps
OPERATIONS = ["POST /v1/completions", "POST /v1/chat/completions", "GET /v1/models",
              "GET /v1/models/{model_id}", "GET /health", "GET /metrics", "GET /debug/engine"]
CHECKS = [checks.not_a_server_error, checks.status_code_conformance, checks.content_type_conformance,
          checks.response_schema_conformance, checks.response_headers_conformance,
          checks.negative_data_rejection]  # the last one judges only schema-invalid (negative) cases


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from hypothesis.configuration import set_hypothesis_home_dir

    set_hypothesis_home_dir(tmp_path_factory.mktemp("hypothesis"))  # its caches stay out of the repository
    tok = make_tokenizer()
    model = tiny_hf_model("llama", vocab_size=len(tok), max_position_embeddings=MAX_MODEL_LEN, seed=3)
    loaded = dataclasses.replace(loaded_from_hf(model, name=NAME), tokenizer=tok)
    # 4 running + 4 queued: at most 8 sequences per request, so a generated n=128 is a quick 400.
    engine = make_engine(loaded, max_model_len=MAX_MODEL_LEN, max_num_seqs=4)
    from specplan.engine.server import create_app

    with ServerThread(create_app(engine, NAME, max_queued=4)) as s:
        yield s
    set_hypothesis_home_dir(None)


@pytest.fixture(scope="module")
def doc(server) -> dict:
    r = httpx.get(server.url + "/openapi.json")
    assert r.status_code == 200
    return r.json()


@pytest.fixture
def api(server):
    """The loaded document, fresh for each test: schemathesis learns from the responses it sees, and
    a test's generated cases must not depend on which tests ran before it."""
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


def resolve(doc: dict, schema: dict) -> dict:
    while "$ref" in schema:
        schema = doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
    return schema


# ---- the document -------------------------------------------------------------------------------------
def test_document_is_valid_openapi_31(doc):
    assert doc["openapi"].startswith("3.1.")
    openapi_spec_validator.validate(doc, cls=openapi_spec_validator.OpenAPIV31SpecValidator)
    assert sorted(f"{m.upper()} {p}" for p, ops in doc["paths"].items() for m in ops) == sorted(OPERATIONS)


@pytest.mark.parametrize("path, required", [("/v1/completions", "prompt"), ("/v1/chat/completions", "messages")])
def test_post_bodies_and_responses_are_described(doc, path, required):
    op = doc["paths"][path]["post"]
    body = op["requestBody"]
    assert body["required"]
    request = resolve(doc, body["content"]["application/json"]["schema"])
    assert request["required"] == [required]  # model is optional: this server serves one
    assert {"model", required, "max_tokens", "stream", "temperature"} <= set(request["properties"])
    ok = op["responses"]["200"]["content"]
    assert set(ok) == {"application/json", "text/event-stream"}
    assert "choices" in resolve(doc, ok["application/json"]["schema"])["required"]
    for status in ("400", "404", "429", "500", "503"):
        error = resolve(doc, op["responses"][status]["content"]["application/json"]["schema"])
        assert resolve(doc, error["properties"]["error"])["required"] == ["message", "type", "param", "code"]
    assert "422" not in op["responses"]  # invalid requests get 400, as OpenAI answers them


def test_logprobs_are_loosely_typed_in_responses(doc):
    """Choices accept a logprobs object as well as null, so richer logprobs need no schema change."""
    for name in ("CompletionChoice", "ChatChoice", "ChatChunkChoice"):
        types = {s.get("type") for s in doc["components"]["schemas"][name]["properties"]["logprobs"]["anyOf"]}
        assert types == {"object", "null"}, name


def test_swagger_ui(server):
    r = httpx.get(server.url + "/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


# ---- the live server against it -----------------------------------------------------------------------
HANDPICKED = [  # the paths a random body rarely reaches, each validated like a fuzzed case
    ("/v1/completions", {"model": NAME, "prompt": "hello world", "max_tokens": 5}),
    ("/v1/completions", {"prompt": ["hello", [5, 6, 7]], "max_tokens": 3, "n": 2, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": [7] * 200, "max_tokens": 2, "stream": True}),  # too long: a 400, not a stream
    ("/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                              "max_completion_tokens": 3, "stream": True, "spec": {"k": 3},
                              "stream_options": {"include_usage": True}}),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}),  # 404
    # Found by the fuzzer: a top_k beyond int64 once failed the engine step (a 500, and with it every
    # request in flight); a top_k of the vocabulary or more now means no limit.
    ("/v1/completions", {"prompt": "hello", "top_k": 2**63, "max_tokens": 4}),
]


@pytest.mark.parametrize("path, body", HANDPICKED)
def test_handpicked_responses_conform(api, server, path, body):
    case = api[path]["POST"].Case(body=body, media_type="application/json")
    case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)


def test_queue_full_answers_the_documented_429(api, server):
    """A busy server's 429 (with its Retry-After header) is the documented one."""
    busy = {"prompt": "hello", "max_tokens": 100, "n": 8, "stream": True}  # fills 4 running + 4 queued
    with httpx.stream("POST", server.url + "/v1/completions", json=busy, timeout=30) as stream:
        assert stream.status_code == 200
        case = api["/v1/completions"]["POST"].Case(body={"prompt": "hi", "n": 2}, media_type="application/json")
        response = case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)
        assert response.status_code == 429
    wait_pool_full(server)  # leaving the stream cancelled its job


def test_checks_catch_a_wrong_stream_schema(server, doc):
    """The stream events are really validated: against a chunk schema the server does not keep, a
    streamed completion fails the checks (and a streamed chat, whose chunks differ, does not)."""
    wrong = copy.deepcopy(doc)
    wrong["components"]["schemas"]["CompletionChunk"]["required"].append("not_sent")
    api = schemathesis.openapi.from_dict(wrong)
    body = {"prompt": "hello", "max_tokens": 3, "stream": True}
    case = api["/v1/completions"]["POST"].Case(body=body, media_type="application/json")
    with pytest.raises(schemathesis.errors.FailureGroup, match="SSE event violates schema"):
        case.call_and_validate(base_url=server.url, checks=CHECKS, timeout=30)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
    api["/v1/chat/completions"]["POST"].Case(body=chat, media_type="application/json").call_and_validate(
        base_url=server.url, checks=CHECKS, timeout=30)


def _integral(value):
    """2.0 as 2, deep. JSON Schema counts 2.0 as an integer, the server's strict parsing does not (a
    400 naming the field); the fuzzer generates such numbers so often that they would hide the rest."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_integral(v) for v in value]
    if isinstance(value, dict):
        return {k: _integral(v) for k, v in value.items()}
    return value


def _served(case):
    """A positive case nudged toward the engine past the rules a schema cannot state, each of which
    would otherwise answer most cases with the same 400: integral numbers, the served model (any
    other name is a 404), a non-empty prompt, stream_options only with stream."""
    body = case.body
    if isinstance(body, dict):
        body = _integral(body)
        if "model" in body:
            body["model"] = NAME
        if body.get("prompt") in ("", []):
            body["prompt"] = "hello"
        if body.get("stream_options") is not None:
            body["stream"] = True
        case.body = body
    return case


@pytest.mark.parametrize("label", OPERATIONS)
def test_fuzz(api, server, label):
    op = api[label.split(" ", 1)[1]][label.split(" ", 1)[0]]
    has_inputs = label.startswith("POST") or "{" in label
    strategy = op.as_strategy(generation_mode=GenerationMode.POSITIVE)
    if has_inputs:  # an operation without inputs has no schema-invalid request to make
        strategy = st.one_of(strategy, strategy.map(_served), op.as_strategy(generation_mode=GenerationMode.NEGATIVE))
    documented = {int(code) for code in op.definition.raw["responses"]}
    seen: dict[int, int] = {}

    # Seeded (derandomize) and bounded: a fixed number of examples, each answered well within the deadline.
    @settings(max_examples=45 if label.startswith("POST") else 15, derandomize=True, database=None,
              deadline=timedelta(seconds=15), phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case):
        response = case.call(base_url=server.url, timeout=30)
        seen[response.status_code] = seen.get(response.status_code, 0) + 1
        case.validate_response(response, checks=CHECKS)

    run()
    assert set(seen) <= documented, f"undocumented status codes for {label}: {seen}"
    if label.startswith("POST"):
        assert 200 in seen and 400 in seen, f"the fuzzer should reach the engine and its validation: {seen}"
        wait_pool_full(server)  # every request, finished or failed, gave its KV blocks back
