"""What users of the OpenAI SDK, instructor and pydantic write, unchanged, against a live server.

Drives the real ``openai`` package (and ``instructor``) over HTTP on the tiny random model: the
text is garbage, so assertions are made on what the grammar guarantees (shapes, schemas, call
formats), on protocol details (deltas, events, errors), and against other runs of the same
request.
"""

from __future__ import annotations

import enum
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")

from pydantic import BaseModel, Field, StringConstraints  # noqa: E402

from stencil.service.state import service_state  # noqa: E402
from service_live import TINY_MODEL_NAME as MODEL_NAME, tiny_live_server  # noqa: E402

MESSAGES = [{"role": "user", "content": "Ann is an admin in Oslo, tagged red and blue, aged 35."}]
EOS = 2  # SmolLM2's <|im_end|>: banning it shows what the grammar alone allows after a call


class Role(enum.Enum):
    admin = "admin"
    user = "user"


class Address(BaseModel):
    city: str = Field(max_length=8)


Tag = Annotated[str, StringConstraints(max_length=4)]


class Person(BaseModel):
    """Nested model + Enum (pydantic writes both as $defs), a set (uniqueItems) and a multipleOf."""

    name: str = Field(max_length=8)
    role: Role
    tags: set[Tag] = Field(max_length=3)
    age: int = Field(ge=0, le=100, multiple_of=5)
    home: Address


class Card(BaseModel):
    """Like Person but all exactly enforceable, so it also compiles under ``strict: true``."""

    name: str = Field(max_length=8)
    role: Role
    home: Address
    level: Literal[1, 2, 3]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 9}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The current time."}}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir, num_kv_blocks=256) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


# -- 1. tool parameters with $defs / $ref -----------------------------------------------------------


def test_raw_pydantic_schema_as_tool_parameters_gives_valid_calls(client):
    params = Person.model_json_schema()
    assert "$defs" in params  # what pydantic writes, and what used to be a 400
    tool = {"type": "function", "function": {"name": "P", "parameters": params}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[tool], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=200, seed=1)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls", c
    args = json.loads(c.message.tool_calls[0].function.arguments)
    Person.model_validate(args)
    assert args["age"] % 5 == 0 and args["role"] in ("admin", "user")


def test_sdk_pydantic_function_tool_is_parsed_into_the_model(client):
    r = client.chat.completions.parse(model=MODEL_NAME, messages=MESSAGES, tools=[openai.pydantic_function_tool(Card)],
                                      tool_choice="required", parallel_tool_calls=False, max_tokens=200, seed=2)
    call = r.choices[0].message.tool_calls[0]
    assert isinstance(call.function.parsed_arguments, Card)
    assert r.choices[0].model_extra["valid"] is True


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_returns_the_nested_model(server, mode):
    instructor = pytest.importorskip("instructor")
    raw = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ic = instructor.from_openai(raw, mode=getattr(instructor.Mode, mode))
    p = ic.chat.completions.create(model=MODEL_NAME, response_model=Person, messages=MESSAGES, max_tokens=200,
                                   max_retries=0, temperature=0)
    assert isinstance(p, Person) and isinstance(p.role, Role) and isinstance(p.home, Address)
    assert isinstance(p.tags, set) and p.age % 5 == 0 and 0 <= p.age <= 100


# -- 2. strict omitted = relax only what cannot be enforced -----------------------------------------

# uniqueItems over an open array and multipleOf over unbounded numbers were beyond the grammar's exact
# enforcement when this was written; enum, maxItems and maxLength are not. The tests ask the compiler
# which keywords it relaxes now.
RELAXED = {"type": "object", "properties": {
    "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4, "uniqueItems": True},
    "n": {"type": "number", "multipleOf": 0.3, "minimum": 0, "maximum": 9},
    "colour": {"enum": ["red", "green"]}}, "required": ["tags", "n", "colour"], "additionalProperties": False}


def _relaxed_keywords(schema: dict) -> list[str]:
    from stencil.grammar.json_schema import schema_to_regex

    _, notes = schema_to_regex(schema, strict=False)
    keywords = sorted({n.split(" ", 1)[0] for n in notes})
    if not keywords:
        pytest.skip("the grammar enforces every keyword of this schema exactly: nothing to relax")
    return keywords


