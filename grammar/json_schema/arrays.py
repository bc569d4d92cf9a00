"""JSON arrays: ``prefixItems``/``items`` (2020-12 §10.3.1), draft-04 tuple ``items`` with
``additionalItems``, ``minItems``/``maxItems``, ``contains`` and ``uniqueItems`` where exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from stencil.grammar.base import MAX_REPEAT_COUNT, GrammarError
from stencil.grammar.json_schema.rx import Rx, alt, opt, repeat, seq

if TYPE_CHECKING:
    from stencil.grammar.json_schema.schema_compiler import SchemaCompiler


def _layout(s: dict, path: str) -> tuple[list[tuple[object, str]], object, str]:
    """(prefix schemas with paths, schema of the rest, path of the rest)."""
    items = s.get("items", True)
    if "prefixItems" in s and isinstance(s["prefixItems"], list):
        prefix = [(x, f"{path}/prefixItems/{i}") for i, x in enumerate(s["prefixItems"])]
        return prefix, (True if items is None else items), f"{path}/items"
    if isinstance(items, list):
        prefix = [(x, f"{path}/items/{i}") for i, x in enumerate(items)]
        return prefix, s.get("additionalItems", True), f"{path}/additionalItems"
    return [], items, f"{path}/items"


def compile_array(c: "SchemaCompiler", s: dict, path: str) -> Rx:
    comma = c.ws + "," + c.ws
    lo = s.get("minItems", 0)
    hi = s.get("maxItems")
    if lo > MAX_REPEAT_COUNT:
        raise GrammarError(f"minItems {lo} is more than the {MAX_REPEAT_COUNT} items a grammar can require "
                           "of one array", keyword="minItems", path=f"{path}/minItems")
    if hi is not None and hi > MAX_REPEAT_COUNT:
        c.warnings.append(f"maxItems at {path}: arrays are written with at most {MAX_REPEAT_COUNT} items "
                          f"(not {hi})")
        hi = MAX_REPEAT_COUNT
    if s.get("unevaluatedItems") not in (None, True):
        c.unsupported("unevaluatedItems", path)
    prefix_specs, rest_schema, rest_path = _layout(s, path)
    prefix: list[Rx] = []
    for schema, where in prefix_specs:
        r = c.sub(schema, where)
        if r is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
            break
        prefix.append(r)
    if hi is None or hi > len(prefix):
        rest = c.sub(rest_schema, rest_path)
        if rest is None:
            hi = len(prefix) if hi is None else min(hi, len(prefix))
    else:
        rest = None
    if hi is not None and hi < lo:
        return None
    if s.get("uniqueItems") is True and (hi is None or hi > 1):
        if not prefix and "contains" not in s:
            out = _unique(c, rest_schema, rest_path, lo, hi, path)
            if out is not _IGNORED:
                return out
        else:
            c.unsupported("uniqueItems", path, "uniqueItems with tuple items or contains cannot be "
                                               "enforced exactly")
    if "contains" in s:
        return _contains(c, s, path, prefix, rest, lo, hi, comma)
    prefix = prefix[:hi] if hi is not None else prefix

    def tail(i: int) -> Rx:
        """Elements from position ``i`` on, each written with its leading comma."""
        if hi is not None and i >= hi:
            return ""
        if i >= len(prefix):
            upper = None if hi is None else hi - i
            return repeat(seq(comma, rest), max(lo - i, 0), upper)
        step = seq(comma, prefix[i], tail(i + 1))
        return step if i < lo else opt(step)

    if hi == 0:
        return c.bracket("\\[", "\\]", None, True)
    first = prefix[0] if prefix else rest
    return c.bracket("\\[", "\\]", seq(first, tail(1)), lo == 0)


def _contains(c, s, path, prefix, rest, lo, hi, comma) -> Rx:
    if prefix or hi is not None or lo > 1 or s.get("minContains", 1) != 1 or "maxContains" in s:
        c.unsupported("contains", path, "contains with tuple items, maxItems or min/maxContains")
        return None
    rest_schema = s.get("items", True)
    hit = c.sub({"allOf": [s["contains"], rest_schema]} if rest_schema is not True else s["contains"],
                f"{path}/contains")
    if hit is None:
        return None
    if rest is None:
        body = hit
    else:
        body = seq(repeat(seq(rest, comma), 0, None), hit, repeat(seq(comma, rest), 0, None))
    return c.bracket("\\[", "\\]", alt([body]), False)


_IGNORED = object()  # _unique could not enforce uniqueItems and warned (strict off): arrays as usual
MAX_UNIQUE_BRANCHES = 4096  # (remaining set, next value) pairs of a uniqueItems array (grammar mode)
MAX_UNIQUE_SEQUENCES = 2048  # distinct sequences written out in plain-regex mode


def _unique(c: "SchemaCompiler", items: object, items_path: str, lo: int, hi: int | None,
            path: str) -> Rx:
    """Arrays of distinct values drawn from the finite set ``items`` admits (``enum``/``const``,
    booleans, null), exactly: after each value the rest of the array may use only the values
    not used yet, so a state is the set still unused (how many were used is its complement's
    size, which decides whether the array may end or go on). Each state is one shared terminal
    in grammar mode (2^k states at most, bounded by ``MAX_UNIQUE_BRANCHES``); a plain regex
    writes every order out (bounded by ``MAX_UNIQUE_SEQUENCES``).

    Returns ``_IGNORED`` when it cannot and strict mode is off (a warning was recorded).

    Raises:
        GrammarError: (strict) the items are not a finite set, or too many orders.
    """
    values = _finite_item_values(c, items, items_path)
    if values is None:
        c.unsupported("uniqueItems", path, "uniqueItems cannot be enforced exactly unless the items "
                                           "come from a finite set (enum, const, boolean, null)")
        return _IGNORED
    k = len(values)
    top = k if hi is None else min(hi, k)
    if lo > top:
        return None
    comma = c.ws + "," + c.ws
    if top == 0:
        return c.bracket("\\[", "\\]", None, True)
    from math import comb, perm
    if c.opts.grammar:
        cost = sum(comb(k, u) * (k - u) for u in range(top))
        limit = MAX_UNIQUE_BRANCHES
    else:
        cost = sum(perm(k, u) for u in range(1, top + 1))
        limit = MAX_UNIQUE_SEQUENCES
    if cost > limit:
        c.unsupported("uniqueItems", path, f"uniqueItems over {k} values up to {top} items has more "
                                           f"than {limit} orders to write out")
        return _IGNORED
    lits = [c._literal(v) for v in values]
    memo: dict[int, Rx] = {}

    def rest(unused: int) -> Rx:
        """Nonempty runs of distinct values from the set ``unused`` (a bit per value)."""
        if unused in memo:
            return memo[unused]
        used = k - bin(unused).count("1")
        branches = []
        for i in range(k):
            if not unused >> i & 1:
                continue
            left = unused & ~(1 << i)
            more = seq(comma, rest(left)) if used + 1 < top and left else None
            if used + 1 >= lo:
                branches.append(seq(lits[i], "" if more is None else "(?:" + more + ")?"))
            elif more is not None:
                branches.append(seq(lits[i], more))
        out = c._share(alt(branches)) if branches else None
        memo[unused] = out
        return out

    return c.bracket("\\[", "\\]", rest((1 << k) - 1), lo == 0)


def _finite_item_values(c: "SchemaCompiler", items: object, path: str) -> list | None:
    """The distinct JSON values (by JSON equality) ``items`` admits, when finitely many."""
    from stencil.grammar.json_schema.merge import json_key

    schema = c._deref(items, path)
    if schema is False:
        return []
    if not isinstance(schema, dict):
        return None
    values = c._finite_values_deep(schema, path)
    if values is None:
        types = schema.get("type")
        types = [types] if isinstance(types, str) else types
        if not isinstance(types, list) or not types or not set(types) <= {"boolean", "null"}:
            return None
        values = ([True, False] if "boolean" in types else []) + ([None] if "null" in types else [])
    check = c.value_check(schema, "enum" in schema or "const" in schema)
    out, seen = [], set()
    for v in values:
        key = json_key(v)
        if key not in seen and (check is None or c.value_valid(v, check)):
            seen.add(key)
            out.append(v)
    return out

