"""Schemas handed to llguidance's JSON front end (``json_schema.handover``, built through its C API,
``backends.llg_c``) have the language of Stencil's own translation: the two grammars give the same
mask at every step of random walks driven by either, every string a walk ends on validates with
jsonschema, and what the argument does not cover is not handed over."""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import torch

from mask_bits import allowed_ids, mask_words, spelled, walk_both
from stencil.grammar.backends.lazy import LazyBackend
from stencil.grammar.backends.llg_c import library
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.bitmask import allocate_bitmask
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.frontend import to_program
from stencil.grammar.json_schema.handover import llguidance_schema
from stencil.grammar.vocab import TokenVocabulary

pytestmark = pytest.mark.skipif(library() is None, reason="llguidance is not the release the C API binding is for")

# Single characters, a few multi-byte tokens that cross JSON token boundaries, a UTF-8 character
# split in two tokens, and the named escapes.
_TEXTS = ([chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t", "\r", '{"', '":', '", "', ": ", ", ", "true",
          "null", "-1", "00", '"}', "]}", "ab", "\\n", "\\\"", "é"])
_TOKENS = {i: t.encode() for i, t in enumerate(_TEXTS)}
_TOKENS[len(_TOKENS)] = "é".encode()[:1]
_TOKENS[len(_TOKENS)] = "é".encode()[1:]
EOS = len(_TOKENS)
MODEL_VOCAB = EOS + 3

