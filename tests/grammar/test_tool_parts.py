"""Tool-call grammars from cached parts (``stencil.grammar.tool_calls.CallParts``): a repeated or
extended tool list compiles only the functions it has not seen (counted, not timed), the answer's
language does not change on a cache hit, and the Lark form of a large answer is the language of
the regex form. Oracle for the languages: the same samples through llguidance matchers of both
forms (real tokenizer), and expected verdicts written by hand.
"""

from __future__ import annotations

import json

import pytest

from stencil.grammar.base import GrammarError
from stencil.grammar.call_syntax import HERMES
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.json_schema.schema_compiler import schema_to_regex
from stencil.grammar.tool_calls import (LARK_FROM_CHARS, CallParts, ToolCalls, ToolFunction, arguments_schema, call_regex,
                                         tool_call_spec)
from stencil.service.tool_formats import FORMATS

WEATHER = ToolFunction("get_weather", {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                                       "days": {"type": "integer"}},
                                       "required": ["city"], "additionalProperties": False})
CLOCK = ToolFunction("now")
NOTE = ToolFunction("add_note", {"$defs": {"Tag": {"type": "object", "properties": {"k": {"type": "string",
                                                                                          "maxLength": 4}},
                                                   "required": ["k"]}},
                                 "type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/Tag"},
                                                                           "maxItems": 2}},
                                 "required": ["tags"]})


def _calls(fns, **kw) -> ToolCalls:
    return ToolCalls(tuple(fns), **{"required": False, "parallel": True, **kw})


def test_a_repeated_list_compiles_no_function_again():
    parts = CallParts()
    first, w1 = tool_call_spec(_calls([WEATHER, CLOCK, NOTE]), parts=parts)
    assert (parts.compiles, parts.hits, len(parts)) == (3, 0, 3)
    again, w2 = tool_call_spec(_calls([WEATHER, CLOCK, NOTE]), parts=parts)
    assert (parts.compiles, parts.hits) == (3, 3)
    assert again == first and w2 == w1  # the same text: the same language


def test_an_extended_list_compiles_only_the_new_function():
    parts = CallParts()
    tool_call_spec(_calls([WEATHER, CLOCK]), parts=parts)
    extended, _ = tool_call_spec(_calls([WEATHER, CLOCK, NOTE]), parts=parts)
    assert (parts.compiles, parts.hits) == (3, 2)
    fresh, _ = tool_call_spec(_calls([WEATHER, CLOCK, NOTE]), parts=CallParts())
    assert extended == fresh


