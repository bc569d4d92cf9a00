"""JSON Schema → regex, exact or refused (fail closed).

``schema_to_regex`` returns a regex (Python ``re`` / outlines-core 0.2.14 dialect, implicitly
anchored) whose language is a set of serialized JSON documents that the schema admits: every
string it matches validates with ``jsonschema`` (the draft named by ``$schema``, format
checker on). The layout is canonical: compact JSON (or a bounded run of whitespace with
``whitespace="flexible"``), properties in schema order, additional properties after the
declared ones, strings escaped as ``json.dumps(ensure_ascii=False)`` does, integers without
leading zeros, bounded numbers without exponent. A keyword that cannot be enforced exactly
raises ``GrammarError(keyword=..., path="#/json/pointer")``, or with ``strict=False`` is ignored
and reported in the warnings.

Documented restrictions (subsets, never supersets): recursion through ``$ref`` is unrolled
``max_recursion_depth`` times; ``{}``/``true`` values nest at most ``any_max_depth`` deep;
a schema without ``type`` admits only the types its keywords talk about (``properties`` →
object, ``items`` → array, ...), or any type when it names none; ``oneOf`` object branches
told apart by a property they declare but do not require are written with that property.
When ``additionalProperties`` is absent and the object declares properties, the grammar
writes no extra properties (as
OpenAI structured outputs, XGrammar and Outlines do): extra keys are rarely wanted from a model,
and every "any value" slot multiplies the automaton (MaskBench-dev, 100 schemas: 68 pass
instead of 49, compile p50 93 ms instead of 1.4 s). An object that declares no properties is
free-form and takes any keys. ``extra_properties=True`` follows the specification everywhere
(extra keys after the declared ones); an explicit ``additionalProperties`` schema is always honoured.
"""

from __future__ import annotations

import functools
import itertools
import json
import re
import time
from dataclasses import dataclass, field, replace

import jsonschema
from jsonschema import validators

from stencil.grammar.json_schema import numbers as nr
from stencil.grammar.base import MAX_REPEAT_COUNT, GrammarError, GrammarTimeout, Program
from stencil.grammar.json_schema.arrays import compile_array
from stencil.grammar.json_schema.canonical import canonical_json
from stencil.grammar.json_schema.complement import NOT_PATTERNS, NOT_STRINGS, ComplementError, complement
from stencil.grammar.json_schema.interning import ContentIds
from stencil.grammar.json_schema.keywords import (ANNOTATIONS, ASSERTIONS, JSON_TYPES, TYPE_KEYWORDS, enum_values,
                                                  json_type)
from stencil.grammar.json_schema.merge import MergeError, json_key, merge
from stencil.grammar.json_schema.numbers import compile_number
from stencil.grammar.json_schema.objects import _ANY_KEY, _key_literal, compile_object
from stencil.grammar.json_schema.oneof import (by_discriminator, disjoint, exclusive_required, possible_types,
                                       promote_discriminators, without_empty_object, written_apart)
from stencil.grammar.json_schema.refs import RefResolver
from stencil.grammar.program import (REF_OPEN, cuttable, expand, has_refs, is_empty, is_regular_text, minus, ref,
                                     term_ref, to_lark)
from stencil.grammar.json_schema.rx import Rx, alt, opt, repeat, seq
from stencil.grammar.json_schema.strings import (ANY_CHAR, STRING_SUPERSET_KEYWORDS, StringError, StringSpec,
                                        excluded_keys_regex, pattern_superset_regex, string_regex,
                                        string_superset_regex)

MAX_MIN_LENGTH = MAX_REPEAT_COUNT  # most characters minLength may require (each is an automaton state)
GRAMMAR_ANY_DEPTH = 3  # container nesting of free-form values in served programs
# The free run of whitespace="flexible" around structural characters: a short run on one line
# (`{ "a": 1 }`), or one line break and an indent, which is how models pretty-print JSON
# (`{\n  "name": ...`; SmolLM2 writes "\n " and ' "' as two tokens). The old bound, two
# characters in all, refused the 2-space indent the model was trained on; with the indent
# allowed, SmolLM2-135M gets more fields right than in compact JSON
# (docs/benchmarks.md, "Field accuracy: compact against flexible JSON").
# Bounded (at most 22 characters) so that a run of whitespace cannot go on until max_tokens;
# 20 columns reach the tenth level of a 2-space indent, as llama.cpp's JSON grammars allow.
ENUM_SET_MIN = 8  # enums longer than this are decided by a set of their values (``value_valid``)
FLEXIBLE_WS = "(?:[ \\t\\n\\r]{0,2}|\\r?\\n[ \\t]{0,20})"
ANY_CHAR_GROUP = ANY_CHAR if ANY_CHAR.startswith("(?:") else "(?:" + ANY_CHAR + ")"

_TYPES = JSON_TYPES
_OLD_DRAFTS = ("draft-03", "draft-04", "draft-06", "draft-07")


@dataclass(frozen=True, slots=True)
class SchemaOptions:
    """Compiler options (see ``schema_to_regex``)."""

    whitespace: str = "compact"
    strict: bool = True
    max_recursion_depth: int = 3
    any_max_depth: int = 1
    any_max_length: int | None = None
    extra_properties: bool = False
    max_string_length: int = 128
    max_regex_chars: int = 8_000_000
    deadline: float | None = None  # time.monotonic() past which compilation stops (GrammarTimeout)
    grammar: bool = False  # recursion as grammar rules (rules.ref) instead of unrolling
    # Grammar mode: a subschema's regex of at least this many characters is written once, as a
    # terminal (rules.term_ref), however often it is used.
    term_min_chars: int = 48
    # Regex mode: free-form values' pieces (``any_value``) become terminal references all the
    # same, which the caller writes out (``program.expand``) or names in Lark (tool-call answers:
    # ``stencil.grammar.tool_calls``). The language is regex mode's.
    share_terminals: bool = False
    # Grammar mode: every value's and key's regex a terminal, noted in ``value_terms``, where the
    # Lark writer cuts lexemes (``program.to_lark``).
    value_lexemes: bool = False