SCHEMAS = [
    {"type": "object", "properties": {"id": {"type": "integer", "minimum": -3, "maximum": 12},
                                      "name": {"type": "string", "minLength": 1, "maxLength": 4},
                                      "ok": {"type": "boolean"}, "n": {"type": "null"}},
     "required": ["id"]},
    {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "integer"}},
     "additionalProperties": {"type": "integer", "exclusiveMaximum": 3.5}},
    {"type": "array", "items": {"enum": ["x", "y\"z", "a\\b", "l\nm", 7, -2, True, None, [], {}, {"k": [1, "v"]}]},
     "minItems": 1, "maxItems": 3},
    {"anyOf": [{"type": "string", "maxLength": 2}, {"type": "integer", "exclusiveMinimum": -10}]},
    {"$defs": {"t": {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0},
                                                      "c": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                     "required": ["v"]}},
     "$ref": "#/$defs/t"},
    {"properties": {"p": {"type": ["string", "null"]}, "q": {"const": {"z": []}}}, "required": ["q"]},
    {"type": "object", "properties": {}, "additionalProperties": False},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 5,
     "exclusiveMinimum": True, "maximum": 1000},
    {"type": ["integer", "number", "boolean"]},
    {},  # free-form values, GRAMMAR_ANY_DEPTH deep in both
    {"type": "object", "properties": {"meta": {"type": "object"}, "list": {"type": "array"}, "x": True},
     "additionalProperties": True},
    {"description": "any value, its containers one level deeper"},
    {"type": "object", "properties": {"p": {"type": "number", "minimum": 0}, "q": {"type": "number", "minimum": 1,
                                                                                "maximum": 10.0}}},
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^[a-c]+(-[0-9]{1,2})?$"},
                                          {"type": "string", "pattern": "b\\.", "maxLength": 4},
                                          {"type": "string", "pattern": "^(x|y\\d)\\Z|^é"}]}},
    {"type": "object", "properties": {"d": {"type": "string", "format": "date"}, "u": {"type": "string", "format": "uuid"},
                                      "e": {"type": "string", "format": "email"}, "i": {"type": "string", "format": "ipv4"},
                                      "w": {"type": "string", "pattern": "^\\w+\\s?$", "minLength": 2}}},
    {"$defs": {"base": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}},
     "allOf": [{"$ref": "#/$defs/base"}, {"properties": {"b": {"type": "string", "maxLength": 3}, "a": {"minimum": 2}}}]},
    {"type": "object", "properties": {"k": {"type": "string"}},
     "anyOf": [{"required": ["k"]}, {"properties": {"z": {"type": "boolean"}}, "required": ["z"]}]},
    {"type": "object", "properties": {"id": {"type": "integer"}},
     "patternProperties": {"^x-": {"type": "string"}, "^y_[0-9]+$": {"type": "null"}}},
    {"$defs": {"cat": {"type": "object", "properties": {"kind": {"const": "cat"}, "lives": {"type": "integer"}},
                       "required": ["kind"]}},
     "oneOf": [{"$ref": "#/$defs/cat"},
               {"type": "object", "properties": {"kind": {"const": "dog"}, "good": {"type": "boolean"}},
                "required": ["kind"]},
               {"type": "string", "maxLength": 3}, {"enum": [1, 2, "abcd"]}]},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
     "oneOf": [{"required": ["a"]}, {"required": ["b"]}]},
    {"allOf": [{"type": "string"}, {"enum": ["x", "yy", 3, "zzzz"]}], "maxLength": 2},
    {"type": "object", "properties": {"a": {"$ref": "#/$defs/x", "minimum": 1}}, "$defs": {"x": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "minProperties": 1,
     "maxProperties": 5},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "zz"], "minProperties": 2},
    {"$schema": "http://json-schema.org/draft-04/schema#", "type": "array",
     "items": [{"type": "integer"}, {"enum": ["x", "y"]}], "additionalItems": {"type": "null"}, "maxItems": 4},
    {"type": "array", "prefixItems": [{"type": "boolean"}], "items": False},
    # a reference inside a resource with its own $id is resolved against that $id
    {"$defs": {"inner": {"$id": "http://example.com/inner.json", "$defs": {"b": {"type": "boolean"}},
                         "type": "object", "properties": {"q": {"$ref": "#/$defs/b"}}, "required": ["q"]}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/inner"}}},
    # negated classes: llguidance quotes a class with every control with every escape (see _decoded)
    {"type": "array", "items": {"anyOf": [{"type": "string", "pattern": "^[^\\\\]*$"},
                                          {"type": "string", "pattern": "^[^\"a]{1,3}$"},
                                          {"type": "string", "pattern": "^[^\n]$"}]}, "maxItems": 2},
]

REFUSED = [
    True, {"type": "string", "pattern": "(?=a)"}, {"type": "string", "format": "date", "pattern": "1"},
    {"type": "string", "format": "duration"},  # checked by jsonschema, not written by Stencil
    {"type": "number", "minimum": -1}, {"type": "number", "exclusiveMinimum": 0}, {"type": "number", "minimum": 0.5},
    {"type": "number", "minimum": 2, "maximum": 2}, {"type": "number", "maximum": 5},
    {"oneOf": [{"type": "string"}, {"type": "string", "maxLength": 3}]},  # not disjoint
    {"type": "object", "properties": {"a": {"$ref": "http://example.com/remote.json"}}},
    {"enum": [1.5]}, {"enum": ["\x01"]}, {"type": "integer", "multipleOf": 2},
    {"type": "array", "items": {"type": "string"}, "uniqueItems": True},
    {"type": "string", "x-guidance": {"lenient": True}},
    {"type": "integer", "minimum": 3, "maximum": 2},
    {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]},  # no finite instance
    {"type": "object", "properties": {"a\x01": {"type": "string"}}},
    {"$schema": "http://json-schema.org/draft-03/schema#", "type": "string"},  # draft 3 (with or
    {"$schema": "http://json-schema.org/draft-03/schema", "type": "string"},  # without the '#')
    {"$schema": ["not", "a", "uri"], "type": "string"}, {"$schema": 3, "type": "string"},
]


@pytest.fixture(scope="module")
def backend():
    vocab = TokenVocabulary.from_token_bytes(_TOKENS, EOS, MODEL_VOCAB)
    return LazyBackend(vocab)


_mask = mask_words


def _allowed(mask: np.ndarray) -> list[int]:
    return allowed_ids(mask, MODEL_VOCAB)


def _text(ids: list[int]) -> str:
    return spelled(ids, _TOKENS)


def _validator(schema):
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return cls(schema, format_checker=cls.FORMAT_CHECKER)


