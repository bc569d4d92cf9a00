"""The OpenAI-compatible routes, driven by the official ``openai`` package over real HTTP.

A tiny random model emits garbage text, so every assertion on content is made on constrained
output (JSON Schema, tool calls) or against another run of the same request (seeds, stops).
"""

from __future__ import annotations

import json
import socket

import httpx
import jsonschema
import pytest

openai = pytest.importorskip("openai")

from stencil.service.state import service_state  # noqa: E402
from service_live import TINY_MODEL_NAME as MODEL_NAME, tiny_live_server, wait_until  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"level": {"type": "integer", "minimum": 0, "maximum": 9},
                   "colour": {"enum": ["red", "green", "blue"]}},
    "required": ["level", "colour"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {"type": "object",
                       "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                      "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                       "required": ["city", "days"], "additionalProperties": False},
    },
}
CLOCK = {"type": "function", "function": {"name": "now", "description": "The current time."}}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with tiny_live_server(tiny_model_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def _json_format(schema=SCHEMA):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")


def test_json_schema_completion_validates(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format=_json_format(),
                                       max_completion_tokens=40, seed=7)
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens > 0


def test_json_object_is_any_object(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, response_format={"type": "json_object"},
                                       max_tokens=24, seed=1, temperature=0)
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict)
    else:  # cut at max_tokens: still the start of an object
        assert c.finish_reason == "length" and c.message.content.startswith("{")


def test_streamed_equals_whole_and_reports_usage(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, response_format=_json_format(), max_tokens=40, seed=11)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.choices[0].message.content
    assert finish == ["stop"]
    jsonschema.validate(json.loads(text), SCHEMA)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


PARAMS = {"get_weather": WEATHER["function"]["parameters"],
          "now": {"type": "object", "properties": {}, "additionalProperties": False}}


def test_required_tool_call_arguments_validate(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                       tool_choice="required", parallel_tool_calls=False, max_tokens=80, seed=3)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_parallel_calls_each_validate(client):
    # A random model may chain calls until max_tokens; then there are no tool_calls, only the
    # cut text, which must still be call blocks.
    for seed in range(3):
        c = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                           tool_choice="required", max_tokens=120, seed=seed).choices[0]
        if c.finish_reason == "tool_calls":
            assert c.message.tool_calls and c.message.content is None
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])
        else:
            assert c.finish_reason == "length" and c.message.content.startswith("<tool_call>{")


def test_named_function_without_parameters_gets_empty_arguments(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER, CLOCK],
                                       tool_choice={"type": "function", "function": {"name": "now"}},
                                       max_tokens=40, seed=5)
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in calls] == [("now", "{}")]


def test_named_function_streams_as_it_is_written(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
              tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=60, seed=2)
    whole = client.chat.completions.create(**kw).choices[0].message.tool_calls
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == \
        (0, "function", "get_weather", "") and first.id.startswith("call_")
    assert all(d.id is None and d.function.name is None and d.index == 0 for d in rest)
    assert len(rest) >= 3  # the arguments arrive as they are written, not in one piece
    assert [(first.function.name, "".join(d.function.arguments for d in rest))] == \
        [(c.function.name, c.function.arguments) for c in whole]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_gives_text_or_a_valid_call(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                           max_tokens=30, seed=seed)
        c = r.choices[0]
        if c.message.tool_calls:
            assert c.finish_reason == "tool_calls"
            for call in c.message.tool_calls:
                jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
        else:
            assert not c.message.content.startswith("<tool_call>")


def test_auto_text_cut_at_max_tokens_is_a_text_answer_not_an_invalid_one(client):
    seen_text = False
    for seed in range(6):
        r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                           max_tokens=3, seed=seed)
        c = r.choices[0]
        extra = c.model_extra or {}
        if c.finish_reason == "length" and not c.message.tool_calls and \
                not "<tool_call>".startswith(c.message.content[:11]):
            seen_text = True  # free text, cut: no schema for text, so no verdict of validity
            assert "valid" not in extra, extra
        elif c.finish_reason == "length":  # a call (or its opening) cut short is not a valid answer
            assert extra.get("valid") in (False, None), extra
    assert seen_text  # the tiny model writes text on most seeds: the case is exercised


