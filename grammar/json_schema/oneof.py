"""Sufficient tests that two schemas admit no common instance (for exact ``oneOf``).

``oneOf`` equals ``anyOf`` exactly when its branches are pairwise disjoint (2020-12 §10.2.1.3).
We prove disjointness by: disjoint type sets (through ``$ref``, ``allOf``, ``anyOf`` and
``oneOf``); finite value sets (``enum``/``const``) of one branch that the other rejects (checked
with ``jsonschema``); a property required by both whose subschemas are disjoint (a
discriminator), or required by one and forbidden by the other; or objects that write only keys
the other branch forbids (closed objects with different keys), when the empty object is not
common to both. ``without_empty_object`` removes that last overlap where it is the only one.
An ``allOf`` is merged first, so a discriminator written as ``{"allOf": [{"type": "string"},
{"enum": [...]}]}`` (what merging a branch into its parent gives) still counts. When no proof is
found the caller fails closed.

``exclusive_required`` handles the other common shape, ``oneOf`` of bare ``required`` lists
("exactly one of these keys"), by rewriting it into branches that exclude each other.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

from stencil.grammar.json_schema.keywords import ANNOTATIONS, enum_values, json_type

if TYPE_CHECKING:
    from stencil.grammar.json_schema.schema_compiler import SchemaCompiler

_ALL = {"object", "array", "string", "number", "integer", "boolean", "null"}
_IMPLIED = {
    "object": ("properties", "required", "additionalProperties", "patternProperties",
               "minProperties", "maxProperties", "propertyNames"),
    "array": ("items", "prefixItems", "minItems", "maxItems", "contains", "additionalItems"),
    "string": ("minLength", "maxLength", "pattern", "format"),
}


_MAX_DEPTH = 6  # how deep the tests below look through $ref and combinators


def _branches(c: "SchemaCompiler | None", s: dict, key: str) -> list:
    """The members of ``s[key]`` (a list keyword), each with its top-level ``$ref`` inlined."""
    members = s.get(key)
    if not isinstance(members, list):
        return []
    return [c._deref(m, "#") if c is not None else m for m in members]


def possible_types(s: object, c: "SchemaCompiler | None" = None, depth: int = 0) -> set[str]:
    """Types an instance of ``s`` may have, by its ``type`` keyword (all when absent); with the
    compiler ``c``, also through ``$ref`` and the branches of ``allOf``/``anyOf``/``oneOf``."""
    if c is not None:
        s = c._deref(s, "#")
    if not isinstance(s, dict):
        return set() if s is False else set(_ALL)
    if "enum" in s or "const" in s:
        out = {json_type(v) for v in enum_values(s)}
        return out | ({"number"} if "integer" in out else set())
    t = s.get("type")
    out = set(_ALL) if t is None else ({t} if isinstance(t, str) else set(t))
    if c is not None and depth < _MAX_DEPTH:
        for m in _branches(c, s, "allOf"):
            out &= possible_types(m, c, depth + 1)
        for key in ("anyOf", "oneOf"):
            members = _branches(c, s, key)
            if members:
                out &= set().union(*(possible_types(m, c, depth + 1) for m in members))
    if "integer" in out:
        out.add("number")
    if "number" in out:
        out.add("integer")
    return out


def _forbids(s: object, name: str, c: "SchemaCompiler | None" = None, depth: int = 0) -> bool:
    """Whether no object that validates against ``s`` has key ``name`` (sufficient test)."""
    if c is not None:
        s = c._deref(s, "#")
    if s is False:
        return True
    if not isinstance(s, dict):
        return False
    props = s.get("properties", {}) if isinstance(s.get("properties"), dict) else {}
    if name in props:
        if props[name] is False:
            return True
    elif s.get("additionalProperties", True) is False and not s.get("patternProperties"):
        return True
    if c is None or depth >= _MAX_DEPTH:
        return False
    if any(_forbids(m, name, c, depth + 1) for m in _branches(c, s, "allOf")):
        return True
    for key in ("anyOf", "oneOf"):
        members = _branches(c, s, key)
        if members and all(_forbids(m, name, c, depth + 1) for m in members):
            return True
    return False


def generated_types(s: object, c: "SchemaCompiler | None" = None) -> set[str]:
    """Types of the instances the grammar writes for ``s`` (keywords imply a missing ``type``)."""
    if isinstance(s, dict) and "type" not in s and "enum" not in s and "const" not in s:
        implied = {t for t, kws in _IMPLIED.items() if any(k in s for k in kws)}
        if implied:
            return implied
    return possible_types(s, c)


_SIMPLE_OBJECT = {"type", "properties", "required", "additionalProperties", "minProperties",
                  "maxProperties", "propertyNames"}


def _written_keys(c: "SchemaCompiler", s: dict) -> list[str] | None:
    """The keys the grammar may write in an object of ``s`` when they are all declared, else
    None: ``additionalProperties: false`` (every written instance validates, so has no other
    key), or an object of plain keywords whose ``additionalProperties`` is absent (the grammar
    then writes no undeclared key, see ``stencil.grammar.json_schema``)."""
    if s.get("patternProperties"):
        return None
    props = s.get("properties", {})
    if not isinstance(props, dict):
        return None
    addl = s.get("additionalProperties")
    if addl is False or (addl is None and props and not c.opts.extra_properties
                         and set(s) - ANNOTATIONS <= _SIMPLE_OBJECT):
        return [n for n, v in props.items() if v is not False]
    return None


def _never_empty(s: dict) -> bool:
    """Whether every object of ``s`` has a key (a required one, or ``minProperties``)."""
    req = s.get("required")
    return bool(isinstance(req, list) and req) or (s.get("minProperties") or 0) >= 1


def _one_way(c: "SchemaCompiler", a: dict, b: dict, depth: int) -> bool:
    """True only if no instance the grammar writes for ``a`` validates against ``b``."""
    ta = generated_types(a, c)
    if not ta & possible_types(b, c):
        return True
    values = c._finite_values(a, "#")
    if values is not None and not any(c.value_valid(v, b) for v in values):
        return True
    if depth < _MAX_DEPTH:
        # An instance of a union is one of a branch; one of ``b`` validates a branch of ``b``.
        for side in ("a", "b"):
            s = a if side == "a" else b
            for key in ("anyOf", "oneOf"):
                members = _branches(c, s, key)
                if not members:
                    continue
                rest = {k: v for k, v in s.items() if k != key}
                parts = [_merged(c, {"allOf": [rest, m]}) if rest else m for m in members]
                if all(p is False or (isinstance(p, dict) and (
                        _one_way(c, p, b, depth + 1) if side == "a" else _one_way(c, a, p, depth + 1)))
                       for p in parts):
                    return True
    if ta <= {"object"}:
        pa, pb = a.get("properties", {}), b.get("properties", {})
        ra, rb = set(a.get("required", [])), set(b.get("required", []))
        for name in ra | rb:
            # One side requires ``name`` and both declare it with disjoint values: an instance of
            # one either lacks it (failing the side that requires it) or has a value the other
            # side rejects.
            if name in pa and name in pb and disjoint(c, pa[name], pb[name], depth + 1):
                return True
        if any(_forbids(b, n, c) for n in ra) or any(_never_writes(c, a, n) for n in rb):
            return True
        keys = _written_keys(c, a)
        if keys is not None and all(_forbids(b, n, c) for n in keys):
            # Every key ``a`` writes is one ``b`` forbids: only the empty object can be common.
            if _never_empty(a) or not c.value_valid({}, b):
                return True
    return False


def _never_writes(c: "SchemaCompiler", s: dict, name: str) -> bool:
    """Whether the grammar never writes key ``name`` in an object of ``s``: forbidden, or an
    undeclared key where the grammar writes no additional properties (``additionalProperties``
    false, or absent on an object that declares properties: see ``stencil.grammar.json_schema``)."""
    if _forbids(s, name):
        return True
    if name in s.get("properties", {}) or s.get("patternProperties"):
        return False
    addl = s.get("additionalProperties")
    return addl is False or (addl is None and bool(s.get("properties")) and not c.opts.extra_properties)


def promote_discriminators(c: "SchemaCompiler", branches: list) -> list:
    """Branches in which a property that tells them apart is made required.

    When two object branches declare the same property with disjoint subschemas (a
    discriminator such as ``"kind": {"const": "text"}``) but do not require it, an object
    without it matches both and ``oneOf`` could not be written exactly. Writing the
    discriminator always makes the branches' written instances disjoint; the grammar then admits
    a subset of the schema (instances without the discriminator are not written), like the
    other documented restrictions of ``stencil.grammar.json_schema``.
    """
    out = list(branches)  # a branch is copied only when it changes (callers compare identity)
    for i in range(len(out)):
        for j in range(i + 1, len(out)):
            # The schema's own branches: an object without the discriminator matches those, not
            # the promoted ones (once one branch requires it, it no longer overlaps a third one
            # that does not, which must require it all the same).
            a, b = branches[i], branches[j]
            if not isinstance(a, dict) or not isinstance(b, dict) or disjoint(c, a, b):
                continue
            pa, pb = a.get("properties", {}), b.get("properties", {})
            for name in pa:
                if name in pb and disjoint(c, pa[name], pb[name]):
                    for k in (i, j):
                        req = list(out[k].get("required", []))
                        if name not in req:
                            out[k] = {**out[k], "required": req + [name]}
                    break
    return out


def written_apart(c: "SchemaCompiler", written: list, branches: list, a: int, b: int) -> bool:
    """Whether no instance written for branch ``a`` validates branch ``b`` and the other way
    round, where ``written`` are the branches as the grammar writes them
    (``promote_discriminators`` of ``branches``): a written instance must match its own branch
    alone among the schema's, not only among the written ones."""
    if written[a] is branches[a] and written[b] is branches[b]:
        return disjoint(c, branches[a], branches[b])
    return disjoint(c, written[a], branches[b]) and disjoint(c, branches[a], written[b])


