"""Lexemes cut at whole JSON values (``SchemaCompiler.value_terms``, ``program.to_lark``).

Stencil's own translation of a schema reaches llguidance as Lark whose lexemes are JSON's tokens:
each key and scalar value a lexeme, containers rules, the punctuation and whitespace between one
lexeme a run. It used to be one lexeme spelling the whole document. The language must not change:
llguidance's lexer takes the longest match and never backs up, so a cut in the wrong place loses
strings. Checked here against the one-lexeme grammar of the same program: the same mask at every
step of random walks (and every walk's end valid for jsonschema), on schemas that only Stencil's
translation serves, and on MaskBench instances."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mask_bits import mask_words, spelled, walk_both
from stencil.grammar.backends.lazy import LazyBackend
from stencil.grammar.backends.llg_c import library
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.bitmask import allocate_bitmask
from stencil.grammar.frontend import to_program
from stencil.grammar.json_schema.schema_compiler import schema_to_program
from stencil.grammar.program import Program
from stencil.grammar.vocab import TokenVocabulary

pytestmark = pytest.mark.skipif(library() is None, reason="llguidance is not the release the C API binding is for")

# Single characters and tokens that cross the places where one lexeme ends and the next begins.
_TEXTS = ([chr(c) for c in range(0x20, 0x7F)] + ["\n", "\t", '{"', '":', '", "', '","', ": ", ", ", '":"', '"}',
          "]}", "},{", "}]", "1,", '1}', "[{", '["', '"]', "true", "null", "-1", "12", "ab", "\\n"])
_TOKENS = {i: t.encode() for i, t in enumerate(_TEXTS)}
EOS = len(_TOKENS)
MODEL_VOCAB = EOS + 3

SCHEMAS = [
    # optional members before required ones, nested arrays of objects, bounded strings
    {"type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{2}$"},
                                      "n": {"type": "integer", "minimum": -5, "maximum": 120},
                                      "tags": {"type": "array", "maxItems": 3,
                                               "items": {"type": "object", "properties": {
                                                   "k": {"type": "string", "maxLength": 3}, "on": {"type": "boolean"}},
                                                   "required": ["k"]}},
                                      "x": {"type": "number"}},
     "required": ["n"]},
    # a oneOf of strings that may overlap: one minus the other (an intersection inside a value)
    {"type": "object", "properties": {"id": {"oneOf": [{"type": "string", "pattern": "^[a-c]{2}$"},
                                                       {"type": "string", "maxLength": 3}]}}},
    # keys no pattern matches, written as a complement
    {"type": "object", "properties": {"a": {"type": "integer"}},
     "patternProperties": {"^x": {"type": "string", "maxLength": 2}}, "additionalProperties": {"type": "null"}},
    # objects in a oneOf whose first members differ in being optional (o36016's shape)
    {"oneOf": [{"type": "object", "properties": {"type": {"const": "t"}, "label": {"type": "string"}},
                "required": ["type"], "additionalProperties": False},
               {"type": "object", "properties": {"type": {"const": "e"}, "label": {"type": "string"}},
                "required": ["label"], "additionalProperties": False}]},
    # recursion: a Lark program with rules
    {"$defs": {"t": {"type": "object", "properties": {"v": {"type": "integer"},
                                                      "c": {"type": "array", "items": {"$ref": "#/$defs/t"}}},
                     "required": ["v"]}}, "$ref": "#/$defs/t"},
    # a number cut into rules of its own (multipleOf), values around it
    {"type": "array", "items": {"type": "integer", "multipleOf": 7, "minimum": 0, "maximum": 300}, "maxItems": 4},
    # free-form values
    {},
    {"type": "object", "properties": {"m": {"type": "object"}, "l": {"type": "array"}}},
    # several types at one place, prefixItems, an empty closed object
    {"type": ["object", "string", "null"], "properties": {"a": {"type": "integer"}}, "maxLength": 2},
    {"type": "array", "prefixItems": [{"type": "boolean"}, {"type": "object", "properties": {},
                                                             "additionalProperties": False}],
     "items": {"type": "integer"}},
    {"anyOf": [{"type": "object", "properties": {}, "additionalProperties": False},
               {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
]

# A container's literal text where the same container's structure may stand: not cut (``cuttable``).
LITERAL_BESIDE_STRUCTURE = [
    {"anyOf": [{"const": {"a": 1}}, {"type": "object", "properties": {"a": {"type": "integer"}}}]},
    {"type": "array", "items": {"enum": [[1, 2], {"k": "v"}, "s"]}, "maxItems": 2},
    {"type": "array", "items": {"enum": ["a", "b", "c"]}, "uniqueItems": True},
]


@pytest.fixture(scope="module")
def backend():
    return LazyBackend(TokenVocabulary.from_token_bytes(_TOKENS, EOS, MODEL_VOCAB))


def programs(schema, whitespace: str = "flexible", objects: str = "closed") -> tuple[Program, Program]:
    """Stencil's own translation of ``schema``, cut at values and not (``value_lexemes``)."""
    kw = dict(whitespace=whitespace, extra_properties=objects == "schema")
    return schema_to_program(schema, **kw), schema_to_program(schema, value_lexemes=False, **kw)


