"""Hostile and broken requests get a 4xx that names the problem; one request's fault stays its own.

Every case here goes through the real app (tiny model, real tokenizer, real grammar compiler).
The isolation tests inject a fault into one request (its matcher, its detokenizer, its grammar
compile) with ``monkeypatch`` keyed on something only that request has, and check that a request
running beside it completes normally and that the engine is still alive with every KV block free.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import threading
import time
from concurrent.futures import Future

import httpx
import pytest
from litestar.testing import TestClient

from stencil.engine.config import EngineConfig
from stencil.engine.detokenizer import IncrementalDetokenizer
from stencil.engine.llm_engine import EngineError, LLMEngine
from stencil.engine.request import SamplingParams
from stencil.engine.structured_output import StructuredOutputManager
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.backends.eager import EagerMatcher
from stencil.grammar.backends.lazy import LazyMatcher
from stencil.service.app import create_app
from stencil.service.state import ServiceConfig
from stencil.service.validation import OutputChecker

MAX_PROMPT_CHARS = 20_000
MAX_BODY = 64 << 10
MAX_SCHEMA = 16 << 10


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    app = create_app(EngineConfig(model=tiny_model_dir, num_kv_blocks=256, max_num_seqs=16, grammar_timeout_s=1.5),
                     ServiceConfig(max_tokens_cap=64, default_max_tokens=8, max_body_bytes=MAX_BODY,
                                   max_prompt_chars=MAX_PROMPT_CHARS, max_schema_bytes=MAX_SCHEMA,
                                   request_timeout_s=60))
    with TestClient(app, timeout=60) as c:
        yield c


def _engine_idle(client) -> dict:
    stats = client.get("/health").json()["engine"]
    assert stats["running"] == 0 and stats["waiting"] == 0, stats
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"], stats
    return stats


def _engine_idle_soon(client, polls: int = 200) -> dict:
    """``_engine_idle`` once the engine thread has applied the aborts posted to it (it reads its
    inbox between steps), polling ``/health`` at most ``polls`` times."""
    for _ in range(polls):
        stats = client.get("/health").json()["engine"]
        if stats["running"] == 0 and stats["waiting"] == 0:
            break
        time.sleep(0.05)
    return _engine_idle(client)


def _metric(client, name: str) -> float:
    """The value of an unlabelled sample of ``/metrics``."""
    from prometheus_client.parser import text_string_to_metric_families

    text = client.get("/metrics").text
    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name)


def _problem(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/problem+json")
    p = r.json()
    assert p["status"] == status and p["request_id"] == r.headers["x-request-id"]
    return p


def _nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


CYCLE = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
SELF_CYCLE = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


# -- the body ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("raw, needle", [
    (b'{"prompt": "x",}', "not valid JSON"),
    (b'{"prompt": ', "not valid JSON: it ends at byte 11"),
    (b'{"prompt": "x", "foo": 1, "max_tokens": ', "not valid JSON: it ends at byte 40"),
    (b"\x00\x01", "not valid JSON"),
    (b"", "body is empty"),
    (b'{"prompt": "\xff\xfe"}', "UTF-8"),
    (b'{"pr\xc3\x28mpt": "x"}', "UTF-8"),
    (b'{"prompt": "x", "response_schema": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}", "too deeply"),
])
def test_undecodable_bodies(client, raw, needle):
    p = _problem(client.post("/generate", content=raw, headers={"content-type": "application/json"}), 400)
    assert needle in p["detail"], p


def test_deep_nesting_of_a_typed_field_is_refused_at_its_first_wrong_level(client):
    raw = b'{"prompt": "x", "stop": ' + b"[" * 20_000 + b"]" * 20_000 + b"}"
    p = _problem(client.post("/generate", content=raw, headers={"content-type": "application/json"}), 422)
    assert p["field"] == "stop[0]" and "Expected `str`" in p["detail"], p


@pytest.mark.parametrize("body, needle, field", [
    ({"prompt": ["a", "b"]}, "Expected `str | null`", "prompt"),
    ({"prompt": "x", "max_tokens": "ten"}, "Expected `int | null`", "max_tokens"),
    ({"prompt": "x", "temperature": -1}, ">= 0.0", "temperature"),
    ({"prompt": "x", "top_p": 0}, "> 0.0", "top_p"),
    ({"prompt": "x", "stream": "yes"}, "Expected `bool`", "stream"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role", "messages[0].role"),
    ({"messages": [{"role": "user", "content": "x", "name": "bob"}]}, "unknown field `name`", "messages[0].name"),
    ({"prompt": "x", "respose_schema": {}}, "unknown field `respose_schema`", "respose_schema"),
    ({"prompt": "x", "max_tokens": -3}, ">= 1", "max_tokens"),
    ({"prompt": "x", "max_tokens": 0}, ">= 1", "max_tokens"),
    # strict types: msgspec's lenient mode (Litestar's default) would have taken these
    ({"prompt": "x", "max_tokens": "5"}, "Expected `int | null`, got `str`", "max_tokens"),
    ({"prompt": "x", "stream": "true"}, "Expected `bool`, got `str`", "stream"),
    ({"prompt": "x", "temperature": "0.5"}, "Expected `float`, got `str`", "temperature"),
    ({"prompt": "x", "max_tokens": True}, "Expected `int | null`, got `bool`", "max_tokens"),
    ({"messages": [{"role": "user", "content": 5}]}, "Expected `str`, got `int`", "messages[0].content"),
])
def test_wrong_types_and_unknown_fields_name_the_field(client, body, needle, field):
    p = _problem(client.post("/generate", json=body), 422)
    assert needle in p["detail"] and p["field"] == field, p


@pytest.mark.parametrize("ctype", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"])
def test_a_body_not_sent_as_json_is_415(client, ctype):
    for path in ("/generate", "/v1/chat/completions"):
        r = client.post(path, content=b'{"prompt": "x", "messages": [{"role": "user", "content": "x"}]}',
                        headers={"content-type": ctype})
        assert r.status_code == 415, r.text
        message = r.json()["detail"] if path == "/generate" else r.json()["error"]["message"]
        assert "application/json" in message and ctype in message
    for ctype in ("application/json; charset=utf-8", "application/vnd.api+json"):
        r = client.post("/generate", content=b'{"prompt": "x", "max_tokens": 1}', headers={"content-type": ctype})
        assert r.status_code == 200, r.text


POSTS = {"/generate": {"prompt": "x", "max_tokens": 1},
         "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
         "/v1/completions": {"prompt": "x", "max_tokens": 1},
         "/v1/responses": {"input": "x", "max_output_tokens": 1}}


@pytest.mark.parametrize("path", list(POSTS))
@pytest.mark.parametrize("headers", [{}, {"content-type": ""}])
def test_a_body_without_content_type_is_415(client, path, headers):
    """``curl -H 'Content-Type:' -d '{...}'``: the body is not declared JSON, so it is not read as JSON."""
    r = client.post(path, content=json.dumps(POSTS[path]).encode(), headers=headers)
    assert r.status_code == 415, r.text
    if path == "/generate":
        p = _problem(r, 415)
        message, field = p["detail"], p["field"]
    else:
        message, field = r.json()["error"]["message"], r.json()["error"]["param"]
    assert field == "content-type" and "application/json" in message and "has none" in message, r.text
    assert client.post(path, json=POSTS[path]).status_code == 200  # httpx's json= declares it


def test_json_that_is_not_an_object(client):
    for body in ([1, 2], "prompt", 3):
        p = _problem(client.post("/generate", json=body), 422)
        assert "Expected `object`" in p["detail"], p


# -- prompts and lengths -------------------------------------------------------------------------------

def test_empty_messages_with_tools_are_refused(client):
    """The tools' system message must not make an empty conversation look like one."""
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = client.post("/v1/chat/completions", json={"messages": [], "tools": [tool], "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages" and "messages is empty" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body, status, needle, field", [
    ({"prompt": ""}, 400, "prompt is empty", "prompt"),
    ({"messages": []}, 400, "messages is empty", "messages"),
    ({"prompt": "x" * (MAX_PROMPT_CHARS + 1)}, 400, f"the limit is {MAX_PROMPT_CHARS}", "prompt"),
    ({"messages": [{"role": "user", "content": "y" * (MAX_PROMPT_CHARS + 1)}]}, 400,
     f"the limit is {MAX_PROMPT_CHARS}", "messages"),
    # 3000 words are about 3000 tokens: longer than the tiny model's 2048-token context.
    ({"prompt": "hello " * 3000}, 400, "this model allows at most 2047", "prompt"),
    ({"messages": [{"role": "user", "content": "hello " * 3000}]}, 400, "this model allows at most 2047", "messages"),
    ({"prompt": "x", "max_tokens": 65}, 400, "at most 64", "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**12}, 400, "at most 64", "max_tokens"),
    ({"prompt": "x", "max_tokens": 10**30}, 400, "at most 64", "max_tokens"),
])
def test_prompt_and_length_limits(client, body, status, needle, field):
    p = _problem(client.post("/generate", json=body), status)
    assert needle in p["detail"] and p.get("field") == field, p


@pytest.mark.parametrize("spec, needle", [
    ({"method": "ngram", "max_batch_size": None}, "speculative.max_batch_size must be an integer"),
    ({"method": "ngram", "num_speculative_tokens": 4.5}, "speculative.num_speculative_tokens must be an integer"),
    ({"method": "ngram", "max_draft_tokens_per_step": "5"}, "speculative.max_draft_tokens_per_step must be an integer"),
    ({"method": "ngram", "cost_aware": "no"}, "speculative.cost_aware must be a boolean"),
    ({"method": "ngram", "min_acceptance": 2}, "speculative.min_acceptance must be in 0..1"),
    ({"method": "ngram", "backoff_steps": -5}, "backoff_steps must be >= 0"),
])
def test_bad_speculative_settings_are_named_and_never_fatal(client, spec, needle):
    """A wrongly typed speculative setting once passed parsing and killed the engine loop in the
    next step (``None > int``); it is refused up front, naming the field."""
    p = _problem(client.post("/generate", json={"prompt": "x", "max_tokens": 4, "speculative": spec}), 400)
    assert needle in p["detail"] and p["field"] == "speculative." + next(k for k in spec if k != "method"), p
    ok = client.post("/generate", json={"prompt": "x", "max_tokens": 3, "speculative": {"method": "ngram"}})
    assert ok.status_code == 200, ok.text
    _engine_idle(client)


@pytest.mark.parametrize("temperature", [1e7, 1.7e307])
def test_absurd_temperature_is_refused_not_fatal(client, temperature):
    """Past float32's range the sampler would divide masked -inf logits by inf (NaN) and
    torch.multinomial would kill the engine loop for everyone."""
    body = {"prompt": "x", "regex": "[ab]{5}", "temperature": temperature, "speculative": True}
    p = _problem(client.post("/generate", json=body), 400)
    assert "temperature must be between 0 and 1e+06" in p["detail"] and p["field"] == "temperature", p
    ok = client.post("/generate", json={**body, "temperature": 1e6})
    assert ok.status_code == 200 and re.fullmatch("[ab]{5}", ok.json()["text"]), ok.text


def test_body_over_the_limit_is_413(client):
    p = _problem(client.post("/generate", json={"prompt": "z" * (MAX_BODY + 10)}), 413)
    assert p["title"] == "Payload Too Large" and f"at most {MAX_BODY} bytes" in p["detail"], p
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "z" * (MAX_BODY + 10)}]})
    assert r.status_code == 413 and f"at most {MAX_BODY} bytes" in r.json()["error"]["message"], r.text


