"""JSON string values: ``minLength``/``maxLength``, ``pattern`` and ``format`` (2020-12 §6.3, §7).

Lengths count decoded characters (code points), so one canonical escape such as ``\\n`` is
one character. Returns the regex of the whole literal, quotes included.
"""

from __future__ import annotations

import contextlib
import functools

from dataclasses import dataclass

from stencil.grammar import charset as cs
from stencil.grammar.json_schema import pattern as sp
from stencil.grammar.json_schema.formats import format_pattern
from stencil.grammar.program import both, minus
from stencil.grammar.json_schema.rx import Rx, alt, repeat, seq

ANY_CHAR = cs.json_char(cs.ANY_CHAR)
NEWLINE = cs.json_char(cs.chars("\n"))
# Inside length-bounded strings: no '"' and no control characters other than \n and \t.
# outlines-core 0.2.14's index build grows exponentially with the count when the escaped quote
# is allowed (measured: 16 characters took 1.9 s with it, 0.05 s without). A subset, so exact.
BOUNDED_CHAR = cs.json_char(cs.subtract(cs.ANY_CHAR, cs.union(cs.chars('"'), cs.charset((0, 8)),
                                                              cs.charset((11, 31)))))


class StringError(ValueError):
    def __init__(self, keyword: str, message: str, position: int | None = None):
        super().__init__(message)
        self.keyword = keyword
        self.message = message
        self.position = position


@dataclass(frozen=True, slots=True)
class StringSpec:
    min_length: int = 0
    max_length: int | None = None
    pattern: str | None = None
    format: str | None = None
    max_length_cap: int | None = None  # write at most this many characters (a subset)
    exact_chars: bool = False  # bounded strings take every character (not BOUNDED_CHAR's subset)
    intersect: bool = False  # may write intersections (rules.both: lazy backend only)


def _fit_length(body, lo: int, hi: int | None):
    """Return ``body`` restricted to lengths in [lo, hi], or None if not exactly expressible."""
    blo, bhi = sp.length_range(body)
    if blo >= lo and (hi is None or (bhi is not None and bhi <= hi)):
        return body
    items = list(body.items) if isinstance(body, sp.Seq) else [body]
    variable = [i for i, it in enumerate(items) if sp.length_range(it)[0] != sp.length_range(it)[1]]
    if len(variable) != 1:
        return None
    k = variable[0]
    rep = items[k]
    if not (isinstance(rep, sp.Rep) and isinstance(rep.item, sp.Atom)):
        return None
    fixed = sum(sp.length_range(it)[0] for i, it in enumerate(items) if i != k)
    new_lo = max(rep.lo, lo - fixed)
    new_hi = rep.hi if hi is None else (hi - fixed if rep.hi is None else min(rep.hi, hi - fixed))
    if new_hi is not None and (new_hi < new_lo or new_hi < 0):
        return sp.Seq((sp.Atom(cs.EMPTY),))
    items[k] = sp.Rep(rep.item, max(new_lo, 0), new_hi)
    return sp.Seq(tuple(items))


def _branch_regex(branch: sp.Branch) -> Rx:
    body = sp.emit(branch.body)
    prefix = "" if branch.start else ANY_CHAR + "*"
    if not branch.end:
        suffix = ANY_CHAR + "*"
    elif branch.newline_ok:
        suffix = "(?:" + NEWLINE + ")?"
    else:
        suffix = ""
    return seq(prefix, body, suffix)


def _pattern_body(pattern: str, lo: int, hi: int | None, intersect: bool = False,
                  over: bool = False) -> Rx:
    try:
        split = sp.split_lookaheads(pattern)
        behind = None if split is not None else sp.split_lookbehind(pattern)
        if behind is not None and behind[4] and sp.has_lookahead(behind[0]):
            behind = None  # a lookahead before ``$`` may see its newline: read as a whole below
    except sp.PatternError as exc:
        raise StringError("pattern", f"unsupported pattern: {exc.message}", exc.position) from None
    if split is not None:
        return _lookaheads(pattern, *split, lo, hi, intersect, over)
    if behind is not None:
        return _lookbehind(*behind, lo, hi, intersect, over)
    if sp.has_lookaround(pattern):
        return _lookarounds(pattern, lo, hi, intersect, over)
    try:
        branches = sp.branches(sp.parse(pattern, over))
    except sp.PatternError as exc:
        raise StringError("pattern", f"unsupported pattern: {exc.message}", exc.position) from None
    if lo == 0 and hi is None:
        return alt([_branch_regex(b) for b in branches])
    out: list[Rx] = []
    for b in branches:
        if not (b.start and b.end and not b.newline_ok) and not (b.start and b.end):
            if intersect:
                return both(_pattern_body(pattern, 0, None), repeat(ANY_CHAR, lo, hi))
            raise StringError("pattern", "an unanchored pattern together with minLength/maxLength "
                              "is not supported")
        fitted = _fit_length(b.body, lo, hi)
        if fitted is None:
            if intersect:  # exact: the pattern's strings that have the right length
                return both(_pattern_body(pattern, 0, None), repeat(ANY_CHAR, lo, hi))
            raise StringError("pattern", "pattern combined with minLength/maxLength is not "
                              "expressible exactly")
        out.append(sp.emit(fitted))
        if b.newline_ok:
            # Python's '$' also admits one trailing newline; that string is one char longer.
            with_nl = _fit_length(b.body, max(lo - 1, 0), None if hi is None else hi - 1)
            if with_nl is not None and (hi is None or hi >= 1):
                out.append(seq(sp.emit(with_nl), NEWLINE))
    return alt(out)


