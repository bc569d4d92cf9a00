"""Schemas handed to llguidance's own JSON Schema front end, when it provably means what Stencil means.

``llguidance_schema(schema, whitespace)`` returns a schema for llguidance 1.9.1's JSON front end
(``parser/src/json``, built without Lark through its C API: ``stencil.grammar.backends.llg_c``) whose
language, as a set of byte strings, is exactly the one Stencil's own compiler writes for
``schema`` (grammar mode), or None when the argument below does not cover the schema. Nothing is
approximated: a schema is handed over whole or not at all, and then every backend that needs
Stencil's own text (the eager index, the closing automaton) translates the same spec and gets
the same language.

Why the languages are equal. The schema is rewritten keyword by keyword from a whitelist; every
other keyword Stencil acts on refuses the handover, every annotation and every keyword unknown to
both is dropped. For each whitelisted construct, Stencil's text (``compiler``, ``objects``,
``arrays``, ``strings``, ``numbers``) and llguidance's (``json/compiler.rs``, ``json/schema.rs``,
``json/numeric.rs``, derivre's ``JsonQuote``) are:

* **layout** -- llguidance puts its whitespace pattern, matched once, between any two lexemes
  (``SkipSpec::once``), none before the first or after the last; its lexemes are ``{ } [ ] , :``,
  keys, strings, numbers and literals, so the gaps are exactly Stencil's: after ``{``/``[``,
  before ``}``/``]``, around ``,`` and ``:``, one run in an empty ``{}`` (``SchemaCompiler.bracket``).
  The pattern handed over is Stencil's ``FLEXIBLE_WS`` (flexible) or none (compact,
  ``whitespace_flexible: false``); separators are the defaults ``,`` and ``:``.
* **strings** -- llguidance quotes ``(?s:.{m,n})`` (``.`` one Unicode scalar) with
  ``json_allowed_escapes`` ``nrbtf"\\`` (no ``u``): raw characters but ``"``, ``\\``, U+0000-U+001F
  and U+007F, or ``\\" \\\\ \\b \\f \\n \\r \\t``; one encoded character per decoded one, so the
  counts of ``minLength``/``maxLength`` agree. That is Stencil's alphabet (``charset.json_char``).
  A ``maxLength`` above ``MAX_MIN_LENGTH`` without ``pattern``/``format`` is handed over as that
  many characters, the most Stencil's compiler writes there (with a warning: ``capped``).
* **pattern**/**format** -- not the user's pattern (Python's ``re`` and Rust's regex differ on
  ``\\d``, ``\\w``, ``$``): Stencil's reading of it, the AST ``pattern.parse`` makes (atoms as
  sets of characters, a subset of Python's meaning), written as a Rust regex over the decoded
  string with explicit classes (``charset.class_regex``, no shorthand, which llguidance's
  ``regex_to_lark`` would rewrite; without the characters no string can spell, since
  llguidance quotes a class holding every control character with every escape, ``\\"`` and
  ``\\\\`` even where the class lacks them), each top-level alternative with ``(?s:.)*`` where it is not
  anchored and ``\\n?`` where Python's ``$`` admits a final newline, the whole anchored
  ``^(?:...)$``. llguidance searches a pattern (``SearchRegex``), and one anchored at both ends
  is searched as itself (derivre's ``mk_from_ast``); it quotes the decoded language as above, and
  intersects it with the lengths, as Stencil's ``strings._pattern_body`` does. A format is the
  same with Stencil's own pattern for it; a format together with a pattern is refused.
* **integers** -- both write the canonical decimals of the range (no leading zero, no ``+``);
  llguidance also writes ``-0`` where the range has no bound or has a negative lower and a
  non-negative upper bound, so a range that takes both signs is handed over as the union of its
  negative and non-negative parts (``-0`` in neither). Bounds follow the same ceiling/floor rules
  (``normalize_integer_bounds``); |bound| < 2^53 so llguidance's float arithmetic is exact.
* **numbers** -- unbounded, both regexes are ``-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?``;
  or with an integral ``minimum`` a >= 0 and maybe an integral ``maximum`` b > a (``_numbers``).
* **objects** -- ``properties`` in order, ``required`` (names among them), closed unless
  ``additionalProperties`` is a schema (Stencil's default closes an object that declares
  properties: handed over as ``false``). Both write the members in declared order, each optional
  one skippable (``ordered_sequence``; ``objects._declared_part``), then any number of extra
  members whose key is a string that is no declared name: llguidance takes the strings minus the
  declared names' literals, Stencil the strings whose decoded value is none of them; the same
  set, since a name without control characters has one encoding. Names have no control
  character and no U+007F (``serde_json`` and ``json.dumps`` write them alike).
* **arrays** -- ``prefixItems`` (or a draft-04 list of ``items`` with ``additionalItems``),
  ``items``, ``minItems``/``maxItems`` (at most ``MAX_REPEAT_COUNT``).
* **minProperties/maxProperties** -- only where every object Stencil writes satisfies them
  (dropped), or "at least one property" of a closed object without required ones
  (llguidance's own special case writes the same union).
* **enum/const** -- values of null, booleans, integers (|v| < 2^53), strings as above, and
  arrays/objects of such values, kept when they pass the schema's ``type`` (as Stencil's
  ``_enum`` keeps the values that validate); llguidance compiles each as a constant schema
  (``compile_const``): the same text as Stencil's ``_literal``, whitespace gaps included.
* **oneOf** as Stencil writes it (``_Writer.one_of``): a union of branches it proved disjoint,
  the same union llguidance's ``anyOf`` reads.
* **allOf** as Stencil compiles it: its members merged (``merge.merge``, references inlined)
  and the merged schema handed over by these same rules; **anyOf** as the union of its
  branches, each merged with the sibling keywords when there are any (``compiler._sub``).
* **patternProperties** of a closed object, with pairwise different literal prefixes or endings (what
  Stencil writes, ``objects._disjoint_patterns``) and matching no declared name: the key
  patterns as Stencil reads them (below, **pattern**); llguidance proves them disjoint itself
  or refuses (then Stencil's own translation serves the schema).
* **$ref** within the document (resolved as Stencil's ``refs.RefResolver`` does where it has
  identifiers below its root; recursion is a rule in both), its target as a definition; with
  asserting siblings (2019-09 on) merged with them, as Stencil's ``_ref`` does,
  **type** as a name or list (``integer`` under ``number`` adds nothing in either). A schema
  without ``type`` has the types its keywords imply (``compiler._admitted_types``), or all,
  written out.
* **free-form values** -- ``true``/``{}``, an object without declared properties, an array
  without ``items``: Stencil nests them at most ``GRAMMAR_ANY_DEPTH`` containers deep
  (``SchemaCompiler.any_value``), llguidance's own "any" has no limit, so they are handed over
  as that many definitions (``_Writer.any_value``): scalars, then arrays and objects (any key)
  of the level below.

Refused as well: an unsatisfiable part (an empty range or enum, ``false``: the two report it
differently), a ``$ref`` cycle without a finite instance, a draft-03 schema, and any schema with
an ``x-guidance`` or internal ``x-stencil-*`` key. The equality is checked by
``tests/grammar/test_grammar_handover.py`` (both grammars walked against each other, and the jsonschema
oracle over both) and holds for llguidance 1.9.1 only: ``llg_c.VERIFIED_VERSION``.
"""