@dataclass(slots=True)
class SchemaCompiler:
    """One compilation: the root, its resolver and validator, options, warnings, ref stack."""

    root: object
    opts: SchemaOptions
    warnings: list[str] = field(default_factory=list)
    ref_depth: dict[str, int] = field(default_factory=dict)
    emitted: int = 0  # characters of regex text produced so far (all subschemas)
    rules: dict[int, Rx] = field(default_factory=dict)  # rule number → body (grammar mode)
    rule_ids: dict[str, int] = field(default_factory=dict)  # (target, siblings, types) → number
    in_progress: set[str] = field(default_factory=set)  # rule keys being compiled on this path
    recursive: set[str] = field(default_factory=set)  # rule keys found to refer to themselves
    # rule key → compiled body (grammar mode); ("multiple", a, n) → that step's ``Multiples``
    bodies: dict = field(default_factory=dict)
    terminals: list[str] = field(default_factory=list)  # terminal number → regex (grammar mode)
    term_ids: dict[str, int] = field(default_factory=dict)  # regex → terminal number
    # terminal numbers whose regex is a whole JSON value (``Program.value_terms``)
    value_terms: set[int] = field(default_factory=set)
    # terminal number → the same language as llguidance reads it faster (``Program.lark_forms``)
    lark_forms: dict[int, str] = field(default_factory=dict)
    memo: dict = field(default_factory=dict)  # (keyword, schema text, types) → regex (grammar mode)
    enum_keys: dict = field(default_factory=dict)  # id(an enum schema) → (it, its values' json_key set)
    sub_memo: dict = field(default_factory=dict)  # (content number, types) → regex (grammar mode)
    ids: ContentIds = field(default_factory=ContentIds)  # content numbers of schemas (interning)
    # (content number, content number) → whether the two branches are disjoint (``oneof.disjoint``),
    # shared with the handover's attempt on the same document (``SharedProofs``); None: not kept
    proofs: dict | None = None
    deref_memo: dict = field(default_factory=dict)  # id(schema) → (schema, ``_deref`` of it)
    resolver: RefResolver = field(init=False)
    validator: object = field(init=False)
    old_draft: bool = field(init=False)
    ws: str = field(init=False)

    def __post_init__(self) -> None:
        cls = validators.validator_for(self.root, default=jsonschema.Draft202012Validator)
        ancient = cls in (jsonschema.Draft3Validator, jsonschema.Draft4Validator)
        self.resolver = RefResolver(self.root, id_keyword="id" if ancient else "$id")
        self.validator = cls(self.root if isinstance(self.root, (dict, bool)) else {},
                             format_checker=cls.FORMAT_CHECKER)
        dialect = self.root.get("$schema", "") if isinstance(self.root, dict) else ""
        self.old_draft = any(d in str(dialect) for d in _OLD_DRAFTS)
        self.ws = "" if self.opts.whitespace == "compact" else FLEXIBLE_WS

    # -- errors --------------------------------------------------------------------------------
    def unsupported(self, keyword: str, path: str, message: str | None = None) -> None:
        """Fail closed on ``keyword`` (strict) or record a warning and go on."""
        text = message or f"keyword {keyword!r} cannot be enforced exactly"
        if self.opts.strict:
            raise GrammarError(text, keyword=keyword, path=path)
        self.warnings.append(f"{keyword} at {path}: {text} (ignored)")

    # -- helpers for the type modules ----------------------------------------------------------
    def value_valid(self, value: object, schema: object) -> bool:
        """Whether ``value`` validates against ``schema`` (a subschema of the root).

        A schema of ``type`` alone (what ``value_check`` leaves of most enums) is checked with
        the validator's own type checker, the same verdict in ~1 us where a validator evolved
        for it takes ~15 us (a tool list's enums: a fifth of its translation)."""
        if type(schema) is dict and type(schema.get("enum")) is list and len(schema["enum"]) > ENUM_SET_MIN:
            # An enum of many values (and maybe a type): one set lookup, not a comparison a value
            # (a oneOf of enum branches decided value by value: n^2 comparisons, 64 ms for
            # JsonSchemaStore base.json's 580 values). ``json_key`` equality is jsonschema's.
            if schema.keys() - ANNOTATIONS <= {"enum", "type"}:
                entry = self.enum_keys.get(id(schema))
                if entry is None or entry[0] is not schema:
                    entry = self.enum_keys[id(schema)] = (schema, frozenset(map(json_key, schema["enum"])))
                if json_key(value) not in entry[1]:
                    return False
                return "type" not in schema or self.value_valid(value, {"type": schema["type"]})
        if type(schema) is dict and len(schema) == 1 and "type" in schema:
            types = schema["type"]
            try:
                if isinstance(types, str):
                    return self.validator.is_type(value, types)
                if isinstance(types, list):
                    return any(self.validator.is_type(value, t) for t in types)
            except Exception:  # an unknown type name: admits nothing, as below
                return False
        try:
            return self.validator.evolve(schema=schema).is_valid(value)
        except Exception:  # an invalid subschema counts as admitting nothing
            return False

    def value_check(self, schema: dict, own_values: bool) -> dict | None:
        """What a value must still validate against to be kept among ``schema``'s finite values
        (None: nothing). ``own_values``: the values are ``schema``'s own ``enum``/``const``. Where
        the schema says nothing else but a type, the type alone: checking a value against an enum
        of n values is n comparisons, n^2 in all (a 5,000-name enum took seconds)."""
        own = {k for k in schema if k not in ANNOTATIONS}
        if own <= {"type"} or (own_values and own <= {"enum", "const", "type"}):
            return {"type": schema["type"]} if "type" in schema else None
        if own_values and ("enum" in schema) != ("const" in schema):
            # a value of the schema's own enum (or its const) passes that keyword: the rest of
            # the schema decides, without n comparisons per value
            return {k: v for k, v in schema.items() if k not in ("enum", "const")}
        return schema

    def string_for(self, schema: object, path: str) -> Rx:
        """Regex of the string literals ``schema`` admits (used for keys), written out."""
        r = self.sub(schema, path, only_types=("string",))
        if r is not None and self.terminals and is_regular_text(r, self.terminals):
            return expand(r, self.terminals)
        return r  # (an intersection or complement, grammar mode: it keeps its terminal references)

    def term(self, rx: str, force: bool = False) -> str:
        """``rx`` as a terminal reference when it is long enough to be worth sharing (grammar
        mode) or ``force`` says so; identical regexes share one terminal. Text referring to a
        rule stays as it is (a long one becomes a helper rule)."""
        if (len(rx) < self.opts.term_min_chars and not (force and REF_OPEN not in rx)) or _is_term(rx):
            return rx
        if REF_OPEN in rx:  # not regular: a long piece becomes a helper rule (shared the same way)
            if len(rx) < 4 * self.opts.term_min_chars or _is_ref(rx):
                return rx
            key = "text:" + rx
            n = self.rule_ids.get(key)
            if n is None:
                n = self.rule_ids[key] = len(self.rule_ids)
                self.rules[n] = rx
            return ref(n)
        n = self.term_ids.get(rx)
        if n is None:
            if rx != ANY_CHAR_GROUP and ANY_CHAR_GROUP in rx:
                # The JSON character class is in every free string: one shared terminal.
                rx = rx.replace(ANY_CHAR_GROUP, self.term(ANY_CHAR_GROUP))
                n = self.term_ids.get(rx)
            if n is None and rx != FLEXIBLE_WS and FLEXIBLE_WS in rx:
                # So is the flexible whitespace, around every structural character, and the
                # member and key separators it surrounds (a shorter Lark text: llguidance reads
                # about 1 us an item of it before a request's first mask).
                rx = self._separators(rx.replace(FLEXIBLE_WS, self._ws_term()))
                n = self.term_ids.get(rx)
            if n is None:
                n = self.term_ids[rx] = len(self.terminals)
                self.terminals.append(rx)
        return term_ref(n)

    def _separators(self, rx: str) -> str:
        """``rx`` (its whitespace already the shared terminal W) with ``W,W`` and ``W:W`` written
        as shared terminals of their own; not where a quantifier follows, which binds to the
        last W alone."""
        ws = self._ws_term()
        for sep in (",", ":"):
            piece = ws + sep + ws
            if piece in rx:
                name = self._shared_term(piece)
                rx = _separator_re(piece).sub(lambda _m: name, rx)
        return rx

    def _ws_term(self) -> str:
        """The flexible whitespace as one shared terminal (written once in the Lark text)."""
        return self._shared_term(FLEXIBLE_WS)

    def _shared_term(self, rx: str) -> str:
        """A reference to the terminal of ``rx`` exactly, added on first use (however short)."""
        n = self.term_ids.get(rx)
        if n is None:
            n = self.term_ids[rx] = len(self.terminals)
            self.terminals.append(rx)
        return term_ref(n)

    def any_value(self, depth: int | None = None) -> str:
        """Any JSON value nested at most ``depth`` containers deep."""
        depth = self.opts.any_max_depth if depth is None else depth
        scalar = alt(['"' + self._any_char() + '*"', nr.NUMBER, "true", "false", "null"])
        if depth <= 0:
            return self._share_any(scalar)
        inner = self._share_any(self.any_value(depth - 1))
        comma, colon = self.ws + "," + self.ws, self.ws + ":" + self.ws
        n = self.opts.any_max_length
        more = None if n is None else max(n - 1, 0)
        array = self.bracket("\\[", "\\]", seq(inner, repeat(seq(comma, inner), 0, more)), True)
        member = seq(self.key_term('"' + self._any_char() + '*"'), colon, inner)
        obj = self.bracket("\\{", "\\}", seq(member, repeat(seq(comma, member), 0, more)), True)
        return self._share_any(alt([self._share_any(scalar), array, obj]))  # type: ignore[list-item]

    def _share_any(self, rx: Rx) -> Rx:
        """A free-form value's piece as a shared terminal in grammar mode or where
        ``share_terminals`` asks for them (itself otherwise)."""
        return self._value_term(rx) if (self.opts.grammar or self.opts.share_terminals) and rx is not None else rx

    def _value_term(self, rx: str) -> str:
        """``term(rx)`` for a regex of whole JSON values (a schema's, a key's): in grammar mode a
        terminal however short, noted in ``value_terms``. The Lark writer ends one lexeme and
        starts the next at such terminals (``program.to_lark``), so that llguidance's lexer
        meets JSON's own tokens, not one lexeme of the whole document."""
        if not (self.opts.grammar and self.opts.value_lexemes):
            return self.term(rx)
        out = self.term(rx, force=True)
        if _is_term(out):
            self.value_terms.add(int(out[1:-1]))
        return out

    def excluded_strings(self, names: list[str]) -> str:
        """String literals whose decoded value is none of ``names`` (``excluded_keys_regex``: a
        trie, a plain regex). In grammar mode a terminal whose Lark form is "any string, less
        these literals" (llguidance's ``& ~``: the same set, each decoded string having one
        encoding in Stencil's alphabet). llguidance masks the complement form with its
        precomputed token slices; the trie it walks token by token (a mask at ~0.4 ms against
        ~0.01 at 49k tokens, in every key of an object that takes undeclared keys)."""
        rx = excluded_keys_regex(names)
        if not self.opts.grammar:
            return rx
        out = self.term(rx, force=True)
        n = int(out[1:-1])
        if n not in self.lark_forms:
            self.lark_forms[n] = minus(_ANY_KEY, alt([_key_literal(x) for x in dict.fromkeys(names)]))
        return out

    def key_term(self, rx: Rx) -> Rx:
        """A member's key regex (whole JSON strings) as ``_value_term`` writes values (grammar
        mode; itself otherwise)."""
        return self._value_term(rx) if self.opts.grammar and rx is not None else rx

    def bracket(self, open_: str, close: str, body: Rx, empty_ok: bool) -> Rx:
        """An object or array: ``open_``, then ``body`` (its non-empty member lists; None: none),
        or nothing when ``empty_ok``, then ``close``, with one run of the whitespace mode's
        whitespace between any two of these tokens: ``{ }`` has one run, not two in a row (so
        that every gap between two tokens takes the same single run, as llguidance's JSON front
        end writes it: ``json_schema.handover``)."""
        ws = self.ws
        if body is None or body == "":
            return seq(open_, ws, close) if empty_ok or body == "" else None
        if not empty_ok:
            return seq(open_, ws, body, ws, close)
        return seq(open_, ws, opt(seq(body, ws)), close)

    def _share(self, rx: Rx) -> Rx:
        """``rx`` as a shared terminal in grammar mode (itself otherwise)."""
        return self.term(rx) if self.opts.grammar and rx is not None else rx

    @staticmethod
    def _any_char() -> str:
        from stencil.grammar.json_schema.strings import ANY_CHAR
        return ANY_CHAR

    # -- the recursive walk --------------------------------------------------------------------
    def sub(self, schema: object, path: str, only_types: tuple[str, ...] | None = None) -> Rx:
        """Regex of ``schema`` at JSON pointer ``path``; None when it admits nothing.

        In grammar mode each schema is compiled once per type restriction, however often it is
        reached (a definition under many properties, an ``allOf`` of references merged anew in
        every place that uses it: equal contents share a number, ``interning.ContentIds``): the
        regex does not depend on where the schema stands, only the
        messages of errors and warnings do (they name the first place). Recursion does not break
        this: a reference to a definition being compiled is a rule reference, whose body is the
        same wherever it is written. Regex mode unrolls recursion to a depth counted along the
        path, so there the place matters and nothing is memoized."""
        if self.opts.deadline is not None and time.monotonic() > self.opts.deadline:
            raise GrammarTimeout("schema compilation exceeded its time limit")
        if not (self.opts.grammar and isinstance(schema, dict)):
            return self._finish(self._sub(schema, path, only_types), path)
        key = (self.ids.of(schema), only_types if only_types is None else tuple(only_types))
        if key in self.sub_memo:
            out = self.sub_memo[key]
            if out is not None:
                self._count(out, path)
            return out
        out = self._finish(self._sub(schema, path, only_types), path)
        self.sub_memo[key] = out
        return out

    def _finish(self, out: Rx, path: str) -> Rx:
        """``sub``'s last step: a terminal in grammar mode, and the size limit."""
        if out is not None and self.opts.grammar:
            out = self._value_term(out)
        if out is not None:
            self._count(out, path)
        return out

    def _count(self, out: str, path: str) -> None:
        """Add ``out`` to the characters written so far. Unrolled recursion and shared
        definitions are copied into the text; stop before an exponential schema exhausts memory."""
        self.emitted += len(out)
        if self.emitted > self.opts.max_regex_chars or len(out) > self.opts.max_regex_chars:
            raise GrammarError(f"the regex grows beyond {self.opts.max_regex_chars} characters "
                               "(lower max_recursion_depth or simplify the schema)",
                               keyword="$ref" if any(self.ref_depth.values()) else "schema", path=path)

    def _sub(self, schema: object, path: str, only_types: tuple[str, ...] | None) -> Rx:
        if schema is True or schema == {}:
            return self._restrict_any(only_types)
        if schema is False:
            return None
        if not isinstance(schema, dict):
            raise GrammarError("a schema must be an object or a boolean", keyword="type", path=path)
        if "$ref" in schema and isinstance(schema["$ref"], str):
            return self._ref(schema, path, only_types)
        schema = _normalize(schema, path)
        finite = self._finite_values(schema, path)
        if finite is not None:
            # A finite value set makes every other keyword (not, oneOf, if, ...) decidable:
            # keep the values that jsonschema accepts against the whole schema.
            own = "enum" in schema or "const" in schema  # its own values (else an allOf member's)
            return self._enum(schema, path, only_types, None if own else finite)
        if "allOf" in schema:
            return self._all_of(schema, path, only_types)
        if "anyOf" in schema:
            rest = {k: v for k, v in schema.items() if k != "anyOf"}
            return alt([self.sub({"allOf": [rest, b]} if rest else b, f"{path}/anyOf/{i}", only_types)
                        for i, b in enumerate(schema["anyOf"])])
        if "oneOf" in schema:
            if not self.opts.grammar:  # unrolled refs make the result depend on the path
                return self._one_of(schema, path, only_types)
            # The same oneOf written in many places (a definition's union inlined under every
            # property) is proved and compiled once; a reference in it is a rule either way.
            key = ("oneOf", self.ids.of(schema), only_types)
            if key not in self.memo:
                self.memo[key] = self._one_of(schema, path, only_types)
            return self.memo[key]
        for key in ("$dynamicRef", "$recursiveRef"):
            if key in schema:
                self.unsupported(key, path)
        if "not" in schema:
            neg = self._deref(schema["not"], f"{path}/not")
            if (isinstance(neg, dict) and set(neg) <= {"required"} | ANNOTATIONS
                    and isinstance(neg.get("required"), list) and 1 < len(neg["required"]) <= 8):
                # not all of these present = one of them absent (exact; a union of cases)
                rest = {k: v for k, v in schema.items() if k != "not"}
                absent = [{"properties": {name: False}} for name in neg["required"]]
                return self.sub({"allOf": [rest, {"anyOf": absent}]}, path, only_types)
            schema = self._not(schema, path)
            if schema is None:
                return None
            if "anyOf" in schema:  # any value but some, as a union by type
                return self._sub(schema, path, only_types)
        if "if" in schema:
            split = self._if_then_else(schema, path)
            if split is not None:
                return alt([self.sub(b, path, only_types) for b in split])
            self.unsupported("if", path, "keyword 'if' cannot be enforced exactly: only a condition "
                             "that tests one property against const or enum values (and may require "
                             "it) is compiled, as a union of the then and else cases")
        if any(isinstance(schema.get(k), dict) and schema[k] for k in _DEPENDENCY_KEYWORDS):
            return self._dependencies(schema, path, only_types)
        return self._typed(schema, path, only_types)

    def _if_then_else(self, schema: dict, path: str) -> list | None:
        """``if``/``then``/``else`` whose condition tests one property against values (the usual
        ``{"properties": {"type": {"const": "x"}}}``) as a union of the two cases:
        ``if`` holds (the property has one of the values, or is absent unless ``if`` requires
        it) with ``then``; or it fails (another value, or absent when required) with ``else``
        (2020-12 §10.2.2.1). None for any other condition."""
        cond = self._deref(schema["if"], f"{path}/if")
        if not isinstance(cond, dict) or set(cond) - ANNOTATIONS - {"properties", "required"}:
            return None
        props = cond.get("properties")
        required = cond.get("required", [])
        if not isinstance(props, dict) or len(props) != 1 or not isinstance(required, list):
            return None
        (name, test), = props.items()
        test = self._deref(test, f"{path}/if/properties")
        if not isinstance(test, dict) or set(test) - ANNOTATIONS - {"enum", "const"} or set(required) - {name}:
            return None
        values = enum_values(test)
        rest = {k: v for k, v in schema.items() if k not in ("if", "then", "else")}
        then, other = schema.get("then", True), schema.get("else", True)
        present = {"required": [name], "properties": {name: {"enum": values}}}
        origin = {"path": path, "property": name, "values": values}
        other_value = {"required": [name], "properties": {name: {"not": {"enum": values, _FROM_IF: origin}}}}
        absent = {"properties": {name: False}}
        branches = [{"allOf": [rest, present, then]}, {"allOf": [rest, other_value, other]}]
        branches.append({"allOf": [rest, absent, other if name in required else then]})
        return branches

    def _dependencies(self, schema: dict, path: str, only_types) -> Rx:
        """``dependentRequired``/``dependentSchemas``/draft-04 ``dependencies`` as a union:
        for each trigger name, either it is absent, or it is present and its dependency holds
        (2020-12 §10.2.2.4, §6.5.4). Exact; 2^k branches, so at most 4 triggers."""
        rest = {k: v for k, v in schema.items() if k not in _DEPENDENCY_KEYWORDS}
        deps: dict[str, object] = {}
        for key in _DEPENDENCY_KEYWORDS:
            for name, dep in (schema.get(key) or {}).items():
                dep = {"required": dep} if isinstance(dep, list) else dep
                deps[name] = {"allOf": [deps[name], dep]} if name in deps else dep
        if len(deps) > 4:
            self.unsupported("dependencies", path, "more than 4 dependency triggers")
            return self._typed(rest, path, only_types)
        options = [[{"properties": {name: False}}, {"allOf": [{"required": [name]}, dep]}]
                   for name, dep in deps.items()]
        branches = [{"allOf": [rest, *choice]} for choice in itertools.product(*options)]
        return alt([self.sub(b, f"{path}/dependencies", only_types) for b in branches])

    def _restrict_any(self, only_types) -> Rx:
        if only_types is None:
            return self.any_value()
        return self._typed({"type": list(only_types)}, "#", None)

    def _ref(self, schema: dict, path: str, only_types, extra: dict | None = None) -> Rx:
        """``schema`` (a ``$ref``, with its siblings) and, when given, ``extra`` (a schema the
        value must also satisfy: ``allOf: [extra, schema]``, its properties written first, that
        keeps the reference a reference, so that a recursive one becomes a rule instead of
        being inlined)."""
        base = self.resolver.base_of(schema, self.resolver.root_base)
        target = self.resolver.resolve(schema["$ref"], base, path)
        key = target.pointer if target.base == self.resolver.root_base else target.base + target.pointer
        if self.opts.grammar:
            return self._ref_rule(schema, target, key, only_types, extra)
        count = self.ref_depth.get(key, 0)
        if count > self.opts.max_recursion_depth:
            return None  # recursion unrolled far enough: this branch admits nothing more
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        resolved = target.schema
        if siblings and not self.old_draft and any(k in ASSERTIONS for k in siblings):
            resolved = {"allOf": [resolved, siblings]}
        if extra:
            resolved = {"allOf": [extra, resolved]}  # extra first: its properties are written first
        self.ref_depth[key] = count + 1
        try:
            return self.sub(resolved, target.pointer, only_types)
        finally:
            self.ref_depth[key] = count

    def _ref_rule(self, schema: dict, target, key: str, only_types, extra: dict | None = None) -> Rx:
        """Grammar mode: a ``$ref`` met again while its target is being compiled on the same path
        becomes a reference to a rule (``rules.ref``), whose body is the target's regex; other
        references are inlined as in regex mode. Exact: nothing is unrolled or cut."""
        siblings = {k: v for k, v in schema.items() if k != "$ref"}
        resolved = target.schema
        if siblings and not self.old_draft and any(k in ASSERTIONS for k in siblings):
            resolved = {"allOf": [resolved, siblings]}
        own = siblings if resolved is not target.schema else None
        if extra:
            resolved = {"allOf": [extra, resolved]}  # extra first: its properties are written first
        rule_key = json.dumps([key, own, list(only_types) if only_types else None, extra or None],
                              sort_keys=True, default=str)
        number = self.rule_ids.get(rule_key)
        if number is not None and (number in self.rules or rule_key in self.in_progress):
            if rule_key in self.in_progress:
                self.recursive.add(rule_key)
            return ref(number)
        if rule_key in self.bodies:  # compiled before (its text is a terminal when long)
            return self.bodies[rule_key]
        if rule_key in self.in_progress:
            number = self.rule_ids[rule_key] = len(self.rule_ids)
            self.recursive.add(rule_key)
            return ref(number)
        self.in_progress.add(rule_key)
        try:
            out = self.sub(resolved, target.pointer, only_types)
        finally:
            self.in_progress.discard(rule_key)
        if rule_key not in self.recursive:
            self.bodies[rule_key] = out
            return out
        number = self.rule_ids[rule_key]
        if out is None:
            raise GrammarError("the schema refers to itself with no way to end (every value would be "
                               "infinite)", keyword="$ref", path=target.pointer)
        self.rules[number] = out
        return ref(number)

    def _deref(self, schema: object, path: str) -> object:
        """Inline top-level ``$ref``s of an ``allOf`` member (one level, cycle-safe); the result is
        kept per schema object (the ``oneOf`` proofs ask for the same branches again and again)."""
        if not isinstance(schema, dict):
            return schema
        hit = self.deref_memo.get(id(schema))
        if hit is not None:
            return hit[1]
        out = self._deref_uncached(schema, path)
        self.deref_memo[id(schema)] = (schema, out)  # the object kept: its id stays its own
        return out

    def _deref_uncached(self, schema: object, path: str) -> object:
        seen = 0
        while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and seen < 32:
            base = self.resolver.base_of(schema, self.resolver.root_base)
            target = self.resolver.resolve(schema["$ref"], base, path)
            siblings = {k: v for k, v in schema.items() if k != "$ref"}
            if siblings and not self.old_draft and any(k in ASSERTIONS for k in siblings):
                schema = {"allOf": [target.schema, siblings]}
            else:
                schema = target.schema
            seen += 1
        if seen >= 32:
            raise GrammarError("$ref chain too long", keyword="$ref", path=path)
        return _normalize(schema) if isinstance(schema, dict) else schema

    def _flatten_all_of(self, schema: object, path: str, out: list) -> None:
        schema = self._deref(schema, path)
        if isinstance(schema, dict) and "allOf" in schema:
            rest = {k: v for k, v in schema.items() if k != "allOf"}
            out.append(rest)
            for i, member in enumerate(schema["allOf"]):
                self._flatten_all_of(member, f"{path}/allOf/{i}", out)
        else:
            out.append(schema)

    def _all_of(self, schema: dict, path: str, only_types) -> Rx:
        members: list = []
        self._flatten_all_of(schema, path, members)
        merged: object = True
        try:
            for m in members:
                merged = merge(merged, m)
        except MergeError as exc:
            self.unsupported(exc.keyword, f"{path}/allOf", exc.message)
            return self.sub(members[0], path, only_types)
        return self.sub(merged, path, only_types)

    def _one_of(self, schema: dict, path: str, only_types) -> Rx:
        rest = {k: v for k, v in schema.items() if k != "oneOf"}
        rewritten = exclusive_required(schema["oneOf"], ANNOTATIONS)
        if rewritten is not None:
            if not rewritten:
                return None
            return self.sub({**rest, "anyOf": rewritten}, path, only_types)
        branches = []
        for b in schema["oneOf"]:
            flat: list = []
            self._flatten_all_of({"allOf": [rest, b]} if rest else b, path, flat)
            try:
                merged: object = True
                for m in flat:
                    merged = merge(merged, m)
            except MergeError as exc:
                self.unsupported(exc.keyword, f"{path}/oneOf", exc.message)
                merged = b
            branches.append(merged)
        finite = [self._finite_values_deep(b, path) for b in branches]
        values, seen = [], set()
        for v in (v for f in finite if f is not None for v in f):
            if json_key(v) not in seen:
                seen.add(json_key(v))
                values.append(v)
        # The values of finite branches are decided one by one: kept when they validate against
        # exactly one branch (finite or not).
        kept = [v for v in values if sum(self.value_valid(v, b) for b in branches) == 1]
        if all(f is not None for f in finite):
            return self._enum({}, path, only_types, kept) if kept else None
        # Every other instance can only match the infinite branches, so those must be pairwise
        # disjoint; each is written without the finite values (decided above).
        index = [i for i, f in enumerate(finite) if f is None]
        infinite = without_empty_object(self, [branches[i] for i in index])
        taken: dict[int, list[Rx]] = {}  # branch (place in ``infinite``) → what others take away
        if not by_discriminator(self, infinite):  # else all disjoint, in one pass
            schema_branches, infinite = infinite, promote_discriminators(self, infinite)
            for a in range(len(infinite)):
                for b in range(a + 1, len(infinite)):
                    if not written_apart(self, infinite, schema_branches, a, b):
                        self._take_apart(infinite, a, b, index, taken, path)
        parts = [self._enum({}, path, only_types, kept)] if kept else []
        for k, (i, b) in enumerate(zip(index, infinite)):
            inside = [v for v in values if self.value_valid(v, b)]
            if inside:
                b = {"allOf": [b, {"not": {"enum": inside}}]}
            if k in taken:
                parts.append(minus(self.sub(b, f"{path}/oneOf/{i}", only_types), alt(taken[k])))
                continue
            raw = schema["oneOf"][i]
            if b is branches[i] and isinstance(raw, dict) and isinstance(raw.get("$ref"), str):
                # Unchanged: compile the reference as a reference (merging inlined it, and a
                # recursive one would be inlined without end), with the siblings of ``oneOf``.
                where = f"{path}/oneOf/{i}"
                parts.append(self._finish(self._ref(raw, where, only_types, rest or None), where))
                continue
            parts.append(self.sub(b, f"{path}/oneOf/{i}", only_types))
        return alt(parts)

    def _take_apart(self, branches: list, a: int, b: int, index: list[int], taken: dict[int, list[Rx]],
                    path: str) -> None:
        """Make ``oneOf`` branches ``a`` and ``b`` (which may both match) exact where both are
        strings: each is written minus a superset of the strings valid against the other
        (``strings.string_superset_regex``: patterns over-approximated, lengths exact), so no
        written string validates against both, and one valid against one branch alone is
        written (but where an over-approximated atom takes away more: then a subset, never an
        invalid string). Grammar mode only (llguidance's ``& ~``); ``taken`` gathers, per
        branch, the regexes to take away.

        Raises:
            GrammarError: (through ``unsupported``) "may both match", where a branch may be
                other than a string, or says more of its strings than a superset can hold
                (``format``, ``enum``...).
        """
        pair = (branches[a], branches[b])
        if self.opts.grammar and all(
                isinstance(x, dict) and possible_types(x, self) == {"string"}
                and set(x) - ANNOTATIONS <= STRING_SUPERSET_KEYWORDS for x in pair):
            try:
                supersets = [string_superset_regex(x) for x in pair]
            except StringError:
                pass
            else:
                taken.setdefault(a, []).append(supersets[1])
                taken.setdefault(b, []).append(supersets[0])
                return
        self.unsupported("oneOf", f"{path}/oneOf", f"branches {index[a]} and {index[b]} may both match")

    def _not(self, schema: dict, path: str) -> dict | None:
        neg = self._deref(schema["not"], f"{path}/not")
        rest = {k: v for k, v in schema.items() if k != "not"}
        if neg is True or neg == {}:
            return None
        if neg is False:
            return rest
        if isinstance(neg, dict) and set(neg) <= {"type"} | ANNOTATIONS:
            banned = {neg["type"]} if isinstance(neg["type"], str) else set(neg["type"])
            if "number" in banned:
                banned.add("integer")
            allowed = [t for t in (_types(rest) or list(_TYPES)) if t not in banned]
            if "integer" in banned and "number" in allowed:
                self.unsupported("not", f"{path}/not", "not integer but number")
            return {**rest, "type": allowed}
        reason = None
        if isinstance(neg, dict) and set(neg) <= {"enum", "const", _FROM_IF} | ANNOTATIONS:
            values = neg.get("enum", []) + ([neg["const"]] if "const" in neg else [])
            if "enum" in rest or "const" in rest:
                return {**rest, "enum": [v for v in enum_values(rest)
                                         if json_key(v) not in {json_key(x) for x in values}]}
            excluded: dict[str, list] = {}
            for v in values:
                excluded.setdefault(json_type(v), []).append(v)
            try:
                # (grammar mode: strings under other keywords too, written minus the values' literals)
                parts = complement(_admitted_types(rest), excluded,
                                   plain_strings=self.opts.grammar or not set(rest) & set(TYPE_KEYWORDS["string"]))
            except ComplementError as exc:
                reason = exc.message
            else:
                return {**rest, "anyOf": parts} if parts else None
        if (self.opts.grammar and isinstance(neg, dict) and isinstance(neg.get("pattern"), str)
                and set(neg) <= {"pattern", "type"} | ANNOTATIONS and neg.get("type", "string") == "string"):
            # Any value but the strings matching a pattern: the strings are written minus a
            # superset of those (llguidance's ``& ~``, lazy only); other types are untouched.
            return {**rest, NOT_PATTERNS: [*rest.get(NOT_PATTERNS, []), neg["pattern"]]}
        if isinstance(neg, dict) and set(neg) <= {"required"} | ANNOTATIONS and len(neg["required"]) == 1:
            name = neg["required"][0]
            props = dict(rest.get("properties", {}))
            props[name] = False
            return {**rest, "properties": props}
        if isinstance(neg, dict) and _FROM_IF in neg:
            # The else case of an ``if`` the user wrote, not a ``not``: say so.
            origin = neg[_FROM_IF]
            self.unsupported("if", origin["path"], (
                f"keyword 'if' cannot be enforced exactly: its else case needs property "
                f"{origin['property']!r} to be any value but {json.dumps(origin['values'])}, "
                f"which has no exact regex: {reason}"))
            return rest
        self.unsupported("not", f"{path}/not", None if reason is None else
                         f"keyword 'not' cannot be enforced exactly ({reason})")
        return rest

    def _finite_values(self, schema: dict, path: str) -> list | None:
        """The values of an ``enum``/``const`` on ``schema`` or one of its ``allOf`` members."""
        if "enum" in schema or "const" in schema:
            return enum_values(schema)
        if "allOf" not in schema:
            return None
        members: list = []
        self._flatten_all_of(schema, path, members)
        for m in members:
            if isinstance(m, dict) and ("enum" in m or "const" in m):
                return enum_values(m)
        return None

    def _finite_values_deep(self, schema: object, path: str, depth: int = 0) -> list | None:
        """The values of a schema that admits finitely many (``enum``/``const``, also through
        ``$ref``, ``allOf`` members and ``anyOf``/``oneOf`` of finite branches), or None."""
        schema = self._deref(schema, path)
        if not isinstance(schema, dict) or depth > 8:
            return None
        found = self._finite_values(schema, path)
        if found is not None:
            return found
        for key in ("oneOf", "anyOf"):
            if isinstance(schema.get(key), list):
                parts = [self._finite_values_deep(b, path, depth + 1) for b in schema[key]]
                if all(p is not None for p in parts):
                    return [v for p in parts for v in p]
        return None

    def _enum(self, schema: dict, path: str, only_types, values: list | None = None) -> Rx:
        check = self.value_check(schema, values is None)
        values = enum_values(schema) if values is None else values
        if not values and "enum" in schema:
            raise GrammarError("enum is empty: no value can match", keyword="enum", path=path)
        out = []
        for v in values:
            if only_types is not None and json_type(v) not in only_types and not (
                    json_type(v) == "integer" and "number" in only_types):
                continue
            if check is not None and not self.value_valid(v, check):
                continue
            out.append(self._literal(v))
        return alt(out)

    def _literal(self, value: object) -> str:
        """An enum/const value as the grammar writes it: canonical JSON, with the whitespace mode's
        free runs between the tokens of objects and arrays (none in compact mode)."""
        from stencil.grammar import charset as cs
        if self.ws == "" or not isinstance(value, (dict, list)):
            return cs.literal(canonical_json(value))
        ws = self.ws
        if not value:
            return ("\\[" if isinstance(value, list) else "\\{") + ws + ("\\]" if isinstance(value, list) else "\\}")
        if isinstance(value, list):
            inner = (ws + "," + ws).join(self._literal(v) for v in value)
            return "\\[" + ws + inner + ws + "\\]"
        members = (ws + "," + ws).join(cs.literal(canonical_json(k)) + ws + ":" + ws + self._literal(v)
                                       for k, v in value.items())
        return "\\{" + ws + members + ws + "\\}"

    def _typed(self, schema: dict, path: str, only_types) -> Rx:
        types = _admitted_types(schema)
        if only_types is not None:
            types = [t for t in types if t in only_types or (t == "integer" and "number" in only_types)]
        if "number" in types and "integer" in types:
            types = [t for t in types if t != "integer"]
        parts = []
        for t in types:
            if t == "object":
                parts.append(compile_object(self, schema, path))
            elif t == "array":
                parts.append(compile_array(self, schema, path))
            elif t == "string":
                parts.append(self._string(schema, path))
            elif t in ("number", "integer"):
                parts.append(compile_number(self, schema, path, integer=(t == "integer")))
            elif t == "boolean":
                parts.append("(?:true|false)")
            elif t == "null":
                parts.append("null")
            else:
                raise GrammarError(f"unknown type {t!r}", keyword="type", path=path)
        return alt(parts)

    def _string(self, schema: dict, path: str) -> Rx:
        if NOT_STRINGS in schema:
            others = {k: v for k, v in schema.items() if k != NOT_STRINGS}
            if not set(others) & set(TYPE_KEYWORDS["string"]):
                return self.excluded_strings(schema[NOT_STRINGS])
            if not self.opts.grammar:  # (a plain regex has no complement of these strings)
                self.unsupported("not", f"{path}/not", "keyword 'not' cannot be enforced exactly (strings but "
                                 "some values, where a pattern, length or format keyword also applies)")
                return self._string(others, path)
            # The strings the other keywords admit, but these values (grammar mode: llguidance's
            # ``& ~``; a string has one encoding here, so its literal is every way to write it).
            from stencil.grammar import charset as cs

            literals = alt(['"' + cs.literal(cs.json_escape_text(v)) + '"' for v in schema[NOT_STRINGS]])
            return minus(self._string(others, path), literals)
        if NOT_PATTERNS in schema:
            out = self._string({k: v for k, v in schema.items() if k != NOT_PATTERNS}, path)
            for pattern in schema[NOT_PATTERNS]:
                try:
                    out = minus(out, pattern_superset_regex(pattern))
                except StringError as exc:
                    self.unsupported("not", f"{path}/not/pattern", f"keyword 'not' cannot be enforced "
                                     f"exactly ({exc.message})")
            return out
        fmt = schema.get("format") if isinstance(schema.get("format"), str) else None
        hi = schema.get("maxLength")
        lo = schema.get("minLength", 0)
        if isinstance(lo, int) and lo > MAX_MIN_LENGTH:
            # Each required character is an automaton state: 10^8 of them exhaust the compile
            # worker's memory (it died with SIGABRT) instead of giving an answer.
            raise GrammarError(f"minLength {lo} is more than the {MAX_MIN_LENGTH} characters a grammar "
                               "can require of one string", keyword="minLength", path=f"{path}/minLength")
        spec = StringSpec(schema.get("minLength", 0), hi, schema.get("pattern"), fmt,
                          self.opts.max_string_length, exact_chars=self.opts.grammar,
                          intersect=self.opts.grammar)
        if hi is not None and hi > self.opts.max_string_length and not schema.get("pattern") and not fmt:
            self.warnings.append(f"maxLength at {path}: strings are written with at most "
                                 f"{self.opts.max_string_length} characters (not {hi})")
        try:
            return string_regex(spec)
        except StringError as exc:
            if self.opts.strict:
                raise GrammarError(exc.message, keyword=exc.keyword, path=f"{path}/{exc.keyword}",
                                   position=exc.position) from None
            self.warnings.append(f"{exc.keyword} at {path}: {exc.message} (ignored)")
            return string_regex(StringSpec(spec.min_length, spec.max_length))