@pytest.mark.parametrize("body, field", [
    ({"speculative": {"foo": 1}}, "speculative.foo"),
    ({"speculative": {"method": "ngram", "min_evidence": -1}}, "speculative.min_evidence"),
    ({"soft_limits": {"bogus": 3}}, "soft_limits.bogus"),
    ({"soft_limits": {"string_chars": 0}}, "soft_limits.string_chars"),
    ({"temperature": 1e308}, "temperature"),
])
def test_engine_refusals_name_the_field(client, body, field):
    p = _problem(client.post("/generate", json={"prompt": "x", "max_tokens": 2, **body}), 400)
    assert p["field"] == field and field in p["detail"], p


def test_whitespace_prompt_and_max_tokens_one_are_served(client):
    r = client.post("/generate", json={"prompt": "   ", "max_tokens": 1})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


# -- schemas -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schema, needle, keyword, path", [
    (_nested(40), "nests deeper than 32 levels", None, "#" + "/items" * 33),
    (SELF_CYCLE, "admits no value", "$ref", "#"),
    (CYCLE, "admits no value", "$ref", "#"),
    ({"type": "array", "minItems": 3, "maxItems": 1}, "admits no value", "minItems", "#"),
    ({"type": "string", "minLength": 5, "maxLength": 2}, "admits no value", "minLength", "#"),
    ({"type": "string", "minLength": 100_000_000}, "more than the 10000 characters", "minLength", "#/minLength"),
    ({"enum": []}, "enum is empty", "enum", "#"),
    ({"type": "array", "minItems": 1_000_000, "items": {"type": "integer"}}, "more than the 10000 items",
     "minItems", "#/minItems"),
    ({"type": "string", "pattern": "^a{1000000}$"}, "repetition count 1000000 is above the 10000", "pattern",
     "#/pattern"),
    ({"type": "string", "pattern": "^(a{1000}){1000}$"}, "nest to 1000000 copies", "pattern", "#/pattern"),
    ({"type": "integer", "minimum": 5, "maximum": 3}, "admits no value", "minimum", "#"),
    ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 2}, "admits no value", "exclusiveMinimum", "#"),
    ({"not": {}}, "admits no value", "not", "#"),
    (False, "admits no value", "false", "#"),
    ({"type": "object", "properties": {"a": {"$ref": "http://127.0.0.1:9/evil.json"}}}, "points outside the schema",
     "$ref", "#/properties/a"),
    ({"$ref": "file:///etc/passwd"}, "nothing is ever fetched", "$ref", "#"),
    ({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}},
     f"the limit is {MAX_SCHEMA}", None, None),
])
def test_bad_schemas_name_keyword_and_path(client, schema, needle, keyword, path):
    p = _problem(client.post("/generate", json={"prompt": "x", "response_schema": schema}), 400)
    assert needle in p["detail"], p
    assert p.get("keyword") == keyword and p.get("path") == path, p