def test_n_choices_use_consecutive_seeds(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=6)
    both = client.chat.completions.create(n=2, seed=20, **kw)
    first = client.chat.completions.create(seed=20, **kw).choices[0].message.content
    second = client.chat.completions.create(seed=21, **kw).choices[0].message.content
    assert [c.index for c in both.choices] == [0, 1]
    assert [c.message.content for c in both.choices] == [first, second]
    assert both.usage.completion_tokens == 12  # no EOS is likely in 6 random tokens, so assert it
    one = client.chat.completions.create(seed=20, **kw).usage.prompt_tokens
    assert both.usage.prompt_tokens == one  # the prompt is counted once, as OpenAI does
    assert all(c.finish_reason == "length" for c in both.choices)


def test_stop_string_cuts_the_output(client):
    kw = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, seed=4, temperature=0)
    text = client.chat.completions.create(**kw).choices[0].message.content
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    r = client.chat.completions.create(stop=[stop], **kw).choices[0]
    assert r.finish_reason == "stop"
    assert r.message.content == text[:text.index(stop)]


def test_logprobs_cover_each_token(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=5, seed=9, logprobs=True)
    c = r.choices[0]
    items = c.logprobs.content
    assert len(items) == r.usage.completion_tokens
    assert bytes(b for it in items for b in it.bytes).decode() == c.message.content
    assert all(it.logprob <= 0 and it.top_logprobs == [] for it in items)  # none asked


def test_completions_echo_and_logprobs(client):
    r = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=4, seed=1, echo=True,
                                  logprobs=0)
    c = r.choices[0]
    assert c.text.startswith("Hello there")
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens
    assert c.text[lp.text_offset[0]:] == "".join(lp.tokens)
    plain = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=4, seed=1)
    assert c.text == "Hello there" + plain.choices[0].text


def test_completions_stream_and_schema(client):
    kw = dict(model=MODEL_NAME, prompt=["a", "b"], max_tokens=30, seed=3,
              extra_body={"response_format": _json_format()})
    whole = client.completions.create(**kw)
    streamed = list(client.completions.create(stream=True, **kw))
    for i in range(2):
        text = "".join(ch.choices[0].text for ch in streamed if ch.choices and ch.choices[0].index == i)
        assert text == whole.choices[i].text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_errors_use_openai_shape(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=MESSAGES)
    assert e.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES,
                                       response_format=_json_format({"type": "strin"}))
    assert "strin" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, tools=[WEATHER],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert e.value.body["param"] == "tool_choice"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, top_logprobs=3)
    assert e.value.body["param"] == "top_logprobs" and "logprobs: true" in e.value.message
    for bad, param in (({"n": 0}, "n"), ({"stream_options": {"include_usage": True}}, "stream_options"),
                       ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
                       ({"tools": [WEATHER, WEATHER]}, "tools")):
        raw = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **bad})
        assert (raw.status_code, raw.json()["error"]["param"]) == (400, param), raw.text
    raw = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": "hi"})
    assert raw.status_code == 400
    assert set(raw.json()) == {"error"} and set(raw.json()["error"]) == {"message", "type", "param", "code"}
    # /generate keeps problem details
    raw = httpx.post(server.url + "/generate", json={"prompt": "x", "response_schema": {"type": "strin"}})
    assert raw.status_code == 400 and raw.headers["content-type"].startswith("application/problem+json")
    assert "error" not in raw.json() and raw.json()["status"] == 400


def test_a_schema_the_tool_grammar_cannot_enforce_is_a_400_naming_its_field(server):
    """The tool-call grammar (``stencil.grammar.tool_calls``) names the field of the schema it refuses."""
    unenforceable = {"type": "object", "minProperties": 2}
    strict_tool = {"type": "function", "function": {"name": "s", "strict": True, "parameters": unenforceable}}
    for extra, param in (({"tools": [WEATHER, strict_tool], "tool_choice": "required"}, "tools[1].function.parameters"),
                         ({"tools": [WEATHER], "response_format": _json_format(unenforceable)}, "response_format")):
        raw = httpx.post(server.url + "/v1/chat/completions", json={"model": MODEL_NAME, "messages": MESSAGES, **extra})
        assert (raw.status_code, raw.json()["error"]["param"]) == (400, param), raw.text
        assert "minProperties" in raw.json()["error"]["message"]


def _wait(pred, timeout_s: float = 15.0) -> bool:
    return wait_until(pred, timeout_s)