_DEPENDENCY_KEYWORDS = ("dependentRequired", "dependentSchemas", "dependencies")
# internal: on the ``not`` that ``_if_then_else`` writes, where the ``if`` stands and what it tests
_FROM_IF = "x-stencil-from-if"
@functools.lru_cache(maxsize=64)
def _separator_re(piece: str) -> re.Pattern:
    """``piece`` where no quantifier follows it."""
    return re.compile(re.escape(piece) + r"(?![*+?{])")


def _is_ref(rx: str) -> bool:
    return rx.startswith("\ue000") and rx.endswith("\ue001") and rx.count("\ue000") == 1


def _is_term(rx: str) -> bool:
    return rx.startswith("\ue002") and rx.endswith("\ue003") and rx.count("\ue002") == 1


def _types(schema: dict) -> list[str] | None:
    t = schema.get("type")
    if t is None:
        return None
    return [t] if isinstance(t, str) else list(t)


def _admitted_types(schema: dict) -> list[str]:
    """The types ``schema`` admits: its ``type``, else those its keywords talk about, else all."""
    types = _types(schema)
    if types is None:
        implied = [t for t, kws in TYPE_KEYWORDS.items() if any(k in schema for k in kws)]
        types = (implied + (["integer"] if "number" in implied else [])) or list(_TYPES)
    return types


