"""Character sets and their regex text, shared by the JSON Schema compiler and the character classes.

Part of ``grammar/``'s ground floor (with ``stencil.grammar.charclass`` and ``stencil.grammar.program``):
it imports no other module of Stencil.

A ``CharSet`` is a sorted tuple of disjoint, non-adjacent inclusive code-point ranges (what
``charset`` makes; every operation here takes and returns that form). It is turned into
regex text in the one dialect both Python ``re`` and outlines-core 0.2.14 (Rust
``regex-automata`` syntax, Unicode mode, matching UTF-8 bytes) read the same way: classes
with every metacharacter escaped, control characters as ``\\xHH`` and everything else as the
literal character. No ``\\d``/``\\w``/``.`` shorthand is emitted, since Rust and Python disagree
on their Unicode meaning.

Canonical JSON strings: the grammar writes each decoded character one way only, the way
``json.dumps(..., ensure_ascii=False)`` does (RFC 8259 §7 escapes): ``\\"``, ``\\\\``, ``\\b``,
``\\f``, ``\\n``, ``\\r``, ``\\t``, everything else literal (``/`` unescaped, non-ASCII as
UTF-8). One encoding per character makes string languages comparable (enum exclusion,
``oneOf`` disjointness) and keeps automata small. Decoded strings take no other control
character (U+0000-U+001F without a named escape, which ``json.dumps`` writes ``\\u00xx``) and
no U+007F: a subset of the strings, so still exact, and the alphabet of llguidance's JSON front
end with ``json_allowed_escapes`` ``nrbtf\\"\\\\`` (no ``u``), so that a sub-schema handed to it
(``json_schema.handover``) has the same strings. No MaskBench-dev instance has such a character.
"""

from __future__ import annotations

import functools

MAX_CP = 0x10FFFF
CharSet = tuple[tuple[int, int], ...]

ANY_CHAR: CharSet = ((0, MAX_CP),)
EMPTY: CharSet = ()

_NAMED_ESCAPES = {0x22: '\\\\"', 0x5C: "\\\\\\\\", 0x08: "\\\\b", 0x0C: "\\\\f", 0x0A: "\\\\n",
                  0x0D: "\\\\r", 0x09: "\\\\t"}
# Characters that must be escaped inside a class for both dialects ('[' opens a nested class
# in Rust; '&', '~', '-' form set operators there).
_CLASS_META = set("\\]^-[&~")
_LITERAL_META = set("\\.+*?()|[]{}^$")
_RULE_MARKS = tuple(range(0xE000, 0xE007))  # written escaped: bare, they mark references (rules.py)


def charset(*ranges: tuple[int, int]) -> CharSet:
    """Normalise ranges (any order, overlapping) into a CharSet."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(r for r in ranges if r[0] <= r[1]):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def chars(text: str) -> CharSet:
    """The set of the characters of ``text``."""
    if len(text) == 1:
        cp = ord(text)
        return ((cp, cp),)
    return charset(*((ord(c), ord(c)) for c in text))


def union(*sets: CharSet) -> CharSet:
    return charset(*(r for s in sets for r in s))


def complement(s: CharSet) -> CharSet:
    out, start = [], 0
    for lo, hi in s:
        if lo > start:
            out.append((start, lo - 1))
        start = hi + 1
    if start <= MAX_CP:
        out.append((start, MAX_CP))
    return tuple(out)


def intersect(a: CharSet, b: CharSet) -> CharSet:
    """The characters in both: one sweep over the two sorted range lists (the pieces come out
    sorted, and no two adjacent, since neither input has adjacent ranges)."""
    out = []
    i = j = 0
    na, nb = len(a), len(b)
    while i < na and j < nb:
        alo, ahi = a[i]
        blo, bhi = b[j]
        lo = alo if alo > blo else blo
        hi = ahi if ahi < bhi else bhi
        if lo <= hi:
            out.append((lo, hi))
        if ahi < bhi:
            i += 1
        else:
            j += 1
    return tuple(out)


def subtract(a: CharSet, b: CharSet) -> CharSet:
    return intersect(a, complement(b)) if b else a


def contains(s: CharSet, cp: int) -> bool:
    return any(lo <= cp <= hi for lo, hi in s)


def size(s: CharSet) -> int:
    return sum(hi - lo + 1 for lo, hi in s)


def _class_char(cp: int) -> str:
    c = chr(cp)
    if cp < 0x20 or cp == 0x7F:
        return f"\\x{cp:02x}"
    if 0xD800 <= cp <= 0xDFFF:
        raise ValueError("surrogate code point in a character class")
    if cp in _RULE_MARKS:
        return f"\\u{cp:04x}"
    return "\\" + c if c in _CLASS_META else c


def literal(text: str) -> str:
    """Regex text matching exactly ``text`` (escaping only what both dialects treat as meta)."""
    out = []
    for c in text:
        cp = ord(c)
        if cp < 0x20 or cp == 0x7F:
            out.append(f"\\x{cp:02x}")
        elif c in _LITERAL_META:
            out.append("\\" + c)
        elif cp in _RULE_MARKS:
            out.append(f"\\u{cp:04x}")
        else:
            out.append(c)
    return "".join(out)


_NOT_SURROGATE: CharSet = ((0, 0xD7FF), (0xE000, MAX_CP))


def _without_surrogates(s: CharSet) -> CharSet:
    return intersect(s, _NOT_SURROGATE)


@functools.lru_cache(maxsize=4096)
def class_regex(s: CharSet) -> str | None:
    """Regex text for one character of ``s`` (None when ``s`` is empty); kept per set, since
    the same classes (digits, word characters, "any but a quote") come back in pattern after
    pattern."""
    s = _without_surrogates(s)
    if not s:
        return None
    if len(s) == 1 and s[0][0] == s[0][1]:
        return literal(chr(s[0][0]))
    comp = _without_surrogates(complement(s))
    negate = len(comp) < len(s)
    body = []
    for lo, hi in (comp if negate else s):
        if lo == hi:
            body.append(_class_char(lo))
        elif hi == lo + 1:
            body.append(_class_char(lo) + _class_char(hi))
        else:
            body.append(f"{_class_char(lo)}-{_class_char(hi)}")
    return "[" + ("^" if negate else "") + "".join(body) + "]"


_ESCAPED: CharSet = charset((0, 0x1F), (0x22, 0x22), (0x5C, 0x5C), (0x7F, 0x7F))  # never raw


@functools.lru_cache(maxsize=8192)
def json_char(s: CharSet) -> str | None:
    """Regex for one decoded character of ``s`` written canonically inside a JSON string.

    Returns None when no character of ``s`` can be written (``s`` empty, or only controls
    without a named escape and U+007F). See the module docstring for the canonical escapes.
    """
    alts = []
    plain = class_regex(subtract(s, _ESCAPED))
    if plain is not None:
        alts.append(plain)
    escaped = intersect(s, _ESCAPED)
    # the named escapes only: other controls and U+007F are left out (module docstring)
    alts.extend(_NAMED_ESCAPES[cp] for lo, hi in escaped for cp in range(lo, hi + 1) if cp in _NAMED_ESCAPES)
    if not alts:
        return None
    return alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"


def json_escape_text(text: str) -> str:
    """The canonical JSON string body of ``text`` (what ``json.dumps(ensure_ascii=False)`` writes)."""
    import json
    return json.dumps(text, ensure_ascii=False)[1:-1]