def _lookaheads(pattern: str, rest: str, looks: list[tuple[bool, str, int]], lo: int, hi: int | None,
                intersect: bool, over: bool) -> Rx:
    """``pattern`` = ``^(?=X)(?!Y)REST`` (``sp.split_lookaheads``): ``^REST``'s strings,
    intersected with ``^(?:X)``'s, minus ``^(?:Y)``'s. Exact as the atoms are: a subset of
    Python's language (``over``: a superset), since a complement takes away the other
    approximation of its part."""
    anchor = 1 if pattern.startswith("^") else 2  # (``^`` or ``\\A``)
    if not intersect:
        raise StringError("pattern", "a lookahead is written as an intersection, which only the "
                          "lazy backend serves", anchor)
    with _at(anchor, len(pattern) - len(rest)):  # (positions in ``rest`` past its anchor)
        out = _pattern_body(rest, lo, hi, True, over)
    for negative, look, start in looks:
        parts = []
        for branch, offset in sp.top_branches(look):  # each anchored: ^(?:a|$) is ^a|^$
            again = 1 if branch.startswith("^") else 2 if branch.startswith("\\A") else 0
            with _at(0, start + offset + again - 1):  # (an anchor of its own holds here: dropped)
                parts.append(_pattern_body("^" + branch[again:], 0, None, True, over != negative))
        part = alt(parts)
        out = minus(out, part) if negative else both(out, part)
    return out


def _lookbehind(head: str, negative: bool, look: str, start: int, dollar: bool, lo: int, hi: int | None,
                intersect: bool, over: bool) -> Rx:
    """A pattern ``HEAD(?<!X)$`` (``sp.split_lookbehind``): ``HEAD\\Z``'s strings minus
    (``(?<=X)``: intersected with) ``.*X\\Z``'s, then for ``$`` an optional newline (exact as in
    ``_lookaheads``)."""
    if not intersect:
        raise StringError("pattern", "a lookbehind is written as an intersection, which only the "
                          "lazy backend serves", start - 4)
    out = _pattern_body(head + "\\Z", 0, None, True, over)
    with _at(0, start - 3):
        tail = _pattern_body("(?:" + look + ")\\Z", 0, None, True, over != negative)
    out = minus(out, tail) if negative else both(out, tail)
    if dollar:
        out = seq(out, "(?:" + NEWLINE + ")?")
    return out if lo == 0 and hi is None else both(out, repeat(ANY_CHAR, lo, hi))


def _lookarounds(pattern: str, lo: int, hi: int | None, intersect: bool, over: bool) -> Rx:
    """A pattern with lookarounds elsewhere than ``_lookaheads`` and ``_lookbehind`` read them:
    each alternative ``HEAD (?=X) TAIL`` (``sp.split_lookarounds``, groups holding one written
    out) is ``HEAD\\Z``'s strings followed by those of ``^TAIL`` that ``^(?:X)`` matches (``(?!``:
    does not match); ``HEAD (?<=X) TAIL`` is ``HEAD\\Z``'s strings that ``(?:X)\\Z`` matches
    followed by ``^TAIL``'s. ``HEAD`` and ``TAIL`` are read the same way in turn, so every
    lookaround is an intersection or a complement (exact as in ``_lookaheads``)."""
    try:
        parts = sp.split_lookarounds(sp.Placed(pattern, tuple(range(len(pattern)))))
    except sp.PatternError as exc:
        raise StringError("pattern", f"unsupported pattern: {exc.message}", exc.position) from None
    out: list[Rx] = []
    for part in parts:
        if isinstance(part, sp.Placed):
            out.append(_placed_body(part, over))
            continue
        if not intersect:
            raise StringError("pattern", "a lookaround is written as an intersection, which only the "
                              "lazy backend serves", part.where)
        put = functools.partial(sp.Placed.put, where=part.where)
        head = _placed_body(part.head + put("\\Z"), over)
        tail = _placed_body(put("^") + part.tail, over)
        looks = []
        for branch, offset in sp.top_branches(part.look.text):
            text = part.look[offset:offset + len(branch)]
            if part.behind:
                text = put("(?:") + text + put(")\\Z")
            elif branch.startswith("^") and part.head.text == "^":  # ``^(?=^a)``: the same
                pass
            else:
                text = put("^") + text
            looks.append(_placed_body(text, over != part.negative))
        look = alt(looks)
        if part.behind:
            out.append(seq(minus(head, look) if part.negative else both(head, look), tail))
        else:
            out.append(seq(head, minus(tail, look) if part.negative else both(tail, look)))
    body = alt(out)
    return body if lo == 0 and hi is None else both(body, repeat(ANY_CHAR, lo, hi))