def test_hanging_up_aborts_every_choice(server):
    eng = service_state(server.app).engine.engine
    finished = service_state(server.app).metrics.finished

    def finished_total() -> float:
        return sum(s.value for fam in finished.collect() for s in fam.samples if s.name.endswith("_total"))

    before = finished_total()
    # [ab]{3000} cannot end within 1000 tokens: only max_tokens or an abort stops these choices.
    body = json.dumps({"model": MODEL_NAME, "messages": MESSAGES, "n": 2, "max_tokens": 1000, "response_format": {
        "type": "json_schema", "json_schema": {"name": "ab", "schema": {"type": "string", "pattern": "^[ab]{3000}$"}}}})
    host, port = server.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
    assert _wait(lambda: eng.stats()["running"] == 2)
    sock.close()
    assert _wait(lambda: eng.stats()["running"] == 0 and eng.stats()["waiting"] == 0)
    assert _wait(lambda: eng.stats()["kv_blocks_free"] == eng.stats()["kv_blocks_total"])
    assert finished_total() == before  # aborted, not run to their 1000 tokens


def test_structured_outputs_regex_choice_and_lark_grammar(client):
    """vLLM-style ``structured_outputs`` (``extra_body``) on the OpenAI endpoints: a regex, a choice,
    a Lark grammar (its errors name line and column), never together with a response format."""
    import re as _re

    import openai

    msgs = [{"role": "user", "content": "go"}]
    for so, check in ((
            {"regex": "[0-9]{3}-[a-z]{2}"}, lambda t: _re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
            ({"choice": ["yes", "no"]}, lambda t: t in ("yes", "no")),
            ({"grammar": 'start: "(" start ")" | "x"'}, lambda t: _re.fullmatch(r"\(*x\)*", t)
             and t.count("(") == t.count(")"))):
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0,
                                           extra_body={"structured_outputs": so})
        choice = r.choices[0]
        assert choice.finish_reason == "stop" and check(choice.message.content), choice
    r = client.completions.create(model="tiny", prompt="go", max_tokens=8, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["alpha", "beta"]}})
    assert r.choices[0].text in ("alpha", "beta"), r
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=msgs,
                                       extra_body={"structured_outputs": {"grammar": "start: ((x"}})
    assert "line 1" in str(info.value)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=msgs,
                                       extra_body={"structured_outputs": {"regex": "a", "choice": ["a"]}})
    assert info.value.body["param"] == "structured_outputs"


def test_a_streamed_answer_says_closed_by_budget_as_the_whole_one(client):
    """``closed_by_budget`` (a Stencil extension) comes with a streamed choice's last chunk too."""
    # a free string: the model writes on in it until the budget closes it (whatever the logits' last bits)
    note = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 60}}, "required": ["note"],
            "additionalProperties": False}
    seen = set()
    for budget in range(6, 30, 3):
        kw = dict(model=MODEL_NAME, messages=MESSAGES, response_format=_json_format(note), max_tokens=budget, seed=11)
        try:
            whole = client.chat.completions.create(**kw)
        except openai.BadRequestError:
            continue  # below the schema's shortest answer
        flag = (whole.choices[0].model_extra or {}).get("closed_by_budget", False)
        chunks = list(client.chat.completions.create(stream=True, **kw))
        last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
        assert (last.choices[0].model_extra or {}).get("closed_by_budget", False) == flag
        seen.add(flag)
    assert True in seen


def test_a_warning_with_control_characters_is_escaped_in_its_header(server):
    """A relaxed keyword under a property name holding CR / LF: the answer comes, its
    ``X-Stencil-Warnings`` header holds the name escaped (the server used to refuse to write
    the raw header and drop the connection with no answer)."""
    import httpx

    key = "a\r\nX-Injected: 1"
    schema = {"type": "object", "required": [key],
              "properties": {key: {"type": "array", "items": {"type": "string"}, "uniqueItems": True,
                                   "maxItems": 2}}}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={
        "model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200, r.text
    header = r.headers["x-stencil-warnings"]
    assert "uniqueItems" in header and "\\x0d\\x0aX-Injected" in header, header
    assert "x-injected" not in r.headers


def test_a_tool_call_the_budget_closed_says_so_in_its_warnings(server):
    """A ``tool_choice: "required"`` answer at the least ``max_tokens`` the call admits: the
    budget narrows it (``closed_by_budget``) and the answer's warnings say so for that choice, as
    a ``response_format`` answer's do (they were dropped for calls)."""
    import re

    import httpx

    body = {"model": MODEL_NAME, "messages": MESSAGES, "tools": [WEATHER], "tool_choice": "required",
            "temperature": 0}
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, "max_tokens": 1})
    assert r.status_code == 400, r.text
    need = int(re.search(r"needs at least (\d+) tokens", r.json()["error"]["message"]).group(1))
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60, json={**body, "max_tokens": need})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice.get("closed_by_budget") is True, choice
    notes = r.json().get("warnings", [])
    assert any(w.startswith("choice 0: max_tokens narrowed the answer") for w in notes), r.json()
