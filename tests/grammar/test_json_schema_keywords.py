"""Exact accept/reject cases for each JSON Schema keyword of stencil.grammar.json_schema.

Every case is checked twice: the regex (Python ``re.fullmatch``) must give the expected verdict,
and jsonschema (format checker on) must agree that accepted texts are valid instances.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stencil.grammar.base import GrammarError
from stencil.grammar.json_schema import schema_to_regex


def _check(schema, accept, reject, **kw):
    regex, _ = schema_to_regex(schema, **kw)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    for text in accept:
        assert re.fullmatch(regex, text), f"should accept {text!r}"
        assert validator.is_valid(json.loads(text)), f"oracle rejects accepted {text!r}"
    for text in reject:
        assert not re.fullmatch(regex, text), f"should reject {text!r}"
    return regex


def test_types_and_type_arrays():
    _check({"type": "null"}, ["null"], ["nul", "0", '""'])
    _check({"type": "boolean"}, ["true", "false"], ["True", "1"])
    _check({"type": "integer"}, ["0", "-7", "120"], ["-0", "01", "1.5", "1e3", "+1"])
    _check({"type": "number"}, ["0", "-1.25", "3e-7", "2E+10"], ["01", ".5", "1.", "-"])
    _check({"type": "string"}, ['""', '"a\\"b"', '"é\\n"'], ['"a"b"', "'a'", '"\\x"'])
    _check({"type": ["string", "null"]}, ['"x"', "null"], ["1", "[]"])


def test_enum_and_const_any_value():
    _check({"enum": ["a.b", 1, None, {"k": [1, 2]}, [True]]},
           ['"a.b"', "1", "null", '{"k":[1,2]}', "[true]"], ['"a-b"', "2", '{"k":[1]}', "1.0"])
    _check({"const": "x*y"}, ['"x*y"'], ['"xxy"', '"x*yy"'])
    _check({"type": "integer", "enum": [1, "a", 2.5, 3]}, ["1", "3"], ['"a"', "2.5"])


def test_empty_enum_and_false_are_unsatisfiable():
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"enum": []})
    assert e.value.keyword == "enum"
    with pytest.raises(GrammarError):
        schema_to_regex(False)
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"type": "array", "minItems": 3, "maxItems": 2})
    assert e.value.keyword == "minItems"


def test_properties_required_and_optional_subsets():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"},
                                               "c": {"type": "boolean"}}, "required": ["b"]}
    _check(schema, ['{"b":"x"}', '{"a":1,"b":"x"}', '{"b":"x","c":true}', '{"a":1,"b":"","c":false}'],
           ['{}', '{"a":1}', '{"b":"x",}', '{,"b":"x"}', '{"b":"x","a":1}', '{"b":"x","d":1}'])
    none_required = {"type": "object", "properties": {"a": {"type": "null"}, "b": {"type": "null"},
                                                      "c": {"type": "null"}}}
    _check(none_required, ["{}", '{"a":null}', '{"b":null}', '{"a":null,"c":null}',
                           '{"a":null,"b":null,"c":null}'],
           ['{,}', '{"a":null,}', '{,"b":null}', '{"c":null,"a":null}'])



@pytest.mark.parametrize("n", [13, 40, 200])
def test_many_optional_properties_any_ordered_subset(n):
    """Blocks of the subset chain (13 and 40 members: two levels, 200: three) stay exact."""
    import random

    rng = random.Random(n)
    names = [f"p{i}" for i in range(n)]
    schema = {"type": "object", "properties": {k: {"type": "integer"} for k in names}}
    regex, _ = schema_to_regex(schema)
    assert len(regex) < 60 * n * 8  # linear in n, not quadratic
    for _ in range(40):
        keep = sorted(rng.sample(range(n), rng.randint(0, min(n, 9))))
        members = [f'"p{i}":{i}' for i in keep]
        assert re.fullmatch(regex, "{" + ",".join(members) + "}")
        if len(members) >= 2:
            swapped = members[:]
            swapped[0], swapped[-1] = swapped[-1], swapped[0]
            assert not re.fullmatch(regex, "{" + ",".join(swapped) + "}")
            assert not re.fullmatch(regex, "{" + ",".join(members + members[-1:]) + "}")
            assert not re.fullmatch(regex, "{" + ",".join(members) + ",}")
    # The Rust regex parser behind outlines-core must accept the nesting.
    from outlines_core import Index, Vocabulary

    Index(regex, Vocabulary(3, {"{": [0], "}": [1], '"p0":0': [2]}))

def test_additional_properties():
    closed = {"type": "object", "properties": {"a": {"type": "null"}}, "additionalProperties": False}
    _check(closed, ["{}", '{"a":null}'], ['{"b":1}'])
    typed = {"type": "object", "properties": {"a": {"type": "null"}},
             "additionalProperties": {"type": "integer"}}
    _check(typed, ['{"a":null,"b":1}', '{"b":1,"c":2}', "{}"], ['{"b":"x"}', '{"a":1}', '{"a":null,"a":1}'])
    _check({"type": "object"}, ["{}", '{"k":[1]}'], ["[]"])  # nothing declared: free-form
    open_ = {"type": "object", "properties": {"a": {"type": "null"}}}
    _check(open_, ['{"a":null}'], ['{"z":1}'])  # default: no extra keys written
    _check(open_, ['{"a":null,"z":[1,{"q":"r"}]}', '{"ab":1}'], ['{"a":1}', '{"a":null,"a":3}'],
           extra_properties=True, any_max_depth=2)
    # Default depth 1: an extra value may be a container of scalars, not deeper.
    _check(open_, ['{"a":null,"z":[1,"q"]}', '{"z":{"q":"r"}}'], ['{"z":[1,{"q":"r"}]}'],
           extra_properties=True)
    # A required key the schema does not declare takes any value (after the declared ones),
    # unless additionalProperties forbids it.
    _check({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["id"]},
           ['{"id":1}', '{"a":null,"id":"x"}', '{"id":[true]}'], ['{}', '{"a":null}', '{"id":1,"a":null}'])
    with pytest.raises(GrammarError):
        schema_to_regex({"type": "object", "properties": {"a": {}}, "required": ["id"],
                         "additionalProperties": False})


def test_pattern_properties_and_property_names():
    schema = {"type": "object", "patternProperties": {"^x-[a-z]+$": {"type": "integer"}},
              "additionalProperties": False}
    _check(schema, ["{}", '{"x-a":1}', '{"x-a":1,"x-bc":2}'], ['{"y":1}', '{"x-a":"s"}', '{"x-A":1}'])
    names = {"type": "object", "propertyNames": {"pattern": "^[a-c]+$"},
             "additionalProperties": {"type": "null"}}
    _check(names, ['{"ab":null}', "{}"], ['{"ad":null}'])


def test_items_prefix_items_and_bounds():
    _check({"type": "array", "items": {"type": "integer"}, "minItems": 1, "maxItems": 3},
           ["[1]", "[1,2,3]"], ["[]", "[1,2,3,4]", "[1,]", '["a"]'])
    _check({"type": "array", "prefixItems": [{"type": "string"}, {"type": "null"}], "items": False},
           ["[]", '["a"]', '["a",null]'], ['[null]', '["a",null,1]'])
    _check({"$schema": "http://json-schema.org/draft-04/schema#", "type": "array",
            "items": [{"type": "integer"}], "additionalItems": {"type": "boolean"}},
           ["[]", "[1]", "[1,true,false]"], ["[true]", "[1,2]"])


def test_counts_above_the_repeat_cap_are_refused_or_narrowed():
    """``minItems`` above ``MAX_REPEAT_COUNT`` is a 400 (a subset cannot help), ``maxItems`` above it
    is written as the cap (a subset, with a warning), never dropped (a superset)."""
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"type": "array", "minItems": 10_001, "items": {"type": "null"}})
    assert (e.value.keyword, e.value.path) == ("minItems", "#/minItems")
    schema = {"type": "array", "maxItems": 1_000_000, "items": {"type": "null"}}
    regex, warnings = schema_to_regex(schema)
    assert warnings == ["maxItems at #: arrays are written with at most 10000 items (not 1000000)"]
    _check(schema, ["[]", "[null]", "[" + ",".join(["null"] * 10_000) + "]"],
           ["[" + ",".join(["null"] * 10_001) + "]", "[1]"])
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"type": "string", "pattern": "x{0,10001}"})
    assert (e.value.keyword, e.value.position) == ("pattern", 1)


def test_string_lengths_count_characters_not_bytes():
    _check({"type": "string", "minLength": 2, "maxLength": 3},
           ['"ab"', '"abc"', '"é\\n"', '"日本語"'], ['"a"', '"abcd"', '"\\n"'])


def test_pattern_is_a_search_over_the_decoded_string():
    _check({"type": "string", "pattern": "[0-9]{3}"}, ['"a123b"', '"999"'], ['"12"', '"a1b2c3"'])
    _check({"type": "string", "pattern": "^a.c$"}, ['"abc"', '"a\\"c"', '"abc\\n"'], ['"ac"', '"abcd"'])
    # U+FEFF is whitespace for ECMA-262 but not for Python: neither \\s nor \\S admits it.
    _check({"type": "string", "pattern": "^\\S$"}, ['"a"'], ['"\ufeff"', '" "'])
    _check({"type": "string", "pattern": "^(foo|bar)+$"}, ['"foobar"', '"bar"'], ['"fo"', '""'])
    _check({"type": "string", "pattern": "^[a-z][a-z0-9_]*$", "maxLength": 4},
           ['"a"', '"ab_9"'], ['"ab_90"', '"9a"'])


def test_unsupported_pattern_features_fail_closed_with_position():
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"type": "string", "pattern": "^(?=a)b"})
    assert e.value.keyword == "pattern" and e.value.position is not None
    regex, warnings = schema_to_regex({"type": "string", "pattern": "(a)\\1"}, strict=False)
    assert warnings and "pattern" in warnings[0]


@pytest.mark.parametrize("fmt,good,bad", [
    ("date", ["2024-02-29", "2023-12-31"], ["2023-02-29", "2023-13-01", "0000-01-01", "2023-1-01"]),
    ("time", ["23:59:59Z", "08:00:00.5+02:00"], ["24:00:00Z", "08:00:00"]),
    ("date-time", ["2023-04-30T10:00:00Z"], ["2023-04-31T10:00:00Z", "2023-04-30 10:00:00Z"]),
    ("email", ["a.b@example.com"], ["ab", "a@", ".a@example.com", "a..b@example.com"]),
    ("uuid", ["123e4567-e89b-12d3-a456-426614174000"], ["123e4567e89b12d3a456426614174000"]),
    ("ipv4", ["192.168.0.1", "0.0.0.0"], ["256.1.1.1", "01.2.3.4", "1.2.3"]),
    ("ipv6", ["::1", "2001:db8::ff00:42:8329", "1:2:3:4:5:6:7:8"], ["1:2:3:4:5:6:7:8:9", ":::"]),
    ("hostname", ["example.com", "a-b.c", "my-site.org"], ["-a.com", "a..b", "a_b.com", "xn--X"]),
    ("uri", ["https://example.com/a?b=c#d", "urn:isbn:123"], ["//example.com", "not a uri"]),
])
def test_formats_agree_with_the_format_checker(fmt, good, bad):
    _check({"type": "string", "format": fmt}, [json.dumps(g) for g in good],
           [json.dumps(b) for b in bad])


def test_regex_format_is_a_subset_of_compilable_patterns():
    good = ["^[a-zA-Z0-9_]{3,16}$", "", "(a|b)*?c{1,20}\\d+", "^(?:[a-z0-9._%+-]+)@x\\.com$",
            "[^-]", "x{0,100}|y{7,}", "\\bword\\b", "((a))"]
    bad = ["*", "\\", "Invalid regex pattern [", "a{3,2}", "[z-a]", "\\b*", "a**", "(a", "[]"]
    regex = _check({"type": "string", "format": "regex"}, [json.dumps(g) for g in good],
                   [json.dumps(b) for b in bad])
    for text in bad:
        with pytest.raises(re.error):
            re.compile(text)
    # Every string of the language compiles (hypothesis walks the regex itself).
    from hypothesis import HealthCheck, assume, given, settings, strategies as st
    from stencil.grammar.json_schema.formats import format_pattern

    @settings(max_examples=400, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(st.from_regex(re.compile("(?:" + format_pattern("regex") + ")"), fullmatch=True))
    def compiles(pattern):
        re.compile(pattern)
        # strings are written without controls that lack a named escape, and without U+007F
        # (stencil.grammar.charset): those patterns are left out of the language
        assume(not re.search("[\x00-\x07\x0b\x0e-\x1f\x7f]", pattern))
        assert re.fullmatch(regex, json.dumps(pattern, ensure_ascii=False))

    compiles()


def test_integral_float_counts_are_counts():
    # Draft 6 on: "maxLength": 2.0 is the integer 2 (it used to reach the regex as "{0,2.0}").
    _check({"type": "string", "maxLength": 2.0, "minLength": 1.0}, ['"a"', '"ab"'], ['""', '"abc"'])
    _check({"type": "array", "maxItems": 1.0}, ["[]", "[1]"], ["[1,2]"])
    from stencil.grammar.frontend import to_program
    from stencil.grammar.base import GrammarSpec
    program = to_program(GrammarSpec.json_schema({"type": "string", "maxLength": 2.0}))
    assert "2.0" not in program.lark()


def test_integer_ranges_exact():
    regex = _check({"type": "integer", "minimum": -15, "maximum": 230}, [], [])
    for v in range(-40, 300):
        assert bool(re.fullmatch(regex, str(v))) == (-15 <= v <= 230), v
    regex = _check({"type": "integer", "exclusiveMinimum": 9, "exclusiveMaximum": 1000}, [], [])
    for v in list(range(0, 30)) + list(range(990, 1010)):
        assert bool(re.fullmatch(regex, str(v))) == (9 < v < 1000), v
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
              "minimum": 0, "exclusiveMinimum": True}
    _check(draft4, ["1", "17"], ["0", "-1"])


def test_number_ranges_with_fractions():
    schema = {"type": "number", "minimum": -1.5, "exclusiveMaximum": 2.25}
    regex = _check(schema, ["-1.5", "0", "2.2499", "-1.4"], ["-1.51", "2.25", "2.250", "3", "-2"])
    for text in ["-1.50", "1.999", "2.24", "0.0", "-0.5"]:
        assert re.fullmatch(regex, text)


def test_multiple_of_integers():
    _check({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 30},
           ["0", "5", "30"], ["3", "35", "-5"])
    _check({"type": "integer", "multipleOf": 2}, ["0", "-4", "12", "8"], ["3", "-7", "11"])
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"type": "integer", "multipleOf": 7})
    assert e.value.keyword == "multipleOf"


def test_any_of_one_of_and_all_of():
    _check({"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 1}]},
           ["3", '"a"'], ['"ab"', "null"])
    _check({"oneOf": [{"type": "object", "properties": {"k": {"const": "a"}, "x": {"type": "integer"}},
                       "required": ["k"]},
                      {"type": "object", "properties": {"k": {"const": "b"}}, "required": ["k"]}]},
           ['{"k":"a"}', '{"k":"a","x":1}', '{"k":"b"}'], ['{"k":"c"}'])
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"oneOf": [{"type": "integer"}, {"type": "number"}]})
    assert e.value.keyword == "oneOf"
    _check({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                      {"properties": {"a": {"minimum": 5}, "b": {"type": "null"}}}]},
           ['{"a":5}', '{"a":7,"b":null}'], ['{"a":4}', '{}', '{"b":null}'])



def test_one_of_exactly_one_required_set_and_merged_discriminators():
    props = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "integer"}}
    _check({"type": "object", "properties": props, "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
           ['{"a":1}', '{"b":2}', '{"a":1,"c":3}'], ['{}', '{"a":1,"b":2}', '{"c":3}'])
    # Overlapping sets: {a, b} or {a, c}, never both b and c.
    _check({"type": "object", "properties": props,
            "oneOf": [{"required": ["a", "b"]}, {"required": ["a", "c"]}]},
           ['{"a":1,"b":2}', '{"a":1,"c":3}'], ['{"a":1}', '{"a":1,"b":2,"c":3}', '{"b":2,"c":3}'])
    # One set inside another: the larger branch always satisfies both, so only {a} without b.
    _check({"type": "object", "properties": props, "oneOf": [{"required": ["a"]}, {"required": ["a", "b"]}]},
           ['{"a":1}', '{"a":1,"c":3}'], ['{"a":1,"b":2}', '{"b":2}'])
    # A discriminator that only becomes an enum after merging with the parent's property.
    _check({"type": "object", "properties": {"kind": {"type": "string"}, "n": {"type": "integer"}},
            "oneOf": [{"properties": {"kind": {"enum": ["x"]}}, "required": ["kind"]},
                      {"properties": {"kind": {"enum": ["y"]}}, "required": ["kind", "n"]}]},
           ['{"kind":"x"}', '{"kind":"x","n":1}', '{"kind":"y","n":2}'], ['{"kind":"y"}', '{"kind":"z"}'])
    # Branches whose written objects cannot meet: b requires a key a never writes (a declares
    # properties, so the grammar writes no others), and the other way round.
    _check({"oneOf": [{"type": "object", "properties": {"t": {"type": "string"}}, "required": ["t"]},
                      {"type": "object", "properties": {"e": {"type": "string"}, "g": {"type": "string"}},
                       "required": ["e", "g"]}]},
           ['{"t":"x"}', '{"e":"a","g":"b"}'], ['{"t":"x","e":"a","g":"b"}', '{"e":"a"}'])
    # A discriminator declared but not required is written always, so the branches stay apart.
    _check({"oneOf": [{"type": "object", "properties": {"kind": {"const": "a"}, "x": {"type": "null"}}},
                      {"type": "object", "properties": {"kind": {"const": "b"}}}]},
           ['{"kind":"a"}', '{"kind":"a","x":null}', '{"kind":"b"}'], ['{}', '{"x":null}'])
    with pytest.raises(GrammarError):  # nothing tells {} apart
        schema_to_regex({"oneOf": [{"type": "object", "properties": {"r": {"type": "string"}}},
                                   {"type": "object", "properties": {"b": {"type": "string"}}}]})


def test_one_of_finite_branches_empty_objects_and_nested_unions():
    # A finite branch beside infinite ones: its values are decided one by one, and the other
    # branches are written without them ({} minus three strings: the trie complement).
    _check({"oneOf": [{"enum": ["nano", "vim", 3]}, {"type": "string"}]},
           ['3', '"emacs"', '""'], ['"nano"', '"vim"', '4', 'null'])
    _check({"oneOf": [{"enum": ["any"]}, {"type": "string", "pattern": "^[0-9 x]+$"}]},
           ['"any"', '"3 x 4"'], ['"anyx"', '"a"'])
    # Closed objects with different keys meet only in {}, which two branches admit: oneOf
    # rejects it, and each branch is written without it.
    _check({"oneOf": [{"type": "object", "properties": {"key": {"type": "string"}}, "additionalProperties": False},
                      {"type": "object", "properties": {"keys": {"type": "array", "items": {"type": "string"}}},
                       "additionalProperties": False}]},
           ['{"key":"a"}', '{"keys":["a"]}'], ['{}', '{"key":"a","keys":[]}'])
    # ... and where one branch requires its key, {} belongs to the other alone.
    _check({"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                       "additionalProperties": False},
                      {"type": "object", "properties": {"b": {"type": "integer"}}, "additionalProperties": False}]},
           ['{"a":1}', '{"b":2}', '{}'], ['{"a":1,"b":2}'])
    # Types through a $ref to another union; a required discriminator against a declared one.
    _check({"$defs": {"strs": {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}},
            "oneOf": [{"$ref": "#/$defs/strs"},
                      {"type": "object", "properties": {"p": {"type": "string"}}, "additionalProperties": False}]},
           ['"x"', '["x"]', '{"p":"x"}', '{}'], ['1', '[1]'])
    _check({"type": "object", "properties": {"when": {"type": "string"}, "at": {"type": "integer"}},
            "oneOf": [{"properties": {"when": {"enum": ["delayed"]}}, "required": ["when", "at"]},
                      {"properties": {"when": {"not": {"enum": ["delayed"]}}}}]},
           ['{"when":"delayed","at":1}', '{"when":"now"}', '{}', '{"at":2}'],
           ['{"when":"delayed"}', '{"when":"delayed","at":"x"}'])
    # The branches of a union inside a branch: each is closed against the other branch's key.
    _check({"oneOf": [{"type": "object", "properties": {"c": {"type": "null"}}, "required": ["c"],
                       "additionalProperties": False},
                      {"type": "object", "oneOf": [
                          {"properties": {"and": {"type": "null"}}, "required": ["and"], "additionalProperties": False},
                          {"properties": {"or": {"type": "null"}}, "required": ["or"], "additionalProperties": False}]}]},
           ['{"c":null}', '{"and":null}', '{"or":null}'], ['{}', '{"c":null,"and":null}'])
    with pytest.raises(GrammarError) as e:  # an infinite branch inside another: still refused
        schema_to_regex({"oneOf": [{"type": "string", "pattern": "^a"}, {"type": "string"}]})
    assert e.value.keyword == "oneOf"


def test_one_of_of_recursive_references_stays_a_grammar():
    from stencil.grammar.json_schema import schema_to_program

    schema = {"$defs": {
        "cond": {"type": "object", "oneOf": [{"$ref": "#/$defs/leaf"}, {"$ref": "#/$defs/all"}]},
        "leaf": {"type": "object", "properties": {"is": {"type": "integer"}}, "required": ["is"],
                 "additionalProperties": False},
        "all": {"type": "object", "properties": {"all": {"type": "array", "items": {"$ref": "#/$defs/cond"}}},
                "required": ["all"], "additionalProperties": False}},
        "$ref": "#/$defs/cond"}
    program = schema_to_program(schema)
    assert program.kind == "lark"  # the references became rules, not an endless inlining


def test_dependencies_as_absent_or_satisfied():
    props = {"a": {"type": "integer"}, "b": {"type": "integer"}, "c": {"type": "string"}}
    _check({"type": "object", "properties": props, "dependencies": {"a": ["b"]}},
           ["{}", '{"a":1,"b":2}', '{"b":2}', '{"c":"x"}'], ['{"a":1}', '{"a":1,"c":"x"}'])
    _check({"type": "object", "properties": props, "dependentRequired": {"a": ["b"], "c": ["a"]}},
           ["{}", '{"a":1,"b":2}', '{"a":1,"b":2,"c":"x"}'], ['{"b":2,"c":"x"}', '{"a":1,"c":"x"}'])
    _check({"type": "object", "properties": props,
            "dependentSchemas": {"c": {"properties": {"a": {"minimum": 5}}, "required": ["a"]}}},
           ['{"a":1}', '{"a":5,"c":"x"}'], ['{"a":4,"c":"x"}', '{"c":"x"}'])


def test_if_then_else_on_one_property_value():
    props = {"kind": {"type": "string"}, "a": {"type": "integer"}, "b": {"type": "integer"}}
    schema = {"type": "object", "properties": props, "if": {"properties": {"kind": {"const": "x"}}},
              "then": {"required": ["a"]}, "else": {"required": ["b"]}}
    # "kind" absent: the condition holds vacuously, so "then" applies.
    _check(schema, ['{"kind":"x","a":1}', '{"kind":"y","b":2}', '{"kind":"xx","b":2}', '{"a":1}'],
           ['{"kind":"x"}', '{"kind":"y","a":1}', '{"b":2}', "{}"])
    required = dict(schema, **{"if": {"properties": {"kind": {"enum": ["x", "z"]}}, "required": ["kind"]}})
    _check(required, ['{"kind":"z","a":1}', '{"kind":"q","b":2}', '{"b":2}'], ['{"a":1}', '{"kind":"z","b":2}'])


def test_not_enum_of_strings_is_a_string_complement():
    _check({"type": "string", "not": {"enum": ["ab", "c"]}}, ['""', '"a"', '"abc"', '"cc"', '"b"'],
           ['"ab"', '"c"'])


# Values of every type, as the grammar writes them and otherwise (1.0, 10e-1, "-0": equal to 1 and 0).
_VALUES = ["1", "1.0", "1.00", "10e-1", "1e0", "2", "-1", "0", "-0", "0.5", "1.5", "-1.5", '"1"', '""',
           "true", "false", "null", "[]", "[1]", "{}", '{"a":1}']


def _sound(schema, texts, grammar):
    """The texts the compiled schema admits, each checked valid against jsonschema."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.frontend import to_program

    regex = re.compile(to_program(GrammarSpec.json_schema(schema), grammar=grammar).regex())
    validator = jsonschema.Draft202012Validator(schema)
    admitted = {t for t in texts if regex.fullmatch(t)}
    unsound = [t for t in admitted if not validator.is_valid(json.loads(t))]
    assert not unsound, f"admitted but invalid: {unsound}"
    return admitted