_COUNTS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties",
           "minContains", "maxContains")
_NORMALIZED = frozenset(_COUNTS + ("exclusiveMinimum", "exclusiveMaximum"))


def _normalize(schema: dict, path: str | None = None) -> dict:
    """Rewrite draft-04 boolean ``exclusiveMinimum``/``exclusiveMaximum`` into the numeric form,
    and integral floats of the count keywords (``"maxLength": 2.0``, valid since draft 6) as ints.

    Raises:
        GrammarError: a count keyword that is no non-negative integer (``2.5``, ``-1``, ``true``:
            what the meta-schema refuses, which a schema from Python has not been checked
            against; over HTTP it is a 400 before this), naming it (and ``path``, where given).
    """
    if schema.keys().isdisjoint(_NORMALIZED):  # the common case, at C speed
        return schema
    out = schema
    for key in _COUNTS:
        if key not in out:
            continue
        v = out[key]
        if isinstance(v, float) and v.is_integer() and v >= 0:
            out = dict(out) if out is schema else out
            out[key] = int(v)
        elif isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise GrammarError(f"{key} must be a non-negative integer, got {v!r}", keyword=key, path=path)
    for ex, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        if isinstance(out.get(ex), bool):
            out = dict(out)
            flag = out.pop(ex)
            if flag and bound in out:
                out[ex] = out.pop(bound)
    return out