def test_remote_ref_is_never_fetched(client):
    """A listening socket sees no connection: the $ref is refused before anything resolves it."""
    import socket

    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    srv.settimeout(0.5)
    url = f"http://127.0.0.1:{srv.getsockname()[1]}/schema.json"
    try:
        for schema in ({"$ref": url}, {"type": "object", "properties": {"a": {"$ref": url + "#/x"}}},
                       {"$defs": {"x": {"$ref": url}}, "type": "integer"}):
            p = _problem(client.post("/generate", json={"prompt": "x", "response_schema": schema}), 400)
            assert url in p["detail"], p
        with pytest.raises(socket.timeout):
            srv.accept()
    finally:
        srv.close()


def test_recursive_schema_is_bounded_and_served(client):
    tree = {"$defs": {"n": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                            "required": ["c"]}}, "$ref": "#/$defs/n"}
    r = client.post("/generate", json={"prompt": "x", "response_schema": tree, "max_tokens": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    if body["finish_reason"] == "stop":
        assert body["valid"] and isinstance(json.loads(body["text"]), dict)


def test_large_schema_within_limits_is_served_or_refused_by_name(client):
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(200)},
            "required": [f"p{i}" for i in range(200)]}
    r = client.post("/generate", json={"prompt": "x", "response_schema": wide, "max_tokens": 8})
    if r.status_code == 200:
        assert r.json()["finish_reason"] == "length" and r.json()["text"].startswith('{"p0":')
    else:
        assert "grammar" in _problem(r, 400)["detail"]


# -- regexes -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [r"(a*)*b", r"(x+x+)+y", r"(a|a)*c", r"(\w+\s?)*!"])
def test_catastrophic_backtracking_shapes_are_answered(client, pattern):
    """Grammars are automata, not backtracking matchers: these compile and are served (the
    output check, ``regex``'s own match, has a timeout of its own)."""
    r = client.post("/generate", json={"prompt": "x", "regex": pattern, "max_tokens": 48, "stop": ["y", "b"]})
    assert r.status_code == 200, r.text
    body = r.json()
    if body["finish_reason"] == "stop" and body["valid"]:
        assert re.fullmatch(pattern, body["text"])


def test_exploding_regexes_are_served_lazily_or_refused_by_name(client):
    """A regex whose DFA explodes is served at once by the lazy matcher; asking for an eager index
    gets a 400 naming the grammar, remembered so a repeat does not tie up a worker again."""
    pattern = r"(a{1,100}){1,100}[b-z]{0,5000}"
    r = client.post("/generate", json={"prompt": "x", "regex": pattern, "max_tokens": 8})
    assert r.status_code == 200, r.text
    assert re.fullmatch("a+[b-z]*", r.json()["text"]), r.json()
    failures = _metric(client, "stencil_grammar_eager_failures_total")
    body = {"prompt": "x", "regex": pattern, "grammar_backend": "eager"}
    p = _problem(client.post("/generate", json=body), 400)
    assert "grammar" in p["detail"], p
    assert _metric(client, "stencil_grammar_eager_failures_total") == failures + 1
    assert _problem(client.post("/generate", json=body), 400)["detail"] == p["detail"]
    assert _metric(client, "stencil_grammar_eager_failures_total") == failures + 1  # not built again
    # Rust's regex syntax takes a repeated repeat; Python's (and so the output check) does not.
    p = _problem(client.post("/generate", json={"prompt": "x", "regex": "a{1000}{1000}"}), 400)
    assert p["position"] == 7 and "regex" in p["detail"], p