_mask = mask_words


def _text(ids: list[int]) -> str:
    return spelled(ids, _TOKENS)


def test_an_object_is_cut_into_its_keys_values_and_punctuation():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}}}
    program = to_program(GrammarSpec.json_schema(schema, whitespace="compact"), handover=False)
    lark = program.lark()
    assert program.kind == "regex" and program.value_terms
    assert "MAIN" not in lark and lark.startswith("start: ")
    lines = dict(line.split(": ", 1) for line in lark.strip().splitlines())
    lexemes = {v for k, v in lines.items() if k[0] == "T"}
    assert '/"a"/' in lexemes and '/"b"/' in lexemes  # each key its own lexeme
    whole = programs(schema, "compact")[1]
    assert not whole.value_terms and whole.lark().startswith("start: MAIN\n")
    for doc in ('{"a":1,"b":"x"}', '{"b":""}', "{}", '{"b":"x","a":1}', '{"a":"1"}'):  # the same language
        assert bool(re.fullmatch(whole.regex(), doc)) == bool(re.fullmatch(program.regex(), doc)) \
            == (doc in ('{"a":1,"b":"x"}', '{"b":""}', "{}")), doc


@pytest.mark.parametrize("schema", LITERAL_BESIDE_STRUCTURE)
def test_a_literal_container_beside_structure_keeps_one_lexeme(backend, schema):
    program = to_program(GrammarSpec.json_schema(schema, whitespace="compact"), handover=False)
    assert not program.value_terms and program == programs(schema, "compact")[1]  # compiled again, not cut
    g = backend.build(program)
    if "anyOf" in schema:  # the literal's lexeme would have swallowed '{"a":' of {"a":2}
        m = g.matcher()
        assert m.accept_tokens([_TEXTS.index(c) for c in '{"a":2}']) and m.is_accepting()


@pytest.mark.parametrize("whitespace", ["compact", "flexible"])
@pytest.mark.parametrize("objects", ["closed", "schema"])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_cut_lexemes_give_the_masks_of_one_lexeme(backend, index, objects, whitespace):
    schema = SCHEMAS[index]
    try:
        program, unc = programs(schema, whitespace, objects)
    except GrammarError:
        assert objects == "schema"  # (open, a schema may be refused)
        return
    assert program.value_terms and "MAIN" not in program.lark()  # cut: none of these is guarded
    assert program == to_program(GrammarSpec.json_schema(schema, whitespace=whitespace,
                                                         additional_properties=objects), handover=False)
    cut, whole = backend.build(program), backend.build(unc)
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema)
    rng = random.Random(index * 31 + len(objects) + len(whitespace))
    bm = allocate_bitmask(1, MODEL_VOCAB)
    ended = 0
    for walk in range(24):
        ids = walk_both(cut, whole, bm, rng, EOS, MODEL_VOCAB, 100, eos_rate=0.4)
        if ids is None:
            continue
        ended += 1
        if objects == "closed" or "additionalProperties" in json.dumps(schema):
            assert validator.is_valid(json.loads(_text(ids))), (schema, _text(ids))
    assert ended >= 4