from __future__ import annotations

import functools
import json
import re
from decimal import Decimal
from urllib.parse import unquote

import jsonschema
import msgspec
from jsonschema import validators

from stencil.grammar.base import MAX_REPEAT_COUNT, GrammarError
from stencil.grammar import charset as cs
from stencil.grammar.json_schema import pattern as sp
from stencil.grammar.json_schema.schema_compiler import (FLEXIBLE_WS, GRAMMAR_ANY_DEPTH, MAX_MIN_LENGTH, SchemaCompiler,
                                                 SchemaOptions, SharedProofs, _normalize)
from stencil.grammar.json_schema.formats import format_pattern
from stencil.grammar.json_schema.interning import ContentIds
from stencil.grammar.json_schema.keywords import ANNOTATIONS, ASCII_ESCAPE, ASSERTIONS, JSON_TYPES, TYPE_KEYWORDS
from stencil.grammar.json_schema.merge import MergeError, json_key, merge
from stencil.grammar.json_schema.numbers import bounds, integer_range
from stencil.grammar.json_schema.objects import _disjoint_patterns
from stencil.grammar.json_schema.oneof import (by_discriminator, disjoint, exclusive_required, promote_discriminators,
                                       without_empty_object, written_apart)
from stencil.grammar.json_schema.rx import alt, repeat, seq

MAX_EXACT_INT = 2 ** 53
MAX_DEPTH = 48  # schemas nested deeper are not handed over
# An object with more optional properties than this is not handed over: llguidance's parser
# holds items in proportion to them at every member (with string values, masks of 3-6 ms at
# 300-550 optional properties, and at 600 a step past its 50,000-item limit: the request failed
# mid-answer); Stencil's own translation writes such members as one lexeme (masks under 1 ms at
# 700, a compile of ~0.35 s). Not lower: MaskBench's eslintrc merges 258 optional rules whose
# values Stencil writes as a Lark grammar (first mask 80 ms, against 35 ms handed over).
MAX_OPTIONAL = 400
# Stencil acts on these (``compiler._ASSERTIONS`` and a few more); only the handled ones pass.
_HANDLED = {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
            "minLength", "maxLength", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum",
            "enum", "const", "anyOf", "$ref", "pattern", "format", "allOf", "patternProperties", "oneOf",
            "minProperties", "maxProperties", "prefixItems", "additionalItems"}
_TYPES = JSON_TYPES
# The keys of a leaf per scalar type (``_Writer.node`` writes it at once): annotations, "type",
# and a string's lengths (bounds and patterns, formats, enums take ``_node``'s way).
_LEAVES = {t: frozenset(ANNOTATIONS | {"type"} | ({"minLength", "maxLength"} if t == "string" else set()))
           for t in ("string", "number", "integer", "boolean", "null")}
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
ESCAPES = 'nrbtf\\"'  # llguidance's json_allowed_escapes: the named escapes, no \u


# what Stencil acts on and this module does not hand over (a schema using one is refused)
_UNHANDLED = frozenset(ASSERTIONS | {"$dynamicRef", "$recursiveRef", "$dynamicAnchor", "$recursiveAnchor",
                                     "dependentSchemas", "unevaluatedItems", "unevaluatedProperties",
                                     "propertyNames", "contentSchema"}) - _HANDLED


class _Refused(Exception):
    """The schema is outside the argument of the module docstring."""


