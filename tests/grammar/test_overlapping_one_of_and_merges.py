"""Two exactness cases of the schema compiler, each against jsonschema as the oracle over every
text of a small alphabet:

* ``oneOf`` of string branches that may both match (two patterns, a pattern and a length, a
  pattern and any string): each branch is written minus the strings valid against the others
  (lazy backend), so a string is written exactly when one branch alone admits it.
* ``patternProperties`` that spell their keys (``^id$``) beside an open ``additionalProperties``.
* ``allOf`` members with different ``patternProperties`` or a ``propertyNames``: merged into one
  object whose keys take every demand (both sides' patterns, properties, additionalProperties),
  or refused where no single object says the same.
"""

from __future__ import annotations

import itertools

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from char_vocab import accepts, char_compiler
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.json_schema.merge import MergeError, merge

ALPHABET = "ab01"
CHARS = 'ab01"\\{}:,n'  # the JSON texts of those strings, and of objects with such keys
STRINGS = ["".join(t) for n in range(5) for t in itertools.product(ALPHABET, repeat=n)]


@pytest.fixture(scope="module")
def compiler():
    with char_compiler(CHARS) as c:
        yield c


def _accepts(grammar, value) -> bool:
    return accepts(grammar, value, CHARS)


def _mismatches(compiler, schema: dict, values, mode: str = "closed") -> list:
    valid = jsonschema.Draft202012Validator(schema).is_valid
    try:
        grammar = compiler.compile(GrammarSpec.json_schema(schema, additional_properties=mode))
    except GrammarError as e:  # an empty language: then nothing may validate
        assert "no token sequence can produce" in str(e) or "admits no value" in str(e)
        return [v for v in values if valid(v)]
    return [v for v in values if _accepts(grammar, v) != valid(v)]


ATOMS = ["a", "b", "0", "1", ".", "[ab]", "\\d", "[^a]", "(?:a|1)"]
QUANTIFIERS = ["", "", "*", "+", "?", "{1,2}"]
piece = st.builds(lambda a, q: a + q, st.sampled_from(ATOMS), st.sampled_from(QUANTIFIERS))
pattern = st.builds(lambda start, body, end: start + body + end, st.sampled_from(["", "^"]),
                    st.lists(piece, min_size=0, max_size=3).map("".join), st.sampled_from(["", "$"]))
branch = st.builds(
    lambda p, lengths: {"type": "string", **({} if p is None else {"pattern": p}),
                        **({} if lengths[0] == 0 else {"minLength": lengths[0]}),
                        **({} if lengths[1] is None else {"maxLength": lengths[1]})},
    st.one_of(st.none(), pattern), st.sampled_from([(0, None), (0, None), (1, None), (0, 2), (2, 3)]))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(branches=st.lists(branch, min_size=2, max_size=3))
def test_one_of_overlapping_strings_is_exact(compiler, branches):
    assert _mismatches(compiler, {"oneOf": branches}, STRINGS) == []


def test_one_of_maskbench_shapes(compiler):
    # A pattern and any string (Github_hard o9779): the strings the pattern does not match.
    schema = {"oneOf": [{"type": "string", "pattern": "^[a0]{2}$"}, {"type": "string"}]}
    assert _mismatches(compiler, schema, STRINGS) == []
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    assert _accepts(grammar, "ab") and not _accepts(grammar, "a0")
    # Branches under a parent's type, with other keywords beside them (Github_medium o9805).
    schema = {"type": "string", "oneOf": [{"pattern": "^[ab]{1,3}$"}, {"minLength": 2, "pattern": "1"}]}
    assert _mismatches(compiler, schema, STRINGS) == []


def test_one_of_still_refuses_what_a_superset_cannot_hold(compiler):
    for schema in ({"oneOf": [{"type": "string", "format": "date"}, {"type": "string", "pattern": "1"}]},
                   {"oneOf": [{"type": "string"}, {"type": ["string", "integer"]}]}):
        with pytest.raises(GrammarError) as e:
            compiler.compile(GrammarSpec.json_schema(schema))
        assert e.value.keyword == "oneOf" and "may both match" in str(e.value)


KEYS = ["a", "b", "ab", "ba", "0", "a\n"]
OBJECTS = [dict(zip(keys, vals)) for n in range(3) for keys in itertools.permutations(KEYS, n)
           for vals in itertools.product([0, "a"], repeat=n)]


def _in_written_order(obj: dict, declared: list[str]) -> bool:
    """Whether ``obj``'s keys are in the order Stencil writes them: the declared ones first, in
    the schema's order, then the others (in any order)."""
    keys = list(obj)
    ours = [k for k in keys if k in declared]
    return keys[:len(ours)] == ours and ours == [k for k in declared if k in ours]


