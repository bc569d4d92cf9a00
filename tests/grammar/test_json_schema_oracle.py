"""stencil.grammar.json_schema against oracles: jsonschema on generated strings (soundness), exact
equivalence on value families (completeness), Decimal arithmetic for numeric ranges, and the
outlines-core Index reading the regexes the way Python ``re`` does.
"""

from __future__ import annotations

import json
import re
from decimal import Decimal

import jsonschema
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stencil.grammar.json_schema import schema_to_regex
from stencil.grammar.json_schema.numbers import int_range, number_range
from stencil.grammar.json_schema.canonical import canonical_json

_SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 500},
                                      "tags": {"type": "array", "items": {"enum": ["a", "b\"c"]},
                                               "maxItems": 3},
                                      "name": {"type": "string", "pattern": "^[A-Z][a-z]*$"}},
     "required": ["id"]},
    {"type": "array", "prefixItems": [{"type": "number", "exclusiveMinimum": -2.5, "maximum": 7}],
     "items": {"type": ["null", "boolean"]}, "minItems": 1},
    {"anyOf": [{"type": "string", "format": "date"}, {"type": "string", "format": "ipv4"},
               {"type": "string", "format": "uuid"}]},
    {"$defs": {"t": {"type": "object", "properties": {"c": {"type": "array", "items": {"$ref": "#/$defs/t"}}}}},
     "$ref": "#/$defs/t"},
    {"type": "string", "format": "date-time"},
    {"type": "string", "format": "email"},
    {"type": "string", "format": "hostname"},
    {"type": "string", "format": "ipv6"},
    {"type": "string", "format": "uri"},
    {},
]


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


def test_every_generated_string_validates():
    """Soundness: strings drawn from the regex parse as JSON and pass jsonschema."""
    for schema in SCHEMAS:
        regex, _ = schema_to_regex(schema)
        validator = _validator(schema)

        @_SETTINGS
        @given(st.from_regex(regex, fullmatch=True))
        def check(text):
            value = json.loads(text)
            assert validator.is_valid(value), (schema, text)

        check()


@_SETTINGS
@given(st.integers(-10**6, 10**6), st.integers(-10**6, 10**6), st.integers(-10**7, 10**7))
def test_int_range_is_exact(a, b, v):
    lo, hi = min(a, b), max(a, b)
    regex = int_range(lo, hi)
    assert bool(re.fullmatch(regex, str(v))) == (lo <= v <= hi)
    assert bool(re.fullmatch(regex, str(lo))) and bool(re.fullmatch(regex, str(hi)))


_DEC = st.decimals(min_value=-50, max_value=50, places=3, allow_nan=False, allow_infinity=False)


@_SETTINGS
@given(_DEC, _DEC, st.booleans(), st.booleans(), st.lists(_DEC, min_size=1, max_size=20))
def test_number_range_is_exact(a, b, lo_x, hi_x, values):
    lo, hi = min(a, b), max(a, b)
    regex = number_range(lo, lo_x, hi, hi_x)
    for v in values + [lo, hi]:
        for text in {format(v, "f"), format(v.normalize(), "f"), format(v, "f") + "00"}:
            if text.startswith("-") and Decimal(text) == 0:
                continue  # "-0…" is never written
            inside = (lo < v if lo_x else lo <= v) and (v < hi if hi_x else v <= hi)
            assert regex is not None or not inside
            if regex is not None:
                assert bool(re.fullmatch(regex, text)) == inside, (lo, lo_x, hi, hi_x, text)


@_SETTINGS
@given(st.text(alphabet=st.sampled_from("ab7_ \n\té\\/"), max_size=8), st.integers(0, 4), st.integers(0, 6))
def test_string_lengths_are_exact(s, lo, extra):
    schema = {"type": "string", "minLength": lo, "maxLength": lo + extra}
    regex, _ = schema_to_regex(schema)
    assert bool(re.fullmatch(regex, canonical_json(s))) == _validator(schema).is_valid(s)


@_SETTINGS
@given(st.text(alphabet=st.sampled_from("abc019-\n"), max_size=7),
       st.sampled_from(["^a+b?$", "[0-9]-", "^(ab|c)*$", "b$", "^[^a]*$", "\\d{2}", "^\\w+$"]))
def test_patterns_are_exact_on_canonical_strings(s, pattern):
    schema = {"type": "string", "pattern": pattern}
    regex, _ = schema_to_regex(schema)
    assert bool(re.fullmatch(regex, canonical_json(s))) == (re.search(pattern, s) is not None)


def _byte_vocab():
    from outlines_core import Vocabulary
    tokens = [bytes([b]) for b in range(0x20, 0x7F)] + [b"\n", b"\xc3", b"\xa9", b"\x01"]
    return Vocabulary(len(tokens), {t: [i] for i, t in enumerate(tokens)}), tokens


def test_outlines_core_reads_the_regexes_like_python():
    """Byte by byte, the Index accepts exactly what ``re.fullmatch`` accepts.

    The end is marked with a sentinel byte (``(?:REGEX)\\x01``), as stencil.grammar.compiler does, to
    step around outlines-core 0.2.14 refusing to continue past an accepting state.
    """
    from outlines_core import Guide, Index
    vocab, tokens = _byte_vocab()
    ids = {t: i for i, t in enumerate(tokens)}
    cases = {
        SCHEMAS[0]["properties"]["id"]["minimum"] and json.dumps(SCHEMAS[0]): [
            '{"id":12}', '{"id":501}', '{"id":3,"tags":["b\\"c"]}', '{"id":3,"name":"Ab"}',
            '{"id":3,"name":"ab"}'],
        json.dumps({"type": "string", "maxLength": 2}): ['"é"', '"éé"', '"ééé"', '"\\\\"'],
        json.dumps({"type": "number", "minimum": 0.5}): ["0.5", "0.49", "12", "1e3"],
    }
    for schema_text, texts in cases.items():
        regex, _ = schema_to_regex(json.loads(schema_text))
        index = Index("(?:" + regex + ")\x01", vocab)
        for text in texts:
            guide = Guide(index)
            ok = True
            for b in text.encode() + b"\x01":
                if ids[bytes([b])] not in guide.get_tokens():
                    ok = False
                    break
                guide.advance(ids[bytes([b])], return_tokens=False)
            ok = ok and guide.is_finished()
            assert ok == bool(re.fullmatch(regex, text)), (schema_text, text)


def test_hostname_labels_match_fqdn_without_fake_a_labels():
    """Every label over {a, -} up to 6 characters: ours iff fqdn accepts it and it has no "--"
    at the third and fourth characters."""
    import itertools

    from fqdn import FQDN
    regex, _ = schema_to_regex({"type": "string", "format": "hostname"})
    for n in range(1, 7):
        for chars in itertools.product("a-", repeat=n):
            label = "".join(chars)
            expected = FQDN(label, min_labels=1).is_valid and label[2:4] != "--"
            assert bool(re.fullmatch(regex, json.dumps(label))) == expected, label
