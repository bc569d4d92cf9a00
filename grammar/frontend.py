"""Spec → program: what every backend compiles, written by Stencil alone.

A :class:`~stencil.grammar.base.GrammarSpec` becomes a :class:`~stencil.grammar.program.Program`: a regex for
regexes, choices and schemas a regex can express, a Lark grammar for user grammars and for
schemas that refer to themselves (recursion is kept, not unrolled). The backends only ever see
programs, so the language of a spec does not depend on which backend serves it.
"""

from __future__ import annotations

import json
from dataclasses import replace

import msgspec

from stencil.grammar.base import GrammarError, GrammarSpec, Program
from stencil.grammar.json_schema.keywords import ASCII_ESCAPE, unknown_keywords
from stencil.grammar.regex_tools import (check_lark_counts, check_lark_size, check_supported, choice_regex,
                                 locate_syntax_error)

MAX_GRAMMAR_CHARS = 1_000_000  # a user Lark grammar longer than this is refused


def to_program(spec: GrammarSpec, *, max_recursion_depth: int = 3, deadline: float | None = None,
               grammar: bool = True, handover: bool = True) -> Program:
    """Translate ``spec``.

    Args:
        spec: the constraint.
        max_recursion_depth: how often a ``$ref`` may be unrolled where a regex is written.
        deadline: ``time.monotonic()`` past which the translation stops with
            :class:`GrammarTimeout` (``None``: no limit).
        grammar: schemas that refer to themselves become Lark grammars (exact); ``False``
            unrolls their recursion ``max_recursion_depth`` times into a regex (a subset, for a
            backend that takes regexes only).
        handover: (grammar mode) a schema llguidance's JSON front end provably reads as Stencil
            does becomes a "json" program for it (``json_schema.handover``); ``False``: always
            Stencil's own translation.

    Raises:
        GrammarError: the spec is invalid or cannot be enforced exactly (named keyword, JSON
            path or regex position); GrammarTimeout past ``deadline``.
    """
    if spec.kind == "regex":
        core = check_supported(spec.value)
        pos, msg = locate_syntax_error(spec.value)
        if msg is not None:
            raise GrammarError(f"invalid regex: {msg}", position=pos)
        return Program("regex", core)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"choice is not valid JSON: {e.msg}", position=e.pos) from None
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise GrammarError("choice must be a JSON array of strings")
        return Program("regex", choice_regex(choices))
    if spec.kind == "json_schema":
        schema = _load_schema(spec.value)
        if "x-stencil" in spec.value or ASCII_ESCAPE.search(spec.value) is not None:
            _refuse_reserved_keys(schema)
        # (from the module itself: the package's lazy names cost a trip through importlib's
        # Python code on every call)
        from stencil.grammar.json_schema.schema_compiler import SharedProofs, schema_to_program

        shared = SharedProofs()  # (what a refused handover proved, for the translation after it)
        if spec.additional_properties not in ("closed", "schema"):
            raise GrammarError(f"unknown additional_properties mode {spec.additional_properties!r}",
                               keyword="additional_properties")
        closed = spec.additional_properties == "closed"
        program = _handed_over(schema, spec, shared) if grammar and handover else None
        if program is None:
            program = schema_to_program(schema, whitespace=spec.whitespace, strict=spec.strict,
                                        max_recursion_depth=max_recursion_depth, deadline=deadline,
                                        grammar=grammar, shared=shared, extra_properties=not closed)
        unknown = unknown_keywords(schema)  # served as JSON Schema says (ignored), but said
        return replace(program, warnings=(*unknown, *program.warnings)) if unknown else program
    if spec.kind == "lark":
        if not spec.value.strip():
            raise GrammarError("the grammar is empty: it needs a start rule", keyword="grammar",
                               line=1, column=1)
        if len(spec.value) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the grammar is {len(spec.value)} characters, above the limit of "
                               f"{MAX_GRAMMAR_CHARS}", keyword="grammar")
        check_lark_size(spec.value)
        check_lark_counts(spec.value)
        return Program("lark", spec.value)
    raise GrammarError(f"unknown grammar kind {spec.kind!r}")


def _handed_over(schema: object, spec: GrammarSpec, shared=None) -> Program | None:
    """The "json" program of ``schema`` (parsed from ``spec``) when it may be handed to
    llguidance (its C API is the verified release), else None. Where the handed-over schema
    caps a bound as Stencil's compiler does, its warnings are that compiler's
    (``Program.own_warnings``). ``shared``: ``SharedProofs`` for the translation that follows a
    refusal."""
    from stencil.grammar.backends.llg_c import library
    from stencil.grammar.json_schema.handover import dumps, llguidance_schema

    if library() is None:
        return None
    capped: list = []
    out = llguidance_schema(schema, spec.whitespace, spec.value, capped, shared,
                            open_objects=spec.additional_properties == "schema")
    return None if out is None else Program("json", dumps(out), own_warnings=bool(capped))


_DECODER = msgspec.json.Decoder()


def _load_schema(text: str) -> object:
    """``json.loads(text)``, read by msgspec in a third of the time where it can (what it reads,
    it reads to the same values); what it refuses (integers past 64 bits, ``1e400``, ``NaN``,
    lone surrogates, invalid JSON) goes to ``json``.

    Raises:
        GrammarError: the text is not JSON.
    """
    try:
        return _DECODER.decode(text)
    except msgspec.MsgspecError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"schema is not valid JSON: {e.msg}") from None


def _refuse_reserved_keys(schema: object) -> None:
    """Raise where a key of ``schema`` is one Stencil's compiler writes for itself
    (``x-stencil-*``: its rewriting of ``not`` and ``if``): in a user's schema it would change
    the language behind the validator's back (the validator ignores it).

    Raises:
        GrammarError: naming the key and where it is.
    """
    stack: list = [(schema, "#")]
    while stack:
        node, path = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if isinstance(k, str) and k.startswith("x-stencil"):
                    raise GrammarError(f"'{k}' is a key Stencil reserves for its own rewriting of schemas",
                                       keyword=k, path=path)
                if isinstance(v, (dict, list)):
                    stack.append((v, f"{path}/{k}"))
        elif isinstance(node, list):
            stack.extend((v, f"{path}/{i}") for i, v in enumerate(node) if isinstance(v, (dict, list)))


_WARM_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^\\w+\\d?\\s?$", "maxLength": 8},
        "when": {"type": "string", "format": "date-time"},
        "n": {"type": "number", "multipleOf": 0.5, "minimum": 0},
        "kind": {"enum": ["a", {"b": 1}]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "uniqueItems": True},
        "words": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
        "child": {"$ref": "#"},
    },
    "required": ["name"],
}


def warm_up() -> None:
    """Pay the translation's one-time costs before the first request: imports on first use,
    Python's Unicode ``\\d``/``\\s`` sets (~0.3 s), the validators (~0.3 s cold). A server calls
    it when it starts (``GrammarCompiler`` does, in its pool), a benchmark before its clock."""
    from stencil.grammar.charclass import unicode_sets

    unicode_sets()
    for ws in ("compact", "flexible"):
        to_program(GrammarSpec.json_schema(_WARM_SCHEMA, whitespace=ws)).lark()
        to_program(GrammarSpec.json_schema({"type": "object", "properties": {"n": {"type": "integer"}}},
                                           whitespace=ws))

