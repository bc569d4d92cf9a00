"""Tool calls: the plan from OpenAI's fields, the (streaming) parse, the prompt. The call regex is
``stencil.grammar.tool_calls``'s (``tests/grammar/test_tool_calls.py``); the end-to-end constrained
generation is in ``test_openai_api.py``.
"""

from __future__ import annotations

import json

import msgspec
import pytest

from stencil.grammar.tool_calls import CALL_OPEN, NO_ARGUMENTS
from stencil.schemas.openai import ChatMessage, ContentPart, FunctionCall, Tool, ToolCall
from stencil.service.tool_parser import ToolCallParser, parse_answer
from stencil.service.tools import (
    ToolError, ToolPlan, arguments_schema, parse_tool_output, plan_tools, template_messages, template_supports_tools,
    tools_system_text,
)

WEATHER = msgspec.convert({"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}, Tool)
CLOCK = msgspec.convert({"type": "function", "function": {"name": "now"}}, Tool)


def _fns(*tools: Tool) -> list:
    return [t.function for t in tools]


def _block(name: str, args: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": args}, separators=(",", ":")) + "</tool_call>"


# -- plan ----------------------------------------------------------------------------------------


def test_plan_defaults():
    assert plan_tools([], None) == ToolPlan("none", (), False)
    p = plan_tools(_fns(WEATHER, CLOCK), None)
    assert (p.mode, [f.name for f in p.functions], p.parallel) == ("auto", ["get_weather", "now"], True)
    assert plan_tools(_fns(WEATHER), "required", parallel_tool_calls=False).parallel is False
    assert plan_tools(_fns(WEATHER), "none").active is False
    assert plan_tools(_fns(WEATHER), "required", max_calls=1).parallel is False
    assert plan_tools(_fns(WEATHER), "required", max_calls=3).max_calls == 3


def test_plan_named_function_is_one_required_call():
    p = plan_tools(_fns(WEATHER, CLOCK), "auto", named="now", parallel_tool_calls=True)
    assert (p.mode, [f.name for f in p.functions], p.parallel) == ("required", ["now"], False)


@pytest.mark.parametrize("tools, choice, named, param", [
    ([WEATHER, WEATHER], "auto", None, "tools"),
    ([], "required", None, "tool_choice"),
    ([WEATHER], None, "nope", "tool_choice"),
    ([msgspec.convert({"function": {"name": "get weather"}}, Tool)], "auto", None, "tools"),
    ([msgspec.convert({"function": {"name": "x" * 65}}, Tool)], "auto", None, "tools"),
    ([msgspec.convert({"function": {"name": "s", "parameters": {"type": "string"}}}, Tool)], "auto", None, "tools"),
])
def test_plan_errors_name_the_field(tools, choice, named, param):
    with pytest.raises(ToolError) as e:
        plan_tools(_fns(*tools), choice, named)
    assert e.value.param == param
    if tools and (tools[0].function.parameters or {}).get("type") == "string":  # arguments are objects (OpenAI)
        assert str(e.value) == ("tools[0]: function 's': parameters must be the JSON Schema of an object "
                                '(type "object"), not of type "string"')


# -- the grammar's input (the regex itself: tests/grammar/test_tool_calls.py) -------------------------


def test_the_plan_asks_the_grammar_for_its_functions_and_shape():
    strict = msgspec.convert({"function": {"name": "s", "parameters": {"type": "object"}, "strict": True}}, Tool)
    calls = plan_tools(_fns(WEATHER, CLOCK, strict), "auto", parallel_tool_calls=True, max_calls=3).calls(
        "tools[{i}].parameters")
    assert [(f.name, f.parameters, f.strict, f.field) for f in calls.functions] == [
        ("get_weather", WEATHER.function.parameters, False, "tools[0].parameters"),
        ("now", None, False, "tools[1].parameters"), ("s", {"type": "object"}, True, "tools[2].parameters")]
    assert (calls.required, calls.parallel, calls.max_calls) == (False, True, 3)
    named = plan_tools(_fns(WEATHER, CLOCK), "auto", named="now").calls()
    assert ([f.field for f in named.functions], named.required, named.parallel) == (
        ["tools[0].function.parameters"], True, False)
    assert arguments_schema(CLOCK.function) == NO_ARGUMENTS


# -- parse ---------------------------------------------------------------------------------------


def test_parse_calls_and_text():
    plan = plan_tools(_fns(WEATHER, CLOCK), "auto", parallel_tool_calls=True)
    content, calls = parse_tool_output(_block("get_weather", {"city": "Paris"}) + _block("now", {}), plan)
    assert content is None
    assert [(c.function.name, c.function.arguments, c.type) for c in calls] == \
        [("get_weather", '{"city":"Paris"}', "function"), ("now", "{}", "function")]
    assert len({c.id for c in calls}) == 2
    assert parse_tool_output("Sunny.", plan) == ("Sunny.", [])
    with pytest.raises(ValueError):
        parse_tool_output(CALL_OPEN + '{"name":"now","argu', plan)
    # tools off: the marker is just text
    assert parse_tool_output(_block("now", {}), plan_tools([], None)) == (_block("now", {}), [])


ARGS = ['{"city":"Pa}ris","q":"a\\"}b","n":[1,{"x":[]}],"e":{}}', '"a string {"', "12", "-3.5e2", "true",
        "null", "[1,[2]]", "{}"]


@pytest.mark.parametrize("chunk", [1, 2, 5, 1000])
def test_streamed_parse_gives_each_call_its_characters(chunk):
    text = "".join(CALL_OPEN + '{"name":"f' + str(i) + '","arguments":' + a + "}</tool_call>"
                   for i, a in enumerate(ARGS))
    p = ToolCallParser(may_be_text=True)
    events = []
    for i in range(0, len(text), chunk):
        events += p.feed(text[i:i + chunk])
    events += p.finish()
    assert p.complete and not p.text
    assert [(c.name, c.arguments, c.complete) for c in p.calls] == [(f"f{i}", a, True) for i, a in enumerate(ARGS)]
    for i, a in enumerate(ARGS):
        mine = [e for e in events if e.index == i]
        assert mine[0].kind == "start" and mine[0].name == f"f{i}" and mine[-1].kind == "end"
        assert "".join(e.text for e in mine if e.kind == "arguments") == a
    if chunk == 1:  # arguments arrive as they are written, a character at a time
        assert sum(e.kind == "arguments" for e in events if e.index == 0) == len(ARGS[0])


def test_streamed_parse_of_text_and_of_cut_output():
    for text in ["", "<tool", "Sunny <tool_call>", "<tool_cal!"]:
        p = ToolCallParser(may_be_text=True)
        got = [e for ch in text for e in p.feed(ch)] + p.finish()
        assert "".join(e.text for e in got) == text and all(e.kind == "text" for e in got)
        assert p.complete and not p.calls
    assert parse_answer(CALL_OPEN + '{"name":"f","arguments":{"a":', may_be_text=True) is None
    assert parse_answer(CALL_OPEN + '{"name":"f","arguments":{}}</tool_call>junk', may_be_text=False) is None
    assert parse_answer("", may_be_text=False) is None


# -- prompt --------------------------------------------------------------------------------------


def _history() -> list[ChatMessage]:
    call = ToolCall(id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Rome"}'))
    return [ChatMessage(role="developer", content="Be brief."),
            ChatMessage(role="user", content=[ContentPart(type="text", text="Weather?")]),
            ChatMessage(role="assistant", content=None, tool_calls=[call]),
            ChatMessage(role="tool", content="18C", tool_call_id="call_1")]


def test_template_messages_without_native_tools():
    plan = plan_tools(_fns(WEATHER), "auto", parallel_tool_calls=True)
    msgs, tools_arg = template_messages(_history(), plan, native_tools=False)
    assert tools_arg is None
    assert msgs[0]["role"] == "system" and msgs[0]["content"].endswith("Be brief.")
    assert msgs[0]["content"].startswith(tools_system_text(plan))
    assert msgs[1] == {"role": "user", "content": "Weather?"}
    assert msgs[2] == {"role": "assistant", "content": _block("get_weather", {"city": "Rome"})}
    assert msgs[3] == {"role": "user", "content": "Result of calling get_weather: 18C"}


def test_template_messages_with_native_tools():
    plan = plan_tools(_fns(WEATHER, CLOCK), "required", parallel_tool_calls=False)
    msgs, tools_arg = template_messages(_history(), plan, native_tools=True)
    assert [t["function"]["name"] for t in tools_arg] == ["get_weather", "now"]
    assert tools_arg[1]["function"]["parameters"] == NO_ARGUMENTS
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Rome"}}
    assert msgs[3] == {"role": "tool", "content": "18C", "tool_call_id": "call_1"}
    # tool_choice none: no tools in the prompt
    assert template_messages(_history(), plan_tools(_fns(WEATHER), "none"), True)[1] is None


def test_template_support_detection_and_rendering(tokenizer):
    assert not template_supports_tools(tokenizer.chat_template)  # SmolLM2's ChatML template
    assert template_supports_tools("{% if tools %}{{ tools | tojson }}{% endif %}")
    from stencil.service.prompts import render_messages

    plan = plan_tools(_fns(WEATHER), "auto", parallel_tool_calls=True)
    text = render_messages(tokenizer, template_messages(_history(), plan, False)[0])
    assert "get_weather" in text and "Result of calling get_weather: 18C" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_bad_past_arguments_are_refused():
    call = ToolCall(id="c", function=FunctionCall(name="now", arguments="{not json"))
    with pytest.raises(ToolError) as e:
        template_messages([ChatMessage(role="assistant", tool_calls=[call])], plan_tools([], None), False)
    assert e.value.param == "messages"