def by_discriminator(c: "SchemaCompiler", branches: list) -> bool:
    """True only if every branch admits objects only and requires one property whose values are
    a finite set, disjoint from every other branch's: then no instance matches two branches
    (it would have two values for the property). One pass over the branches, where the pairwise
    ``disjoint`` takes n^2 proofs (Azure pipeline schemas: 30 activity types under one ``oneOf``);
    when it holds, ``promote_discriminators`` would change nothing either (every pair is disjoint)."""
    from stencil.grammar.json_schema.merge import json_key

    if len(branches) < 2 or not all(isinstance(b, dict) for b in branches):
        return False
    if any(not possible_types(b, c) <= {"object"} for b in branches):
        return False
    common = set(branches[0].get("required") or ())
    for b in branches[1:]:
        common &= set(b.get("required") or ())
    for name in sorted(common, key=str):
        seen: set[str] = set()
        for b in branches:
            prop = (b.get("properties") or {}).get(name)
            values = c._finite_values_deep(prop, "#") if isinstance(prop, dict) else None
            keys = None if values is None else {json_key(v) for v in values}
            if keys is None or keys & seen:
                break
            seen |= keys
        else:
            return True
    return False


def without_empty_object(c: "SchemaCompiler", branches: list) -> list:
    """Branches without the empty object, where at least two of them admit it.

    ``{}`` then validates against two branches, so ``oneOf`` rejects it; leaving it out of every
    branch that admits it (``minProperties: 1``) keeps the union exact. Done only when each of
    those branches writes nothing but objects (``minProperties`` would make an untyped branch
    object-only); otherwise the branches are returned unchanged.
    """
    empty = [i for i, b in enumerate(branches) if c.value_valid({}, b)]
    if len(empty) < 2 or any(not isinstance(branches[i], dict)
                             or not generated_types(branches[i], c) <= {"object"} for i in empty):
        return branches
    out = list(branches)
    for i in empty:
        out[i] = {**out[i], "minProperties": max(1, out[i].get("minProperties") or 0)}
    return out