def _format(schema: dict, strict: bool | None) -> dict:
    fmt: dict = {"name": "answer", "schema": schema}
    if strict is not None:
        fmt["strict"] = strict
    return {"type": "json_schema", "json_schema": fmt}


@pytest.mark.parametrize("strict", [None, False])
def test_strict_omitted_or_false_relaxes_and_reports(server, strict):
    keywords = _relaxed_keywords(RELAXED)
    checked = 0
    for seed in range(4):
        raw = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
            "model": MODEL_NAME, "messages": MESSAGES, "response_format": _format(RELAXED, strict),
            "max_tokens": 60, "seed": seed})
        assert raw.status_code == 200, raw.text
        body = raw.json()
        header = raw.headers["x-stencil-warnings"]
        assert all(k in header for k in keywords), (keywords, header)
        assert all(any(k in w for w in body["warnings"]) for k in keywords), body["warnings"]
        choice = body["choices"][0]
        try:
            value = json.loads(choice["message"]["content"])
        except ValueError:  # cut at max_tokens inside the document
            assert choice["finish_reason"] == "length" and choice["valid"] is False
            continue
        ok = jsonschema.Draft202012Validator(RELAXED).is_valid(value)
        assert choice["valid"] is ok  # the verdict is jsonschema's, relaxed keywords included, whatever stopped it
        # what the grammar can enforce, it still enforces
        assert value["colour"] in ("red", "green") and len(value["tags"]) <= 4
        assert set(value["tags"]) <= {"a", "b", "c"} and 0 <= value["n"] <= 9
        checked += 1
    assert checked > 0


def test_streamed_relaxed_answer_carries_header_valid_and_warnings(server):
    keyword = _relaxed_keywords(RELAXED)[0]
    body = {"model": MODEL_NAME, "messages": MESSAGES, "response_format": _format(RELAXED, None), "max_tokens": 60,
            "seed": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200 and keyword in r.headers["x-stencil-warnings"]
        chunks = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    last = chunks[-1]["choices"][0]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert last["finish_reason"] in ("stop", "length") and isinstance(last["valid"], bool)
    if last["finish_reason"] == "stop":
        assert last["valid"] is jsonschema.Draft202012Validator(RELAXED).is_valid(json.loads(text))
    assert last["valid"] or last["warnings"]


def test_strict_true_fails_closed_as_generate_does(client, server):
    keywords = _relaxed_keywords(RELAXED)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=_format(RELAXED, True))
    assert e.value.body["code"] in keywords and e.value.body["param"] == "response_format"
    raw = httpx.post(server.url + "/generate", json={"prompt": "x", "response_schema": RELAXED})
    assert raw.status_code == 400 and raw.json()["keyword"] in keywords


def test_tool_strict_flag_follows_openai(client):
    keyword = _relaxed_keywords(RELAXED)[0]
    relaxed_tool = {"type": "function", "function": {"name": "t", "parameters": RELAXED}}
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[relaxed_tool],
                                       tool_choice="required", max_tokens=80, seed=0)
    assert any(keyword in w for w in r.model_extra["warnings"])
    strict_tool = {"type": "function", "function": {"name": "t", "parameters": RELAXED, "strict": True}}
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[strict_tool],
                                       tool_choice="required", max_tokens=80)


# -- 3. the Responses API --------------------------------------------------------------------------


def test_responses_create_with_instructions_and_usage(client):
    r = client.responses.create(model=MODEL_NAME, instructions="Answer briefly.", input="Hello there",
                                max_output_tokens=8, temperature=0)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    assert r.incomplete_details.reason == "max_output_tokens"
    assert r.usage.output_tokens == 8 and r.usage.total_tokens == r.usage.input_tokens + 8
    same = client.responses.create(model=MODEL_NAME, instructions="Answer briefly.",
                                   input=[{"role": "user", "content": [{"type": "input_text", "text": "Hello there"}]}],
                                   max_output_tokens=8, temperature=0)
    assert r.output_text == same.output_text != ""
    assert r.store is False