def test_a_member_after_an_optional_run_is_not_lost_in_a_recursive_schema(backend):
    """Before the cut, a recursive schema's Lark kept each run between rule references one lexeme:
    ``"a":"x"(,"b":"y")?`` then ``(,"kids":{...})?``. After ``"x"`` the lexer went on into ``,"``
    as the first lexeme (it may continue with ``b``) and died at ``k``: a valid object refused."""
    schema = {"$defs": {"n": {"type": "object", "properties": {
        "a": {"type": "string"}, "b": {"type": "string"},
        "kids": {"type": "object", "additionalProperties": {"$ref": "#/$defs/n"}}}}}, "$ref": "#/$defs/n"}
    cut, whole = programs(schema, "compact")
    assert cut.kind == whole.kind == "lark"
    docs = {'{"a":"x","kids":{}}': True, '{"a":"x","b":"y","kids":{"z":{"a":"q","kids":{}}}}': True,
            '{"kids":{"z":{}}}': True, '{"a":"x","kids":{"z":{"b":1}}}': False, '{"kids":{},"a":"x"}': False}
    for doc, ok in docs.items():
        assert jsonschema.Draft202012Validator(schema).is_valid(json.loads(doc)) or not ok
        m = backend.build(cut).matcher()
        assert (m.accept_tokens([_TEXTS.index(ch) for ch in doc]) and m.is_accepting()) is ok, doc
    m = backend.build(whole).matcher()  # the old writer's loss
    assert not m.accept_tokens([_TEXTS.index(ch) for ch in '{"a":"x","kids":{}}'])


MASKBENCH = Path(__file__).resolve().parents[3] / "shared" / "corpora" / "maskbench-dev"


@pytest.mark.skipif(not MASKBENCH.exists(), reason="../shared/corpora/maskbench-dev is absent")
def test_maskbench_instances_cut(tokenizer):
    """Every token of every instance (valid and invalid) of the first schemas, in an evenly
    spaced sample, that only Stencil's own translation serves and whose lexemes are cut: a regex
    program gives the masks of its one-lexeme form at every step; a recursive one (whose old
    form was not exact, above) accepts no invalid instance."""
    from stencil.grammar.vocab import build_vocabulary

    backend = LazyBackend(build_vocabulary(tokenizer, model_vocab_size=len(tokenizer)))
    files = sorted(MASKBENCH.glob("*.json"))
    files = [files[i * len(files) // 200] for i in range(200)]
    bm = allocate_bitmask(1, len(tokenizer))
    compared = {"regex": 0, "lark": 0}
    for f in files:
        d = json.loads(f.read_text())
        spec = GrammarSpec.json_schema(d["schema"], whitespace="flexible")
        try:
            if to_program(spec).kind == "json":
                continue
            program, unc = programs(d["schema"])
        except GrammarError:
            continue
        if not program.value_terms or program.kind == "regex" and compared["regex"] == 8:
            continue
        cut, whole = backend.build(program), backend.build(unc)
        for test in d["tests"]:
            a, b = cut.matcher(), whole.matcher()
            for t in tokenizer.encode(json.dumps(test["data"], ensure_ascii=False), add_special_tokens=False):
                if program.kind == "regex":
                    assert np.array_equal(_mask(a, bm), _mask(b, bm)), f.name
                    ok = a.accept_tokens([t])
                    assert b.accept_tokens([t]) == ok, f.name
                else:
                    ok = a.accept_tokens([t])
                if not ok:
                    break
            else:
                assert not a.is_accepting() or test["valid"], f.name
        compared[program.kind] += 1
    assert compared["regex"] >= 5 and compared["lark"] >= 2, compared


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(names=st.lists(st.text(alphabet='ab"\\\n', max_size=3), max_size=4),
       keys=st.lists(st.text(alphabet='ab"\\\n', max_size=4), min_size=1, max_size=6))
def test_other_keys_as_llguidance_reads_them_are_the_tries_keys(backend, names, keys):
    """The keys an object takes besides its declared names: a trie (the plain regex) and, in the
    Lark form, any string less the names' literals (``SchemaCompiler.excluded_strings``)."""
    schema = {"type": "object", "properties": {n: {"type": "integer"} for n in names},
              "additionalProperties": {"type": "null"}}
    program = programs(schema, "compact")[0]
    assert program.lark_forms if names else not program.lark_forms
    rx = re.compile(program.regex())
    g = backend.build(program)
    for key in keys + names:
        for value in ("1", "null"):
            doc = "{" + json.dumps(key) + ":" + value + "}"
            ok = (key in names) == (value == "1")
            assert bool(rx.fullmatch(doc)) is ok, doc
            ids = [_TEXTS.index(ch) for ch in doc]
            m = g.matcher()
            assert (m.accept_tokens(ids) and m.is_accepting()) is ok, doc