@pytest.mark.parametrize("pattern, needle", [("(?=a)b", "lookaround"), ("ab(c", "position"),
                                              ("[z-a]", "regex"), ("a" * 5000, "4096"),
                                              ("(b{1000}){1000}", "nest to 1000000 copies"),
                                              ("x((c{50}){50}){5}y", "nest to 12500 copies"),
                                              # counts side by side: each within the bound, summed above it
                                              ("|".join(f"({c}{{100}}){{100}}" for c in "abcdefgh"),
                                               "unroll to 40400 copies in all")])
def test_invalid_regexes_name_the_problem(client, pattern, needle):
    p = _problem(client.post("/generate", json={"prompt": "x", "regex": pattern}), 400)
    assert needle in p["detail"] or (needle == "position" and p.get("position") is not None), p
    assert p["field"] == "regex", p


@pytest.mark.parametrize("grammar, needle, column", [
    ('start: "a"~1000000', "repetition count 1000000 is above the 10000", 11),
    ('start: ("a"~1000)~1000', "nest to 1000000 copies", 18),
    ('start: "b" /a{20000}/', "repetition count 20000", 14),
    ('start: "x"~1..20000', "repetition count 20000", 11),
    ("start: " + " | ".join(f'("{c}"~100)~100' for c in "abcdefgh"), "unroll to 40400 copies in all", 65),
])
def test_lark_counts_above_what_a_grammar_counts_are_refused_like_a_regexs(client, grammar, needle, column):
    """Lark repetitions get the regex's limits (its budget automaton would unroll every copy,
    holding the interpreter lock); the 400 names the grammar's line and column."""
    p = _problem(client.post("/generate", json={"prompt": "x", "grammar": {"lark": grammar}}), 400)
    assert needle in p["detail"] and p["field"] == "grammar", p
    assert (p.get("line"), p.get("column")) == (1, column), p
    r = client.post("/generate", json={"prompt": "x", "grammar": {"lark": 'start: ("ab"~2)~3 | "~9999999"'},
                                       "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200 and r.json()["text"] in ("abababababab", "~9999999"), r.json()


def test_a_lark_grammar_longer_than_max_tokens_is_refused_before_it_runs(client):
    """The admission check of a regex (``max_tokens`` below the shortest output) holds for a Lark
    grammar written by hand too."""
    body = {"prompt": "x", "grammar": {"lark": 'start: "a"~100'}, "max_tokens": 24}
    p = _problem(client.post("/generate", json=body), 400)
    q = _problem(client.post("/generate", json={"prompt": "x", "regex": "a{100}", "max_tokens": 24}), 400)
    assert p["field"] == q["field"] == "max_tokens", (p, q)
    need = re.search(r"needs at least (\d+) tokens", q["detail"]).group(1)
    assert f"needs at least {need} tokens" in p["detail"], (p, q)
    r = client.post("/generate", json={"prompt": "x", "grammar": {"lark": 'start: "a"~100'}, "max_tokens": int(need)})
    assert r.status_code == 200 and r.json()["text"] == "a" * 100, r.json()


@pytest.mark.parametrize("pattern, position", [("(ab[", 3), ("(?=a)b", 0), (r"(a)\1", 3), ("a{1000000}", 1),
                                               ("x[{]{2,20001}", 4)])
def test_regex_errors_name_field_and_position(client, pattern, position):
    p = _problem(client.post("/generate", json={"prompt": "x", "regex": pattern}), 400)
    assert (p["field"], p["position"]) == ("regex", position), p


@pytest.mark.parametrize("stream", [False, True])
def test_a_compile_error_comes_before_the_first_byte(client, stream):
    """The engine prefills while the grammar compiles; a compile that fails is still a 400 before any
    byte of the answer (a stream never starts), and the prefilled request leaves no block behind."""
    prompt = "a long prompt to prefill while the grammar compiles " * 6
    for regex, schema in (("(?=a)b", None), (None, {"type": "object", "properties": {"a": {"not": {}}},
                                                        "required": ["a"]})):
        body = {"prompt": prompt, "stream": stream, **({"regex": regex} if regex else {"response_schema": schema})}
        p = _problem(client.post("/generate", json=body), 400)
        assert p["field"] == ("regex" if regex else "response_schema"), p
    _engine_idle_soon(client)


def test_output_check_of_a_cut_output_cannot_stall(client):
    """An output cut by a stop string is checked against the regex: never with exponential backtracking.

    Python's ``re`` needs ~2^n steps to refuse ``x * n`` for ``(x+x+)+y``; run in a thread so a
    regression fails here instead of hanging.
    """
    checker = OutputChecker()
    spec = GrammarSpec(kind="regex", value="(x+x+)+y")
    result: dict = {}
    t = threading.Thread(target=lambda: result.update(c=checker.check(spec, "x" * 64, "stop")), daemon=True)
    t.start()
    t.join(5)
    assert not t.is_alive(), "the regex output check backtracked exponentially"
    assert result["c"].valid is False and result["c"].warnings
    assert checker.check(spec, "xxxxy", "stop").valid is True


def test_server_is_clean_after_bad_input(client):
    _engine_idle(client)
    assert client.post("/generate", json={"prompt": "x", "max_tokens": 2}).json()["usage"]["completion_tokens"] == 2


# -- the OpenAI routes report the same faults in their own shape ----------------------------------------

@pytest.mark.parametrize("raw, needle", [
    (b'{"model": "x", "messages": [{"role": "user", "content": "\xff"}]}', "UTF-8"),
    # a typed field is refused at its first wrong level, before any depth limit
    (b'{"messages": ' + b"[" * 20_000 + b"]" * 20_000 + b"}", "messages[0]: Expected `object`, got `array`"),
    (b'{"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema", '
     b'"json_schema": {"name": "d", "schema": ' + b'{"a": ' * 5000 + b"1" + b"}" * 5000 + b"}}}", "too deeply"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": CYCLE}}}).encode(),
     "admits no value"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema",
                                     "json_schema": {"name": "r", "schema": {"$ref": "https://example.com/s"}}}}
                ).encode(), "points outside the schema"),
    (json.dumps({"messages": [{"role": "user", "content": "x"}], "max_tokens": -1}).encode(), "max_tokens"),
    # cut short after a field the route does not know: the cut is the problem, not the field
    (b'{"prompt": "hi", ', "not valid JSON: it ends at byte 17"),
    (b'{"messages": [{"role": "user", "content": "x"}], "max_output_tokens": 16', "not valid JSON: it ends at byte 72"),
])
def test_openai_routes_name_the_problem(client, raw, needle):
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert needle in err["message"] and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("body, param", [
    ({"max_tokens": "5"}, "max_tokens"),
    ({"stream": "true"}, "stream"),
    ({"n": 1.5}, "n"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
])
def test_openai_routes_take_strict_types(client, body, param):
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "Expected" in r.json()["error"]["message"]


DEEP = _nested(40)
CHAT = {"messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/chat/completions", {**CHAT, "temperature": 2.5}, "temperature", "between 0 and 2"),
    ("/v1/completions", {"prompt": "x", "temperature": 2.5}, "temperature", "between 0 and 2"),
    ("/v1/responses", {"input": "x", "temperature": 2.5}, "temperature", "between 0 and 2"),
    ("/v1/chat/completions", {**CHAT, "temperature": -1}, "temperature", "between 0 and 2"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages[0].content", "messages[0].content is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]},
     "messages[1].content", "is required"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "42"}]},
     "messages[1].tool_call_id", "messages[1].tool_call_id is required"),
    ("/v1/responses", {"input": [{"role": "user"}]}, "input[0].content", "needs content"),
    ("/v1/chat/completions", {}, "messages", "missing required field `messages`"),
    ("/v1/chat/completions", {"messages": [{"content": "x"}]}, "messages[0].role", "missing required field `role`"),
    ("/v1/completions", {"prompt": ""}, "prompt", "prompt is empty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 3000}]}, "messages",
     "this model allows at most 2047"),
    ("/v1/responses", {"input": "hello " * 3000}, "input", "this model allows at most 2047"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 10**9}, "max_completion_tokens",
     "max_completion_tokens is 1000000000; this server allows at most 64"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 10**9}, "max_tokens", "max_tokens is 1000000000"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 64, "max_completion_tokens": 10}, "max_completion_tokens",
     "max_tokens (64) and max_completion_tokens (10) differ"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 2, "structured_outputs": {"regex": "[ab]{20}"}},
     "max_completion_tokens", "max_completion_tokens 2 is below the shortest output"),
    ("/v1/responses", {"input": "x", "max_output_tokens": 10**9}, "max_output_tokens",
     "max_output_tokens is 1000000000"),
    ("/v1/responses", {"input": []}, "input", "input is empty"),
    ("/v1/responses", {"input": ""}, "input", "input is empty"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                                         "schema": {"type": "strin"}}}}, "text.format", "'strin'"),
    ("/v1/responses", {"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": DEEP}}},
     "text.format", "text.format nests deeper than 32 levels"),
    ("/v1/chat/completions", {**CHAT, "response_format": {"type": "json_schema",
                                                          "json_schema": {"name": "d", "schema": DEEP}}},
     "response_format", "response_format nests deeper than 32 levels"),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"a": DEEP}}}}]},
     "tools[0].function.parameters", "tools[0].function.parameters nests deeper"),
    ("/v1/chat/completions", {**CHAT, "structured_outputs": {"regex": "(ab["}}, "structured_outputs.regex",
     "unterminated character class"),
    ("/v1/chat/completions", {**CHAT, "soft_limits": {"bogus": 3}}, "soft_limits.bogus", "soft_limits.bogus"),
])
def test_openai_errors_name_the_param_as_sent(client, path, body, param, needle):
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and needle in err["message"] and err["type"] == "invalid_request_error", err