def test_responses_parse_returns_output_parsed(client):
    r = client.responses.parse(model=MODEL_NAME, input=MESSAGES[0]["content"], text_format=Card,
                               max_output_tokens=200, temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, Card)
    assert r.model_extra["valid"] is True


def test_responses_stream_sends_typed_events_in_order(client):
    events = list(client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=6, stream=True,
                                         extra_body={"seed": 3}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == events[-4].text
    whole = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=6, extra_body={"seed": 3})
    assert whole.output_text == text


def test_responses_function_call_round_trip_and_streamed_arguments(client):
    tools = [{"type": "function", "name": "get_weather", "description": "Weather in a city.",
              "parameters": WEATHER["function"]["parameters"]}]
    kw = dict(model=MODEL_NAME, input="Weather in Rome?", tools=tools, tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=60, extra_body={"seed": 4})
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and len(calls) == 1
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
    events = list(client.responses.create(stream=True, **kw))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert len(deltas) >= 3 and "".join(deltas) == done.arguments == calls[0].arguments
    added = next(e for e in events if e.type == "response.output_item.added")
    assert added.item.type == "function_call" and added.item.name == "get_weather" and added.item.arguments == ""
    # the round trip: the call and its output go back as input items
    follow = client.responses.create(model=MODEL_NAME, tools=tools, tool_choice="none", max_output_tokens=10,
                                     input=[{"role": "user", "content": "Weather in Rome?"}, *r.output,
                                            {"type": "function_call_output", "call_id": calls[0].call_id,
                                             "output": '{"sky": "clear"}'}])
    assert follow.output[0].type == "message" and follow.output_text


def test_responses_logprobs_with_top_alternatives(client):
    r = client.responses.create(model=MODEL_NAME, input="Hi", max_output_tokens=4, temperature=0, top_logprobs=2,
                                include=["message.output_text.logprobs"])
    part = r.output[0].content[0]
    assert len(part.logprobs) == 4 and "".join(lp.token for lp in part.logprobs) == part.text
    for lp in part.logprobs:
        assert len(lp.top_logprobs) == 2 and lp.top_logprobs[0].token == lp.token
        assert lp.top_logprobs[0].logprob >= lp.top_logprobs[1].logprob


def test_responses_max_tool_calls_bounds_the_calls(client):
    tools = [{"type": "function", "name": "now", "description": "The time."}]
    r = client.responses.create(model=MODEL_NAME, input="Time?", tools=tools, tool_choice="required",
                                max_tool_calls=2, max_output_tokens=120)
    assert r.status == "completed" and 1 <= len(r.output) <= 2


def test_stateless_fields_and_unknown_routes_get_openai_errors(client, server):
    for kw, param in (({"previous_response_id": "resp_1"}, "previous_response_id"), ({"store": True}, "store"),
                      ({"background": True}, "background"), ({"include": ["file_search_call.results"]}, "include")):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL_NAME, input="x", **kw)
        assert e.value.body["param"] == param, e.value.body
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve("resp_123")
    assert "stateless" in e.value.message
    for method, path in (("POST", "/v1/embeddings"), ("GET", "/v1/nothing/here"), ("DELETE", "/v1/models")):
        raw = httpx.request(method, server.url + path, json={})
        assert raw.status_code in (404, 405), raw.text
        assert set(raw.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.embeddings.create(model=MODEL_NAME, input="x")


# -- 4. sampling controls ---------------------------------------------------------------------------


def _token_ids(server, token_bytes: list[int]) -> list[int]:
    vocab = service_state(server.app).engine.engine.grammar.vocab.token_bytes
    return [t for t, b in vocab.items() if b == bytes(token_bytes)]


def test_logit_bias_of_minus_100_on_the_greedy_first_token_changes_it(client, server):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=4, temperature=0, logprobs=True)
    first = client.chat.completions.create(**kw).choices[0].logprobs.content[0]
    ids = _token_ids(server, first.bytes)
    assert ids
    banned = client.chat.completions.create(logit_bias={str(t): -100 for t in ids}, **kw).choices[0]
    assert banned.logprobs.content[0].bytes != first.bytes
    forced = client.chat.completions.create(logit_bias={"42": 100}, **kw).choices[0]
    assert {tuple(it.bytes) for it in forced.logprobs.content} == {tuple(_bytes_of(server, 42))}


