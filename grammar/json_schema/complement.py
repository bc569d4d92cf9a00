"""Every value of some types but a few: ``not: {"enum": [...]}`` as a union of positive schemas.

A negation has no regex of its own, but "any value but these" splits by JSON type into pieces
that have one: a type none of the values belongs to stays whole; the booleans but ``true`` are
``false``; the integers but 3 and 7 are three ranges (``maximum: 2``, ``4..6``, ``minimum: 8``),
and the numbers but 1 are two open ranges (``exclusiveMaximum: 1``, ``exclusiveMinimum: 1``,
which leave out ``1.0`` too, as JSON Schema equality does); the strings but a few are the trie
complement the object keys use. Exact: the union admits a value exactly when it has one of the
types and is none of the values. What has no such split (objects and arrays among the values,
strings under ``pattern``/length/``format``) raises ``ComplementError`` saying which.
"""

from __future__ import annotations

from decimal import Decimal

NOT_STRINGS = "x-stencil-not-strings"  # internal: a string type minus these values (from `not`)
NOT_PATTERNS = "x-stencil-not-patterns"  # internal: strings matching none of these patterns (from `not`)
MAX_NUMBERS = 16  # most excluded numbers (each splits a range in two)


class ComplementError(ValueError):
    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


def complement(types: list[str], excluded: dict[str, list], plain_strings: bool) -> list[dict]:
    """The values of ``types`` except ``excluded``, as schemas whose union is exactly that.

    Args:
        types: the JSON types admitted (``"integer"`` is dropped where ``"number"`` is there).
        excluded: the values to leave out, by their JSON type (``1.0`` under ``"integer"``).
        plain_strings: the strings admitted are all strings (no ``pattern``, length or
            ``format`` keyword goes with them), so that a trie complement is exact.

    Returns:
        One schema per piece (each names its ``type``), to be intersected with the rest of the
        schema; an empty list when nothing is left.

    Raises:
        ComplementError: an excluded value of a type this cannot split.
    """
    if "number" in types:
        types = [t for t in types if t != "integer"]
    parts: list[dict] = []
    for t in types:
        out = excluded.get(t, []) + (excluded.get("integer", []) if t == "number" else [])
        if not out:
            parts.append({"type": t})
        elif t == "boolean":
            parts += [{"type": t, "enum": [b]} for b in (False, True) if b not in out]
        elif t == "string":
            if not plain_strings:
                raise ComplementError("strings but some values, where a pattern, length or format "
                                      "keyword also applies")
            parts.append({"type": t, NOT_STRINGS: out})
        elif t in ("integer", "number"):
            parts += _ranges(t, out)
        elif t != "null":
            raise ComplementError(f"{'objects' if t == 'object' else 'arrays'} but some values")
    return parts


def _ranges(t: str, values: list) -> list[dict]:
    """The integers (or numbers) between and beyond ``values``, one schema a range."""
    points = sorted({Decimal(repr(v)) if isinstance(v, float) else Decimal(v): v for v in values}.items())
    if len(points) > MAX_NUMBERS:
        raise ComplementError(f"numbers but more than {MAX_NUMBERS} values")
    if t == "integer":  # bounds between integers, inclusive (the same in every draft)
        ints = [int(d) for d, _ in points]
        lows, highs = [None] + [i + 1 for i in ints], [i - 1 for i in ints] + [None]
        return [{"type": t, **({} if lo is None else {"minimum": lo}), **({} if hi is None else {"maximum": hi})}
                for lo, hi in zip(lows, highs) if lo is None or hi is None or lo <= hi]
    cuts = [v for _, v in points]
    lows, highs = [None] + cuts, cuts + [None]
    return [{"type": t, **({} if lo is None else {"exclusiveMinimum": lo}),
             **({} if hi is None else {"exclusiveMaximum": hi})} for lo, hi in zip(lows, highs)]
