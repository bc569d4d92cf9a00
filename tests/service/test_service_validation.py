"""Service pieces that need no model: schema checks, output checks, parameter building, errors, logs."""

from __future__ import annotations

import json
import logging

import pytest

from stencil.engine.async_engine import EngineDeadError
from stencil.engine.llm_engine import EngineError, EngineOverloaded
from stencil.engine.speculative import SpecConfig
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.budget import SoftLimits
from stencil.service import inputs, prompts
from stencil.service.errors import GenerationTimeout, InputError, Overloaded, named_as, to_problem
from stencil.service.logs import JsonFormatter
from stencil.service.state import ServiceConfig
from stencil.service.validation import OutputChecker, check_schema

CFG = ServiceConfig(max_tokens_cap=100, default_max_tokens=20, max_schema_depth=8, max_schema_bytes=2000).validate()


def _input_error(fn, *a, **kw) -> InputError:
    with pytest.raises(InputError) as ei:
        fn(*a, **kw)
    return ei.value


# -- schemas coming in -----------------------------------------------------------------------------

def test_misspelt_type_names_keyword_and_path():
    e = _input_error(check_schema, {"type": "object", "properties": {"age": {"type": "integr"}}},
                     max_bytes=2000, max_depth=8)
    assert e.path == "#/properties/age/type"
    assert e.keyword == "type" and e.field == "response_schema"
    assert "'integr'" in e.detail


def test_draft_is_taken_from_dollar_schema():
    # An array-valued "items" is valid in draft-07 and invalid in 2020-12 (the default).
    tuple_items = {"type": "array", "items": [{"type": "string"}]}
    check_schema({"$schema": "http://json-schema.org/draft-07/schema#", **tuple_items}, max_bytes=2000, max_depth=8)
    e = _input_error(check_schema, tuple_items, max_bytes=2000, max_depth=8)
    assert e.path == "#/items"


@pytest.mark.parametrize("ref", ["http://example.com/s.json", "other.json#/a", "//host/x"])
def test_non_local_refs_are_refused(ref):
    e = _input_error(check_schema, {"properties": {"a": {"$ref": ref}}}, max_bytes=2000, max_depth=8)
    assert e.keyword == "$ref" and e.path == "#/properties/a"


def test_local_refs_and_bool_schemas_pass():
    check_schema({"$defs": {"p": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/p"}}},
                 max_bytes=2000, max_depth=8)
    check_schema(True, max_bytes=10, max_depth=1)


def test_depth_and_size_limits():
    deep: dict = {}
    node = deep
    for _ in range(9):  # 9 nested "items" → depth 9 > 8
        node["items"] = {}
        node = node["items"]
    e = _input_error(check_schema, deep, max_bytes=2000, max_depth=8)
    assert "deeper than 8" in e.detail
    check_schema(deep["items"], max_bytes=2000, max_depth=8)  # one level less passes
    big = {"enum": ["x" * 100] * 30}
    assert "bytes" in _input_error(check_schema, big, max_bytes=2000, max_depth=8).detail


def test_schema_must_be_object_or_bool():
    assert "must be a JSON object" in _input_error(check_schema, [1], max_bytes=100, max_depth=4).detail


# -- outputs going out -----------------------------------------------------------------------------

def test_json_output_is_checked_with_formats():
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"d": {"type": "string", "format": "date"}},
                                    "required": ["d"]})
    c = OutputChecker()
    ok = c.check(spec, '{"d":"2024-02-29"}', "stop")
    assert ok.valid and ok.output == {"d": "2024-02-29"} and ok.warnings == []
    bad = c.check(spec, '{"d":"2023-02-29"}', "stop")  # not a leap year
    assert not bad.valid and bad.output == {"d": "2023-02-29"} and "#/d" in bad.warnings[0]
    assert not c.check(spec, '{"d":', "stop").valid


def test_a_repeated_key_is_said_and_its_last_value_checked():
    spec = GrammarSpec.json_schema({"type": "object", "properties": {"id": {"type": "integer"}},
                                    "additionalProperties": {"type": "string"}})
    c = OutputChecker()
    r = c.check(spec, '{"id":1,"a":"b","a":"c"}', "stop")
    assert r.valid and r.output == {"id": 1, "a": "c"} and len(r.warnings) == 1 and "'a'" in r.warnings[0]
    bad = c.check(spec, '{"id":1,"a":"b","a":2}', "stop")  # the last value is what fails
    assert not bad.valid and "#/a" in bad.warnings[0] and "repeats the key 'a'" in bad.warnings[-1]
    free = GrammarSpec.json_schema({"type": "object"})
    assert c.check(free, '{"a":1,"n":{"a":2}}', "stop").warnings == []  # one key in two objects: no repeat