@pytest.mark.parametrize("grammar", [False, True])
@pytest.mark.parametrize("a", [{}, {"a": {"type": "integer"}}, {"a": {"type": ["integer", "string", "null"]}}])
def test_if_const_then_required_on_a_property_of_any_type_is_exact(a, grammar):
    """The else case needs "a" to be anything but 1: a union by type (1.0 left out too)."""
    schema = {"type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]},
              **({"properties": a} if a else {})}
    texts = [t for v in _VALUES for t in ('{"a":%s}' % v, '{"a":%s,"b":2}' % v)] + ['{"b":2}', "{}"]
    admitted = _sound(schema, texts, grammar)
    assert {'{"a":1,"b":2}', '{"a":2}', '{"a":-1}', '{"b":2}'} <= admitted
    assert not {'{"a":1}', '{"a":1.0}', "{}"} & admitted
    if not a:  # any other value at all
        assert {'{"a":1.5}', '{"a":0}', '{"a":"1"}', '{"a":true}', '{"a":null}', '{"a":[1]}'} <= admitted
    elif a["a"]["type"] == "integer":
        assert not {'{"a":1.5}', '{"a":"1"}'} & admitted and '{"a":0}' in admitted


@pytest.mark.parametrize("grammar", [False, True])
def test_not_enum_is_a_union_by_type(grammar):
    ints = _sound({"type": "integer", "not": {"enum": [3, 7, 7.0, 1.5, "x"]}},
                  [str(i) for i in range(-3, 12)] + ["7.0", "1.5"], grammar)
    assert ints == {str(i) for i in range(-3, 12)} - {"3", "7"}
    nums = _sound({"type": "number", "not": {"const": 1}}, _VALUES, grammar)
    assert nums == {"2", "-1", "0", "0.5", "1.5", "-1.5"}  # no exponent, no "-0": the canonical forms
    anything = _sound({"not": {"enum": [True, None, "1", 0]}}, _VALUES, grammar)
    assert {"false", '""', "1", "-1.5", "[1]", "{}"} <= anything
    assert not {"true", "null", '"1"', "0", "-0"} & anything
    with pytest.raises(GrammarError, match="admits no value"):
        schema_to_regex({"type": "boolean", "not": {"enum": [True, False]}})


