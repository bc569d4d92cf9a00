"""Checks at both ends of a constrained request: the schema coming in, the output going out.

Coming in, a JSON Schema is checked against its meta-schema (the draft named by ``$schema``,
default 2020-12), against size and nesting limits, and for ``$ref`` values that would point
outside the document (never fetched: remote references are refused).

Going out, the generated text is parsed and validated with ``jsonschema`` — an oracle apart
from the grammar that shaped it. Validators are built once per schema and reused, since
building one costs milliseconds and running one tens of microseconds (FACTS.md).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import regex
from jsonschema.validators import validator_for
from referencing import Registry

from stencil.grammar.base import GrammarSpec
from stencil.grammar.json_schema.keywords import close_type
from stencil.service.errors import InputError


def _pointer(parts) -> str:
    """JSON pointer (``#/a/0/b``) of a path given as keys and indices (RFC 6901 escaping)."""
    out = "#"
    for p in parts:
        out += "/" + str(p).replace("~", "~0").replace("/", "~1")
    return out


class SchemaChecks:
    """``check_schema`` with a memory: the canonical texts of schemas that passed (an LRU of
    ``capacity``, per app, thread-safe).

    Checking a schema against its meta-schema costs 1-3 ms for a small one and hundreds of ms
    for a 40 kB one (jsonschema, pure Python), and a busy server sees the same few schemas over
    and over: a repeat costs one ``json.dumps`` here. ``known`` tells a caller on the event loop
    whether a check would be cheap, so it can send the others to a worker thread.
    """

    def __init__(self, capacity: int = 1024):
        import threading

        self.capacity = capacity
        self._ok: OrderedDict[tuple[str, int, int], None] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _key(schema: Any, max_bytes: int, max_depth: int) -> tuple[str, int, int] | None:
        try:
            return json.dumps(schema, separators=(",", ":"), sort_keys=True), max_bytes, max_depth
        except (TypeError, ValueError):
            return None

    def known(self, schema: Any, *, max_bytes: int, max_depth: int) -> bool:
        """Whether ``schema`` passed before under these limits."""
        key = self._key(schema, max_bytes, max_depth)
        with self._lock:
            return key is not None and key in self._ok

    def check(self, schema: Any, *, max_bytes: int, max_depth: int) -> None:
        """``check_schema``, skipped for a schema that passed before (same errors otherwise)."""
        key = self._key(schema, max_bytes, max_depth)
        with self._lock:
            if key is not None and key in self._ok:
                self._ok.move_to_end(key)
                return
        check_schema(schema, max_bytes=max_bytes, max_depth=max_depth)
        if key is not None:
            with self._lock:
                self._ok[key] = None
                if len(self._ok) > self.capacity:
                    self._ok.popitem(last=False)


def check_schema(schema: Any, *, max_bytes: int, max_depth: int) -> None:
    """Refuse a JSON Schema the service must not compile.

    Args:
        schema: the decoded ``response_schema`` (a dict or a bool).
        max_bytes: largest compact JSON encoding allowed (bytes).
        max_depth: deepest nesting of objects/arrays allowed.

    Raises:
        InputError: (field ``response_schema``) not an object or bool, too large, too deep, a
            ``$ref`` that is not local (``#...``), or invalid under its meta-schema — the
            message names the keyword and the JSON pointer of the offending part.
    """
    if not isinstance(schema, (dict, bool)):
        raise InputError(f"response_schema must be a JSON object or boolean, got {type(schema).__name__}",
                         field="response_schema", lead=True)
    size = len(json.dumps(schema, separators=(",", ":")).encode())
    if size > max_bytes:
        raise InputError(f"response_schema is {size} bytes; the limit is {max_bytes}", field="response_schema",
                         lead=True)
    # Iterative walk: a recursive one would let a deep schema exhaust the Python stack.
    stack: list[tuple[Any, tuple, int]] = [(schema, (), 0)]
    while stack:
        node, path, depth = stack.pop()
        if depth > max_depth:
            raise InputError(f"response_schema nests deeper than {max_depth} levels of JSON (each object or array "
                             "counts: a property's schema is two below its object's, under 'properties')",
                             field="response_schema", path=_pointer(path), lead=True)
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                raise InputError(f"$ref {ref!r} points outside the schema; only local references (#...) "
                                 "are allowed and nothing is ever fetched",
                                 field="response_schema", keyword="$ref", path=_pointer(path))
            stack.extend((v, path + (k,), depth + 1) for k, v in node.items())
        elif isinstance(node, list):
            stack.extend((v, path + (i,), depth + 1) for i, v in enumerate(node))
    if isinstance(schema, bool):
        return
    draft = schema.get("$schema")
    if draft is not None and not isinstance(draft, str):
        raise InputError("$schema must be a string URI", field="response_schema", keyword="$schema",
                         path="#/$schema")
    cls = validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        cls.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = _pointer(e.path)
        raise InputError(f"invalid JSON Schema at {where}: {e.message}{_type_hint(e)}", field="response_schema",
                         keyword=str(e.path[-1]) if e.path else e.validator, path=where) from None


def _type_hint(e: "jsonschema.SchemaError") -> str:
    """"; did you mean 'object'?" where a ``type`` names no JSON type but is close to one (a typo
    such as "objekt" or "String": ``stencil.grammar.json_schema.keywords.close_type``), else ""."""
    at_type = bool(e.path) and (e.path[-1] == "type" or (len(e.path) > 1 and e.path[-2] == "type"))
    if not at_type:
        return ""
    values = e.instance if isinstance(e.instance, list) else [e.instance]
    for v in values:
        close = close_type(v) if isinstance(v, str) else None
        if close:
            return f"; did you mean {close!r} for {v!r}?"
    return ""


def _noting_repeats(pairs: list[tuple[str, object]], repeated: list[str]) -> dict:
    """``json.loads``' ``object_pairs_hook``: the object (the last value of a repeated key, as
    ``json.loads`` itself keeps), each repeated key noted in ``repeated`` once."""
    out: dict = {}
    for k, v in pairs:
        if k in out and k not in repeated:
            repeated.append(k)
        out[k] = v
    return out


@dataclass(slots=True)
class CheckedOutput:
    """The verdict on one finished output.

    Attributes:
        output: the parsed JSON value (JSON schema), the chosen string (choice), else ``None``
            (``None`` too for a text cut at ``max_tokens`` that is not valid).
        valid: the request's constraint admits the text, whatever stopped it.
        warnings: why it is not valid, or why a valid text may be short, in words.
        truncated_value: valid, but generation stopped at ``max_tokens`` (or the model's
            context) where the constraint still allowed more: the last value (a run of digits,
            an optional part of a regex, free text) may be shorter than the model would have
            written.
    """

    output: Any
    valid: bool
    warnings: list[str] = field(default_factory=list)
    truncated_value: bool = False


class OutputChecker:
    """Validates finished outputs against their ``GrammarSpec`` with cached validators.

    One per app (not a global): an LRU of ``capacity`` jsonschema validators and compiled
    Python regexes, keyed by the spec's canonical text. A regex check gives up after
    ``regex_timeout_s`` seconds (the output is then reported not valid, with a warning).
    """

    def __init__(self, capacity: int = 256, regex_timeout_s: float = 0.05):
        self.capacity = capacity
        self.regex_timeout_s = regex_timeout_s
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._empty_registry = Registry()  # no retrieval callback: remote $refs are never fetched

    def _cached(self, key: tuple[str, str], build):
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        value = build()
        self._cache[key] = value
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return value

    def validator(self, schema_text: str):
        """The jsonschema validator (with format checking) of a canonical schema text."""
        def build():
            schema = json.loads(schema_text)
            cls = validator_for(schema, default=jsonschema.Draft202012Validator)
            return cls(schema, format_checker=cls.FORMAT_CHECKER, registry=self._empty_registry)
        return self._cached(("json", schema_text), build)

    def _regex(self, pattern: str):
        # ``regex`` (the ``re``-compatible module transformers already needs) rather than ``re``:
        # its matches take a timeout. A backtracking match of a text that does not match, e.g. an
        # output cut by a stop string against ``(x+x+)+y``, can take exponential time and would
        # stall the event loop.
        def build():
            try:
                return regex.compile(pattern)
            except (regex.error, ValueError, OverflowError):
                return False  # a dialect difference; the grammar already enforced the pattern
        return self._cached(("regex", pattern), build)

    def check(self, spec: GrammarSpec | None, text: str, finish_reason: str | None,
              token_ids: list[int] | None = None, compiled=None) -> CheckedOutput:
        """Parse and validate ``text`` against ``spec``.

        ``valid`` says whether the constraint admits the text, whatever stopped it; the
        ``finish_reason`` says what stopped it. A text stopped at ``"length"`` that the
        constraint admits is valid with its ``output`` and ``truncated_value``; one it does not
        admit (a document cut in the middle) is not valid, ``output`` ``None``. Any other reason
        than ``"stop"`` and ``"length"`` is not valid. A Lark grammar has no second
        implementation to check against here: its output's tokens (``token_ids``) are replayed
        through a fresh matcher of ``compiled``.
        """
        if finish_reason not in ("stop", "length"):
            return CheckedOutput(None, False, [f"generation ended with finish_reason {finish_reason!r}"])
        verdict = self._verdict(spec, text, token_ids, compiled)
        if finish_reason == "length":
            if verdict.valid:
                verdict.truncated_value = True
                verdict.warnings.append(
                    "max_tokens was reached: the text may be cut short (there is no constraint to say otherwise)"
                    if spec is None else "max_tokens was reached where the constraint allowed more: the text is "
                                         "complete under it, but its last value may be cut short")
            else:
                verdict.output = None
                verdict.warnings.insert(0, "output was cut at max_tokens before it was complete")
        return verdict

    def _verdict(self, spec: GrammarSpec | None, text: str, token_ids: list[int] | None,
                 compiled) -> CheckedOutput:
        if spec is None:
            return CheckedOutput(None, True)
        if spec.kind == "json_schema":
            repeated: list[str] = []
            try:
                value = json.loads(text, object_pairs_hook=lambda pairs: _noting_repeats(pairs, repeated))
            except ValueError as e:
                return CheckedOutput(None, False, [f"output is not valid JSON: {e}"])
            errors = sorted(self.validator(spec.value).iter_errors(value), key=lambda e: list(e.path))
            notes = [f"output repeats the key {k!r} in one object: JSON parsers keep its last value, which is "
                     f"what was checked (a grammar cannot forbid repeats among keys no declaration names: "
                     f"additionalProperties, patternProperties, open objects)" for k in repeated[:3]]
            if errors:
                return CheckedOutput(value, False, [f"output fails the schema at {_pointer(e.path)}: {e.message}"
                                                    for e in errors[:5]] + notes)
            return CheckedOutput(value, True, notes)
        if spec.kind == "regex":
            rx = self._regex(spec.value)
            try:
                if rx is False or rx.fullmatch(text, timeout=self.regex_timeout_s):
                    return CheckedOutput(None, True)
            except TimeoutError:
                return CheckedOutput(None, False, [f"output could not be checked against the regex within "
                                                   f"{self.regex_timeout_s:g} s"])
            return CheckedOutput(None, False, ["output does not fully match the regex"])
        if spec.kind == "lark":
            if compiled is None or token_ids is None:
                return CheckedOutput(None, True)
            m = compiled.matcher()
            if m.accept_tokens(list(token_ids)) and (m.is_terminated() or m.is_accepting()):
                return CheckedOutput(None, True)
            return CheckedOutput(None, False, ["output is not in the grammar's language"])
        choices = json.loads(spec.value)
        if text in choices:
            return CheckedOutput(text, True)
        return CheckedOutput(None, False, ["output is not one of the choices"])