@dataclass(slots=True)
class SharedProofs:
    """What two translations of one document may share: content numbers and ``oneOf``
    disjointness proofs. The handover (``json_schema.handover``) tries its rewrite first and,
    refused, leaves its proofs to Stencil's own translation of the same document, which needs
    the same ones (a ``oneOf`` of 20 object branches is 190 proofs, each merging and comparing
    branches: 10-15 ms for the slowest MaskBench schemas, done twice before). A proof's answer
    depends on the contents of its branches and on the document their references resolve in,
    so they are shared only where every reference resolves by content alone: a document the
    handover found without identifiers below its root (``ids_below`` False; None: not looked)."""

    ids: ContentIds = field(default_factory=ContentIds)
    proofs: dict = field(default_factory=dict)
    ids_below: bool | None = None

    def for_compiler(self) -> dict:
        """``SchemaCompiler`` keyword arguments: the shared numbers and proofs, or none."""
        return {"ids": self.ids, "proofs": self.proofs} if self.ids_below is False else {}


def schema_to_program(schema: dict | bool, *, whitespace: str = "compact", strict: bool = True,
                      max_recursion_depth: int = 3, deadline: float | None = None,
                      grammar: bool = True, shared: SharedProofs | None = None,
                      extra_properties: bool = False, share_terminals: bool = False,
                      value_lexemes: bool = True) -> Program:
    """Compile a JSON Schema to the program a backend runs (see :func:`schema_to_regex`).

    With ``grammar`` (the default) a schema that refers to itself becomes a Lark grammar whose
    rules are the recursive definitions (``stencil.grammar.program``), exact at any depth; otherwise,
    and for every schema without recursion, a regex.

    ``shared``: proofs a failed handover of the same document made (``SharedProofs``).
    ``extra_properties``: as :func:`schema_to_regex` (an object that says nothing of
    ``additionalProperties`` takes undeclared keys with free-form values).
    ``share_terminals`` (without ``grammar``): :func:`schema_to_regex`'s language, its free-form
    values' pieces kept as terminals (``Program.regex()`` writes them out).
    ``value_lexemes`` (grammar mode): keys and values are terminals of their own, where the Lark
    writer cuts lexemes (``Program.value_terms``); where that is not exact for the schema
    (``program.cuttable``) it is compiled again without (as with ``False``: one lexeme a run
    between rule references, the whole document where there are none).

    Raises:
        GrammarError: as :func:`schema_to_regex`; GrammarTimeout past ``deadline``.
    """
    # Served programs (grammar mode) drop the subsets that only kept outlines-core's index small:
    # free-form values nest GRAMMAR_ANY_DEPTH deep, bounded strings take every character up to
    # their real maxLength (the lazy backend builds states on demand; an eager index that grows
    # too large times out in the background and the grammar stays lazy).
    opts = (SchemaOptions(whitespace, strict, max_recursion_depth, any_max_depth=GRAMMAR_ANY_DEPTH,
                          extra_properties=extra_properties, max_string_length=MAX_MIN_LENGTH,
                          deadline=deadline, grammar=True, value_lexemes=value_lexemes)
            if grammar else SchemaOptions(whitespace, strict, max_recursion_depth,
                                          extra_properties=extra_properties, deadline=deadline,
                                          share_terminals=share_terminals))
    state = {} if shared is None else shared.for_compiler()
    compiler, regex = _compile(schema, opts, **state)
    values = frozenset(compiler.value_terms)
    if values and not cuttable(values, compiler.terminals):
        compiler, regex = _compile(schema, replace(opts, value_lexemes=False), **state)
        values = frozenset()
    notes = tuple(compiler.warnings)
    if compiler.rules or has_refs(regex):
        trees: dict = {}
        if is_empty(regex, compiler.rules, trees):
            raise GrammarError("the schema admits no value (unsatisfiable): it refers to itself with "
                               "no way to end", keyword="$ref", path="#")
        forms = compiler.lark_forms
        return Program("lark", to_lark(regex, compiler.rules, compiler.terminals, trees, values, forms), notes,
                       tuple(compiler.terminals), regex, tuple(sorted(compiler.rules.items())), value_terms=values,
                       lark_forms=tuple(sorted(forms.items())))
    return Program("regex", regex, notes, tuple(compiler.terminals), value_terms=values,
                   lark_forms=tuple(sorted(compiler.lark_forms.items())))