def test_if_that_cannot_be_compiled_names_if_where_it_stands():
    """Refusals name the ``if`` the user wrote, at its path, never the ``not`` of the rewrite."""
    cases = [
        # the else case would need any string but "x" of at most 3 characters
        ({"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}},
          "if": {"properties": {"a": {"const": "x"}}}, "then": {"required": ["b"]}}, "#", "pattern, length"),
        ({"type": "object", "properties": {"p": {"type": "object", "if": {
            "properties": {"a": {"const": {"k": 1}}}}, "then": {"required": ["b"]}}}, "required": ["p"]},
         "#/properties/p", "objects"),
    ]
    for schema, path, why in cases:
        with pytest.raises(GrammarError) as e:
            schema_to_regex(schema)
        assert (e.value.keyword, e.value.path) == ("if", path)
        assert "'a'" in e.value.message and "else case" in e.value.message and why in e.value.message
        assert "not" not in e.value.message.replace("cannot", "")
        _, warnings = schema_to_regex(schema, strict=False)
        assert any(w.startswith(f"if at {path}:") for w in warnings)
    with pytest.raises(GrammarError) as e:  # a condition of another form says what is compiled
        schema_to_regex({"type": "object", "if": {"required": ["a"]}, "then": {}})
    assert (e.value.keyword, e.value.path) == ("if", "#") and "one property" in e.value.message
    with pytest.raises(GrammarError) as e:  # a not the user wrote stays a not
        schema_to_regex({"not": {"const": {"a": 1}}})
    assert (e.value.keyword, e.value.path) == ("not", "#/not")