@pytest.mark.parametrize("objects", ["closed", "schema"])
@pytest.mark.parametrize("share", [False, True])
@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_the_handed_over_grammar_has_the_masks_of_stencils_own(backend, index, whitespace, share, objects,
                                                                monkeypatch):
    """``share``: repeated parts written once as definitions (``share_repeats``), as for a long schema;
    ``objects``: the request's ``additional_properties`` (open objects handed over too, but for
    ``patternProperties``, whose other keys Stencil writes as a complement)."""
    from stencil.grammar.json_schema import handover

    monkeypatch.setattr(handover, "SHARE_MIN_NODES", 0 if share else 10 ** 9)
    schema = SCHEMAS[index]
    spec = GrammarSpec.json_schema(schema, whitespace=whitespace, additional_properties=objects)
    try:
        own = to_program(spec, handover=False)
    except GrammarError:  # (open, some schemas are refused: maxProperties of an open object)
        assert objects == "schema"
        with pytest.raises(GrammarError):
            to_program(spec)
        return
    handed = to_program(spec)
    if objects == "schema" and "patternProperties" in json.dumps(schema):
        assert handed.kind != "json"
        return
    assert handed.kind == "json" and own.kind in ("regex", "lark")
    ours, theirs = backend.build(own), backend.build(handed)
    validator = _validator(schema)
    rng = random.Random(index * 7 + len(whitespace))
    bm = allocate_bitmask(1, MODEL_VOCAB)
    ended = 0
    def forced_agree(a, b, ids):
        # the forced bytes (drafts): llguidance's own on Stencil's grammar; from masks on the other,
        # which also counts bytes forced because no other token of the vocabulary fits (after
        # the first byte of "é" here), so it may go on further
        fa, fb = a.forced_text(), b.forced_text()
        assert fb.startswith(fa), (schema, whitespace, _text(ids), fa, fb)

    for walk in range(24):
        # EOS is taken when offered, half the time
        ids = walk_both(ours, theirs, bm, rng, EOS, MODEL_VOCAB, 120, check=forced_agree)
        if ids is None:
            continue
        ended += 1
        assert validator.is_valid(json.loads(_text(ids))), (schema, _text(ids))
    assert ended >= 4  # enough walks reached an end to make the oracle check mean something


