"""Canonical serialization: the exact text the JSON Schema grammar writes for a value.

Compact separators, strings as ``json.dumps(ensure_ascii=False)``, integral numbers as
integers (JSON Schema equality: ``1.0 == 1``) and other numbers in positional notation.
``order_keys`` rearranges an instance's objects into the grammar's property order (declared
properties in schema order, then the rest in their original order) by walking the schema.
"""

from __future__ import annotations

import json
import math
import re
from decimal import Decimal
from typing import Callable


def _number(x: float) -> str:
    if not math.isfinite(x):
        raise ValueError("NaN and infinities are not JSON")
    if x.is_integer() and abs(x) < 1e21:
        return str(int(x))
    text = repr(x)
    if "e" in text or "E" in text:
        text = format(Decimal(text), "f")
    return text


def canonical_json(value: object) -> str:
    """The grammar's serialization of ``value`` (dict key order kept as given)."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, float):
        return _number(value)
    if isinstance(value, (int, str)):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, list):
        return "[" + ",".join(canonical_json(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(json.dumps(k, ensure_ascii=False) + ":" + canonical_json(v)
                              for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def order_keys(value: object, schema: object, view: Callable[[object, object], dict | None],
               depth: int = 0) -> object:
    """Reorder ``value``'s object keys the way the grammar of ``schema`` writes them.

    ``view(schema, value)`` returns the effective object/array schema (refs resolved, ``allOf``
    merged, the matching ``anyOf``/``oneOf`` branch chosen) or None when unknown.
    """
    if depth > 64 or not isinstance(value, (dict, list)):
        return value
    s = view(schema, value)
    if s is None:
        s = {}
    if isinstance(value, list):
        items = s.get("items", True)
        prefix = s.get("prefixItems", items if isinstance(items, list) else [])
        rest = (s.get("additionalItems", True) if isinstance(items, list) else items)
        return [order_keys(v, prefix[i] if i < len(prefix) else rest, view, depth + 1)
                for i, v in enumerate(value)]
    props = s.get("properties", {}) if isinstance(s.get("properties"), dict) else {}
    required = [r for r in s.get("required", []) if isinstance(r, str)]
    order = list(props) + [r for r in required if r not in props]
    keys = [k for k in order if k in value] + [k for k in value if k not in order]
    addl = s.get("additionalProperties", True)
    patterns = s.get("patternProperties") if isinstance(s.get("patternProperties"), dict) else {}

    def member_schema(k: str) -> object:
        if k in props:
            return props[k]
        for p, sub in patterns.items():  # a key matching a pattern takes its schema
            try:
                if re.search(p, k):
                    return sub
            except re.error:
                pass
        return addl

    return {k: order_keys(value[k], member_schema(k), view, depth + 1) for k in keys}