def test_the_key_is_the_whole_definition():
    parts = CallParts()
    base = {"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}}}
    reordered = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    tool_call_spec(_calls([ToolFunction("f", base)]), parts=parts)
    tool_call_spec(_calls([ToolFunction("f", json.loads(json.dumps(base)), field="tools[3].function.parameters")]),
                   parts=parts)
    assert (parts.compiles, parts.hits) == (1, 1)  # an equal copy, named elsewhere in the request
    # Key order is the order the arguments are written in; strict, name and syntax are the call's.
    for fn, syntax in ((ToolFunction("f", reordered), HERMES), (ToolFunction("f", base, strict=True), HERMES),
                       (ToolFunction("g", base), HERMES), (ToolFunction("f", base), FORMATS[0].syntax)):
        before = parts.compiles
        tool_call_spec(_calls([fn], syntax=syntax), parts=parts)
        assert parts.compiles == before + 1, (fn, syntax.name)


def test_a_refused_function_is_not_kept_and_names_its_own_field():
    parts = CallParts()
    bad = {"type": "object", "properties": {"x": {"type": "number", "multipleOf": 0.3}}}
    for i in (1, 4):
        with pytest.raises(GrammarError) as e:
            tool_call_spec(_calls([WEATHER, ToolFunction("f", bad, strict=True, field=f"tools[{i}]")]), parts=parts)
        assert e.value.field == f"tools[{i}]"
    assert (parts.compiles, len(parts)) == (3, 1)  # WEATHER once; the refused one each time, never kept
    _, warnings = tool_call_spec(_calls([ToolFunction("f", bad)]), parts=parts)
    _, again = tool_call_spec(_calls([ToolFunction("f", bad)]), parts=parts)
    assert warnings == again and warnings and warnings[0].startswith("tool f: ")


def test_a_misspelt_keyword_in_parameters_is_said_once_per_function():
    """JSON Schema ignores an unknown key, so a typo constrains nothing: the answer's warnings say so, from
    the cache too (as a response_schema's do)."""
    parts = CallParts()
    typo = {"type": "object", "proprties": {"a": {"type": "string", "maxLen": 3}}, "requird": ["a"]}
    for _ in range(2):
        _, warnings = tool_call_spec(_calls([WEATHER, ToolFunction("g", typo)]), parts=parts)
        assert warnings == ["tool g: unknown keyword 'proprties' at #: ignored; did you mean 'properties'?",
                            "tool g: unknown keyword 'requird' at #: ignored; did you mean 'required'?"], warnings
    assert parts.compiles == 2


def test_the_cache_is_bounded_least_recently_used_first():
    parts = CallParts(max_entries=2)
    tool_call_spec(_calls([WEATHER, CLOCK]), parts=parts)
    tool_call_spec(_calls([WEATHER]), parts=parts)  # WEATHER used last: CLOCK is the oldest
    tool_call_spec(_calls([NOTE]), parts=parts)
    assert len(parts) == 2
    tool_call_spec(_calls([WEATHER]), parts=parts)
    assert parts.compiles == 3
    tool_call_spec(_calls([CLOCK]), parts=parts)
    assert parts.compiles == 4
    small = CallParts(max_chars=10)  # no call regex is that short: none is kept
    tool_call_spec(_calls([CLOCK]), parts=small)
    assert len(small) == 0


def test_parameters_that_are_not_json_are_compiled_every_time():
    parts = CallParts()
    odd = {"type": "object", "properties": {"a": {"type": "string"}}, "x-note": {1, 2}}  # a set: no JSON text
    tool_call_spec(_calls([ToolFunction("f", odd)]), parts=parts)
    tool_call_spec(_calls([ToolFunction("f", odd)]), parts=parts)
    assert (parts.compiles, len(parts)) == (2, 0)


# -- the language, through real matchers ----------------------------------------------------------

@pytest.fixture(scope="module")
def lazy(tokenizer):
    with GrammarCompiler(tokenizer, len(tokenizer), backend="lazy", timeout_s=120) as c:
        yield c


def _accepts(grammar, tokenizer, text: str) -> bool:
    m = grammar.matcher()
    return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def _samples(syntax) -> dict[str, bool | None]:
    """Texts and whether a parallel auto answer (no max) takes them (None: depends on the shape)."""
    w = syntax.calls_text([("get_weather", '{"city":"Paris"}')])
    two = syntax.calls_text([("get_weather", '{"city":"Rome","days":2}'), ("now", "{}")])
    three = syntax.calls_text([("now", "{}")] * 3)
    prefix = syntax.text_prefix
    return {
        w: True, two: None, three: None,
        syntax.calls_text([("add_note", '{"tags":[{"k":"ab"}]}')]): True,
        syntax.calls_text([("get_weather", '{"city":"Oslo"}')]): False,
        syntax.calls_text([("get_weather", '{"days":2}')]): False,
        syntax.calls_text([("add_note", '{"tags":[{"k":"abcde"}]}')]): False,
        syntax.calls_text([("nope", "{}")]): False,
        w + " ": False if not prefix else None,
        syntax.call_marker if not prefix else prefix + syntax.call_marker: None,
        "": None, "hello": None, prefix + "hello": None,
        (syntax.call_marker[:3] if not prefix else prefix): None,
    }


SHAPES = [dict(required=False, parallel=True), dict(required=True, parallel=True),
          dict(required=False, parallel=False), dict(required=True, parallel=True, max_calls=2)]


@pytest.mark.parametrize("syntax", [f.syntax for f in FORMATS], ids=lambda s: s.name)
def test_the_lark_form_is_the_language_of_the_regex_form(lazy, tokenizer, syntax):
    for shape in SHAPES:
        calls = _calls([WEATHER, CLOCK, NOTE], syntax=syntax, **shape)
        as_regex, w1 = tool_call_spec(calls, lark_from_chars=1 << 30)
        as_lark, w2 = tool_call_spec(calls, lark_from_chars=0)
        lark = shape["required"] or not syntax.begin  # (else a begin lexeme a text could go on from)
        assert (as_regex.kind, as_lark.kind, w1) == ("regex", "lark" if lark else "regex", w2)
        g_regex, g_lark = lazy.compile(as_regex), lazy.compile(as_lark)
        for text, expected in _samples(syntax).items():
            got = _accepts(g_regex, tokenizer, text)
            assert _accepts(g_lark, tokenizer, text) == got, (syntax.name, shape, text)
            if expected is not None and shape == SHAPES[0]:
                assert got == expected, (syntax.name, text)


def test_hermes_verdicts_by_shape(lazy, tokenizer):
    w = HERMES.calls_text([("get_weather", '{"city":"Paris"}')])
    three = HERMES.calls_text([("now", "{}")] * 3)
    auto = lazy.compile(tool_call_spec(_calls([WEATHER, CLOCK, NOTE]), lark_from_chars=0)[0])
    assert [_accepts(auto, tokenizer, t) for t in ("", "hello", "<tool_c", "<tool_call>", w, w + w, three)] == \
        [True, True, True, False, True, True, True]
    capped = lazy.compile(tool_call_spec(_calls([WEATHER, CLOCK], required=True, max_calls=2), lark_from_chars=0)[0])
    assert [_accepts(capped, tokenizer, t) for t in ("", "hello", w, w + w, three)] == \
        [False, False, True, True, False]


def test_a_json_text_answer_in_both_forms(lazy, tokenizer):
    calls = _calls([WEATHER, CLOCK])
    forms = [lazy.compile(tool_call_spec(calls, {"type": "object", "properties": {"ok": {"type": "boolean"}},
                                                 "required": ["ok"]}, lark_from_chars=n)[0]) for n in (1 << 30, 0)]
    w = HERMES.calls_text([("now", "{}")])
    for text, expected in (('{"ok":true}', True), ('{"ok":1}', False), ("hello", False), ("", False), (w, True)):
        assert [_accepts(g, tokenizer, text) for g in forms] == [expected, expected], text


def test_a_large_list_is_a_lark_grammar_and_a_repeated_one_is_the_same_spec(lazy, tokenizer):
    fns = [ToolFunction(f"tool_{i}", {"type": "object", "properties": {"q": {"type": "string", "maxLength": 20},
                                                                      f"n{i}": {"type": "integer"},
                                                                      "when": {"type": "string", "format": "date"}},
                                      "required": ["q"]}) for i in range(60)]
    parts = CallParts()
    spec, _ = tool_call_spec(_calls(fns), parts=parts)
    assert spec.kind == "lark" and len(spec.value) > LARK_FROM_CHARS
    assert tool_call_spec(_calls(fns), parts=parts)[0] == spec and parts.compiles == 60
    g = lazy.compile(spec)
    assert _accepts(g, tokenizer, HERMES.calls_text([("tool_59", '{"q":"x","n59":3}'), ("tool_0", '{"q":"y"}')]))
    assert not _accepts(g, tokenizer, HERMES.calls_text([("tool_59", '{"q":"x","n58":3}')]))
    assert lazy.compile(tool_call_spec(_calls(fns), parts=parts)[0]) is g  # the compiler's cache hits


FREE = ToolFunction("log_event", {"type": "object", "properties": {"payload": {}, "meta": {"type": "object"},
                                                                  "tags": {"type": "array"}},
                                  "required": ["payload"]})
ALSO_FREE = ToolFunction("store", {"type": "object", "properties": {"value": {}, "key": {"type": "string"}},
                                   "required": ["key", "value"]})


def test_free_form_values_are_written_once_for_the_whole_lark_answer(lazy, tokenizer):
    calls = _calls([FREE, ALSO_FREE, WEATHER])
    as_regex, _ = tool_call_spec(calls, lark_from_chars=1 << 30)
    as_lark, _ = tool_call_spec(calls, lark_from_chars=0)
    assert as_lark.kind == "lark"
    defs = [line for line in as_lark.value.splitlines() if line.startswith("T")]
    free = schema_to_regex({})[0]  # a free-form value's regex, written out in the regex form
    assert as_regex.value.count(free) >= 3 and free not in as_lark.value
    assert defs and len({line.split(":", 1)[0] for line in defs}) == len(defs)  # each piece defined once
    assert len(as_lark.value) < len(as_regex.value) / 2
    forms = [lazy.compile(as_regex), lazy.compile(as_lark)]
    for args, expected in (('{"payload":{"a":1,"b":"x"},"tags":[true,null]}', True),
                           ('{"payload":[1,"x"]}', True), ('{"payload":[[1]]}', False),  # (one level deep)
                           ('{"meta":{}}', False), ('{"payload":1,"meta":[]}', False)):
        text = HERMES.calls_text([("log_event", args)])
        assert [_accepts(g, tokenizer, text) for g in forms] == [expected, expected], args
    text = HERMES.calls_text([("store", '{"value":{"deep":2},"key":"k"}'), ("get_weather", '{"city":"Rome"}')])
    assert [_accepts(g, tokenizer, text) for g in forms] == [True, True]


def test_a_call_regex_with_shared_pieces_is_the_plain_compile_written_out():
    parts = CallParts()
    for fn in (FREE, ALSO_FREE, WEATHER, NOTE):
        part = parts.call(fn, HERMES)
        plain = call_regex(fn.name, schema_to_regex(arguments_schema(fn.parameters), strict=False)[0])
        assert part.regex == plain and (part.terminals != ()) == (fn in (FREE, ALSO_FREE))


def test_a_repeated_list_reuses_its_written_lark_answer_and_a_new_shape_writes_its_own():
    parts = CallParts()
    auto, _ = tool_call_spec(_calls([FREE, ALSO_FREE, WEATHER]), parts=parts, lark_from_chars=0)
    again, _ = tool_call_spec(_calls([FREE, ALSO_FREE, WEATHER]), parts=parts, lark_from_chars=0)
    required, _ = tool_call_spec(_calls([FREE, ALSO_FREE, WEATHER], required=True), parts=parts, lark_from_chars=0)
    assert again.value is auto.value and required.value != auto.value
    assert "TEXT" in auto.value and "TEXT" not in required.value
    parts.clear()
    assert tool_call_spec(_calls([FREE, ALSO_FREE, WEATHER]), parts=parts, lark_from_chars=0)[0].value == auto.value