def _placed_body(text: "sp.Placed", over: bool) -> Rx:
    """``_pattern_body`` of a rewritten part of a pattern, its errors placed in the pattern."""
    try:
        return _pattern_body(text.text, 0, None, True, over)
    except StringError as exc:
        exc.position = text.at(exc.position)
        raise


@contextlib.contextmanager
def _at(past: int, shift: int):
    """Shift by ``shift`` the position of a pattern error raised inside, where it is at least
    ``past``: a part's offsets become the whole pattern's."""
    try:
        yield
    except StringError as exc:
        if exc.position is not None and exc.position >= past:
            exc.position += shift
        raise


def pattern_superset_regex(pattern: str) -> Rx:
    """Regex of JSON string literals (with quotes) that includes every string ``re.search``
    matches with ``pattern`` (each atom over-approximated); what ``not: {pattern}`` takes away.

    Raises:
        StringError: a pattern we cannot translate.
    """
    return seq('"', _pattern_body(pattern, 0, None, intersect=True, over=True), '"')  # (in a ``minus``: lazy only)


STRING_SUPERSET_KEYWORDS = frozenset({"type", "pattern", "minLength", "maxLength"})


def string_superset_regex(schema: dict) -> Rx:
    """Regex of JSON string literals (with quotes) that includes every string valid against
    ``schema``, a string schema of ``STRING_SUPERSET_KEYWORDS`` (and annotations) alone: its
    pattern's atoms over-approximated (as :func:`pattern_superset_regex`), its lengths exact.
    What an overlapping ``oneOf`` branch takes away from the others (in a ``minus``: lazy only).

    Raises:
        StringError: a pattern we cannot translate, or a length that is not a count.
    """
    lo, hi = schema.get("minLength", 0), schema.get("maxLength")
    for key, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v != int(v) or v < 0):
            raise StringError(key, f"{key} {v!r} is not a count")
    lo, hi = int(lo), None if hi is None else int(hi)
    pattern = schema.get("pattern")
    body = ANY_CHAR + "*" if pattern is None else _pattern_body(pattern, 0, None, intersect=True, over=True)
    if lo or hi is not None:
        body = both(body, repeat(ANY_CHAR, lo, hi))
    return seq('"', body, '"')


@functools.lru_cache(maxsize=1024)
def string_regex(spec: StringSpec) -> Rx:
    """Regex of the JSON string literals (with quotes) that satisfy ``spec``; None if none.

    Kept across requests (``spec`` is a frozen value): the same formats and patterns come back
    in schema after schema, and translating one (``format: "regex"``, an email) costs
    milliseconds. A refusal (``StringError``) is not kept; it is raised anew each time.

    Raises:
        StringError: a pattern we cannot translate, a checked format we do not cover, or a
            combination (e.g. format plus pattern) we cannot intersect exactly.
    """
    lo, hi = spec.min_length, spec.max_length
    if hi is not None and hi < lo:
        return None
    fmt = None
    if spec.format is not None:
        try:
            fmt = format_pattern(spec.format)
        except KeyError:
            raise StringError("format", f"format {spec.format!r} is not supported") from None
    if fmt is not None and spec.pattern is not None:
        if not spec.intersect:
            raise StringError("pattern", "pattern together with format is not supported")
        body = both(_pattern_body("^(?:" + fmt + ")\\Z", lo, hi, True),
                    _pattern_body(spec.pattern, lo, hi, True))
    elif fmt is not None:
        body = _pattern_body("^(?:" + fmt + ")\\Z", lo, hi, spec.intersect)
    elif spec.pattern is not None:
        body = _pattern_body(spec.pattern, lo, hi, spec.intersect)
    elif hi is None:
        body = repeat(ANY_CHAR, lo, None)
    else:
        cap = hi if spec.max_length_cap is None else max(min(hi, spec.max_length_cap), lo)
        body = repeat(ANY_CHAR if spec.exact_chars else BOUNDED_CHAR, lo, cap)
    return seq('"', body, '"')


def excluded_keys_regex(names: list[str]) -> Rx:
    """String literals whose decoded value is *not* one of ``names`` (a trie complement)."""
    return _excluded_keys(tuple(dict.fromkeys(names)))


@functools.lru_cache(maxsize=256)
def _excluded_keys(names: tuple[str, ...]) -> Rx:
    trie: dict = {}
    for name in names:
        node = trie
        for ch in name:
            node = node.setdefault(ch, {})
        node[""] = {}

    def walk(node: dict) -> Rx:
        children = [c for c in node if c != ""]
        others = cs.complement(cs.chars("".join(children)))
        parts: list[Rx] = []
        if "" not in node:
            parts.append("")
        parts.append(seq(cs.json_char(others), ANY_CHAR + "*"))
        for c in children:
            parts.append(seq(cs.json_char(cs.chars(c)), walk(node[c])))
        return alt(parts)

    return seq('"', walk(trie), '"')