def llguidance_schema(schema: object, whitespace: str, text: str | None = None,
                      capped: list | None = None, shared: SharedProofs | None = None,
                      open_objects: bool = False) -> dict | None:
    """The schema to hand llguidance's JSON front end for ``schema``, or None (see the module).

    Args:
        schema: the user's schema (not modified).
        whitespace: "compact" or "flexible" (Stencil's ``FLEXIBLE_WS`` between tokens).
        text: ``schema`` as JSON text, when the caller has it: a key it lacks as a substring
            is nowhere in the document, which saves a walk of it.
        capped: a list that gets ``"maxLength"`` appended when some string's ``maxLength`` is
            above ``MAX_MIN_LENGTH`` and was handed over as that many characters, as Stencil's
            compiler writes it; that compiler's warnings then belong with the grammar (it
            alone knows their paths).
        shared: where the rewrite's ``oneOf`` proofs go, for Stencil's own translation of the
            same document when the handover is refused (``SharedProofs``).
        open_objects: the request's ``additional_properties`` is "schema": an object without
            ``additionalProperties`` takes undeclared keys with any value (handed over as
            Stencil's free-form value, ``_Writer.any_value``), and ``oneOf`` is proved disjoint
            under that reading; with ``patternProperties`` such an object is not handed over.
    """

    if not isinstance(schema, dict) or whitespace not in ("compact", "flexible"):
        return None
    try:
        if "$schema" in schema and _draft3(schema["$schema"]):
            return None
        if text is not None and ASCII_ESCAPE.search(text) is None and '"x-guidance"' not in text \
                and '"x-stencil' not in text and _ID_KEY.search(text) is None:
            internal = ids = False  # (what ``_scan`` looks for is nowhere in the text)
        else:
            internal, ids = _scan(schema)
        if internal:
            return None
        if shared is not None:
            shared.ids_below = ids
        writer = _Writer(schema, ids, shared, open_objects)
        body, defs = writer.write()
        if writer.count >= SHARE_MIN_NODES:
            body, defs = share_repeats(body, defs)
    except (_Refused, RecursionError, TypeError, ValueError, KeyError, AttributeError):
        return None
    if writer.capped and capped is not None:
        capped.append("maxLength")
    options = {"json_allowed_escapes": ESCAPES}
    if whitespace == "flexible":
        options["whitespace_pattern"] = FLEXIBLE_WS
    else:
        options["whitespace_flexible"] = False
    out = {"x-guidance": options, **body}
    if defs:
        out["$defs"] = defs
    return out


@functools.lru_cache(maxsize=64)
def _draft3(uri: object) -> bool:
    """Whether ``$schema`` ``uri`` names draft 3 (``jsonschema``'s reading, kept per URI: its
    lookup normalizes the URI on every call). Raises TypeError for a ``$schema`` that is no
    URI (the caller refuses the handover)."""
    return validators.validator_for({"$schema": uri}, default=jsonschema.Draft202012Validator) \
        is jsonschema.Draft3Validator


# In a schema's JSON text without an escaped ASCII character (``ASCII_ESCAPE``), a key
# "x-guidance" or "x-stencil..." is spelled so, and an "$id", "id" or "$anchor" with a string
# value is the key, a colon and a quote (a property named "id" has a schema, an object, for its
# value): ``_scan``'s targets.
_ID_KEY = re.compile(r'"(?:\$id|id|\$anchor)"\s*:\s*"')


def _scan(root: dict) -> tuple[bool, bool]:
    """One walk of the document: (whether some object has a key llguidance reads, ``x-guidance``,
    or one of Stencil's internal ones, ``x-stencil-*``; whether something below the root has an
    ``$id``, ``id`` or ``$anchor`` string, a base URI of its own that changes what a reference
    inside it means: then references are resolved as the compiler resolves them)."""
    internal = ids = False
    stack: list = [(root, True)]
    while stack:
        node, top = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k[:2] == "x-" and (k == "x-guidance" or k.startswith("x-stencil")):
                    return True, ids
                if not top and k in ("$id", "id", "$anchor") and isinstance(v, str):
                    ids = True
                if isinstance(v, (dict, list)):
                    stack.append((v, False))
        elif isinstance(node, list):
            stack.extend((v, False) for v in node if isinstance(v, (dict, list)))
    return internal, ids


def _ids_below(root: dict) -> bool:
    """Whether something below the root has an identifier of its own (``_scan``)."""
    return _scan(root)[1]