def test_openai_temperature_range_and_content_rules_keep_what_is_valid(client):
    for path, body in POSTS.items():
        if path != "/generate":
            r = client.post(path, json={**body, "temperature": 2})
            assert r.status_code == 200, r.text
    tool_turn = [{"role": "user", "content": "x"},
                 {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = client.post("/v1/chat/completions", json={"messages": tool_turn, "max_tokens": 1})
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("raw", [b'{"messages": [,}', b'{"messages": '])
def test_openai_malformed_json_says_so(client, raw):
    r = client.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("the body is not valid JSON: "), r.text


def test_each_refusal_is_logged_once_without_the_body(client, caplog):
    caplog.set_level(logging.INFO, logger="stencil")
    secret = "SECRET-PROMPT-7f3a"
    cases = [("/generate", {"prompt": secret, "temperature": 1e308}, 400, "temperature"),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": secret}], "temperature": 2.5}, 400,
              "temperature"),
             ("/generate", {"prompt": secret, "speculative": {"x" * 300: 1}}, 400, "speculative." + "x" * 300),
             ("/v1/completions", {"prompt": secret, "max_tokens": 10**9}, 400, "max_tokens")]
    for path, body, status, field in cases:
        caplog.clear()
        r = client.post(path, json=body)
        assert r.status_code == status, r.text
        lines = [rec for rec in caplog.records if getattr(rec, "request_id", None) == r.headers["x-request-id"]]
        assert len(lines) == 1, [rec.getMessage() for rec in caplog.records]
        text = lines[0].getMessage()
        assert lines[0].levelno == logging.INFO and lines[0].name == "stencil.errors", text
        assert text.startswith(f"refused POST {path} with {status} ({field[:40]}"), text
        assert secret not in text and len(text) < 500, text


# -- isolation -----------------------------------------------------------------------------------------

HEALTHY = {"prompt": "healthy", "regex": "[ab]{200}", "max_tokens": 40, "close_on_budget": False}


def _pair(client, poison: dict, healthy: dict = HEALTHY, delay_s: float = 0.3):
    """POST ``healthy`` then, once it runs, ``poison``; return both responses."""
    async def fire():
        transport = httpx.ASGITransport(app=client.app)
        async with httpx.AsyncClient(transport=transport, base_url="http://stencil", timeout=60) as ac:
            first = asyncio.ensure_future(ac.post("/generate", json=healthy))
            await asyncio.sleep(delay_s)
            second = await ac.post("/generate", json=poison)
            return await first, second

    return client.blocking_portal.call(fire)


def _check_healthy(r: httpx.Response, n: int = 40) -> None:
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and body["usage"]["completion_tokens"] == n, body
    assert re.fullmatch("[ab]+", body["text"]), body


def _inject(monkeypatch, method: str, regex: str, message: str) -> None:
    """Make ``method`` of both backends' matchers raise for grammars of ``regex``."""
    for cls in (EagerMatcher, LazyMatcher):
        original = getattr(cls, method)

        def faulty(self, *args, _original=original, **kw):
            if self.grammar.regex == regex:
                raise RuntimeError(message)
            return _original(self, *args, **kw)

        monkeypatch.setattr(cls, method, faulty)


def test_mask_fault_fails_one_request(client, monkeypatch):
    _inject(monkeypatch, "fill_bitmask", "[p]{50}", "injected mask fault")
    healthy, poisoned = _pair(client, {"prompt": "p", "regex": "[p]{50}", "max_tokens": 20, "close_on_budget": False})
    p = _problem(poisoned, 500)
    assert "grammar mask" in p["detail"] and "injected" not in p["detail"], p  # no internal text leaks
    _check_healthy(healthy)
    _engine_idle(client)


def test_append_fault_fails_one_request(client, monkeypatch):
    _inject(monkeypatch, "accept_tokens", "[q]{50}", "injected accept fault")
    healthy, poisoned = _pair(client, {"prompt": "q", "regex": "[q]{50}", "max_tokens": 20, "close_on_budget": False})
    assert "appending tokens" in _problem(poisoned, 500)["detail"]
    _check_healthy(healthy)
    _engine_idle(client)


def test_draft_fault_fails_one_request(client, monkeypatch):
    _inject(monkeypatch, "forced_text", "[u]{50}", "injected draft fault")
    healthy, poisoned = _pair(client, {"prompt": "u", "regex": "[u]{50}", "max_tokens": 20, "speculative": True, "close_on_budget": False})
    assert "proposing draft tokens" in _problem(poisoned, 500)["detail"]
    _check_healthy(healthy)
    _engine_idle(client)


def test_mask_fault_on_a_draft_row_fails_one_request(client, monkeypatch):
    """A matcher that fails while it fills the rows of its draft tokens (llguidance's "too many
    expressions constructed" did, on ``a{1000000}``) fails that request only: the drafts it
    had must not be read again when the step's tokens are learned (that ended the engine loop)."""
    original, hit = StructuredOutputManager.fill_rows, []

    def faulty(m, drafts, bitmask, row):
        if drafts and m.grammar.regex == "[w]{50}":
            m.accept_tokens(drafts[:1])  # part-way through the draft rows, as the real fault
            hit.append(len(drafts))
            raise RuntimeError("injected draft-row fault")
        return original(m, drafts, bitmask, row)

    monkeypatch.setattr(StructuredOutputManager, "fill_rows", staticmethod(faulty))
    healthy, poisoned = _pair(client, {"prompt": "w", "regex": "[w]{50}", "max_tokens": 20, "speculative": True,
                                       "close_on_budget": False})
    assert hit, "the request never had draft tokens: the test did not reach its case"
    assert "grammar mask" in _problem(poisoned, 500)["detail"]
    _check_healthy(healthy)
    _engine_idle(client)
    assert client.get("/health").json()["status"] == "ok"


def test_detokenizer_fault_fails_one_request_streamed(client, monkeypatch):
    original = IncrementalDetokenizer.push

    def push(self, ids):
        if "POISON" in self.stop:
            raise UnicodeError("injected detokenizer fault")
        return original(self, ids)

    monkeypatch.setattr(IncrementalDetokenizer, "push", push)
    healthy, poisoned = _pair(client, {"prompt": "d", "max_tokens": 20, "stop": ["POISON"], "stream": True})
    assert poisoned.status_code == 200  # headers were sent before the fault: it is reported in-band
    events = [ln[len("data: "):] for ln in poisoned.text.splitlines() if ln.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])
    assert err["type"] == "error" and err["error"]["status"] == 500, err
    assert "detokenizing" in err["error"]["detail"] and err["error"]["request_id"].startswith("req-")
    _check_healthy(healthy)
    _engine_idle(client)


