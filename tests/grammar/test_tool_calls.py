"""The tool-call grammar (``stencil.grammar.tool_calls``): call blocks of the allowed functions, or a
text answer. Oracles: Python ``re`` plus ``str.startswith`` for the regexes, jsonschema for the
arguments. The plan from OpenAI's fields and the parse are in ``tests/service/test_tools.py``.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given
from hypothesis import strategies as st

from stencil.grammar.base import GrammarError
from stencil.grammar.json_schema import schema_to_regex
from stencil.grammar.tool_calls import (
    CALL_OPEN, NO_ARGUMENTS, ToolCalls, ToolFunction, arguments_schema, literal, not_starting_with, tool_call_spec,
    tool_regex,
)

WEATHER = ToolFunction("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                                       "required": ["city"], "additionalProperties": False})
CLOCK = ToolFunction("now")
PERSON = {  # what pydantic writes for a model with a nested model and an Enum
    "$defs": {"Role": {"enum": ["admin", "user"], "title": "Role", "type": "string"},
              "Address": {"properties": {"city": {"title": "City", "type": "string", "maxLength": 8}},
                          "required": ["city"], "title": "Address", "type": "object"}},
    "properties": {"name": {"title": "Name", "type": "string", "maxLength": 8},
                   "role": {"$ref": "#/$defs/Role"}, "home": {"$ref": "#/$defs/Address"}},
    "required": ["name", "role", "home"], "title": "Person", "type": "object",
}
TREE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 2}},
        "required": ["kids"], "additionalProperties": False}


def _to_regex(schema: dict) -> str:
    return schema_to_regex(schema)[0]


def _args_regex(fn: ToolFunction) -> str:
    return schema_to_regex(arguments_schema(fn.parameters))[0]


def _block(name: str, args: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": args}, separators=(",", ":")) + "</tool_call>"


def test_parameters_with_defs_and_refs_compile_as_their_own_document():
    fns = (ToolFunction("P", PERSON), ToolFunction("T", TREE), CLOCK)
    rx = re.compile(tool_regex(ToolCalls(fns, required=True, parallel=True), _args_regex, None))
    good = [("P", {"name": "Ann", "role": "admin", "home": {"city": "Oslo"}}), ("T", {"kids": [{"kids": []}]}),
            ("now", {})]
    bad = [("P", {"name": "Ann", "role": "boss", "home": {"city": "Oslo"}}), ("P", {"name": "Ann", "role": "user"}),
           ("T", {"kids": [{"kids": 1}]}), ("now", {"x": 1}), ("Q", {})]
    for name, args in good:
        assert rx.fullmatch(_block(name, args)), name
        jsonschema.validate(args, arguments_schema(next(f for f in fns if f.name == name).parameters))
    for name, args in bad:
        assert not rx.fullmatch(_block(name, args)), (name, args)
    assert arguments_schema(CLOCK.parameters) == arguments_schema({}) == NO_ARGUMENTS


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


def test_required_regex_single_parallel_and_bounded():
    one = ToolCalls((WEATHER, CLOCK), required=True, parallel=False)
    many = ToolCalls((WEATHER, CLOCK), required=True, parallel=True)
    two = ToolCalls((WEATHER, CLOCK), required=True, parallel=True, max_calls=2)
    a, b = _block("get_weather", {"city": "Paris"}), _block("now", {})
    r_one, r_many, r_two = (re.compile(tool_regex(p, _args_regex, None)) for p in (one, many, two))
    assert r_one.fullmatch(a) and r_one.fullmatch(b)
    assert not r_one.fullmatch(a + b)
    assert r_many.fullmatch(a + b) and r_many.fullmatch(b + a + b)
    assert r_two.fullmatch(a + b) and not r_two.fullmatch(b + a + b)
    for bad in ["", "hello", _block("get_weather", {"city": "Oslo"}), _block("now", {"x": 1}), a + "\n",
                a + "\n" + b]:
        assert not r_many.fullmatch(bad), bad


def test_auto_regex_is_text_or_calls():
    calls = ToolCalls((WEATHER,), required=False, parallel=True)
    rx = re.compile(tool_regex(calls, _args_regex, None))
    for ok in ["", "It is sunny.", "<b>bold</b>", _block("get_weather", {"city": "Rome"})]:
        assert rx.fullmatch(ok), ok
    for bad in [CALL_OPEN, CALL_OPEN + "sunny", _block("now", {})]:
        assert not rx.fullmatch(bad), bad
    # With a JSON response format, the text branch is that JSON and nothing else.
    rx_json = re.compile(tool_regex(calls, _args_regex, _to_regex({"type": "boolean"})))
    assert rx_json.fullmatch("true") and rx_json.fullmatch(_block("get_weather", {"city": "Paris"}))
    assert not rx_json.fullmatch("sunny")


def test_the_spec_is_the_regex_with_the_relaxed_keywords_named():
    loose = ToolFunction("f", {"type": "object", "minProperties": 2})
    calls = ToolCalls((WEATHER, loose), required=False, parallel=False)
    spec, warnings = tool_call_spec(calls, {"type": "integer", "multipleOf": 0.3}, text_strict=False)
    assert (spec.kind, spec.value) == ("regex", tool_regex(calls, lambda fn: schema_to_regex(
        arguments_schema(fn.parameters), strict=False)[0], _to_regex({"type": "integer"})))
    assert warnings == ["response format: multipleOf at #: keyword 'multipleOf' cannot be enforced exactly (ignored)",
                        "tool f: minProperties at #: keyword 'minProperties' cannot be enforced exactly (ignored)"]


def test_a_schema_the_grammar_cannot_enforce_names_its_field():
    strict = ToolFunction("f", {"type": "object", "minProperties": 2}, strict=True,
                          field="tools[1].function.parameters")
    with pytest.raises(GrammarError) as e:
        tool_call_spec(ToolCalls((WEATHER, strict), required=True, parallel=False))
    assert e.value.field == "tools[1].function.parameters"
    with pytest.raises(GrammarError) as e:
        tool_call_spec(ToolCalls((WEATHER,), required=False, parallel=False),
                       {"type": "integer", "multipleOf": 0.3}, text_field="response_format")
    assert (e.value.field, e.value.keyword) == ("response_format", "multipleOf")