class _Writer:
    """One rewrite: schemas in, llguidance schemas out; referenced definitions under ``$defs``."""

    def __init__(self, root: dict, ids: bool = False, shared: SharedProofs | None = None,
                 open_objects: bool = False):

        self.root = root
        self.ids = ids  # the document has identifiers below its root: the compiler's resolver
        self.known = _UNHANDLED
        self.annotations = ANNOTATIONS
        self.defs: dict[str, dict] = {}
        self.names: dict[int, str] = {}  # id(target) → its name in ``$defs``
        self.keep: list = []  # targets named (their ids must stay valid)
        self._compiler = None  # a SchemaCompiler of the root, for Stencil's own allOf merge
        self.shared = shared
        self.depth = 0  # nesting of ``node`` calls
        self.count = 0  # ``node`` calls: the size of the rewrite (``SHARE_MIN_NODES``)
        self.memo: dict[int, tuple] = {}  # id(schema) → (schema, its llguidance schema)
        self.capped = False  # a maxLength above MAX_MIN_LENGTH was written as Stencil writes it
        self.open_objects = open_objects  # (llguidance_schema's argument)

    def write(self) -> tuple[dict, dict]:
        body = self.node(self.root)
        _check_productive(body, self.defs)
        return body, self.defs

    # -- one schema ------------------------------------------------------------------------
    def node(self, s: object) -> dict:
        """The llguidance schema of ``s``, in the order of Stencil's ``SchemaCompiler._sub``:
        a reference, then finite values, ``allOf``, ``anyOf``, ``oneOf``, then the types.

        A leaf (one scalar type, with annotations, and a string's lengths) is written at once:
        what ``_node`` writes for it, without its checks for the keywords it lacks; most of a
        schema's nodes are leaves (``test_grammar_handover`` compares the two paths)."""
        self.count += 1
        if type(s) is dict:
            t = s.get("type")
            if type(t) is str:
                leaf = _LEAVES.get(t)
                if leaf is not None and s.keys() <= leaf:
                    return self.typed(_normalize(s), t)
        key = id(s) if isinstance(s, dict) else None
        if key is not None and key in self.memo:  # a schema object reached twice is written once
            return self.memo[key][1]
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:  # far from Python's recursion limit, which jsonschema
                raise _Refused("nesting")  # (inside value_valid) does not survive
            out = self._node(s)
        finally:
            self.depth -= 1
        if key is not None:
            self.memo[key] = (s, out)  # the object kept: its id stays its own
        return out

    def _node(self, s: object) -> dict:
        if s is True or s == {}:
            return self.any_value()
        if not isinstance(s, dict):
            raise _Refused("false or not a schema")

        if isinstance(s.get("$ref"), str):
            siblings = {k: v for k, v in s.items() if k != "$ref"}
            if any(k not in self.annotations and (k in _HANDLED or k in self.known) for k in siblings) \
                    and not self.compiler().old_draft:
                # asserted beside the reference (2019-09 on): as Stencil's _ref, both at once
                return self.node(self.merged({"allOf": [self.target(s), siblings]}))
            return {"$ref": self.ref(s)}
        s = _normalize(s)  # (internal keys were looked for in the whole document: _scan)
        if "enum" in s or "const" in s or "allOf" in s:
            finite = self.finite(s)
            if finite is not None:
                return finite
        if "allOf" in s:
            return self.node(self.merged(s))
        if "anyOf" in s:
            if not isinstance(s["anyOf"], list) or not s["anyOf"]:
                raise _Refused("anyOf")
            rest = {k: v for k, v in s.items() if k != "anyOf"}
            if any(k in _HANDLED or k in self.known for k in rest):  # each branch with the rest
                return {"anyOf": [self.node({"allOf": [rest, b]}) for b in s["anyOf"]]}
            return {"anyOf": [self.node(b) for b in s["anyOf"]]}
        if "oneOf" in s:
            return self.one_of(s)
        if not s.keys().isdisjoint(self.known):  # (at C speed: most schemas have none)
            for k in s:
                if k in self.known and k not in self.annotations:
                    raise _Refused(k)
        types = self.types(s)
        parts = [self.typed(s, t) for t in types]
        parts = [p for part in parts for p in (part["anyOf"] if len(part) == 1 and "anyOf" in part else [part])]
        return parts[0] if len(parts) == 1 else {"anyOf": parts}

    def compiler(self):
        """A ``SchemaCompiler`` of the root: Stencil's own helpers for ``allOf``, finite values
        and ``oneOf`` (made on first need: it indexes the document)."""

        if self._compiler is None:
            state = {} if self.shared is None else self.shared.for_compiler()
            self._compiler = SchemaCompiler(self.root, SchemaOptions(grammar=True, extra_properties=self.open_objects),
                                            **state)
        return self._compiler

    def finite(self, s: dict) -> dict | None:
        """Stencil's finite-value path (``_finite_values`` then ``_enum``): the values of an
        ``enum``/``const`` of ``s`` or of one of its ``allOf`` members, each kept when it
        validates against the whole of ``s``; None when there is no such keyword."""
        plain = set(s) - self.annotations <= {"enum", "const", "type"}
        if plain:
            return self.enum(s)  # the same values, kept by type alone (nothing else to check)
        c = self.compiler()
        values = c._finite_values(s, "#")
        if values is None:
            return None
        check = c.value_check(s, "enum" in s or "const" in s)  # (as Stencil's ``_enum`` checks them)
        kept, seen = [], set()
        for v in values:
            if not _plain_value(v):
                raise _Refused("enum value")
            if json_key(v) not in seen and (check is None or c.value_valid(v, check)):
                seen.add(json_key(v))
                kept.append(v)
        if not kept:
            raise _Refused("empty enum")
        return {"enum": kept}

    def one_of(self, s: dict) -> dict:
        """``oneOf`` as Stencil's ``_one_of`` writes it: bare ``required`` lists rewritten to
        exclusive branches (``oneof.exclusive_required``); else the branches merged with the
        sibling keywords, the values of finite branches kept where exactly one branch takes them,
        the other branches proved pairwise disjoint (``oneof.disjoint``, after its
        ``without_empty_object`` and ``promote_discriminators``) and written as a union. A branch
        that also holds finite values Stencil writes with ``not`` around them: refused."""

        if not isinstance(s["oneOf"], list) or not s["oneOf"]:
            raise _Refused("oneOf")
        rest = {k: v for k, v in s.items() if k != "oneOf"}
        rewritten = exclusive_required(s["oneOf"], ANNOTATIONS)
        if rewritten is not None:
            if not rewritten:
                raise _Refused("empty oneOf")
            return self.node({**rest, "anyOf": rewritten})
        c = self.compiler()
        branches = []
        for b in s["oneOf"]:
            flat: list = []
            c._flatten_all_of({"allOf": [rest, b]} if rest else b, "#", flat)
            merged: object = True
            try:
                for m in flat:
                    merged = merge(merged, m)
            except MergeError:
                raise _Refused("oneOf merge") from None
            branches.append(merged)
        self.keep.append(branches)
        finite = [c._finite_values_deep(b, "#") for b in branches]
        values, seen = [], set()
        for v in (v for f in finite if f is not None for v in f):
            if json_key(v) not in seen:
                seen.add(json_key(v))
                values.append(v)
        kept = [v for v in values if sum(c.value_valid(v, b) for b in branches) == 1]
        if any(not _plain_value(v) for v in kept):
            raise _Refused("enum value")
        if all(f is not None for f in finite):
            if not kept:
                raise _Refused("empty oneOf")
            return {"enum": kept}
        index = [i for i, f in enumerate(finite) if f is None]
        infinite = without_empty_object(c, [branches[i] for i in index])
        if not by_discriminator(c, infinite):  # as Stencil's _one_of
            schema_branches, infinite = infinite, promote_discriminators(c, infinite)
            for x in range(len(infinite)):
                for y in range(x + 1, len(infinite)):
                    if not written_apart(c, infinite, schema_branches, x, y):
                        raise _Refused("oneOf not disjoint")
        self.keep.append(infinite)
        parts = [{"enum": kept}] if kept else []
        for i, b in zip(index, infinite):
            if any(c.value_valid(v, b) for v in values):
                raise _Refused("oneOf branch minus values")
            raw = s["oneOf"][i]
            if b is branches[i] and isinstance(raw, dict) and isinstance(raw.get("$ref"), str):
                parts.append(self.node({"allOf": [rest, raw]}) if rest else self.node(raw))
            else:
                parts.append(self.node(b))
        return parts[0] if len(parts) == 1 else {"anyOf": parts}

    def merged(self, s: dict) -> object:
        """``allOf`` as Stencil compiles it: the members (references inlined, nested ``allOf``
        flattened: ``SchemaCompiler._flatten_all_of``) merged into one schema (``merge.merge``);
        a member with ``enum``/``const`` (Stencil's finite-value path) is refused."""

        members: list = []
        self.compiler()._flatten_all_of(s, "#", members)
        out: object = True
        for m in members:
            if isinstance(m, dict) and ("enum" in m or "const" in m):
                raise _Refused("allOf with enum")
            try:
                out = merge(out, m)
            except MergeError:
                raise _Refused("allOf") from None
        self.keep.append(out)
        return out

    def types(self, s: dict) -> list[str]:
        t = s.get("type")
        if isinstance(t, str):
            if t not in _TYPES:
                raise _Refused("type")
            return [t]
        if t is None:
            types = [k for k, kws in TYPE_KEYWORDS.items() if any(x in s for x in kws)] or list(_TYPES)
        else:
            types = t
            if not isinstance(types, list) or not types or any(x not in _TYPES for x in types):
                raise _Refused("type")
        if "number" in types:
            types = [x for x in types if x != "integer"]
        return list(dict.fromkeys(types))

    def typed(self, s: dict, t: str) -> dict:
        if t in ("null", "boolean"):
            return {"type": t}
        if t == "string":
            lo, hi = s.get("minLength", 0), s.get("maxLength")
            if (_count(lo) and isinstance(hi, int) and not isinstance(hi, bool) and hi > MAX_MIN_LENGTH
                    and "pattern" not in s and "format" not in s):
                # Stencil writes such a string with at most MAX_MIN_LENGTH characters (its
                # ``_string``, with a warning, which ``capped`` asks the caller to give)
                hi = max(MAX_MIN_LENGTH, lo)
                self.capped = True
            if not _count(lo) or (hi is not None and (not _count(hi) or hi < lo)):
                raise _Refused("string lengths")
            out = {"type": "string"}
            pattern = _string_pattern(s)
            if pattern is not None:
                out["pattern"] = pattern
            if lo:
                out["minLength"] = lo
            if hi is not None:
                out["maxLength"] = hi
            return out
        if t == "integer":
            return _integers(*_int_bounds(s))
        if t == "number":
            return _numbers(s)
        if t == "object":
            return self.obj(s)
        return self.array(s)

    def obj(self, s: dict) -> dict:
        props = s.get("properties", {})
        required = s.get("required", [])
        patterns = s.get("patternProperties")
        if not isinstance(props, dict) or not isinstance(required, list):
            raise _Refused("properties")
        if len(set(required)) != len(required) or any(not isinstance(r, str) for r in required):
            raise _Refused("required")
        addl = s.get("additionalProperties")
        if addl is None:  # Stencil's default: closed when anything is declared, else free-form
            addl_out: object = False if (props or patterns) and not self.open_objects else self.any_value()
        elif addl is False:
            addl_out = False
        else:
            addl_out = self.node(addl)
        out_props = {}
        if _NOT_PLAIN_KEY.search("".join(props)) is not None:  # (one search for all the names)
            raise _Refused("property name")
        req = set(required)
        for name, sub in props.items():
            if sub is False and name not in req:
                # a key that may not appear: neither writes it (llguidance skips an unsatisfiable
                # optional property and takes its name from the additional keys, as Stencil does)
                out_props[name] = False
                continue
            out_props[name] = self.node(sub)
        undeclared = [r for r in required if r not in props]
        if undeclared:
            # Stencil writes them after the declared ones with additionalProperties' schema
            # (any value where it is absent); llguidance writes required names so as well
            declared_addl = s.get("additionalProperties", True)
            if patterns or declared_addl is False:
                raise _Refused("required")
            for name in undeclared:
                if not _plain_text(name, keys=True):
                    raise _Refused("property name")
                out_props[name] = self.node(declared_addl)
        if len(out_props) - len(req) > MAX_OPTIONAL and \
                sum(1 for k, v in out_props.items() if v is not False and k not in req) > MAX_OPTIONAL:
            raise _Refused("optional properties")
        out = {"type": "object", "properties": out_props, "additionalProperties": addl_out}
        if patterns:
            out["patternProperties"] = self.patterns(patterns, list(props),
                                                     True if addl is None and self.open_objects else addl)
        if required:
            out["required"] = list(required)
        self.counts(s, out, sum(1 for v in out_props.values() if v is not False), len(required))
        return out

    @staticmethod
    def counts(s: dict, out: dict, members: int, n_req: int) -> None:
        """``minProperties``/``maxProperties`` where Stencil writes them (``compile_object``):
        satisfied by every object it writes (then nothing is handed over), or "at least one" of
        optional members of a closed object (llguidance's own special case of it)."""
        lo, hi = s.get("minProperties", 0), s.get("maxProperties")
        if not _count(lo) or (hi is not None and not _count(hi)):
            raise _Refused("minProperties")
        closed = out["additionalProperties"] is False and "patternProperties" not in out
        if hi is not None and (hi < n_req or not closed or hi < members):
            raise _Refused("maxProperties")
        if lo > max(n_req, 1) or lo > members:
            raise _Refused("minProperties")
        if lo >= 1 and n_req == 0:
            if not closed:
                raise _Refused("minProperties")
            out["minProperties"] = 1

    def patterns(self, patterns: object, declared: list[str], addl: object) -> dict:
        """``patternProperties`` where Stencil writes them (closed object, patterns with
        different literal prefixes or endings: ``objects._disjoint_patterns``) and no declared name matches
        a pattern (whose schema Stencil would merge into the name's); each key pattern as
        Stencil reads it (``_string_pattern``). llguidance takes the strings of the pattern
        minus the declared names it matches (none), as Stencil does."""
        import re


        if not isinstance(patterns, dict) or addl not in (None, False):
            raise _Refused("patternProperties")
        names = list(patterns)
        if any(not _disjoint_patterns(a, b) for i, a in enumerate(names) for b in names[i + 1:]):
            raise _Refused("patternProperties not disjoint")
        out = {}
        for p, sub in patterns.items():
            try:
                if any(re.search(p, n) for n in declared):
                    raise _Refused("patternProperties match a declared name")
            except re.error:
                raise _Refused("pattern") from None
            key = _string_pattern({"pattern": p})
            if key in out:
                raise _Refused("patternProperties")
            out[key] = self.node(sub)
        return out

    def array(self, s: dict) -> dict:
        """Arrays as Stencil lays them out (``arrays._layout``): ``prefixItems`` (or a draft-04
        list of ``items``) then the rest (``items``, or ``additionalItems`` after a list); written
        in the 2020-12 form."""
        items = s.get("items", True)
        if isinstance(s.get("prefixItems"), list):
            prefix, rest = s["prefixItems"], (True if items is None else items)
        elif isinstance(items, list):
            prefix, rest = items, s.get("additionalItems", True)
        else:
            prefix, rest = [], items
        if not isinstance(rest, dict) and rest not in (True, False):
            raise _Refused("items")
        lo, hi = s.get("minItems", 0), s.get("maxItems")
        if not _count(lo) or (hi is not None and (not _count(hi) or hi < lo)):
            raise _Refused("item counts")
        out: dict = {"type": "array"}
        if prefix:
            out["prefixItems"] = [self.node(x) for x in prefix]
        if rest is False:
            if lo > len(prefix):
                raise _Refused("item counts")
            out["items"] = False
        else:
            out["items"] = self.node(rest)
        if lo:
            out["minItems"] = lo
        if hi is not None:
            out["maxItems"] = hi
        return out

    def enum(self, s: dict) -> dict:
        values = list(s["enum"]) if "enum" in s else None
        if values is not None and not isinstance(s["enum"], list):
            raise _Refused("enum")
        if "const" in s:
            values = [s["const"]] if values is None or json_key(s["const"]) in {json_key(v) for v in values} else []
        types = self.types({"type": s["type"]}) if "type" in s else None
        kept, seen = [], set()
        for v in values:
            if not _plain_value(v):
                raise _Refused("enum value")
            if types is not None and not _has_type(v, types):
                continue
            if _key(v) not in seen:
                seen.add(_key(v))
                kept.append(v)
        if not kept:
            raise _Refused("empty enum")
        return {"enum": kept}

    def any_value(self) -> dict:
        """Stencil's free-form value (``SchemaCompiler.any_value``): scalars, and arrays and
        objects of such values nested at most ``GRAMMAR_ANY_DEPTH`` deep, as definitions."""

        name = f"any{GRAMMAR_ANY_DEPTH}"
        if name not in self.defs:
            scalars = [{"type": "null"}, {"type": "boolean"}, {"type": "number"}, {"type": "string"}]
            self.defs["any0"] = {"anyOf": scalars}
            for k in range(1, GRAMMAR_ANY_DEPTH + 1):
                inner = {"$ref": f"#/$defs/any{k - 1}"}
                self.defs[f"any{k}"] = {"anyOf": scalars + [{"type": "array", "items": inner},
                                                            {"type": "object", "additionalProperties": inner}]}
        return {"$ref": f"#/$defs/{name}"}

    def target(self, s: dict) -> object:
        """The schema ``s["$ref"]`` names: by JSON pointer into the document, or, where the
        document has identifiers below its root, as Stencil's resolver finds it."""
        ref = s["$ref"]
        if self.ids:

            c = self.compiler()
            try:
                return c.resolver.resolve(ref, c.resolver.base_of(s, c.resolver.root_base), "#").schema
            except GrammarError:
                raise _Refused("$ref") from None
        if not ref.startswith("#"):
            raise _Refused("$ref")
        target = self.root
        pointer = unquote(ref[1:])
        if pointer:
            if not pointer.startswith("/"):
                raise _Refused("anchor")
            for token in pointer[1:].split("/"):
                token = token.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and token in target:
                    target = target[token]
                elif isinstance(target, list) and token.isdigit() and int(token) < len(target):
                    target = target[int(token)]
                else:
                    raise _Refused("$ref target")
        return target

    def ref(self, s: dict) -> str:
        """The name in ``$defs`` of what ``s`` refers to (written once, recursion included)."""
        target = self.target(s)
        name = self.names.get(id(target))
        if name is None:
            name = self.names[id(target)] = f"h{len(self.names)}"
            self.keep.append(target)
            self.defs[name] = {}  # placeholder while the target is written (recursion)
            self.defs[name] = self.node(target)
        return f"#/$defs/{name}"


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_REPEAT_COUNT


