"""The JSON Schema compiler's memo: each sub-schema is compiled once, so the work grows with the
schema, not with the number of places a definition is merged into."""

from __future__ import annotations

import re

import pytest

from grammar.json_schema import schema_compiler as C
from grammar.json_schema.interning import ContentIds


def test_content_ids_number_equal_values_alike_and_keep_order_and_types_apart():
    ids = ContentIds()
    a = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"enum": [1, True]}}}
    b = {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"enum": [1, True]}}}
    assert a is not b and ids.of(a) == ids.of(b)
    reordered = {"type": "object", "properties": {"y": {"enum": [1, True]}, "x": {"type": "integer"}}}
    assert ids.of(reordered) != ids.of(a)  # property order is part of the meaning
    assert ids.of([1]) != ids.of([True]) != ids.of([1.0])
    assert ids.of({"a": None}) != ids.of({"a": "null"})
    assert ids.of(a) == ids.of(a)  # from the table by id


def _chain(n: int) -> dict:
    """``d{i}`` has two properties, each an ``allOf`` of ``d{i-1}`` and a sibling: every merge makes
    new dicts, so without a memo by content the compiler's work doubles at each level."""
    defs = {"d0": {"type": "object", "properties": {"v": {"type": "integer"}}, "required": ["v"]}}
    for i in range(1, n + 1):
        member = {"allOf": [{"$ref": f"#/$defs/d{i - 1}"}, {"properties": {"w": {"type": "string"}}}]}
        defs[f"d{i}"] = {"type": "object", "properties": {"x": member, "y": dict(member)}, "required": ["x"]}
    return {"$defs": defs, "$ref": f"#/$defs/d{n}"}


@pytest.mark.parametrize("n", [4, 8])
def test_a_definition_merged_in_many_places_is_compiled_once(monkeypatch, n):
    calls = []
    typed = C.SchemaCompiler._typed
    monkeypatch.setattr(C.SchemaCompiler, "_typed", lambda self, *a, **k: calls.append(1) or typed(self, *a, **k))
    program = C.schema_to_program(_chain(n), whitespace="compact")
    # one typed compile per level (the object) and the leaves' integer and string
    assert len(calls) == n + 3
    # and the language is still the whole chain: the innermost level needs "v"
    text = C.schema_to_regex(_chain(2), whitespace="compact")[0]
    assert re.fullmatch(text, '{"x":{"x":{"v":1,"w":"a"}}}')
    assert not re.fullmatch(text, '{"x":{"x":{"w":"a"}}}')
    assert program.kind == "regex"
