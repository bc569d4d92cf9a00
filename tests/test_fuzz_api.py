"""Schema-driven fuzzing of the HTTP API (schemathesis) against a live server on the tiny model.

The OpenAPI document the server publishes at ``/schema/openapi.json`` is the contract: for every
operation, schemathesis generates bodies that follow it (positive) and bodies that break it
(negative), and every answer must

* never be a 5xx (``not_a_server_error``),
* carry a status code, content type, headers and body that the document declares
  (``status_code_conformance``, ``content_type_conformance``, ``response_headers_conformance``,
  ``response_schema_conformance``); 4xx bodies are validated against the declared
  problem-details / OpenAI error shapes,
* refuse schema-breaking bodies with a 4xx (``negative_data_rejection``),

and beyond the document: every error names the problem in words, a 429 says when to retry,
every event of a stream decodes as one of the documented event types, and after the whole run
no request is left in the engine and every KV block is free.

Bounded for CI: ``STENCIL_FUZZ_EXAMPLES`` (default 25) examples per operation and mode, derandomized
(the same cases every run; set ``STENCIL_FUZZ_RANDOM=1`` to explore new ones), a cap of 16 output
tokens (the default of ``/v1/completions``) and a 2 s grammar-compile timeout on the server.
"""

from __future__ import annotations

import os
import time

import httpx
import msgspec
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
# The built-in OpenAPI checks live here (schemathesis 4.x registers them from this module).
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_headers_conformance, response_schema_conformance,
                                               status_code_conformance)

import schemas.generate
import schemas.openai
import schemas.responses
from engine.config import EngineConfig
from schemas.generate import StreamDelta, StreamError, StreamFinal
from schemas.openai import ChatCompletionChunk, Completion, ErrorResponse
from service.openai_api import UNSERVED_CHAT
from service.responses_api import UNSERVED as UNSERVED_RESPONSES
from service.state import ServiceConfig
from service_live import LiveServer

EXAMPLES = int(os.environ.get("STENCIL_FUZZ_EXAMPLES", "25"))
DERANDOMIZE = os.environ.get("STENCIL_FUZZ_RANDOM", "") != "1"
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
OPERATIONS = [("/generate", "POST"), ("/health", "GET"), ("/metrics", "GET"), ("/v1/chat/completions", "POST"),
              ("/v1/completions", "POST"), ("/v1/responses", "POST"), ("/v1/models", "GET"),
              ("/v1/models/{model_id}", "GET")]
_GENERATE_EVENT = msgspec.json.Decoder(StreamDelta | StreamFinal | StreamError)
_STREAM_TYPES = {"/v1/chat/completions": msgspec.json.Decoder(ChatCompletionChunk),
                 "/v1/completions": msgspec.json.Decoder(Completion)}
_OPENAI_ERROR = msgspec.json.Decoder(ErrorResponse)
_RESPONSE_EVENTS = {"response.created", "response.in_progress", "response.output_item.added",
                    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
                    "response.content_part.done", "response.output_item.done",
                    "response.function_call_arguments.delta", "response.function_call_arguments.done",
                    "response.completed", "response.incomplete", "response.failed", "error"}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    srv = LiveServer(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=16, grammar_timeout_s=2.0),
                     ServiceConfig(max_tokens_cap=16, default_max_tokens=4, max_body_bytes=256 << 10,
                                   request_timeout_s=60)).start()
    yield srv
    srv.stop()


def _declare_forbidden_unknown_fields(doc: dict) -> None:
    """Mark request types that refuse unknown fields with ``additionalProperties: false``.

    Our Structs say ``forbid_unknown_fields=True`` but Litestar's schema generator drops that
    fact; without it a "positive" case may carry an unknown field (then 422 is right) and no
    negative case tries one.
    """
    components = doc.get("components", {}).get("schemas", {})
    for module in (schemas.generate, schemas.openai, schemas.responses):
        for name, obj in vars(module).items():
            if (isinstance(obj, type) and issubclass(obj, msgspec.Struct)
                    and obj.__struct_config__.forbid_unknown_fields and name in components):
                components[name]["additionalProperties"] = False


@pytest.fixture(scope="module")
def api(server):
    doc = httpx.get(server.url + "/schema/openapi.json", timeout=30).json()
    _declare_forbidden_unknown_fields(doc)
    return schemathesis.openapi.from_dict(doc)


