"""``merge.json_key`` tells JSON values apart exactly as jsonschema's equality does (``enum``), and
``SchemaCompiler.value_valid`` decides a long enum by a set of those keys with jsonschema's verdict.
Values are drawn to collide: integers and floats of one value (10 and 10.0, 0 and -0.0, 10**20 and
1e20, 10**300 and 1e300, 2**53 + 1 and its float), booleans against 0 and 1, nested arrays and
objects of them."""

from __future__ import annotations

import random

import jsonschema
import pytest

from stencil.grammar.json_schema import SchemaCompiler, SchemaOptions
from stencil.grammar.json_schema.merge import json_key
from stencil.grammar.json_schema.schema_compiler import ENUM_SET_MIN

_SCALARS = [0, -0.0, 0.0, 1, 1.0, True, False, None, 10, 10.0, 1e1, -3, -3.0, 0.1, 0.30000000000000004, 2.5,
            10 ** 20, 1e20, 10 ** 300, 1e300, 2 ** 53, float(2 ** 53), 2 ** 53 + 1, 12345678901234567890123456789012345,
            12345678901234567890123456789012346, "1", "", "a", "A"]


def _value(rng: random.Random, depth: int = 0) -> object:
    roll = rng.random()
    if depth < 2 and roll < 0.15:
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 2))]
    if depth < 2 and roll < 0.3:
        return {rng.choice("ab"): _value(rng, depth + 1) for _ in range(rng.randint(0, 2))}
    return rng.choice(_SCALARS)


def _equal(a: object, b: object) -> bool:
    return jsonschema.Draft202012Validator({"enum": [a]}).is_valid(b)


def test_json_key_equality_is_jsonschemas_on_colliding_values():
    rng = random.Random(0)
    pairs = [(a, b) for a in _SCALARS for b in _SCALARS]
    pairs += [(_value(rng), _value(rng)) for _ in range(3000)]
    for a, b in pairs:
        assert (json_key(a) == json_key(b)) == _equal(a, b), (a, b)


@pytest.mark.parametrize("seed", range(3))
def test_a_long_enum_is_decided_by_its_key_set_as_jsonschema_decides_it(seed):
    rng = random.Random(seed)
    root = {"type": "object"}
    compiler = SchemaCompiler(root, SchemaOptions())
    for _ in range(20):
        schema = {"enum": [_value(rng) for _ in range(ENUM_SET_MIN + rng.randint(1, 12))], "title": "t"}
        if rng.random() < 0.5:
            schema["type"] = rng.choice(["number", "integer", "string", "array", ["null", "boolean"]])
        validator = jsonschema.Draft202012Validator(schema)
        for value in [_value(rng) for _ in range(60)] + schema["enum"]:
            assert compiler.value_valid(value, schema) == validator.is_valid(value), (schema, value)