def _dec(x: object) -> Decimal | None:
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        raise _Refused("bound")
    d = Decimal(repr(x)) if isinstance(x, float) else Decimal(x)
    if not d.is_finite() or abs(d) >= MAX_EXACT_INT:
        raise _Refused("bound")
    return d


def _int_bounds(s: dict) -> tuple[int | None, int | None]:
    """The integer range of ``s``'s bounds (after ``compiler._normalize``), as ``compile_number`` reads it."""
    if "multipleOf" in s:
        raise _Refused("multipleOf")
    ilo, ihi = integer_range(*bounds(s, _dec))  # (Stencil's own reading, bounds checked by ``_dec``)
    if ilo is not None and ihi is not None and ilo > ihi:
        raise _Refused("empty range")
    return ilo, ihi


def _string_pattern(s: dict) -> str | None:
    """The pattern to hand over for ``s``'s ``pattern`` or ``format`` (not both), or None for
    neither: Stencil's own reading of it (``pattern.parse``, each atom a set of characters; a
    format is Stencil's Python pattern for it, ``formats.format_pattern``), written as a Rust
    regex over the decoded string, anchored at both ends (``_decoded``)."""
    pattern, fmt = s.get("pattern"), s.get("format")
    if pattern is not None and fmt is not None:
        raise _Refused("pattern with format")
    if fmt is not None:

        if not isinstance(fmt, str):
            raise _Refused("format")
        try:
            text = format_pattern(fmt)
        except KeyError:
            raise _Refused("format") from None
        if text is None:  # a format Stencil does not check: any string
            return None
        pattern = "^(?:" + text + ")\\Z"
    if pattern is None:
        return None
    if not isinstance(pattern, str):
        raise _Refused("pattern")
    out = _pattern_text(pattern)
    if out is None:
        raise _Refused("pattern")
    return out


