"""POST /generate, /health, /metrics and the error mapping, through Litestar's TestClient (tiny model)."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from stencil.engine.config import EngineConfig
from stencil.service.app import create_app
from stencil.service.state import service_state
from stencil.service.state import ServiceConfig

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6},
                   "age": {"type": "integer", "minimum": 0, "maximum": 120}},
    "required": ["name", "age"],
}
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=16),
                     ServiceConfig(max_tokens_cap=512, default_max_tokens=32, max_body_bytes=65536,
                                   request_timeout_s=60))
    with TestClient(app, timeout=60) as c:
        yield c


def _sse(text: str) -> list:
    """``data:`` payloads of an event stream, JSON-decoded except ``[DONE]``."""
    out = []
    for event in text.split("\n\n"):
        for line in event.splitlines():
            if line.startswith("data: "):
                payload = line[len("data: "):]
                out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def test_regex_request_returns_a_full_match(client):
    r = client.post("/generate", json={"prompt": "Today is", "regex": DATE, "max_tokens": 20})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "stop" and body["valid"] is True
    assert re.fullmatch(DATE, body["text"])
    assert r.headers["x-request-id"] == body["id"]
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["timings"]["total_ms"] >= body["timings"]["ttft_ms"] > 0


def test_schema_request_returns_valid_json(client):
    r = client.post("/generate", json={"messages": [{"role": "user", "content": "Ann, 30"}],
                                       "response_schema": PERSON, "max_tokens": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "stop" and body["valid"] is True, body
    assert json.loads(body["text"]) == body["output"]
    jsonschema.Draft202012Validator(PERSON).validate(body["output"])  # independent oracle


def test_choice_and_cut_short_outputs(client):
    r = client.post("/generate", json={"prompt": "Answer:", "choice": ["alpha", "beta"]}).json()
    assert r["text"] in ("alpha", "beta") and r["output"] == r["text"] and r["valid"]
    # Below the schema's shortest output: refused before any token, naming max_tokens and the minimum.
    p = client.post("/generate", json={"prompt": "x", "response_schema": PERSON, "max_tokens": 2})
    assert p.status_code == 400 and p.json()["field"] == "max_tokens" and "at least" in p.json()["detail"], p.text
    r = client.post("/generate", json={"prompt": "x", "response_schema": PERSON, "max_tokens": 2,
                                       "close_on_budget": False}).json()
    assert r["finish_reason"] == "length" and r["output"] is None and r["valid"] is False
    assert r["usage"]["completion_tokens"] == 2
    assert r["truncated_value"] is False


def test_a_text_the_constraint_admits_is_valid_whatever_stopped_it(client, tokenizer):
    # Each token of this language is one character (the digits and "-" of SmolLM2's vocabulary
    # are single-character tokens where no "--" or "12" pieces exist), so 10 tokens write a date.
    rx = r"[0-9]{4}-[0-9]{2}-[0-9]{2}( [0-9]{2}:[0-9]{2})?"
    r = client.post("/generate", json={"prompt": "Born on", "regex": rx, "max_tokens": 10,
                                       "close_on_budget": False}).json()
    assert re.fullmatch(rx, r["text"]) and r["usage"]["completion_tokens"] == 10, r
    assert (r["finish_reason"], r["valid"], r["truncated_value"]) == ("length", True, True), r
    assert any("max_tokens" in w for w in r["warnings"])
    number = client.post("/generate", json={"prompt": "n=", "response_schema": {"type": "integer"},
                                            "max_tokens": 3, "close_on_budget": False}).json()
    if number["finish_reason"] == "length":  # the model went on writing digits
        assert number["valid"] and number["truncated_value"] and number["output"] == int(number["text"]), number


@pytest.mark.parametrize("body, status, needle, field", [
    ({"prompt": "x", "response_schema": {"type": "strin"}}, 400, "'strin'", "response_schema"),
    ({"prompt": "x", "max_token": 3}, 422, "max_token", "max_token"),
    ({"prompt": "x", "max_tokens": 0}, 422, ">= 1", "max_tokens"),
    ({"prompt": "x", "max_tokens": 513}, 400, "at most 512", "max_tokens"),
    ({"prompt": 5}, 422, "Expected `str | null`", "prompt"),
    ({"prompt": "x", "regex": "a", "choice": ["a"]}, 400, "at most one", "choice"),
    ({"messages": [{"role": "user", "content": "x"}], "prompt": "y"}, 400, "exactly one", "prompt"),
    ({"prompt": "x", "response_schema": {"$ref": "https://example.com/s.json"}}, 400, "outside", "response_schema"),
    ({"prompt": "x", "whitespace": "wide"}, 422, "whitespace", "whitespace"),
])
def test_bad_requests_name_the_problem(client, body, status, needle, field):
    r = client.post("/generate", json=body)
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    problem = r.json()
    assert needle in problem["detail"] and problem["field"] == field and problem["status"] == status
    assert problem["request_id"] == r.headers["x-request-id"]


def test_strin_names_keyword_and_path(client):
    p = client.post("/generate", json={"prompt": "x", "response_schema": {"type": "strin"}}).json()
    assert (p["keyword"], p["path"]) == ("type", "#/type")


def test_bad_regex_names_position(client):
    p = client.post("/generate", json={"prompt": "x", "regex": "ab(c"})
    assert p.status_code == 400 and p.json()["position"] is not None


def test_malformed_json_and_too_long_prompt(client):
    r = client.post("/generate", content=b'{"prompt": ', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = client.post("/generate", json={"prompt": "hello " * 3000})  # > 2047 tokens of the tiny model
    assert r.status_code == 400 and "tokens" in r.json()["detail"]
    r = client.post("/generate", json={"prompt": "x" * 70000})  # body > 64 KiB
    assert r.status_code == 413
    # The server keeps serving after each of these.
    assert client.post("/generate", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_concurrent_requests_are_batched(client):
    state = service_state(client.app)
    steps0 = state.engine.engine.stats()["num_steps"]

    async def fire():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://stencil", timeout=60) as ac:
            return await asyncio.gather(*(
                ac.post("/generate", json={"prompt": f"item {i}", "regex": "[ab]{400}", "max_tokens": 12,
                                              "close_on_budget": False})
                for i in range(8)))

    responses = client.blocking_portal.call(fire)
    bodies = [r.json() for r in responses]
    assert [r.status_code for r in responses] == [200] * 8
    assert all(b["finish_reason"] == "length" and b["usage"]["completion_tokens"] == 12 for b in bodies), bodies
    assert all(re.fullmatch("[ab]+", b["text"]) for b in bodies), bodies
    steps = state.engine.engine.stats()["num_steps"] - steps0
    assert steps < 8 * 12 // 2, f"{steps} steps for 8 x 12 tokens: requests were not batched"


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 4, 5, 64])
def test_stream_equals_non_stream(client, max_tokens):
    body = {"prompt": "Describe a person.", "response_schema": PERSON, "max_tokens": max_tokens,
            "temperature": 0.8, "seed": 1234, "close_on_budget": max_tokens == 64}
    plain = client.post("/generate", json=body).json()
    r = client.post("/generate", json={**body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = _sse(r.text)
    assert events[-1] == "[DONE]"
    final = events[-2]
    deltas = events[:-2]
    assert final["type"] == "final" and all(e["type"] == "delta" for e in deltas)
    assert "".join(e["text"] for e in deltas) == plain["text"]
    for key in ("output", "valid", "finish_reason", "usage", "warnings"):
        assert final[key] == plain[key], key


def test_unconstrained_stream_with_stop_matches(client):
    body = {"prompt": "a b c", "max_tokens": 24, "temperature": 1.0, "seed": 7, "stop": ["e"]}
    plain = client.post("/generate", json=body).json()
    events = _sse(client.post("/generate", json={**body, "stream": True}).text)
    assert "".join(e["text"] for e in events[:-2]) == plain["text"]
    assert "e" not in plain["text"]


# Line breaks to str.splitlines (and httpx's iter_lines) that SSE does not break at.
SPLITLINES_ONLY = "\u2028\x85\u2029"


@pytest.mark.parametrize("path", ["/generate", "/v1/chat/completions", "/v1/completions"])
def test_stream_events_survive_a_line_reader_that_splits_like_splitlines(client, path):
    # The constraint makes the model write the three characters; every event must still be one
    # line to a client that reads lines with httpx's iter_lines (Stencil's own client does).
    regex = "a" + SPLITLINES_ONLY + "b"
    model = service_state(client.app).model_name
    if path == "/generate":
        body = {"prompt": "x", "regex": regex, "max_tokens": 16, "stream": True}
    elif path == "/v1/chat/completions":
        body = {"model": model, "messages": [{"role": "user", "content": "x"}], "max_tokens": 16, "stream": True,
                "structured_outputs": {"regex": regex}}
    else:
        body = {"model": model, "prompt": "x", "max_tokens": 16, "stream": True,
                "structured_outputs": {"regex": regex}}
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith(("data: ", "event: ")) for ln in lines), lines
    payloads = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: {")]
    if path == "/generate":
        text = "".join(p["text"] for p in payloads if p["type"] == "delta")
    elif path == "/v1/chat/completions":
        text = "".join(p["choices"][0]["delta"].get("content") or "" for p in payloads if p["choices"])
    else:
        text = "".join(p["choices"][0]["text"] for p in payloads if p["choices"])
    assert text == regex
    assert lines[-1] == "data: [DONE]"


def test_event_json_escapes_the_extra_line_breaks_and_decodes_to_the_same_text():
    from stencil.service.openai_common import event_json, sse

    obj = {"text": "x" + SPLITLINES_ONLY + "\u00e9\u2019y"}
    data = event_json(obj)
    assert json.loads(data) == obj and len(data.decode().splitlines()) == 1
    assert b"\\u2028" in data and "\u00e9\u2019".encode() in data  # other text stays raw UTF-8
    event = sse(obj, "response.output_text.delta").decode()
    assert event.splitlines()[:2] == ["event: response.output_text.delta", "data: " + data.decode()]


def test_queue_full_gives_429_with_retry_after(client):
    eng = service_state(client.app).engine.engine
    saved = eng.config.max_waiting
    eng.config.max_waiting = 0
    try:
        r = client.post("/generate", json={"prompt": "x", "max_tokens": 1})
    finally:
        eng.config.max_waiting = saved
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert client.post("/generate", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_api_key(client):
    cfg = service_state(client.app).config
    cfg.api_key = "s3cret"
    try:
        assert client.post("/generate", json={"prompt": "x", "max_tokens": 1}).status_code == 401
        wrong = client.post("/generate", json={"prompt": "x", "max_tokens": 1},
                            headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["status"] == 401
        ok = client.post("/generate", json={"prompt": "x", "max_tokens": 1},
                         headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200
        assert client.post("/generate", json={"prompt": "x", "max_tokens": 1},
                           headers={"X-API-Key": "s3cret"}).status_code == 200
        assert client.get("/health").status_code == 200  # probes need no key
    finally:
        cfg.api_key = None


def test_health_and_openapi(client):
    h = client.get("/health")
    assert h.status_code == 200
    body = h.json()
    assert body["status"] == "ok" and body["engine"]["kv_blocks_total"] == 256
    assert body["engine"]["running"] == 0 and body["engine"]["kv_blocks_free"] == 256
    from stencil.kernels import native, vec_attention

    # The tiny test model is dense fp32: no int4 or block GEMM; attention native (AVX512 or the
    # portable vector kernel) where one builds.
    cpu = native.available() or vec_attention.available()
    assert body["kernels"] == {"attention": "cpu" if cpu else "torch", "int4_gemm": "none",
                               "gguf_gemm": "none", "kv_cache_dtype": "float32"}
    schema = client.get("/schema/openapi.json").json()
    props = schema["components"]["schemas"]["GenerateRequest"]["properties"]
    assert {"prompt", "messages", "response_schema", "regex", "choice", "stream"} <= set(props)
    assert "/generate" in schema["paths"] and "/health" in schema["paths"]


def test_metrics_track_requests(client):
    def scrape() -> dict:
        text = client.get("/metrics").text
        out = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
                out[key] = s.value
        return out

    before = scrape()
    body = client.post("/generate", json={"prompt": "count", "regex": "[ab]{30}", "max_tokens": 6,
                                                 "close_on_budget": False}).json()
    after = scrape()
    assert after["stencil_completion_tokens_total"] - before["stencil_completion_tokens_total"] == 6
    assert (after["stencil_prompt_tokens_total"] - before["stencil_prompt_tokens_total"]
            == body["usage"]["prompt_tokens"])
    ok = 'stencil_http_requests_total{"endpoint": "/generate", "status": "200"}'
    assert after[ok] - before.get(ok, 0) == 1
    assert after["stencil_time_to_first_token_seconds_count"] - before["stencil_time_to_first_token_seconds_count"] == 1
    assert after["stencil_inter_token_latency_seconds_count"] - before["stencil_inter_token_latency_seconds_count"] == 5
    assert after["stencil_kv_blocks_total"] == 256 and after["stencil_kv_blocks_used"] == 0
    assert after["stencil_requests_running"] == 0 and after["stencil_requests_waiting"] == 0
    assert after["stencil_engine_alive"] == 1
    for name in ("stencil_prefix_cache_hit_rate", "stencil_grammar_compile_seconds_count",
                 "stencil_grammar_cache_hits_total", "stencil_spec_draft_tokens_total",
                 "stencil_spec_accepted_tokens_total"):
        assert name in after, name


def test_dead_engine_reported(tiny_model_dir):
    dead: list = []
    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=64), ServiceConfig(),
                     on_engine_dead=dead.append)
    with TestClient(app, timeout=30) as c:
        eng = service_state(app).engine

        def boom():
            raise RuntimeError("simulated kernel fault")

        eng.engine.step = boom
        r = c.post("/generate", json={"prompt": "x", "max_tokens": 4})
        assert r.status_code == 503, r.text
        h = c.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "dead" and "simulated" in h.json()["error"]
        assert c.post("/generate", json={"prompt": "x", "max_tokens": 4}).status_code == 503
    assert len(dead) == 1 and "simulated" in str(dead[0])