def schema_to_regex(schema: dict | bool, *, whitespace: str = "compact", strict: bool = True,
                    max_recursion_depth: int = 3, any_max_depth: int = 1,
                    any_max_length: int | None = None,
                    extra_properties: bool = False,
                    max_string_length: int = 128,
                    deadline: float | None = None) -> tuple[str, list[str]]:
    """Compile a JSON Schema to a regex over serialized JSON documents.

    Args:
        schema: the schema (a dict or a boolean), any draft from 04 to 2020-12.
        whitespace: "compact" (no free whitespace) or "flexible" (around structural
            characters, up to 2 of space, tab, CR, LF, or one line break and an indent of up
            to 20 spaces or tabs: ``FLEXIBLE_WS``).
        strict: raise on keywords that cannot be enforced exactly (True), or ignore them and
            list them in the returned warnings (False).
        max_recursion_depth: how many times one ``$ref`` target may be entered on one path.
        any_max_depth: container nesting allowed inside ``{}``/``true`` values (default 1:
            scalars, or arrays/objects of scalars). Every free-form slot copies this automaton,
            and outlines-core's index grows with it: on MaskBench-dev, depth 1 instead of 2
            passes 20 more of the 272 largest schemas and 3 fewer of the 252 others that differ.
        any_max_length: most members per array/object inside ``{}`` values (None: unbounded).
        extra_properties: allow additional properties where ``additionalProperties`` is absent
            (default False: none).
        max_string_length: a ``maxLength`` above this is written as this many characters at
            most (a warning says so): each counted character is a few automaton states, and
            outlines-core's index build time grows with them (≈ 0.9 s for 256).
        deadline: ``time.monotonic()`` past which compilation stops (``None``: no limit).

    Returns:
        (regex, warnings): the regex is implicitly anchored at both ends.

    Raises:
        GrammarError: unsatisfiable schema, remote ``$ref``, or (strict) a keyword that cannot
            be enforced exactly; ``keyword`` and ``path`` (JSON pointer) name the culprit.
    """
    opts = SchemaOptions(whitespace, strict, max_recursion_depth, any_max_depth, any_max_length,
                         extra_properties, max_string_length, deadline=deadline)
    compiler, regex = _compile(schema, opts)
    return regex, compiler.warnings