def test_a_max_length_above_the_cap_is_handed_over_capped_with_stencils_warnings(backend):
    """Stencil writes at most MAX_MIN_LENGTH characters where ``maxLength`` is larger (and says
    so); the handed-over schema caps it alike, carries the same warnings, and both grammars stop
    a string at exactly that length."""
    from stencil.grammar.json_schema.schema_compiler import MAX_MIN_LENGTH

    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 123456}}, "required": ["s"]}
    spec = GrammarSpec.json_schema(schema, whitespace="compact")
    handed, own = to_program(spec), to_program(spec, handover=False)
    assert handed.kind == "json" and json.loads(handed.text)["properties"]["s"]["maxLength"] == MAX_MIN_LENGTH
    assert handed.own_warnings and "123456" in own.warnings[0]
    vocab = TokenVocabulary.from_token_bytes(_TOKENS, EOS, MODEL_VOCAB)
    with GrammarCompiler(vocab, MODEL_VOCAB, max_workers=1, backend="lazy") as c:
        compiled = c.compile(spec)
        assert compiled.program.kind == "json" and compiled.warnings == own.warnings
    ids = {t: i for i, t in _TOKENS.items()}
    start = [ids['{"'.encode()], ids[b"s"], ids[b'":'], ids[b'"']]
    bm = allocate_bitmask(1, MODEL_VOCAB)
    for program in (handed, own):
        m = backend.build(program).matcher()
        assert m.accept_tokens(start + [ids[b"ab"]] * (MAX_MIN_LENGTH // 2 - 1) + [ids[b"a"]])
        allowed = _allowed(_mask(m, bm))  # one character left
        assert ids[b"a"] in allowed and ids[b"ab"] not in allowed and ids[b'"'] in allowed
        assert m.accept_tokens([ids[b"a"]])
        assert _allowed(_mask(m, bm)) == sorted([ids[b'"'], ids[b'"}']])


@pytest.mark.parametrize("schema", REFUSED, ids=range(len(REFUSED)))
def test_what_the_argument_does_not_cover_is_not_handed_over(schema):
    assert llguidance_schema(schema, "flexible") is None
    spec = GrammarSpec.json_schema(schema)
    try:
        assert to_program(spec).kind != "json"
    except Exception:  # noqa: BLE001 - Stencil's own refusal is fine: the point is no handover
        pass


def test_an_object_of_many_optional_properties_is_not_handed_over():
    """Past ``MAX_OPTIONAL`` optional properties llguidance's parser holds too many items a
    member (a step past its limit at 600): Stencil's own translation serves the object.
    Required properties do not count."""
    from stencil.grammar.json_schema.handover import MAX_OPTIONAL

    def obj(n: int, required: int = 0) -> dict:
        props = {f"p{i}": {"type": "integer"} for i in range(n)}
        return {"type": "object", "properties": props, "required": [f"p{i}" for i in range(required)]}

    assert llguidance_schema(obj(MAX_OPTIONAL), "flexible") is not None
    assert llguidance_schema(obj(MAX_OPTIONAL + 1), "flexible") is None
    assert llguidance_schema(obj(MAX_OPTIONAL + 10, required=10), "flexible") is not None
    assert to_program(GrammarSpec.json_schema(obj(MAX_OPTIONAL + 1))).kind != "json"


def test_a_later_draft_is_handed_over():
    for uri in ("http://json-schema.org/draft-04/schema#", "http://json-schema.org/draft-07/schema#",
                "https://json-schema.org/draft/2020-12/schema", "urn:unknown-draft"):
        assert llguidance_schema({"$schema": uri, "type": "string"}, "flexible") is not None, uri


def test_the_handed_over_schema_spells_each_part():
    out = llguidance_schema({"type": "object", "properties": {"a": {"type": "integer"}}, "title": "t",
                             "x-unknown": 1}, "compact")
    assert out == {"x-guidance": {"json_allowed_escapes": 'nrbtf\\"', "whitespace_flexible": False},
                   "type": "object", "additionalProperties": False,
                   "properties": {"a": {"anyOf": [{"type": "integer", "minimum": 0},
                                                  {"type": "integer", "maximum": -1}]}}}


_LEAVES = [{"type": t, **extra} for t in ("string", "number", "integer", "boolean", "null")
           for extra in ({}, {"description": "d", "title": "t", "examples": [1]}, {"$id": "x", "default": None})]
_LEAVES += [{"type": "string", "minLength": 2}, {"type": "string", "maxLength": 5.0, "description": "d"},
            {"type": "string", "minLength": 3, "maxLength": 1}, {"type": "string", "maxLength": -1},
            {"type": "string", "maxLength": 10 ** 6}, {"type": "string", "minLength": True}]
# not leaves: these go _node's way whatever their type
_NOT_LEAVES = [{"type": "string", "pattern": "a"}, {"type": "integer", "minimum": 1}, {"type": "number", "enum": [1]},
               {"type": "array"}, {"type": ["string"]}, {"type": "strange"}, {"type": "string", "x-unknown": 1}]


@pytest.mark.parametrize("leaf", _LEAVES + _NOT_LEAVES, ids=json.dumps)
def test_a_leaf_is_written_at_once_as_the_general_path_writes_it(leaf):
    """``_Writer.node``'s shortcut for leaves gives what ``_Writer._node`` gives (or refuses as it does)."""
    from stencil.grammar.json_schema.handover import _Refused, _Writer

    def written(fn):
        try:
            return json.dumps(fn(leaf), sort_keys=True)
        except (_Refused, GrammarError) as e:
            return f"refused {type(e).__name__} {e}"

    assert written(_Writer(leaf).node) == written(_Writer(leaf)._node)

def test_repeated_parts_are_written_once_as_definitions():
    from stencil.grammar.json_schema.handover import share_repeats

    point = {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0}, "y": {"type": "integer", "minimum": 0}},
             "required": ["x"], "additionalProperties": False}
    body = {"type": "object", "properties": {"a": point, "b": dict(point), "c": {"type": "array", "items": dict(point)},
                                             "d": {"type": "string"}, "e": {"type": "string"}},
            "additionalProperties": False}
    defs = {"h0": {"anyOf": [dict(point), {"type": "null"}]}}
    before = json.dumps([body, defs])
    new_body, new_defs = share_repeats(body, defs)
    assert json.dumps([body, defs]) == before  # inputs untouched
    ref = {"$ref": "#/$defs/s0"}  # s1: the integer range inside the point, written once as well
    assert new_body["properties"] == {"a": ref, "b": ref, "c": {"type": "array", "items": ref},
                                      "d": {"type": "string"}, "e": {"type": "string"}}  # bare types stay
    assert new_defs["h0"] == {"anyOf": [ref, {"type": "null"}]}
    assert new_defs["s1"] == {"type": "integer", "minimum": 0}
    assert new_defs["s0"]["properties"] == {"x": {"$ref": "#/$defs/s1"}, "y": {"$ref": "#/$defs/s1"}}
    assert share_repeats({"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}}, {}) == (
        {"type": "object", "properties": {"a": {"type": "integer", "minimum": 1}}}, {})


def test_the_handed_over_text_is_what_json_writes():
    from stencil.grammar.json_schema.handover import dumps

    for schema in SCHEMAS + [{"enum": ["é\u2028", 2 ** 60]}]:
        out = llguidance_schema(schema, "flexible")
        assert dumps(out) == json.dumps(out, ensure_ascii=False, separators=(",", ":"))
    value = {"a": [-0.5e-7, 1e300, 2 ** 70]}  # floats (none handed over) are written exactly, if not alike
    assert json.loads(dumps(value)) == value


def test_a_compiled_handed_over_grammar_translates_its_spec_for_the_eager_index():
    vocab = TokenVocabulary.from_token_bytes(_TOKENS, EOS, MODEL_VOCAB)
    with GrammarCompiler(vocab, MODEL_VOCAB, max_workers=1, backend="auto") as c:
        spec = GrammarSpec.json_schema(SCHEMAS[0])
        g = c.compile(spec)
        assert g.program.kind == "json" and g.backend == "lazy"
        assert g.own_program().kind == "regex"
        eager = c.compile(spec, backend="eager")  # the index of the same language
        m, e = g.matcher("lazy"), eager.matcher()
        assert e.backend == "eager"
        bm = allocate_bitmask(1, MODEL_VOCAB)
        for t in [_TEXTS.index('{"'), _TEXTS.index("i"), _TEXTS.index("d"), _TEXTS.index('":'), _TEXTS.index("1")]:
            assert torch.equal(torch.from_numpy(_mask(m, bm)), torch.from_numpy(_mask(e, bm)))
            assert m.accept_tokens([t]) and e.accept_tokens([t])


MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "corpora" / "maskbench-dev"


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/corpora/maskbench-dev is absent")
@pytest.mark.parametrize("objects", ["closed", "schema"])
def test_maskbench_instances_get_the_same_masks_handed_over_or_not(tokenizer, objects):
    """Every token of every instance of the first handed-over schemas of an evenly spaced sample."""
    from stencil.grammar.vocab import build_vocabulary

    vocab = build_vocabulary(tokenizer, model_vocab_size=len(tokenizer))
    backend = LazyBackend(vocab)
    files = sorted(MASKBENCH.glob("*.json"))
    files = [files[i * len(files) // 300] for i in range(300)]
    bm = allocate_bitmask(1, len(tokenizer))
    compared = 0
    for f in files:
        d = json.loads(f.read_text())
        spec = GrammarSpec.json_schema(d["schema"], whitespace="flexible", additional_properties=objects)
        handed = to_program(spec)
        if handed.kind != "json":
            continue
        ours, theirs = backend.build(to_program(spec, handover=False)), backend.build(handed)
        for test in d["tests"]:
            a, b = ours.matcher(), theirs.matcher()
            for t in tokenizer.encode(json.dumps(test["data"], ensure_ascii=False), add_special_tokens=False):
                ma, mb = _mask(a, bm), _mask(b, bm)
                assert np.array_equal(ma, mb), f.name
                if not a.accept_tokens([t]):
                    assert not b.accept_tokens([t])
                    break
                assert b.accept_tokens([t])
            assert a.is_accepting() == b.is_accepting()
        compared += 1
        if compared == 12:
            break
    assert compared == 12


_SCANNED = [
    {"$defs": {"inner": {"$id": "http://example.com/inner.json", "$defs": {"b": {"type": "boolean"}},
                         "type": "object", "properties": {"q": {"$ref": "#/$defs/b"}}, "required": ["q"]}},
     "type": "object", "properties": {"p": {"$ref": "#/$defs/inner"}}},
    {"type": "object", "properties": {"id": {"type": "string"}, "n": {"$anchor": "n", "type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "string", "x-guidance": {"lenient": True}}}},
    {"type": "object", "properties": {"a": {"type": "string", "x-stencil-note": 1}}},
    {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]},
]


def _ascii_escaped(text: str) -> str:
    """``text`` with every "i" and "x" of a key written as a JSON escape (the same document)."""
    return text.replace('"id"', '"\\u0069d"').replace('"$id"', '"$\\u0069d"').replace('"x-', '"\\u0078-')


@pytest.mark.parametrize("schema", _SCANNED, ids=lambda s: json.dumps(s)[:60])
def test_the_texts_shortcut_finds_what_the_walk_finds(schema):
    """``llguidance_schema`` skips its walk for identifiers and llguidance's own keys when the
    schema's text cannot hold them; any spelling of the text (spaces, escaped letters) gives
    what the walk gives."""
    want = llguidance_schema(schema, "flexible")
    for text in (json.dumps(schema, separators=(",", ":")), json.dumps(schema, indent=2),
                 _ascii_escaped(json.dumps(schema))):
        assert json.loads(text) == schema
        assert llguidance_schema(schema, "flexible", text) == want, text