def test_refs_local_pointer_defs_and_recursion():
    schema = {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "next": {"$ref": "#/$defs/node"}}, "required": ["v"]}},
        "$ref": "#/$defs/node"}
    regex = _check(schema, ['{"v":1}', '{"v":1,"next":{"v":2}}'], ['{"next":{"v":2}}'])
    deep = '{"v":0' + ''.join(',"next":{"v":%d' % i for i in range(1, 8)) + '}' * 8
    assert not re.fullmatch(regex, deep)  # unrolled only max_recursion_depth times
    _check({"definitions": {"a": {"type": "boolean"}}, "properties": {"x": {"$ref": "#/definitions/a"}},
            "required": ["x"]}, ['{"x":true}'], ['{"x":1}'])
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"$ref": "https://example.com/schema.json"})
    assert e.value.keyword == "$ref"


def test_the_identifier_keyword_is_the_drafts_own():
    # 2020-12 (no $schema): "id" is no keyword, so "#/..." still points into the root document.
    app = {"id": "schema/app", "definitions": {"flag": {"type": "boolean"}},
           "properties": {"on": {"$ref": "#/definitions/app/definitions/flag"}}, "required": ["on"]}
    _check({"definitions": {"app": app}, "properties": {"app": {"$ref": "#/definitions/app"}},
            "required": ["app"]}, ['{"app":{"on":true}}'], ['{"app":{"on":1}}'])
    # draft-04: "id" sets the base URI and "$id" is no keyword.
    four = "http://json-schema.org/draft-04/schema#"
    _check({"$schema": four, "id": "http://x.test/root.json",
            "definitions": {"n": {"id": "n.json", "type": "integer"}},
            "properties": {"v": {"$ref": "n.json"}}, "required": ["v"]}, ['{"v":3}'], ['{"v":"3"}'])
    _check({"$schema": four, "definitions": {"n": {"$id": "/definitions/n", "type": "integer"}},
            "properties": {"v": {"$ref": "#/definitions/n"}}, "required": ["v"]}, ['{"v":3}'], ['{"v":"3"}'])
    with pytest.raises(GrammarError) as e:  # under draft-04, "$id" names no resource
        schema_to_regex({"$schema": four, "definitions": {"n": {"$id": "n.json", "type": "integer"}},
                         "properties": {"v": {"$ref": "n.json"}}})
    assert e.value.keyword == "$ref"