def disjoint(c: "SchemaCompiler", a: object, b: object, depth: int = 0) -> bool:
    """True only if no instance the grammar writes for one branch validates against the other.
    Kept per pair of branch contents in ``c.proofs`` when the compiler has that memo."""
    if c.proofs is None or depth:
        return _disjoint(c, a, b, depth)
    key = (c.ids.of(a), c.ids.of(b))
    hit = c.proofs.get(key)
    if hit is None:
        hit = c.proofs[key] = _disjoint(c, a, b, depth)
    return hit


def _disjoint(c: "SchemaCompiler", a: object, b: object, depth: int) -> bool:
    if depth > 4:
        return False
    a = c._deref(a, "#")
    b = c._deref(b, "#")
    if a is False or b is False:
        return True
    if a is True or b is True:
        return False
    if not isinstance(a, dict) or not isinstance(b, dict):
        return False
    a, b = _merged(c, a), _merged(c, b)
    for x, y in ((a, b), (b, a)):
        # A finite branch: a common instance would be one of its values, and none validates.
        values = c._finite_values_deep(x, "#")
        if values is not None and not any(c.value_valid(v, y) for v in values):
            return True
    return _one_way(c, a, b, depth) and _one_way(c, b, a, depth)


def _merged(c: "SchemaCompiler", s: dict) -> dict:
    """``s`` with its ``allOf`` members merged in (``s`` itself when they cannot be)."""
    if "allOf" not in s:
        return s
    from stencil.grammar.json_schema.merge import MergeError, merge

    members: list = []
    try:
        c._flatten_all_of(s, "#", members)
        out: object = True
        for m in members:
            out = merge(out, m)
    except MergeError:
        return s
    return out if isinstance(out, dict) else s


_MAX_EXCLUSIVE_BRANCHES = 64


def exclusive_required(branches: list, annotations: set[str]) -> list[dict] | None:
    """Rewrite ``oneOf`` branches that only list ``required`` names into disjoint branches.

    Branch ``i`` holds exactly when its names ``R_i`` are all present; "exactly one branch"
    means ``R_i`` present and, for every other ``j``, some name of ``R_j - R_i`` absent (never
    when ``R_j`` is inside ``R_i``). Each choice of absent names is one branch: ``required``
    plus ``properties: {name: false}``, so the result is a list of pairwise disjoint schemas
    whose union is the ``oneOf``. Returns None when the branches have other keywords or the
    rewrite would exceed 64 branches.
    """
    names: list[list[str]] = []
    for b in branches:
        if not isinstance(b, dict) or not isinstance(b.get("required"), list) \
                or set(b) - annotations - {"required"}:
            return None
        names.append([n for n in b["required"] if isinstance(n, str)])
    out: list[dict] = []
    for i, ri in enumerate(names):
        choices = []
        for j, rj in enumerate(names):
            if j != i:
                choices.append([n for n in rj if n not in ri])
        if any(not ch for ch in choices):
            continue  # every instance of branch i also satisfies some branch j
        for absent in itertools.product(*choices):
            out.append({"required": list(ri), "properties": {n: False for n in dict.fromkeys(absent)}})
            if len(out) > _MAX_EXCLUSIVE_BRANCHES:
                return None
    return out