def test_compile_fault_fails_one_request(client, monkeypatch):
    import stencil.grammar.compiler as compiler_module

    original = compiler_module.to_program

    def to_program(spec, **kw):
        if spec.value == "[r]{50}":
            raise MemoryError("injected compile fault")
        return original(spec, **kw)

    monkeypatch.setattr(compiler_module, "to_program", to_program)
    healthy, poisoned = _pair(client, {"prompt": "r", "regex": "[r]{50}", "max_tokens": 20, "close_on_budget": False})
    p = _problem(poisoned, 500)
    assert p["request_id"] in p["detail"] and "injected" not in p["detail"], p
    _check_healthy(healthy)
    # The compiler is still usable for other grammars.
    assert client.post("/generate", json={"prompt": "x", "regex": "[st]{9}", "max_tokens": 9}).json()["valid"]
    _engine_idle(client)


def test_failed_grammar_and_stop_string_in_one_step_are_both_reported(tiny_model_dir, monkeypatch):
    """A request finished while scheduling (its grammar failed) is reported even when another request
    stops on a stop string in the same step (finishing that one must not swallow the other's end)."""
    import stencil.engine.llm_engine as llm_engine

    class StopsAtOnce(llm_engine.IncrementalDetokenizer):
        def push(self, ids):
            text = super().push(ids)
            self.stopped = True  # as if a stop string had just been found
            return text

    # The engine makes a request's detokenizer at its first token: "stops" gets this one.
    monkeypatch.setattr(llm_engine, "IncrementalDetokenizer", StopsAtOnce)
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64))
    try:
        failed: Future = Future()
        failed.set_exception(GrammarError("injected compile failure"))
        eng.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=8), failed)
        eng.add_request("stops", [4, 5, 6], SamplingParams(max_tokens=8, temperature=0.0))
        outputs = {o.request_id: o for o in eng.step()}
        assert outputs["bad"].finished and outputs["bad"].finish_reason == "error"
        assert "injected" in outputs["bad"].error
        assert outputs["stops"].finished and outputs["stops"].finish_reason == "stop"
        assert not eng.has_unfinished() and eng.kv.num_free_blocks == eng.kv.num_blocks
    finally:
        eng.grammar.close()