def test_empty_schema_is_any_json_within_depth():
    regex = _check({}, ["1", '"s"', "[1,[2]]", '{"a":{"b":1}}'],
                   ["[[[1]]]", '{"a":{"b":[]}}', "[1,]"], any_max_depth=2)
    assert re.fullmatch(regex, "null")


def test_not_and_unsupported_keywords_fail_closed():
    _check({"type": ["string", "integer"], "not": {"type": "integer"}}, ['"a"'], ["1"])
    for schema, keyword in [({"type": "array", "uniqueItems": True}, "uniqueItems"),
                            ({"type": "object", "if": {"required": ["a"]}, "then": {}}, "if")]:
        with pytest.raises(GrammarError) as e:
            schema_to_regex(schema)
        assert e.value.keyword == keyword and e.value.path == "#"
    regex, warnings = schema_to_regex({"type": "array", "uniqueItems": True, "items": {"type": "string"}},
                                      strict=False)
    assert any("uniqueItems" in w and "#" in w for w in warnings)
    assert re.fullmatch(regex, '["a","a"]')


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
    {"type": "array", "items": {"enum": ["a", "b", "c", 1, 1.0, 2]}, "uniqueItems": True,
     "minItems": 2, "maxItems": 3},
    {"type": "array", "items": {"type": "boolean"}, "uniqueItems": True},
    {"type": "array", "items": {"type": ["boolean", "null"]}, "uniqueItems": True, "minItems": 3},
    {"type": "array", "items": {"enum": [{"x": 1}, [1, 2], "q"]}, "uniqueItems": True, "maxItems": 2},
    {"type": "array", "items": {"$ref": "#/$defs/c"}, "uniqueItems": True, "minItems": 2,
     "$defs": {"c": {"enum": ["r", "g", "b"]}}},
])
@pytest.mark.parametrize("grammar", [False, True])
def test_unique_items_over_a_finite_set_exact(schema, grammar):
    """Every array of up to 4 items from the set: accepted exactly when jsonschema says valid."""
    import itertools

    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.frontend import to_program
    from stencil.grammar.json_schema.canonical import canonical_json

    regex = re.compile(to_program(GrammarSpec.json_schema(schema), grammar=grammar).regex())
    validator = jsonschema.Draft202012Validator(schema)
    items = schema["items"]
    pool = items.get("enum") or schema.get("$defs", {}).get("c", {}).get("enum") or [True, False, None]
    seen = 0
    for n in range(5):
        for combo in itertools.product(pool, repeat=n):
            text = canonical_json(list(combo))
            want = validator.is_valid(json.loads(text))
            assert (regex.fullmatch(text) is not None) == want, text
            seen += want
    assert seen > 0