@functools.lru_cache(maxsize=1024)
def _pattern_text(pattern: str) -> str | None:
    """``_string_pattern``'s text for one pattern (None: refused); kept across requests, since
    the same formats and patterns come back in schema after schema."""

    try:
        parts = sp.branches(sp.parse(pattern))
        out = []
        for b in parts:
            body = _decoded(b.body)
            if body is None:
                continue
            out.append(("" if b.start else _ANY + "*") + body
                       + ("\\n?" if b.newline_ok else "" if b.end else _ANY + "*"))
    except (sp.PatternError, _Refused):
        return None
    if not out:
        return None  # the empty language: Stencil reports it
    return "^(?:" + "|".join(out) + ")$"


_ANY = "(?s:.)"  # one Unicode scalar value
_UNWRITTEN = ((0x00, 0x07), (0x0B, 0x0B), (0x0E, 0x1F), (0x7F, 0x7F))  # charset.json_char writes none


def _decoded(node) -> str | None:
    """Rust regex (Python ``re`` reads it alike) for an anchor-free pattern AST over decoded
    characters: the language ``pattern.emit`` writes over their JSON encodings (None: empty)."""

    if isinstance(node, sp.Atom):
        return _decoded_atom(node.chars)
    if isinstance(node, sp.Seq):
        return seq(*(_decoded(i) for i in node.items))
    if isinstance(node, sp.Alt):
        return alt([_decoded(b) for b in node.items])
    if isinstance(node, sp.Rep):
        return repeat(_decoded(node.item), node.lo, node.hi)
    raise _Refused("anchor inside the pattern")