def _compile(schema: dict | bool, opts: SchemaOptions, **state) -> tuple["SchemaCompiler", str]:
    """``state``: ``SchemaCompiler`` fields to start from (``SharedProofs.for_compiler``)."""
    if opts.whitespace not in ("compact", "flexible"):
        raise GrammarError(f"unknown whitespace mode {opts.whitespace!r}", keyword="whitespace")
    if schema is False:
        raise GrammarError("the schema `false` admits no value", keyword="false", path="#")
    try:
        compiler = SchemaCompiler(schema, opts, **state)
        regex = compiler.sub(schema, "#")
    except RecursionError:
        raise GrammarError("the schema nests or refers to itself too deeply", keyword="$ref",
                           path="#") from None
    except GrammarError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
        # A malformed schema (e.g. "minLength": "3") is the client's error, not a crash.
        raise GrammarError(f"invalid schema: {exc}", keyword="schema", path="#") from None
    if regex is None:
        raise GrammarError("the schema admits no value (unsatisfiable)", keyword=_culprit(schema),
                           path="#")
    return compiler, regex


def _culprit(schema: object) -> str:
    """The keyword to name for a root schema that admits no value: the first of the keywords that
    can empty a schema it holds ("schema" when it holds none of them)."""
    if isinstance(schema, dict):
        for k in ("enum", "const", "not", "minItems", "maxItems", "minimum", "maximum", "exclusiveMinimum",
                  "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "pattern", "required",
                  "minProperties", "maxProperties", "allOf", "anyOf", "oneOf", "$ref", "type"):
            if k in schema:
                return k
    return "schema"