def test_valid_is_what_the_constraint_admits_whatever_stopped_it():
    c = OutputChecker()
    spec = GrammarSpec.json_schema({"type": "integer"})
    r = c.check(spec, "12", "length")  # admitted, but the number could have gone on
    assert (r.output, r.valid, r.truncated_value) == (12, True, True) and "max_tokens" in r.warnings[0]
    r = c.check(spec, "12", "stop")
    assert (r.output, r.valid, r.truncated_value, r.warnings) == (12, True, False, [])
    cut = c.check(GrammarSpec.json_schema({"type": "object"}), '{"a": 1', "length")
    assert (cut.output, cut.valid, cut.truncated_value) == (None, False, False)
    assert "max_tokens" in cut.warnings[0]
    low = c.check(GrammarSpec.json_schema({"type": "integer", "minimum": 100}), "12", "length")
    assert (low.output, low.valid) == (None, False)  # a prefix of 120, not yet admitted
    date = GrammarSpec("regex", r"\d{4}-\d{2}-\d{2}( \d{2}:\d{2})?")
    r = c.check(date, "1945-01-01", "length")
    assert (r.valid, r.truncated_value) == (True, True)
    assert c.check(date, "1945-01-01 1", "length").valid is False
    ch = GrammarSpec("choice", json.dumps(["yes", "no"]))
    assert c.check(ch, "no", "length").output == "no"
    assert c.check(ch, "n", "length").valid is False
    free = c.check(None, "free text", "length")
    assert free.truncated_value is True and "constraint allowed" not in free.warnings[0]  # there is none
    assert c.check(spec, "12", "abort").valid is False


def test_regex_choice_and_unconstrained():
    c = OutputChecker()
    rx = GrammarSpec("regex", r"[0-9]{4}-[0-9]{2}")
    assert c.check(rx, "2024-01", "stop").valid
    assert not c.check(rx, "2024-01x", "stop").valid
    ch = GrammarSpec("choice", json.dumps(["yes", "no"]))
    assert c.check(ch, "no", "stop").output == "no"
    assert not c.check(ch, "maybe", "stop").valid
    assert c.check(None, "anything", "stop").valid


def test_validator_cache_is_bounded():
    c = OutputChecker(capacity=2)
    for i in range(5):
        c.validator(json.dumps({"maxLength": i}))
    assert len(c._cache) == 2


# -- request fields → engine objects ---------------------------------------------------------------

def test_sampling_params_defaults_and_caps():
    p = inputs.sampling_params(CFG, stop="END", speculative=False)
    assert p.max_tokens == 20 and p.temperature == 0.0 and p.stop == ["END"]
    assert p.speculative is False  # typed: SpecConfig, False (off) or None (the server's default)
    assert inputs.sampling_params(CFG, speculative=True).speculative == SpecConfig()
    assert inputs.sampling_params(CFG, speculative={"num_speculative_tokens": 2}).speculative == \
        SpecConfig(num_speculative_tokens=2)
    assert inputs.sampling_params(CFG, soft_limits={"array_items": 3}).soft_limits == SoftLimits(array_items=3)
    assert inputs.sampling_params(CFG, soft_limits=True).soft_limits is None
    assert _input_error(inputs.sampling_params, CFG, speculative={"method": "medusa"}).field == "speculative.method"
    assert _input_error(inputs.sampling_params, CFG, soft_limits={"depth": 2}).field == "soft_limits.depth"
    assert _input_error(inputs.sampling_params, CFG, max_tokens=101).field == "max_tokens"
    assert _input_error(inputs.sampling_params, CFG, max_tokens=0).field == "max_tokens"
    assert _input_error(inputs.sampling_params, CFG, top_p=0.0).field == "top_p"
    assert _input_error(inputs.sampling_params, CFG, temperature=float("nan")).field == "temperature"
    assert _input_error(inputs.sampling_params, CFG, stop=["a"] * 9).field == "stop"
    assert _input_error(inputs.sampling_params, CFG, stop=[""]).field == "stop"