@functools.lru_cache(maxsize=4096)
def _decoded_atom(chars: cs.CharSet) -> str | None:
    """``_decoded`` of one atom, a set of characters (kept per set, as ``cs.class_regex``)."""
    chars = cs.subtract(chars, ((0xD800, 0xDFFF),))
    if chars == _ANY_SCALAR:
        return _ANY
    # Without the characters no string can spell (controls without a named escape, U+007F):
    # the same language, and llguidance quotes a set holding every control with every
    # escape, ``\\"`` and ``\\\\`` included even where the set lacks those (derivre's
    # ``quote_all_ctrl``): ``[^\\\\]`` would take a backslash.
    return cs.class_regex(cs.subtract(chars, _UNWRITTEN))


_ANY_SCALAR = cs.subtract(cs.ANY_CHAR, ((0xD800, 0xDFFF),))


def _numbers(s: dict) -> dict:
    """Numbers: unbounded, or ``minimum`` a and optionally ``maximum`` b > a, both integral,
    inclusive, 0 <= a (then both write every exponent-free decimal of the range without a
    leading zero or a sign: ``rx_float_range`` with integral bounds splits into [a, b) with any
    fraction and b with zeros only, as ``numbers.number_range`` does; a negative or fractional
    bound, an exclusive one, or a == b, where the two differ on ``-0.0`` or trailing zeros,
    is refused)."""
    if not any(k in s for k in _BOUNDS):
        return {"type": "number"}
    if "multipleOf" in s or "exclusiveMinimum" in s or "exclusiveMaximum" in s:
        raise _Refused("number bounds")
    lo, hi = _dec(s.get("minimum")), _dec(s.get("maximum"))
    if lo is None or lo < 0 or lo != lo.to_integral_value() or (
            hi is not None and (hi <= lo or hi != hi.to_integral_value())):
        raise _Refused("number bounds")
    out = {"type": "number", "minimum": int(lo)}
    if hi is not None:
        out["maximum"] = int(hi)
    return out


def _integers(lo: int | None, hi: int | None) -> dict:
    """Integers in [lo, hi] as llguidance schemas without ``-0``: a range that takes both signs is
    the union of its negative and its non-negative part (module docstring)."""
    parts = []
    if hi is None or hi >= 0:
        part = {"type": "integer", "minimum": max(lo, 0) if lo is not None else 0}
        if hi is not None:
            part["maximum"] = hi
        parts.append(part)
    if lo is None or lo < 0:
        part = {"type": "integer", "maximum": min(hi, -1) if hi is not None else -1}
        if lo is not None:
            part["minimum"] = lo
        parts.append(part)
    return parts[0] if len(parts) == 1 else {"anyOf": parts}


_NOT_PLAIN = re.compile("[\x00-\x07\x0b\x0e-\x1f\x7f\ud800-\udfff]")
_NOT_PLAIN_KEY = re.compile("[\x00-\x1f\x7f\ud800-\udfff]")


def _plain_text(text: str, keys: bool = False) -> bool:
    """No character without a named escape among the controls, no U+007F (keys: no control at all)."""
    return (_NOT_PLAIN_KEY if keys else _NOT_PLAIN).search(text) is None