def test_the_narrowed_answer_note_quotes_each_place():
    """A generated key may hold commas and spaces: each shortened place is a JSON string."""
    from stencil.service.generation import narrowed_note

    head = "max_tokens narrowed the answer: near the end only continuations that close in time were allowed"
    assert narrowed_note([]) == head
    assert narrowed_note(["", "/it has, commas/0"]) == head + ' (at: the root, "/it has, commas/0")'


def test_a_budget_that_cannot_be_kept_is_a_warning_on_the_cut_answer(client):
    """A schema whose closing automaton cannot be built (a URI format under a length bound) is
    served, but a cut answer says that max_tokens could not be kept by closing it, and why."""
    schema = {"type": "object", "properties": {"u": {"type": "string", "format": "uri", "maxLength": 40}},
              "required": ["u"]}
    r = client.post("/generate", json={"prompt": "link", "response_schema": schema, "max_tokens": 6})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["finish_reason"] == "length" and body["valid"] is False
    assert any("could not be kept by closing" in w and "closing automaton" in w for w in body["warnings"]), body
    _engine_idle(client)


def test_a_lark_grammar_with_too_many_definitions_is_refused_before_llguidance_sees_it(client):
    """A chain of rules past llguidance's stack (about 2,700 links killed the server with a
    segmentation fault) is refused by its count of definitions, with the line of the first one
    past the limit; a chain of 900 is served (it needs more Earley items in a row than
    llguidance's default 2,000: the raised limit, ``llg_c.MAX_ITEMS_IN_ROW``)."""
    from stencil.grammar.regex_tools import MAX_LARK_DEFINITIONS

    def chain(n: int) -> str:
        return "start: r0\n" + "\n".join(f'r{i}: r{i + 1} | "x"' for i in range(n)) + f'\nr{n}: "y"'

    too_many = {"prompt": "x", "grammar": {"lark": chain(MAX_LARK_DEFINITIONS + 5)}}
    p = _problem(client.post("/generate", json=too_many), 400)
    assert p["field"] == "grammar" and f"more than {MAX_LARK_DEFINITIONS} rules" in p["detail"], p
    assert p.get("line") == MAX_LARK_DEFINITIONS + 1, p
    r = client.post("/generate", json={"prompt": "x", "grammar": {"lark": chain(900)}, "max_tokens": 4,
                                       "temperature": 0})
    assert r.status_code == 200 and r.json()["text"] in ("x", "y"), r.json()
    _engine_idle_soon(client)


def test_long_lark_sequences_and_shared_prefixes_compile(client):
    """A rule of 300 literals in a row (its closing automaton's text was one nested group a
    symbol: Python's recursion limit, a 500) and alternatives sharing long prefixes are served."""
    seq = "start: " + " ".join(f'"w{i}"' for i in range(300))
    p = _problem(client.post("/generate", json={"prompt": "x", "grammar": {"lark": seq}, "max_tokens": 64}), 400)
    assert p["field"] == "max_tokens" and "needs at least" in p["detail"], p  # (its shortest output, read)
    r = client.post("/generate", json={"prompt": "x", "grammar": {"lark": seq}, "max_tokens": 16, "temperature": 0,
                                       "close_on_budget": False})
    assert r.status_code == 200 and r.json()["text"].startswith("w0w1w2"), r.json()
    shared = " ".join(f'"s{i}"' for i in range(400))
    fork = f'start: {shared} "a" | {shared} "b"'
    r = client.post("/generate", json={"prompt": "x", "grammar": {"lark": fork}, "max_tokens": 4, "temperature": 0,
                                       "close_on_budget": False})
    assert r.status_code == 200 and r.json()["text"].startswith("s0s1"), r.json()
    _engine_idle_soon(client)


def test_a_grammar_past_the_matchers_limits_fails_alone_as_the_constraints_fault(tiny_model_dir):
    """A rule of 12,000 alternatives holds more Earley items in a row than llguidance allows:
    that request fails with the constraint's error (``GrammarLimitError``, a 400 where the
    service answers it), not an internal one (a 500), and the request beside it is served."""
    from stencil.grammar.base import GrammarLimitError
    from stencil.engine.structured_output import is_dead_end

    assert is_dead_end(GrammarLimitError("x"))
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64))
    alts = eng.grammar.compile(GrammarSpec.grammar("start: " + " | ".join(f'"w{i}"' for i in range(12_000))))
    ok = eng.grammar.compile(GrammarSpec.regex("ab"))
    out = eng.generate([[1, 2, 3], [1, 2, 3]], SamplingParams(max_tokens=6, temperature=0), [alts, ok])
    assert out[0]["error"] is not None and "too large for the grammar matcher" in out[0]["error"], out[0]
    assert out[0]["output"].constraint_error, out[0]
    assert out[1]["error"] is None and out[1]["text"] == "ab", out[1]
    assert eng.kv.num_free_blocks == eng.kv.num_blocks


