"""Tool calls: the plan from OpenAI's fields, the call schema and regex, the parse, the prompt.

Oracles: jsonschema for the call schema, Python ``re`` plus ``str.startswith`` for the regexes.
The end-to-end constrained generation is in ``test_openai_api.py``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from grammar.json_schema import schema_to_regex
from schemas.openai import ChatMessage, ContentPart, FunctionCall, Tool, ToolCall, ToolChoiceFunction
from service.tools import (
    CALL_OPEN, NO_ARGUMENTS, ToolError, ToolPlan, call_schema, literal, not_starting_with, parse_tool_output,
    plan_tools, template_messages, template_supports_tools, tool_regex, tools_system_text,
)

WEATHER = msgspec.convert({"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}, Tool)
CLOCK = msgspec.convert({"type": "function", "function": {"name": "now"}}, Tool)


def _to_regex(schema: dict) -> str:
    return schema_to_regex(schema)[0]


def _block(name: str, args: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": args}, separators=(",", ":")) + "</tool_call>"


# -- plan ----------------------------------------------------------------------------------------


def test_plan_defaults():
    assert plan_tools(None, None, None) == ToolPlan("none", (), False)
    p = plan_tools([WEATHER, CLOCK], None, None)
    assert (p.mode, [f.name for f in p.functions], p.parallel) == ("auto", ["get_weather", "now"], True)
    assert plan_tools([WEATHER], "required", False).parallel is False
    assert plan_tools([WEATHER], "none", None).active is False


def test_plan_named_function_is_one_required_call():
    named = msgspec.convert({"type": "function", "function": {"name": "now"}}, ToolChoiceFunction)
    p = plan_tools([WEATHER, CLOCK], named, True)
    assert (p.mode, [f.name for f in p.functions], p.parallel) == ("required", ["now"], False)


@pytest.mark.parametrize("tools, choice, param", [
    ([WEATHER, WEATHER], "auto", "tools"),
    ([], "required", "tool_choice"),
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "tool_choice"),
])
def test_plan_errors_name_the_field(tools, choice, param):
    if isinstance(choice, dict):
        choice = msgspec.convert(choice, ToolChoiceFunction)
    with pytest.raises(ToolError) as e:
        plan_tools(tools, choice, None)
    assert e.value.param == param


# -- schema and regex ----------------------------------------------------------------------------


def test_call_schema_accepts_exactly_calls_of_known_functions():
    schema = call_schema((WEATHER.function, CLOCK.function))
    ok = [{"name": "get_weather", "arguments": {"city": "Rome"}}, {"name": "now", "arguments": {}}]
    bad = [{"name": "get_weather", "arguments": {"city": "Oslo"}},
           {"name": "get_weather", "arguments": {}},
           {"name": "now", "arguments": {"x": 1}},
           {"name": "other", "arguments": {}},
           {"name": "now"},
           {"name": "now", "arguments": {}, "extra": 1}]
    for doc in ok:
        jsonschema.validate(doc, schema)
    for doc in bad:
        assert not jsonschema.Draft202012Validator(schema).is_valid(doc), doc
    assert call_schema((CLOCK.function,))["properties"]["arguments"] == NO_ARGUMENTS


@pytest.mark.parametrize("marker", ["<tool_call>", "<ab>", "a", "x-]^"])
def test_not_starting_with_exact_cases(marker):
    rx = re.compile(not_starting_with(marker))
    cases = ["", marker, marker + "z", marker[:-1], "z" + marker, marker[:1] + "z", "\n" + marker, marker + "\n"]
    for s in cases:
        assert bool(rx.fullmatch(s)) == (not s.startswith(marker)), (marker, s)


@given(st.text(alphabet="<ab>\nz", max_size=8))
def test_not_starting_with_matches_startswith(s):
    assert bool(re.fullmatch(not_starting_with("<ab>"), s)) == (not s.startswith("<ab>"))


def test_literal_escapes_metacharacters_only():
    text = "a.b*c(d)[e]{f}|g?h+i^j$k\\l<m>/n_"
    assert re.fullmatch(literal(text), text)
    assert "\\<" not in literal("<tool_call>")  # a word boundary in Rust's regex


def test_required_regex_single_and_parallel():
    one = plan_tools([WEATHER, CLOCK], "required", False)
    many = plan_tools([WEATHER, CLOCK], "required", True)
    a, b = _block("get_weather", {"city": "Paris"}), _block("now", {})
    r_one, r_many = re.compile(tool_regex(one, _to_regex, None)), re.compile(tool_regex(many, _to_regex, None))
    assert r_one.fullmatch(a) and r_one.fullmatch(b)
    assert not r_one.fullmatch(a + b)
    assert r_many.fullmatch(a + b) and r_many.fullmatch(b + a + b)
    for bad in ["", "hello", _block("get_weather", {"city": "Oslo"}), _block("now", {"x": 1}), a + "\n",
                a + "\n" + b]:
        assert not r_many.fullmatch(bad), bad


def test_auto_regex_is_text_or_calls():
    plan = plan_tools([WEATHER], "auto", True)
    rx = re.compile(tool_regex(plan, _to_regex, None))
    for ok in ["", "It is sunny.", "<b>bold</b>", _block("get_weather", {"city": "Rome"})]:
        assert rx.fullmatch(ok), ok
    for bad in [CALL_OPEN, CALL_OPEN + "sunny", _block("now", {})]:
        assert not rx.fullmatch(bad), bad
    # With a JSON response format, the text branch is that JSON and nothing else.
    rx_json = re.compile(tool_regex(plan, _to_regex, _to_regex({"type": "boolean"})))
    assert rx_json.fullmatch("true") and rx_json.fullmatch(_block("get_weather", {"city": "Paris"}))
    assert not rx_json.fullmatch("sunny")


# -- parse ---------------------------------------------------------------------------------------


def test_parse_calls_and_text():
    plan = plan_tools([WEATHER, CLOCK], "auto", True)
    content, calls = parse_tool_output(_block("get_weather", {"city": "Paris"}) + _block("now", {}), plan)
    assert content is None
    assert [(c.function.name, c.function.arguments, c.type) for c in calls] == \
        [("get_weather", '{"city":"Paris"}', "function"), ("now", "{}", "function")]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_output("Sunny.", plan) == ("Sunny.", [])
    with pytest.raises(ValueError):
        parse_tool_output(CALL_OPEN + '{"name":"now","argu', plan)
    # tools off: the marker is just text
    assert parse_tool_output(_block("now", {}), plan_tools(None, None, None)) == (_block("now", {}), [])


# -- prompt --------------------------------------------------------------------------------------


def _history() -> list[ChatMessage]:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Rome"}'))
    return [ChatMessage(role="developer", content="Be brief."),
            ChatMessage(role="user", content=[ContentPart(type="text", text="Weather?")]),
            ChatMessage(role="assistant", content=None, tool_calls=[call]),
            ChatMessage(role="tool", content="18C", tool_call_id="call_1")]


def test_template_messages_without_native_tools():
    plan = plan_tools([WEATHER], "auto", True)
    msgs, tools_arg = template_messages(_history(), plan, native_tools=False)
    assert tools_arg is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].endswith("Be brief.")
    assert msgs[0]["content"].startswith(tools_system_text(plan))
    assert msgs[1] == {"role": "user", "content": "Weather?"}
    assert msgs[2] == {"role": "assistant", "content": _block("get_weather", {"city": "Rome"})}
    assert msgs[3] == {"role": "user", "content": "Result of calling get_weather: 18C"}


def test_template_messages_with_native_tools():
    plan = plan_tools([WEATHER, CLOCK], "required", False)
    msgs, tools_arg = template_messages(_history(), plan, native_tools=True)
    assert [t["function"]["name"] for t in tools_arg] == ["get_weather", "now"]
    assert tools_arg[1]["function"]["parameters"] == NO_ARGUMENTS
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert msgs[3] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    # tool_choice none: no tools in the prompt
    assert template_messages(_history(), plan_tools([WEATHER], "none", None), True)[1] is None


def test_template_support_detection_and_rendering(tokenizer):
    assert not template_supports_tools(tokenizer.chat_template)  # SmolLM2's ChatML template
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    from service.generation import render_messages

    plan = plan_tools([WEATHER], "auto", True)
    text = render_messages(tokenizer, template_messages(_history(), plan, False)[0])
    assert "get_weather" in text and "Result of calling get_weather: 18C" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_bad_past_arguments_are_refused():
    call = ToolCall(id="c", function=FunctionCall(name="now", arguments="{not json"))
    with pytest.raises(ToolError) as e:
        template_messages([ChatMessage(role="assistant", tool_calls=[call])], plan_tools(None, None, None), False)
    assert e.value.param == "messages"