@pytest.mark.parametrize("schema", [
    # Two members' patterns: both apply (before, the second member's were dropped).
    {"allOf": [{"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
               {"patternProperties": {"^b": {"type": "string"}}}]},
    # The same pattern on both sides takes both schemas.
    {"allOf": [{"type": "object", "patternProperties": {"^a": {"type": "integer"}}},
               {"patternProperties": {"^a": {"enum": [0, "a"]}, "^b": {"type": "integer"}}}]},
    # A closed member and one that only requires a key its pattern admits (Github_medium o10566).
    {"allOf": [{"type": "object", "patternProperties": {"^[^0]": {"type": "integer"}}, "additionalProperties": False},
               {"required": ["ab"]}]},
    # A declared property on one side, matched by the other side's pattern.
    {"allOf": [{"type": "object", "properties": {"ab": {"type": "integer"}}, "additionalProperties": True},
               {"patternProperties": {"^a": {"enum": [0]}}}]},
    # propertyNames on one side only (before, dropped).
    {"allOf": [{"type": "object", "propertyNames": {"maxLength": 1}}, {"required": ["a"]}]},
])
def test_merged_object_keywords_are_exact(compiler, schema):
    """With JSON Schema's own semantics (``additional_properties="schema"``), over the objects
    written in Stencil's key order."""
    declared = [k for m in schema["allOf"] for k in m.get("properties", {})] + \
        [k for m in schema["allOf"] for k in m.get("required", [])]
    objects = [o for o in OBJECTS if _in_written_order(o, list(dict.fromkeys(declared)))]
    assert _mismatches(compiler, schema, objects, mode="schema") == []


def test_merge_refuses_patterns_beside_a_closed_other_side():
    a = {"patternProperties": {"^a": {"type": "integer"}}, "additionalProperties": False}
    b = {"patternProperties": {"^b": {"type": "integer"}}}
    with pytest.raises(MergeError) as e:
        merge(a, b)
    assert e.value.keyword == "patternProperties"
    # The other side's patterns among this side's own: nothing escapes the closed side.
    merged = merge(a, {"patternProperties": {"^a": {"minimum": 0}}})
    assert merged["patternProperties"] == {"^a": {"allOf": [{"type": "integer"}, {"minimum": 0}]}}
    assert merged["additionalProperties"] is False


@pytest.mark.parametrize("schema", [
    # Spelled keys (with the newline Python's $ admits) join the declared names; the other pattern
    # is taken away with & ~; the rest take additionalProperties.
    {"type": "object", "properties": {"b": {"type": "integer"}},
     "patternProperties": {"^a$": {"type": "integer"}, "^(?:ba|0)$": {"const": 0}, "b$": {"enum": [0, "a"]}},
     "additionalProperties": {"type": "string"}},
    {"type": "object", "patternProperties": {"^ab$|^0$": {"type": "integer"}}, "additionalProperties": {"const": "a"}},
])
def test_spelled_pattern_keys_beside_open_additional_properties(compiler, schema):
    objects = [o for o in OBJECTS if _in_written_order(o, list(schema.get("properties", {})))]
    assert _mismatches(compiler, schema, objects, mode="schema") == []


@pytest.mark.parametrize("schema", [
    # A key schema that is an intersection in grammar mode (a pattern with a length; before, a 400
    # "invalid schema: an intersection (&) has no plain-regex form"), beside a declared key.
    {"type": "object", "properties": {"ab": {"type": "integer"}}, "propertyNames": {"maxLength": 2, "pattern": "^a"}},
    # two propertyNames, one per allOf member: both apply
    {"type": "object", "allOf": [{"propertyNames": {"maxLength": 1}}, {"propertyNames": {"pattern": "^[ab]"}}]},
    # a pattern key with a lookahead, beside a declared key it matches
    {"type": "object", "properties": {"ab": {"type": "string"}},
     "patternProperties": {"^(?!ab$)a": {"type": "integer"}}, "additionalProperties": False},
])
def test_key_schemas_that_are_intersections(compiler, schema):
    declared = list(schema.get("properties", {}))
    objects = [o for o in OBJECTS if _in_written_order(o, declared)]
    assert _mismatches(compiler, schema, objects, mode="schema") == []


@pytest.mark.parametrize("schema", [
    # a finite branch inside an infinite one (before, a 400 at #/oneOf/1/not: a path the user never wrote)
    {"oneOf": [{"const": "a"}, {"type": "string", "maxLength": 2}]},
    {"oneOf": [{"enum": ["a", "b0", 1]}, {"type": "string", "pattern": "^[ab]"}]},
    # strings under a length and a pattern, but some values
    {"type": "string", "maxLength": 3, "pattern": "0|1", "not": {"enum": ["01", "a1"]}},
])
def test_strings_but_some_values_under_other_keywords(compiler, schema):
    assert _mismatches(compiler, schema, STRINGS + [1, 0]) == []


def test_a_discriminator_is_required_of_every_branch_it_tells_apart():
    """``promote_discriminators`` compared branches it had already promoted: once ``t`` required
    ``kind`` (against ``e``), it no longer overlapped ``r``, so ``r`` kept ``kind`` optional and
    ``{"label":"x"}`` was written for ``r``, though it matches ``t`` and ``e`` as well (invalid for
    ``oneOf``). Every object of these keys and values, in the schema's key order: none is written
    that jsonschema rejects, and each branch's own objects with ``kind`` are."""
    import json
    import re

    from stencil.grammar.json_schema.schema_compiler import schema_to_program

    def branch(kind: str, **extra) -> dict:
        return {"type": "object", "properties": {"kind": {"const": kind}, "label": {"type": "string"}, **extra},
                "required": ["label"], "additionalProperties": False}

    schema = {"oneOf": [branch("t"), branch("e"), branch("r", extra={"type": "boolean"})]}
    rx = re.compile(schema_to_program(schema, whitespace="compact").regex())
    validator = jsonschema.Draft202012Validator(schema)
    written = []
    for kind, label, extra in itertools.product([None, "t", "e", "r"], [None, "x"], [None, True]):
        doc = {k: v for k, v in (("kind", kind), ("label", label), ("extra", extra)) if v is not None}
        text = json.dumps(doc, separators=(",", ":"))
        if rx.fullmatch(text):
            assert validator.is_valid(doc), text
            written.append(text)
    assert sorted(written) == sorted(['{"kind":"t","label":"x"}', '{"kind":"e","label":"x"}',
                                      '{"kind":"r","label":"x"}', '{"kind":"r","label":"x","extra":true}'])