def test_unique_items_too_many_orders_is_refused():
    big = {"type": "array", "items": {"enum": list(range(20))}, "uniqueItems": True}
    with pytest.raises(GrammarError) as e:
        schema_to_regex(big)
    assert e.value.keyword == "uniqueItems" and "orders" in str(e.value)



def test_finite_value_sets_decide_every_other_keyword():
    """With enum/const (directly or in an allOf member) jsonschema filters the values."""
    _check({"allOf": [{"enum": [1, "ab", True, [1, 2]]}, {"not": {"type": "integer"}}]},
           ['"ab"', "true", "[1,2]"], ["1"])
    _check({"allOf": [{"enum": ["fo", "foo", 3]}, {"not": {"not": {"maxLength": 2}}}]},
           ['"fo"', "3"], ['"foo"'])
    _check({"enum": [{"a": 1}, {"a": 1, "b": 2}], "not": {"required": ["b"]},
            "oneOf": [{"type": "object"}, {"minProperties": 5}]}, ['{"a":1}'], ['{"a":1,"b":2}'])
    with pytest.raises(GrammarError):
        schema_to_regex({"allOf": [{"const": 2}, {"not": {"minimum": 1}}]})

def test_annotations_are_ignored_silently():
    regex, warnings = schema_to_regex({"type": "string", "title": "t", "description": "d",
                                       "examples": ["x"], "default": "y", "$comment": "c",
                                       "deprecated": True, "readOnly": True})
    assert warnings == [] and re.fullmatch(regex, '"q"')


def test_flexible_whitespace_is_bounded():
    schema = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}}},
              "required": ["a"]}
    _check(schema, ['{ "a" : [1, 2] }', '{\n "a":[ 1 ,2 ]\n}'], ['{   "a":[]}', '{"a":[1,   2]}'], whitespace="flexible")