def test_an_object_of_many_optional_properties_is_served(client):
    """500 optional properties: not handed to llguidance (its parser held items in proportion,
    and failed mid-answer at 600), served by Stencil's own translation; the answer is valid."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(500)}}
    r = client.post("/generate", json={"prompt": "x", "response_schema": schema, "max_tokens": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is True and isinstance(body["output"], dict), body
    assert set(body["output"]) <= set(schema["properties"]), body


def test_a_prompt_near_the_context_end_lowers_max_tokens_and_the_answer_says_so(client, tokenizer):
    """The engine runs the request with ``max_tokens`` lowered to the room the prompt leaves
    (``LLMEngine.check_request`` returns that copy; the caller's params are untouched), and the
    answer's warnings say so (the last output's ``context_room``)."""
    prompt = "hello " * 2030
    room = 2048 - len(tokenizer(prompt)["input_ids"])
    assert 0 < room < 64
    r = client.post("/generate", json={"prompt": prompt, "max_tokens": 64})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["usage"]["completion_tokens"] <= room, body["usage"]
    assert any(w.startswith(f"max_tokens was lowered to {room}:") for w in body["warnings"]), body["warnings"]


def test_the_context_left_after_the_prompt_caps_max_tokens_and_the_budget_keeps_to_it(tiny_model_dir):
    """A prompt that leaves fewer tokens of the context than ``max_tokens``: the answer's budget
    is the room left (the budget-aware masks close the document within it; before, the context
    cut it mid-value: 200, ``valid`` false), the caller's params are left as they were (the
    engine runs a copy: ``check_request`` returns it),
    and a room below the shortest answer is a 400 naming ``max_tokens`` and the context."""
    eng = LLMEngine(EngineConfig(model=tiny_model_dir, num_kv_blocks=64, max_model_len=64))
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2},
                                               "b": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a", "b"]}
    g = eng.grammar.compile(GrammarSpec.json_schema(schema))
    need = g.min_output_tokens(0)
    params = SamplingParams(max_tokens=500, temperature=0)
    for room in (need, need + 3, need + 9):
        out = eng.generate([[1] * (64 - room)], params, [g])[0]
        assert out["error"] is None and len(out["token_ids"]) <= room, out
        value = json.loads(out["text"])  # complete: closed within the room
        assert set(value) == {"a", "b"} and len(value["a"]) >= 2, out["text"]
    assert params.max_tokens == 500 and params.context_room is None
    short = SamplingParams(max_tokens=500, temperature=0)
    fitted = eng.check_request([1] * (64 - need + 1), short)
    assert short.max_tokens == 500 and short.context_room is None  # a query: it writes nothing
    assert fitted.max_tokens == fitted.context_room == need - 1
    with pytest.raises(EngineError) as e:
        eng.check_budget(g, fitted)
    assert e.value.field == "max_tokens" and "the model's context of 64" in str(e.value), e.value


def test_a_terminal_that_writes_others_in_many_times_over_is_refused_at_once(client):
    """``T0: T1 T1``, ``T1: T2 T2``, ... twenty deep is 220 bytes of grammar and a regex of
    millions of characters (each terminal is written out in full): the budget's automaton held
    the server's memory and CPU for minutes. A 400 naming the line of the terminal past the
    limit, at once; the same shape with rules (not copied) is served or refused by its budget."""
    from stencil.grammar.regex_tools import MAX_TERMINAL_CHARS

    doubling = "start: T0\n" + "".join(f"T{i}: T{i + 1} T{i + 1}\n" for i in range(20)) + 'T20: "ab"\n'
    p = _problem(client.post("/generate", json={"prompt": "x", "grammar": {"lark": doubling}}), 400)
    assert p["field"] == "grammar" and f"more than {MAX_TERMINAL_CHARS} characters" in p["detail"], p
    rules = "start: r0\n" + "".join(f"r{i}: r{i + 1} r{i + 1}\n" for i in range(20)) + 'r20: "ab"\n'
    p = _problem(client.post("/generate", json={"prompt": "x", "grammar": {"lark": rules}, "max_tokens": 16}), 400)
    assert p["field"] == "max_tokens", p  # its shortest output (2^21 bytes) is far above 16 tokens
    _engine_idle_soon(client)


def test_llguidance_limit_messages_are_the_constraints_fault():
    """Each way llguidance 1.9.1 words a limit it reached maps to ``GrammarLimitError`` (a 400);
    any other failure stays internal (a 500)."""
    from stencil.grammar.backends.lazy import LazyMatcher
    from stencil.grammar.base import GrammarLimitError

    class Stub:
        def __init__(self, error):
            self._m = self

        def _own(self):
            pass

        def is_error(self):
            return True

        def stop_reason(self):
            return ""

    for message in ("Parser Error: Current row has 12001 items; max is 10000; consider ...",
                    "parser error: Too many items (limit 50000; mask); try avoiding ...",
                    "lexer error: too many expressions constructed"):
        stub = Stub(message)
        stub.get_error = lambda message=message: message
        with pytest.raises(GrammarLimitError, match="too large for the grammar matcher"):
            LazyMatcher._check(stub)
    stub = Stub("something else broke")
    stub.get_error = lambda: "something else broke"
    with pytest.raises(RuntimeError, match="grammar matcher failed: something else broke") as e:
        LazyMatcher._check(stub)
    assert not isinstance(e.value, GrammarLimitError)
