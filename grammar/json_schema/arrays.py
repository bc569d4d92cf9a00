"""JSON arrays: ``prefixItems``/``items`` (2020-12 §10.3.1), draft-04 tuple ``items`` with
``additionalItems``, ``minItems``/``maxItems``, ``contains`` and ``uniqueItems`` where exact.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from grammar.json_schema.rx import Rx, alt, opt, repeat, seq

if TYPE_CHECKING:
    from grammar.json_schema.compiler import SchemaCompiler


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
    ws, comma = c.ws, c.ws + "," + c.ws
    lo = s.get("minItems", 0)
    hi = s.get("maxItems")
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
        c.unsupported("uniqueItems", path)
    if "contains" in s:
        return _contains(c, s, path, prefix, rest, lo, hi, ws, comma)
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
        body: Rx = ""
    else:
        first = prefix[0] if prefix else rest
        body = seq(first, tail(1))
        if lo == 0:
            body = opt(body)
    return seq("\\[", ws, body, ws, "\\]")


def _contains(c, s, path, prefix, rest, lo, hi, ws, comma) -> Rx:
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
    return seq("\\[", ws, alt([body]), ws, "\\]")