def test_flexible_whitespace_admits_pretty_printed_json_up_to_a_bounded_indent():
    """json.dumps(indent=2) and indent=4 layouts (and CRLF line ends) pass; a line break with an
    indent of more than 20 columns, two line breaks, or any run in compact mode do not."""
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "array", "items": {"type": "integer"}}}, "required": ["b"]}}, "required": ["a"]}
    doc = {"a": {"b": [1, 2]}}
    pretty = [json.dumps(doc, indent=2), json.dumps(doc, indent=4), json.dumps(doc, indent="\t"),
              json.dumps(doc, indent=2).replace("\n", "\r\n"), '{"a": {"b": [1, 2]}}']
    deep = '{\n' + " " * 21 + '"a": {"b": []}}'
    _check(schema, pretty, [deep, '{\n\n  "a": {"b": []}}', '{"a":{"b":[1,2]}}   '], whitespace="flexible")
    _check(schema, ['{"a":{"b":[1,2]}}'], pretty, whitespace="compact")


@pytest.mark.parametrize("a, b, disjoint", [
    ("^a", "^b", True), ("^x-", "^y_", True), ("^a|^b", "^c", True), ("^(foo|bar)", "^baz", True),
    ("^a", "^ab", False),  # "ab..." matches both
    ("^a|^b", "^b", False), ("abc", "^x", False),  # unanchored: matches anywhere
    ("^ab?c", "^ac", False),  # the "b" may be absent: "ac" matches both
    (r"^\d", "^a", False),  # no literal prefix
    # told apart by their literal endings (anchored at the end)
    ("^c:[0-3]:sur$", "^c:[0-3]:given$", True), ("xa$", "yba$", True), (r"a\Z", "b$", True),
    ("ab$", "b$", False), (r"ab$", r"b\Z", False), ("a$", "[ab]$", False), ("ca$|^b", "^x|da$", False), ("^yca$|^b$", "^x|da$", True),
])
def test_pattern_properties_are_disjoint_only_with_distinct_literal_ends(a, b, disjoint):
    from stencil.grammar.json_schema.objects import _disjoint_patterns

    assert _disjoint_patterns(a, b) is disjoint and _disjoint_patterns(b, a) is disjoint
    if disjoint:  # no key that Python's re matches with both
        probes = ["a", "ab", "ac", "b", "c", "x-1", "y_1", "foo", "bar", "baz", "c:1:sur", "xa", "yba", "a\n"]
        assert not any(re.search(a, k) and re.search(b, k) for k in probes)


_PIECES = ["a", "b", "ab", "[ab]", "a?", "b*", "(a|b)", "\\.", "."]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.sampled_from(_PIECES), max_size=3),
                          st.sampled_from(["", "$", "\\Z"])), min_size=2, max_size=3))
def test_patterns_said_disjoint_share_no_key(parts):
    """Soundness against Python's re.search: when two patterns are said disjoint, no string over
    their alphabet (to 5 characters, a final newline too) matches both."""
    import itertools

    from stencil.grammar.json_schema.objects import _disjoint_patterns

    patterns = [("^" if start else "") + "".join(body) + end for start, body, end in parts]
    words = ["".join(w) for n in range(6) for w in itertools.product("ab.", repeat=n)]
    words += [w + "\n" for w in words]
    for a, b in itertools.combinations(patterns, 2):
        if _disjoint_patterns(a, b):
            assert not any(re.search(a, w) and re.search(b, w) for w in words), (a, b)


def test_one_of_told_apart_by_a_required_discriminator_is_proved_in_one_pass():
    from stencil.grammar.json_schema.schema_compiler import SchemaCompiler, SchemaOptions
    from stencil.grammar.json_schema.oneof import by_discriminator

    def branch(kind, extra=None):
        return {"type": "object", "properties": {"kind": {"const": kind}, **(extra or {})}, "required": ["kind"]}

    c = SchemaCompiler({}, SchemaOptions(grammar=True))
    assert by_discriminator(c, [branch("a"), branch("b", {"x": {"type": "integer"}}), branch("c")])
    assert not by_discriminator(c, [branch("a"), {**branch("a"), "properties": {"kind": {"enum": ["a", "z"]}}}])
    assert not by_discriminator(c, [branch("a"), {**branch("b"), "type": ["object", "string"]}])  # strings match both
    assert not by_discriminator(c, [branch("a"), {"properties": {"kind": {"const": "b"}}, "type": "object"}])
    # and the schema compiles as the union of its branches
    regex, _ = schema_to_regex({"oneOf": [branch("a"), branch("b")]})
    assert re.fullmatch(regex, '{"kind":"b"}') and not re.fullmatch(regex, '{"kind":"c"}')


_JSON = st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats(allow_nan=False)
                     | st.text(), lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(_JSON)
def test_a_schema_text_is_read_to_what_json_reads(value):
    """The front end reads a schema's text with msgspec where it can, else with ``json``: the
    same values either way (big integers, infinities and lone surrogates take ``json``'s way)."""
    from stencil.grammar.frontend import _load_schema

    text = json.dumps(value)
    assert repr(_load_schema(text)) == repr(json.loads(text))


def test_schema_text_that_is_not_json_is_a_grammar_error():
    from stencil.grammar.frontend import _load_schema

    for text in ('{"a":', "[1,]", "", '{"a" 1}'):
        with pytest.raises(GrammarError, match="schema is not valid JSON"):
            _load_schema(text)
    assert _load_schema('{"x": NaN, "y": -Infinity, "s": "\\ud800"}')["s"] == "\ud800"


@settings(max_examples=300, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text()
                    | st.tuples(st.integers()), lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text() | st.integers(), inner, max_size=4), max_leaves=12))
def test_a_schema_is_written_as_json_would_write_it(value):
    """``GrammarSpec.json_schema``'s text reads back as ``json.dumps``' does (msgspec writes it
    where it reads back to the value itself; NaN, tuples, big integers and integer keys are
    ``json``'s)."""
    from stencil.grammar.base import schema_text

    text = schema_text(value)
    assert repr(json.loads(text)) == repr(json.loads(json.dumps(value)))