def _header(response, name: str) -> str:
    """First value of a header (schemathesis keeps headers as ``{name: [values]}``)."""
    for key, values in response.headers.items():
        if key.lower() == name:
            return values[0] if isinstance(values, list) else values
    return ""


def _check_beyond_schema(path: str, response) -> None:
    """What the document cannot say: errors name the problem; streams are made of documented events."""
    status = response.status_code
    ctype = _header(response, "content-type")
    if status >= 400:
        rid = _header(response, "x-request-id")
        assert rid.startswith("req-"), response.headers
        if path.startswith("/v1"):
            assert _OPENAI_ERROR.decode(response.content).error.message.strip(), response.text
        else:
            problem = msgspec.json.decode(response.content)
            assert problem["detail"].strip() and problem["request_id"] == rid, problem
        if status == 429:
            assert int(_header(response, "retry-after")) >= 1
    if status == 200 and ctype.startswith("text/event-stream"):
        events = [ln[len("data: "):] for ln in response.text.splitlines() if ln.startswith("data: ")]
        assert events and events[-1] == "[DONE]", response.text[-300:]
        for payload in events[:-1]:
            if path == "/generate":
                event = _GENERATE_EVENT.decode(payload)
                if isinstance(event, StreamError):
                    assert event.error.status < 500, event
            elif path == "/v1/responses":
                event = msgspec.json.decode(payload)
                assert event["type"] in _RESPONSE_EVENTS, event
                assert event["type"] != "error" or event["code"] != "server_error", event
            elif '"error"' in payload[:10]:
                assert _OPENAI_ERROR.decode(payload).error.type != "server_error", payload
            else:
                _STREAM_TYPES[path].decode(payload)


def _run(api, server, path: str, method: str, strategy) -> None:
    operation = api[path][method]

    @given(case=strategy(operation))
    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=DERANDOMIZE,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate, Phase.shrink])
    def check(case):
        response = case.call(base_url=server.url, timeout=60)
        case.validate_response(response, checks=CHECKS)
        try:
            _check_beyond_schema(path, response)
        except AssertionError as e:
            raise AssertionError(f"{e}\nrequest body: {case.body!r}") from None

    check()


@pytest.mark.parametrize("path, method", OPERATIONS)
def test_fuzz_positive(api, server, path, method):
    _run(api, server, path, method, lambda op: op.as_strategy(generation_mode=GenerationMode.POSITIVE))


@pytest.mark.parametrize("path, method", [(p, m) for p, m in OPERATIONS if m == "POST"])
def test_fuzz_negative(api, server, path, method):
    _run(api, server, path, method, lambda op: op.as_strategy(generation_mode=GenerationMode.NEGATIVE))


def _servable(path: str):
    """Map a generated body onto one the server can run (one prompt, at most one constraint), so the
    fuzzer reaches generation, streaming and output checking rather than stopping at 400."""
    def fix(case):
        body = case.body
        if not isinstance(body, dict):
            return case
        body.pop("model", None)
        for key in ("best_of", "suffix", *UNSERVED_CHAT, *UNSERVED_RESPONSES):
            body.pop(key, None)  # refused by design (400), which the other tests already reach
        for key, top in (("max_tokens", 8), ("max_completion_tokens", 8), ("max_output_tokens", 8), ("n", 2)):
            value = body.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e300:
                body[key] = 1 + int(abs(value)) % top
        if path == "/generate":
            body.pop("messages", None)
            body["prompt"] = "fuzz"
            for key in [k for k in ("response_schema", "regex", "choice") if body.get(k) is not None][1:]:
                body.pop(key)
        elif path == "/v1/chat/completions":
            body["messages"] = [{"role": "user", "content": "fuzz"}]
        elif path == "/v1/responses":
            body["input"] = "fuzz"
        else:
            body["prompt"] = "fuzz"
        return case
    return fix


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions", "/v1/responses"])
def test_fuzz_servable_bodies(api, server, path):
    _run(api, server, path, "POST",
         lambda op: op.as_strategy(generation_mode=GenerationMode.POSITIVE).map(_servable(path)))


def test_nothing_left_behind(server):
    """After every fuzz case: no request running or waiting, every KV block free, still healthy."""
    deadline = time.monotonic() + 30
    while True:
        h = httpx.get(server.url + "/health", timeout=10)
        stats = h.json()["engine"]
        idle = stats["running"] == 0 and stats["waiting"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
        if idle or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["inflight"] == 0
    assert idle, stats
