"""The JSON Schema compiler's memo: each sub-schema is compiled once, so the work grows with the
schema, not with the number of places a definition is merged into."""

from __future__ import annotations

import re
import threading

import pytest

from stencil.grammar.json_schema import schema_compiler as C
from stencil.grammar.json_schema.interning import ContentIds


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
    here = threading.get_ident()  # (not a grammar compiler's warm-up still running on its own thread)
    monkeypatch.setattr(C.SchemaCompiler, "_typed",
                        lambda self, *a, **k: (threading.get_ident() == here and calls.append(1)) or typed(self, *a, **k))
    program = C.schema_to_program(_chain(n), whitespace="compact")
    # one typed compile per level (the object) and the leaves' integer and string
    assert len(calls) == n + 3
    # and the language is still the whole chain: the innermost level needs "v"
    text = C.schema_to_regex(_chain(2), whitespace="compact")[0]
    assert re.fullmatch(text, '{"x":{"x":{"v":1,"w":"a"}}}')
    assert not re.fullmatch(text, '{"x":{"x":{"w":"a"}}}')
    assert program.kind == "regex"


def _one_of_schema(tail: dict) -> dict:
    """A ``oneOf`` of closed object branches, each requiring a key of its own (disjoint, proved
    pair by pair), then ``tail`` (which the handover to llguidance refuses, so Stencil's own
    translation follows its attempt)."""
    branches = [{"type": "object", "properties": {f"p{i}": {"type": "integer"}, "v": {"type": "string"}},
                 "required": [f"p{i}"], "additionalProperties": False} for i in range(6)]
    return {"type": "object", "properties": {"item": {"oneOf": branches}, "n": tail}, "required": ["item"]}


@pytest.mark.parametrize("ids_below", [False, True])
def test_a_refused_handovers_proofs_serve_stencils_own_translation(monkeypatch, ids_below):
    """The handover's oneOf proofs go to the translation that follows its refusal (the same
    document, ``SharedProofs``); not where an identifier below the root could make equal
    contents mean different things. The programs are the same either way."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.frontend import to_program
    from stencil.grammar.json_schema import handover
    from stencil.grammar.json_schema import oneof

    schema = _one_of_schema({"type": "integer", "multipleOf": 7})
    if ids_below:
        schema["properties"]["n"]["$id"] = "http://example.com/n.json"
    spec = GrammarSpec.json_schema(schema)
    calls = []
    inner = oneof._disjoint
    here = threading.get_ident()  # (not a grammar compiler's warm-up still running on its own thread)
    monkeypatch.setattr(oneof, "_disjoint", lambda *a: (threading.get_ident() == here and calls.append(1)) or inner(*a))

    def count(f) -> int:
        calls.clear()
        f()
        return len(calls)

    attempt = count(lambda: handover.llguidance_schema(schema, "compact"))
    own = count(lambda: to_program(spec, handover=False))
    both = count(lambda: to_program(spec))
    assert attempt > 0 and own > 0
    if ids_below:
        assert both == attempt + own
    else:  # every proof of the attempt reused (and each pair proved once within the translation)
        assert both <= own
    assert to_program(spec) == to_program(spec, handover=False)