def test_what_json_cannot_say_is_refused_as_json_refuses_it():
    import decimal

    from stencil.grammar.base import GrammarSpec

    for bad in ({"enum": {1, 2}}, {"const": b"x"}, {"maximum": decimal.Decimal("1.5")}):
        with pytest.raises(TypeError, match="not JSON serializable"):
            GrammarSpec.json_schema(bad)


@pytest.mark.parametrize("key, value", [("maximum", float("nan")), ("minimum", float("-inf")),
                                        ("exclusiveMaximum", float("inf"))])
def test_a_bound_that_is_no_finite_number_is_a_grammar_error_naming_it(key, value):
    """A Python schema may hold NaN or an infinity (JSON text cannot): a GrammarError naming the
    keyword, not an arithmetic exception from inside the compiler."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.frontend import to_program

    for t in ("number", "integer"):
        with pytest.raises(GrammarError, match="finite") as info:
            to_program(GrammarSpec.json_schema({"type": t, key: value}))
        assert info.value.keyword == key


def test_a_float_bound_from_2_to_the_53_is_its_exact_value():
    """``1.152921504606847e18`` is the float 2**60 exactly; Python's validator compares an
    integer instance with that value, and so does the grammar (it read the shortest decimal,
    1152921504606847000, before: integers up to it were admitted and failed validation)."""
    schema = {"type": "integer", "minimum": 1152921504606846900, "maximum": 1.152921504606847e18}
    rx, _ = schema_to_regex(schema)
    check = jsonschema.Draft202012Validator(schema)
    for n in (1152921504606846900, 1152921504606846975, 2 ** 60, 2 ** 60 + 1, 1152921504606846990,
              1152921504606847000, 1152921504606846899):
        assert bool(re.fullmatch(rx, str(n))) == check.is_valid(n), n


@pytest.mark.parametrize("text", ['{"type":"string","x-stencil-not-strings":["x"]}',
                                  '{"properties":{"a":{"x-stencil-not-patterns":["^a"]}}}',
                                  '{"type":"string","\\u0078-stencil-not-strings":["x"]}'])
def test_stencils_own_keys_are_refused_in_a_users_schema(text):
    """``x-stencil-*`` keys are what the compiler writes for itself (``not``, ``if``): in a
    user's schema they would narrow the language where the validator does not look."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.frontend import to_program

    with pytest.raises(GrammarError, match="reserves") as info:
        to_program(GrammarSpec("json_schema", text))
    assert info.value.keyword.startswith("x-stencil")
    assert to_program(GrammarSpec.json_schema({"enum": ["x-stencil-not-strings"]})).kind in ("json", "regex")


def test_a_circular_schema_is_refused_as_json_refuses_it():
    from stencil.grammar.base import GrammarSpec

    d: dict = {"type": "object"}
    d["properties"] = {"self": d}
    with pytest.raises(ValueError, match="Circular reference"):
        GrammarSpec.json_schema(d)


@pytest.mark.parametrize("key, value", [("maxLength", 2.5), ("minLength", -1), ("maxLength", True),
                                        ("maxItems", "3"), ("minItems", -2), ("maxProperties", None)])
def test_a_count_that_is_no_non_negative_integer_is_a_grammar_error_naming_it(key, value):
    """What the meta-schema refuses (HTTP answers it with a 400 before the compiler sees it) is
    refused by the compiler too, for a schema from Python: by keyword and path, on either path
    (handed to llguidance or Stencil's own translation)."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.frontend import to_program

    schema = {"type": "object", "properties": {"a": {key: value}}, "required": ["a"]}
    for handover in (True, False):
        with pytest.raises(GrammarError, match="non-negative integer") as info:
            to_program(GrammarSpec.json_schema(schema), handover=handover)
        assert (info.value.keyword, info.value.path) == (key, "#/properties/a")
    ok = {"type": "object", "properties": {key: {"type": "string", "maxLength": 2.0}}, "required": [key]}
    assert to_program(GrammarSpec.json_schema(ok)).kind in ("json", "regex")


_DRAFTS = ["http://json-schema.org/draft-03/schema#", "http://json-schema.org/draft-04/schema#",
           "http://json-schema.org/draft-07/schema#", "https://json-schema.org/draft/2020-12/schema"]
_TYPE_VALUES = [None, True, False, 0, 1, -3, 1.0, 2.5, -0.0, 1e300, "", "1", [], [1], {}, {"a": 1}]


@pytest.mark.parametrize("draft", _DRAFTS)
def test_a_type_only_check_agrees_with_the_validator(draft):
    """``value_valid`` reads a schema of ``type`` alone with the validator's type checker: the
    same verdict as the validator itself, in every draft (1.0 is an integer from draft 6 on,
    not before; a boolean is no number; an unknown type name admits nothing)."""
    from stencil.grammar.json_schema.schema_compiler import SchemaCompiler, SchemaOptions

    c = SchemaCompiler({"$schema": draft}, SchemaOptions())
    for t in ["null", "boolean", "integer", "number", "string", "array", "object",
              ["integer", "string"], ["null", "number"], "objekt", ["integer", "objekt"]]:
        for v in _TYPE_VALUES:
            try:
                expected = c.validator.evolve(schema={"type": t}).is_valid(v)
            except Exception:  # noqa: BLE001 - what value_valid's slow path reads as "admits nothing"
                expected = False
            assert c.value_valid(v, {"type": t}) == expected, (draft, t, v)


def test_strings_but_some_values_beside_a_length_are_refused_in_a_plain_regex():
    """A plain regex has no complement of some strings under a length (the lazy backend's grammar
    writes one: tests/grammar/test_overlapping_one_of_and_merges.py); the length is never dropped."""
    with pytest.raises(GrammarError) as e:
        schema_to_regex({"type": "string", "allOf": [{"maxLength": 2}], "not": {"enum": ["ab"]}})
    assert e.value.keyword == "not"
    regex, notes = schema_to_regex({"type": "string", "allOf": [{"maxLength": 2}], "not": {"enum": ["ab"]}},
                                   strict=False)
    assert not re.fullmatch(regex, '"abc"') and re.fullmatch(regex, '"ab"') and notes  # relaxed: said
