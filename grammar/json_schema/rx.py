"""Combinators over regex text, with ``None`` standing for the empty language.

Everything emitted is valid for both Python ``re`` and outlines-core 0.2.14's Rust regex
syntax: non-capturing groups, ``|``, ``?``, ``*``, ``+`` and ``{m,n}`` with both bounds written.
"""

from __future__ import annotations

Rx = str | None


def group(r: str) -> str:
    """Wrap ``r`` so a quantifier applies to all of it (skipped when it is one atom)."""
    if len(r) == 1 or (r.startswith("[") and r.endswith("]") and r.count("[") == 1 and "\\" not in r):
        return r
    if len(r) == 2 and r[0] == "\\":
        return r
    return f"(?:{r})"


def seq(*parts: Rx) -> Rx:
    """Concatenation; empty if any part is empty."""
    if any(p is None for p in parts):
        return None
    return "".join(parts)  # type: ignore[arg-type]


def alt(parts: list[Rx]) -> Rx:
    """Union of the non-empty parts (duplicates dropped, order kept)."""
    seen: list[str] = []
    for p in parts:
        if p is not None and p not in seen:
            seen.append(p)
    if not seen:
        return None
    if len(seen) == 1:
        return seen[0]
    return "(?:" + "|".join(seen) + ")"


def opt(r: Rx) -> str:
    if r is None or r == "":
        return ""
    return group(r) + "?"


def repeat(r: Rx, lo: int, hi: int | None) -> Rx:
    """``r`` repeated between ``lo`` and ``hi`` times (``hi=None``: unbounded)."""
    if hi is not None and hi < lo:
        return None
    if r is None:
        return "" if lo == 0 else None
    if r == "" or hi == 0:
        return ""
    g = group(r)
    if hi is None:
        if lo == 0:
            return g + "*"
        if lo == 1:
            return g + "+"
        return g + "{" + str(lo) + ",}"
    if lo == hi:
        return r if lo == 1 else g + "{" + str(lo) + "}"
    if lo == 0 and hi == 1:
        return g + "?"
    return g + "{" + str(lo) + "," + str(hi) + "}"
