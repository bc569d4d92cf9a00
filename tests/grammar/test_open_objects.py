"""``additional_properties="schema"``: objects that say nothing of ``additionalProperties`` take
undeclared keys, as JSON Schema says; "closed" (the default) takes none. jsonschema (Draft 2020-12)
is the oracle both ways: strings drawn from the grammar validate, and valid instances with
undeclared keys (written in Stencil's canonical order: declared keys in schema order, then the
others) are accepted in "schema" mode and refused in "closed" mode. Served end to end through
/generate and ``stencil serve``'s option.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from litestar.testing import TestClient

from stencil.engine.config import ConfigError, EngineConfig
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.frontend import to_program
from stencil.service import cli, inputs
from stencil.service.app import create_app
from stencil.service.state import ServiceConfig

PERSON = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 5},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name"]}
SCHEMAS = [
    PERSON,
    # nested: the inner object is open too; an explicit additionalProperties schema still rules
    {"type": "object", "properties": {"id": {"type": "integer"},
                                      "meta": {"type": "object", "properties": {"k": {"type": "boolean"}}},
                                      "tags": {"type": "object", "additionalProperties": {"type": "string"}}},
     "required": ["id", "meta"]},
    # no declared key required; a required key that is not declared takes any value
    {"type": "object", "properties": {"a": {"enum": [1, 2]}, "b": {"type": "null"}}, "required": ["z"]},
    # oneOf branches that stay apart when open (a required discriminator)
    {"oneOf": [{"type": "object", "properties": {"kind": {"const": "x"}, "v": {"type": "integer"}},
                "required": ["kind"]},
               {"type": "object", "properties": {"kind": {"const": "y"}, "w": {"type": "string"}},
                "required": ["kind"]}]},
]
_SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))


def _validator(schema):
    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


@pytest.fixture(scope="module")
def lazy(tokenizer):
    with GrammarCompiler(tokenizer, len(tokenizer), backend="lazy") as c:
        yield c


def _accepts(compiler, tokenizer, schema, text: str, mode: str) -> bool:
    """Whether the served grammar (grammar mode, compact JSON) takes ``text`` whole."""
    m = compiler.compile(GrammarSpec.json_schema(schema, additional_properties=mode)).matcher()
    return m.accept_tokens(tokenizer.encode(text, add_special_tokens=False)) and m.is_accepting()


def _dumps(value) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_string_the_open_grammar_writes_validates(index):
    """Soundness: strings drawn from Stencil's regex of the schema in "schema" mode (the same
    object code as the served grammar, free-form values one container deep) pass jsonschema,
    and some of them carry an undeclared key."""
    schema = SCHEMAS[index]
    regex = to_program(GrammarSpec.json_schema(schema, additional_properties="schema"), grammar=False).text
    validator, declared = _validator(schema), _declared(schema)
    extra_seen = []

    @_SETTINGS
    @given(st.from_regex(regex, fullmatch=True))
    def check(text):
        value = json.loads(text)
        assert validator.is_valid(value), (schema, text)
        extra_seen.append(bool(set(value) - declared))

    check()
    assert any(extra_seen), "no drawn instance had an undeclared key"


def _declared(schema) -> set[str]:
    out = set(schema.get("properties", {}))
    for branch in schema.get("oneOf", []):
        out |= set(branch["properties"])
    return out


# (assigned characters only: SmolLM2's tokenizer encodes an unassigned one as U+FFFD)
_CHAR = st.characters(blacklist_categories=("Cs", "Cc", "Cn", "Co"))
_KEY = st.text(_CHAR, max_size=4)
_SCALAR = st.none() | st.booleans() | st.integers(-10**6, 10**6) \
    | st.floats(allow_nan=False, allow_infinity=False, width=32) | _KEY
# free-form values: at most 3 containers deep (SchemaCompiler's GRAMMAR_ANY_DEPTH)
_ANY = st.recursive(_SCALAR, lambda inner: st.lists(inner, max_size=2) | st.dictionaries(_KEY, inner, max_size=2),
                    max_leaves=6).filter(lambda v: _depth(v) <= 3)


def _depth(v) -> int:
    if isinstance(v, list):
        return 1 + max((_depth(x) for x in v), default=0)
    if isinstance(v, dict):
        return 1 + max((_depth(x) for x in v.values()), default=0)
    return 0


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.text(_CHAR, max_size=5), st.none() | st.integers(0, 120),
       st.dictionaries(_KEY.filter(lambda k: k not in PERSON["properties"]), _ANY, min_size=1, max_size=3))
def test_valid_instances_with_undeclared_keys_are_taken_only_in_schema_mode(lazy, tokenizer, name, age, extra):
    """Completeness on PERSON: declared keys in order, then 1-3 undeclared keys with any JSON value."""
    value = {"name": name, **({} if age is None else {"age": age}), **extra}
    assert _validator(PERSON).is_valid(value)
    text = _dumps(value)
    assert _accepts(lazy, tokenizer, PERSON, text, "schema"), text
    assert not _accepts(lazy, tokenizer, PERSON, text, "closed"), text


@pytest.mark.parametrize("text, valid", [
    ('{"id":1,"meta":{"k":true,"x":[1,{"y":null}]},"tags":{"t":"s"},"note":"n"}', True),
    ('{"id":1,"meta":{},"extra":{"a":[[1]]}}', True),
    ('{"id":1,"meta":{"k":1}}', False),  # a declared key's value follows its own schema
    ('{"id":1,"meta":{"k":true,"k":1}}', False),  # ... also when written again as an extra key
    ('{"id":1,"meta":{},"id":"x"}', False),
    ('{"id":1,"meta":{},"tags":{"t":1}}', False),  # an explicit additionalProperties schema rules
])
def test_handwritten_instances_match_jsonschema(lazy, tokenizer, text, valid):
    schema = SCHEMAS[1]
    assert _validator(schema).is_valid(json.loads(text)) is valid
    assert _accepts(lazy, tokenizer, schema, text, "schema") is valid, text


def test_property_names_bound_the_undeclared_keys(lazy, tokenizer):
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "propertyNames": {"maxLength": 3}}
    for text, valid in (('{"a":1,"bcd":[]}', True), ('{"bcd":"x"}', True), ('{"a":1,"bcde":0}', False),
                        ('{"a":1,"a":3}', False)):
        assert _validator(schema).is_valid(json.loads(text)) is valid
        assert _accepts(lazy, tokenizer, schema, text, "schema") is valid, text


def test_free_form_values_nest_at_most_three_containers(lazy, tokenizer):
    assert _accepts(lazy, tokenizer, PERSON, '{"name":"a","x":[[{"y":1}]]}', "schema")
    assert not _accepts(lazy, tokenizer, PERSON, '{"name":"a","x":[[[{"y":1}]]]}', "schema")


def test_the_two_modes_are_two_cache_entries(lazy, tokenizer):
    closed, open_ = (GrammarSpec.json_schema(PERSON, additional_properties=m) for m in ("closed", "schema"))
    assert closed.key() != open_.key()
    assert lazy.compile(closed) is not lazy.compile(open_)
    text = '{"name":"a","x":1}'
    assert (_accepts(lazy, tokenizer, PERSON, text, "closed"), _accepts(lazy, tokenizer, PERSON, text, "schema")) \
        == (False, True)


def test_open_objects_with_pattern_properties_need_the_grammar_backend():
    """The keys no pattern matches are a complement (llguidance's ``&~``): written in grammar mode,
    refused by name where a plain regex is needed (the eager backend)."""
    schema = {"type": "object", "properties": {"a": {}}, "patternProperties": {"^x": {"type": "integer"}}}
    to_program(GrammarSpec.json_schema(schema))  # closed: written
    assert to_program(GrammarSpec.json_schema(schema, additional_properties="schema")).kind in ("regex", "lark")
    with pytest.raises(GrammarError) as e:
        to_program(GrammarSpec.json_schema(schema, additional_properties="schema"), grammar=False)
    assert e.value.keyword == "patternProperties" and "lazy" in str(e.value)
    with pytest.raises(GrammarError):
        to_program(GrammarSpec("json_schema", "{}", additional_properties="open"))


PATTERNED = [
    # open by the request's mode: keys no pattern matches take any value
    ({"type": "object", "properties": {"a": {"type": "string"}},
      "patternProperties": {"^x": {"type": "integer"}, "^y-": {"type": "boolean"}}}, "schema"),
    # open by the schema's own additionalProperties, in the default (closed) mode
    ({"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"],
      "patternProperties": {"^x": {"type": "integer"}}, "additionalProperties": {"type": "string"}}, "closed"),
]
@pytest.mark.parametrize("index, text", [
    (0, '{"x1":1}'), (0, '{"x1":"s"}'), (0, '{"q":"s"}'), (0, '{"a":"s","q":[1]}'), (0, '{"y-k":1}'),
    (0, '{"y-k":true,"zz":{}}'), (0, '{"a":1}'), (1, '{"a":"s","x":2,"q":"t"}'), (1, '{"a":"s","q":1}'),
    (1, '{"a":"s","xa":"t"}')])
def test_pattern_properties_with_open_additional_properties_by_hand(lazy, tokenizer, index, text):
    schema, mode = PATTERNED[index]
    assert _accepts(lazy, tokenizer, schema, text, mode) is _validator(schema).is_valid(json.loads(text)), text


_KEYS = ["a", "x", "x1", "xa", "y-", "y-k", "y", "q", "zz", "ax"]
_VALUES = [1, "s", True, None, [1], {}, {"x": "s"}]


@_SETTINGS
@given(index=st.integers(0, len(PATTERNED) - 1),
       members=st.dictionaries(st.sampled_from(_KEYS), st.sampled_from(_VALUES), max_size=4))
def test_pattern_properties_with_open_additional_properties_match_jsonschema(lazy, tokenizer, index, members):
    """Both ways against jsonschema: a key a pattern matches takes the pattern's schema, a declared
    key its own (and the pattern's), any other additionalProperties' (declared keys first, in
    schema order: Stencil's canonical order)."""
    schema, mode = PATTERNED[index]
    value = {k: members[k] for k in schema["properties"] if k in members}
    value.update((k, v) for k, v in members.items() if k not in schema["properties"])
    text = _dumps(value)
    assert _accepts(lazy, tokenizer, schema, text, mode) is _validator(schema).is_valid(value), text


def test_the_server_default_and_the_request_field():
    cfg = ServiceConfig(additional_properties="schema").validate()
    assert inputs.grammar_spec(cfg, response_schema=PERSON).additional_properties == "schema"
    assert inputs.grammar_spec(cfg, response_schema=PERSON,
                               additional_properties="closed").additional_properties == "closed"
    assert inputs.grammar_spec(ServiceConfig(), response_schema=PERSON).additional_properties == "closed"
    with pytest.raises(ConfigError, match="additional_properties"):
        ServiceConfig(additional_properties="open").validate()
    args = cli.build_parser().parse_args(["serve", "--model", "m", "--additional-properties", "schema"])
    assert cli.service_config_from_args(args).additional_properties == "schema"


@pytest.fixture(scope="module")
def client(tiny_model_dir):
    app = create_app(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=2),
                     ServiceConfig(max_tokens_cap=256, default_max_tokens=64, request_timeout_s=60))
    with TestClient(app, timeout=60) as c:
        yield c


def test_generate_serves_open_objects_and_names_a_bad_value(client):
    r = client.post("/generate", json={"prompt": "A person:", "response_schema": PERSON, "max_tokens": 80,
                                       "seed": 3, "temperature": 1.0, "additional_properties": "schema"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["valid"] is True and json.loads(body["text"]) == body["output"], body
    _validator(PERSON).validate(body["output"])
    bad = client.post("/generate", json={"prompt": "x", "response_schema": PERSON, "additional_properties": "open"})
    assert bad.status_code in (400, 422) and bad.json()["field"] == "additional_properties", bad.text