def _plain_value(v: object) -> bool:
    if v is None or isinstance(v, bool):
        return True
    if isinstance(v, int):
        return abs(v) < MAX_EXACT_INT
    if isinstance(v, str):
        return _plain_text(v)
    if isinstance(v, list):
        return all(_plain_value(x) for x in v)
    if isinstance(v, dict):
        return all(_plain_text(k, keys=True) and _plain_value(x) for k, x in v.items())
    return False  # floats: the two write them differently (repr vs Rust's shortest form)


def _key(v: object) -> object:
    """``merge.json_key`` for the values handed over (no floats): the cheap form for scalars."""
    if isinstance(v, (dict, list)):
        return json_key(v)
    return (type(v).__name__, v)


def _has_type(v: object, types: list[str]) -> bool:
    if v is None:
        return "null" in types
    if isinstance(v, bool):
        return "boolean" in types
    if isinstance(v, int):
        return "integer" in types or "number" in types
    if isinstance(v, str):
        return "string" in types
    return ("array" if isinstance(v, list) else "object") in types


def _check_productive(body: dict, defs: dict[str, dict]) -> None:
    """Refuse unless every definition (and the body) has a finite instance: the fixpoint of
    productive definitions (Hopcroft and Ullman 1979, §4.4), over the rewritten schemas.

    Without definitions there is nothing to check: no reference then, and the writer never puts
    ``false`` where an instance needs a value (a required property, an item below ``minItems``,
    a branch: it refuses those), so every schema it wrote has a finite instance."""
    if not defs:
        return
    done: set[str] = set()

    def finite(s: dict) -> bool:
        if s is False:
            return False
        if "$ref" in s:
            return s["$ref"].rsplit("/", 1)[1] in done
        if "anyOf" in s:
            return any(finite(b) for b in s["anyOf"])
        if s.get("type") == "object":
            return all(finite(s["properties"][r]) for r in s.get("required", []))
        if s.get("type") == "array":
            return not s.get("minItems") or finite(s["items"])
        return True

    changed = True
    while changed:
        changed = False
        for name, d in defs.items():
            if name not in done and finite(d):
                done.add(name)
                changed = True
    if len(done) != len(defs) or not finite(body):
        raise _Refused("no finite instance")


# Schemas whose rewrite visited this many sub-schemas (``_Writer.count``; about 200 schema
# objects written) get their repeated parts written once: below, the search for repeats cost
# more than it saved llguidance on MaskBench-dev (0.05-0.28 ms on average per bin of size),
# above it saved more (0.2-1.3 ms).
SHARE_MIN_NODES = 120
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs")
_SCHEMA_LISTS = ("anyOf", "prefixItems")
_SCHEMA_SLOTS = ("additionalProperties", "items")


def share_repeats(body: dict, defs: dict) -> tuple[dict, dict]:
    """``body`` and ``defs`` with every schema that occurs more than once (equal contents,
    ``interning.ContentIds``; a bare ``{"type": ...}`` or reference aside) written once, as a
    definition, and referred to: the same language, in fewer nodes for llguidance's JSON compiler,
    which compiles each inline schema anew but a definition once. On the largest MaskBench-dev
    schemas (Kubernetes, Github "ultra") that takes a quarter to a third off llguidance's build;
    on a median schema it saves less than it costs, hence ``SHARE_MIN_NODES``. New definitions
    are named ``s0``, ``s1``, ... (the writer's are ``h…`` and ``any…``). Linear in the size of
    the output. The inputs are not modified."""
    ids = ContentIds()
    count: dict[int, int] = {}

    def children(node: dict):
        for k, v in node.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                yield from v.values()
            elif k in _SCHEMA_LISTS and isinstance(v, list):
                yield from v
            elif k in _SCHEMA_SLOTS and isinstance(v, dict):
                yield v

    def visit(node: object) -> None:
        if not isinstance(node, dict) or "$ref" in node:
            return
        n = ids.of(node)
        count[n] = count.get(n, 0) + 1
        if count[n] == 1:  # a repeat's parts were counted with its first occurrence
            for c in children(node):
                visit(c)

    for c in children(body):
        visit(c)
    for d in defs.values():
        for c in children(d):
            visit(c)
    if all(v < 2 for v in count.values()):
        return body, defs
    names: dict[int, str] = {}
    shared: dict[str, dict] = {}

    def rewrite(node: object) -> object:
        if not isinstance(node, dict) or "$ref" in node:
            return node
        n = ids.of(node)
        if count.get(n, 0) < 2 or (len(node) == 1 and "type" in node):
            return rewrite_children(node)
        name = names.get(n)
        if name is None:
            name = names[n] = f"s{len(names)}"
            shared[name] = rewrite_children(node)
        return {"$ref": f"#/$defs/{name}"}

    def rewrite_children(node: dict) -> dict:
        out = {}
        for k, v in node.items():
            if k in _SCHEMA_MAPS and isinstance(v, dict):
                out[k] = {kk: rewrite(vv) for kk, vv in v.items()}
            elif k in _SCHEMA_LISTS and isinstance(v, list):
                out[k] = [rewrite(vv) for vv in v]
            elif k in _SCHEMA_SLOTS and isinstance(v, dict):
                out[k] = rewrite(v)
            else:
                out[k] = v
        return out

    new_body = rewrite_children(body)
    new_defs = {name: rewrite_children(d) for name, d in defs.items()}
    new_defs.update(shared)
    return new_body, new_defs


_ENCODER = msgspec.json.Encoder()


def dumps(schema: dict) -> str:
    """The handed-over schema as the text llguidance reads (key order kept: it is meaningful):
    ``json.dumps(schema, ensure_ascii=False, separators=(",", ":"))`` byte for byte (a float,
    which no handed-over schema holds, may be spelled otherwise), written by msgspec in a third
    of the time; a value msgspec cannot write goes to ``json``."""
    try:
        return _ENCODER.encode(schema).decode()
    except (TypeError, OverflowError, msgspec.EncodeError):
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