def _bytes_of(server, token: int) -> bytes:
    return service_state(server.app).engine.engine.grammar.vocab.token_bytes[token]


def test_top_logprobs_returns_sorted_alternatives(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3)
    items = r.choices[0].logprobs.content
    assert len(items) == 5
    for it in items:
        tops = it.top_logprobs
        assert len(tops) == 3 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        assert tops[0].bytes == it.bytes and tops[0].logprob == pytest.approx(it.logprob)  # greedy: the best
    legacy = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
    lp = legacy.choices[0].logprobs
    assert len(lp.top_logprobs) == 3
    for token, lprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and max(top.values()) == pytest.approx(lprob) and token in top


def test_penalties_change_the_output_and_are_range_checked(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=24, temperature=0)
    plain = client.chat.completions.create(**kw).choices[0].message.content
    # Negative values reward repetition: a random model rarely repeats a token in 24, so positive ones
    # would often change nothing.
    for extra in ({"presence_penalty": -2.0}, {"frequency_penalty": -2.0}, {"extra_body": {"repetition_penalty": 0.2}}):
        assert client.chat.completions.create(**kw, **extra).choices[0].message.content != plain, extra
    for bad, param in (({"presence_penalty": 2.5}, "presence_penalty"),
                       ({"frequency_penalty": -3}, "frequency_penalty"),
                       ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
                       ({"logit_bias": {"99999999": 1}}, "logit_bias"), ({"logit_bias": {"5": 150}}, "logit_bias")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(**kw, **bad)
        assert e.value.body["param"] == param, e.value.body


@pytest.mark.parametrize("extra, param", [
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),  # served, but not this value
    ({"web_search_options": {}}, "web_search_options"),
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),  # another server's extension
    ({"extra_body": {"max_token": 5}}, "max_token"),  # a typo
])
def test_every_field_is_served_or_refused_by_name(client, extra, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, **extra)
    assert e.value.body["param"] == param, e.value.body


def test_neutral_values_of_unserved_fields_and_labels_are_accepted(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=2, store=False,
                                       service_tier="auto", modalities=["text"], user="u-1", metadata={"k": "v"},
                                       safety_identifier="s", prompt_cache_key="doc-7", reasoning_effort="none")
    assert r.choices[0].finish_reason == "length"


# -- 5. tool calls stream as they are written --------------------------------------------------------


def _stream_calls(client, **kw) -> tuple[dict[int, dict], list]:
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, stream=True, **kw))
    calls: dict[int, dict] = {}
    for ch in chunks:
        for tc in (ch.choices[0].delta.tool_calls or []) if ch.choices else []:
            if tc.id is not None:
                assert tc.index not in calls and tc.function.name and tc.type == "function"
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": [tc.function.arguments]}
            else:
                calls[tc.index]["args"].append(tc.function.arguments)
    return calls, chunks


def test_parallel_calls_stream_each_with_its_index_and_false_allows_one(client):
    no_eos = {str(EOS): -100}  # the model may then stop only where the grammar leaves nothing else
    calls, chunks = _stream_calls(client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=True,
                                  logit_bias=no_eos, max_tokens=90, seed=5)
    assert len(calls) >= 2 and sorted(calls) == list(range(len(calls)))
    assert len({c["id"] for c in calls.values()}) == len(calls)
    complete = [c for c in calls.values() if c["name"] == "now" or len(c["args"]) > 1][:-1]
    for c in complete:
        params = WEATHER["function"]["parameters"] if c["name"] == "get_weather" else {"type": "object"}
        jsonschema.validate(json.loads("".join(c["args"])), params)
    one, chunks = _stream_calls(client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
                                logit_bias=no_eos, max_tokens=90, seed=5)
    assert len(one) == 1
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


def test_streamed_calls_equal_whole_calls(client):
    kw = dict(tools=[WEATHER], tool_choice="required", parallel_tool_calls=False, max_tokens=60, seed=9)
    whole = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, **kw).choices[0].message.tool_calls
    calls, _ = _stream_calls(client, **kw)
    assert [(c["name"], "".join(c["args"])) for c in calls.values()] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert len(calls[0]["args"]) >= 4  # "" with the name, then at least 3 fragments