def test_grammar_spec_kinds_and_conflicts():
    assert inputs.grammar_spec(CFG) is None
    s = inputs.grammar_spec(CFG, response_schema={"type": "integer"}, whitespace="flexible", strict=False)
    assert (s.kind, json.loads(s.value), s.whitespace, s.strict) == ("json_schema", {"type": "integer"}, "flexible", False)
    assert inputs.grammar_spec(CFG, regex="a+").value == "a+"
    assert json.loads(inputs.grammar_spec(CFG, choice=["é", "b"]).value) == ["é", "b"]
    e = _input_error(inputs.grammar_spec, CFG, response_schema={}, regex="a")
    assert "at most one" in e.detail and e.field == "regex"
    assert _input_error(inputs.grammar_spec, CFG, choice=[]).field == "choice"
    assert _input_error(inputs.grammar_spec, CFG, regex="").field == "regex"


def test_messages_need_a_template_and_text_parts():
    class NoTemplate:
        chat_template = None

    assert _input_error(prompts.render_messages, NoTemplate(), [{"role": "user", "content": "x"}]).field == "messages"
    assert prompts.message_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], 0) == "ab"
    assert _input_error(prompts.message_text, [{"type": "image_url"}], 3).field == "messages[3].content"
    assert _input_error(prompts.encode_prompt, None, "p", [{"role": "user", "content": "m"}]).field == "prompt"


# -- errors → problems -----------------------------------------------------------------------------

def test_problem_mapping():
    p, h = to_problem(GrammarError("unsupported", keyword="contains", path="#/properties/x"), "r1")
    assert (p.status, p.keyword, p.path, p.request_id) == (400, "contains", "#/properties/x", "r1")
    p, _ = to_problem(GrammarError("bad regex", position=7))
    assert (p.status, p.position) == (400, 7)
    p, h = to_problem(EngineOverloaded("300 waiting"), retry_after=3)
    assert p.status == 429 and h["Retry-After"] == "3"
    assert to_problem(Overloaded("full", retry_after=2))[1]["Retry-After"] == "2"
    assert to_problem(EngineError("prompt has 9000 tokens"))[0].status == 400
    assert to_problem(EngineDeadError("died"))[0].status == 503
    assert to_problem(GenerationTimeout("late"))[0].status == 504
    p, _ = to_problem(KeyError("secret internal detail"), "r9")
    assert p.status == 500 and "secret" not in p.detail and "r9" in p.detail


def test_json_logs_carry_request_id():
    rec = logging.LogRecord("stencil.x", logging.INFO, __file__, 1, "done %d", (3,), None)
    rec.request_id = "req-1"
    out = json.loads(JsonFormatter().format(rec))
    assert out["msg"] == "done 3" and out["request_id"] == "req-1" and out["level"] == "info"


def test_service_config_validation():
    from stencil.engine.config import ConfigError

    with pytest.raises(ConfigError, match="default_max_tokens"):
        ServiceConfig(max_tokens_cap=10, default_max_tokens=20).validate()
    with pytest.raises(ConfigError, match="max_body_bytes"):
        ServiceConfig(max_body_bytes=0).validate()


def test_errors_name_the_requests_field_where_they_say_their_message_leads_with_it():
    names = {"max_tokens": "max_completion_tokens", "prompt": "messages", "response_schema": "text.format"}

    def renamed(error: Exception) -> InputError:
        with pytest.raises(InputError) as info, named_as(names):
            raise error
        return info.value

    e = renamed(_input_error(inputs.sampling_params, CFG, max_tokens=101))
    assert (e.field, e.detail) == ("max_completion_tokens", "max_completion_tokens is 101; this server allows at most 100")
    e = renamed(EngineError("prompt is empty: at least one token is needed", field="prompt", lead=True))
    assert (e.field, e.detail) == ("messages", "messages is empty: at least one token is needed")
    e = renamed(_input_error(check_schema, 5, max_bytes=10, max_depth=3))
    assert e.field == "text.format" and e.detail.startswith("text.format must be a JSON object")
    # a message that does not say it leads with the field keeps its words; only the field moves
    e = renamed(EngineError("the prompt has 9 tokens; this model allows at most 8", field="prompt"))
    assert (e.field, str(e)) == ("messages", "the prompt has 9 tokens; this model allows at most 8")
    assert EngineError("the prompt is empty", field="prompt", lead=True).lead is False  # it does not lead
