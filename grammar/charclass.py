"""Character classes read the way every grammar backend reads them: code point ranges of a
regex class, and the under/over approximations of ``\\d``, ``\\w``, ``\\s`` and their negations.

Python's ``re``, Rust's ``regex`` (the eager index and llguidance) and ECMA-262 (JSON Schema's
``pattern``) disagree on what the shorthand classes hold; each function here returns sets that
stay inside (under) or cover (over) every reading, so that a constraint built from them admits
nothing a backend refuses, or refuses nothing it admits, as its caller needs. Used by the JSON
Schema pattern parser (``stencil.grammar.json_schema.pattern``), the closing automaton
(``stencil.grammar.closing``) and the program's length bounds (``stencil.grammar.program.min_bytes``).
Part of ``grammar/``'s ground floor: of the package it imports only ``stencil.grammar.charset``.
"""

from __future__ import annotations

import functools
import re._constants as sre_c

from stencil.grammar import charset as cs


class UnmodelledClass(ValueError):
    """A class item these functions do not model (a category other than the shorthands)."""


@functools.cache
def unicode_sets() -> dict[str, cs.CharSet]:
    """Python ``re``'s exact ``\\d`` and ``\\s`` sets (str patterns), computed once."""
    import re

    # Every code point but the surrogates, scanned by ``re`` itself (C speed, ~0.1 s, against
    # ~1.3 s for a Python loop over 1.1 M code points).
    every = "".join(map(chr, range(0xD800))) + "".join(map(chr, range(0xE000, cs.MAX_CP + 1)))

    def collect(pattern: str) -> cs.CharSet:
        return cs.charset(*((ord(m.group()[0]), ord(m.group()[-1])) for m in re.finditer(pattern, every)))
    return {"d": collect(r"\d+"), "s": collect(r"\s+")}


_ASCII_WORD = cs.charset((48, 57), (65, 90), (95, 95), (97, 122))
_PY_ONLY_SPACE = cs.charset((0x1C, 0x1F), (0x85, 0x85))


def shorthand(letter: str) -> tuple[cs.CharSet, cs.CharSet]:
    """(under, over) approximations of ``\\d``, ``\\w``, ``\\s`` and their negations."""
    low = letter.lower()
    if low == "d":
        pair = (cs.charset((48, 57)), unicode_sets()["d"])
    elif low == "s":
        # Python and ECMA-262 disagree (U+FEFF, U+001C-U+001F, U+0085): admit only what both
        # call whitespace, and exclude from \S everything either calls whitespace.
        python = unicode_sets()["s"]
        pair = (cs.subtract(python, _PY_ONLY_SPACE), cs.union(python, cs.chars("\ufeff")))
    else:
        pair = (_ASCII_WORD, cs.union(_ASCII_WORD, ((0x80, cs.MAX_CP),)))
    if letter.isupper():
        return cs.complement(pair[1]), cs.complement(pair[0])
    return pair


def complement_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The code points (0 to U+10FFFF) outside ``ranges`` (inclusive ``(lo, hi)`` pairs, in any
    order, overlaps allowed), as sorted disjoint inclusive ranges."""
    out, start = [], 0
    for lo, hi in sorted(ranges):
        if lo > start:
            out.append((start, lo - 1))
        start = max(start, hi + 1)
    if start <= 0x10FFFF:
        out.append((start, 0x10FFFF))
    return out


_CATEGORY_LETTERS = {sre_c.CATEGORY_DIGIT: "d", sre_c.CATEGORY_NOT_DIGIT: "D", sre_c.CATEGORY_SPACE: "s",
                     sre_c.CATEGORY_NOT_SPACE: "S", sre_c.CATEGORY_WORD: "w", sre_c.CATEGORY_NOT_WORD: "W"}


def class_ranges(items) -> list[tuple[int, int]]:
    r"""Code point ranges of an ``IN`` node: a subset of what the backends' class admits, so that
    distances stay upper bounds. ``\d``/``\w``/``\s`` and their negations take the JSON Schema
    pattern parser's under-approximations (``\S``: every code point that neither Python nor the
    backends' Unicode tables call whitespace, and U+001C-U+001F); a negated class ``[^...]`` is
    the complement of its items' over-approximation.

    (``\S`` was once read as its ASCII members by dropping every range that reached past ASCII:
    that left only control characters, and ``[\s\S]*`` near its budget admitted whitespace
    alone.)

    Args:
        items: the node's argument as ``re._parser`` gives it (``(op, av)`` pairs).

    Returns:
        Inclusive ``(lo, hi)`` code point ranges (possibly overlapping).

    Raises:
        UnmodelledClass: a category other than the six shorthands, or an unknown item.
    """
    under: list[tuple[int, int]] = []
    over: list[tuple[int, int]] = []
    negate = False
    for op, av in items:
        if op is sre_c.NEGATE:
            negate = True
        elif op is sre_c.LITERAL:
            under.append((av, av))
            over.append((av, av))
        elif op is sre_c.RANGE:
            under.append(av)
            over.append(av)
        elif op is sre_c.CATEGORY:
            letter = _CATEGORY_LETTERS.get(av)
            if letter is None:
                raise UnmodelledClass(f"category {av} is not modelled")
            lo_set, hi_set = shorthand(letter)
            under.extend(lo_set)
            over.extend(hi_set)
            if letter == "S":
                # The backends' \s is Unicode White_Space, without U+001C-U+001F (Python's has
                # them): to both backends those are \S, and free text may hold them.
                under.append((0x1C, 0x1F))
        else:
            raise UnmodelledClass(f"class item {op} is not modelled")
    return complement_ranges(over) if negate else under
