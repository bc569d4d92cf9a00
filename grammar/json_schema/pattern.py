"""Parse a JSON Schema ``pattern`` and re-emit it over canonical JSON string text.

``pattern`` is matched by ``jsonschema`` with Python ``re.search`` on the *decoded* string
(JSON Schema 2020-12 validation §6.3.3: unanchored). We parse the common subset of the
syntax (literals, classes, ``. \\d \\w \\s`` and negations, groups, alternation, greedy or lazy
quantifiers, ``^``/``$``/``\\A``/``\\Z`` at the ends of top-level alternatives) into a small AST
whose atoms are character sets, then emit each atom through ``stencil.grammar.charset.json_char``.

Exactness: each atom carries a subset of Python's meaning (``\\d`` → ASCII digits, ``\\w`` →
ASCII word characters; negations remove a superset), so the emitted language is a subset of
what ``re.search`` accepts and never more. With ``over=True`` each atom carries a superset instead
(for ``not: {pattern}``, written as a complement of that superset). Python's ``$`` also matches before one final
newline; that case is admitted. Lookaheads right after a leading ``^`` and a lookbehind right
before a final ``$`` or ``\\Z`` are split off (``split_lookaheads``, ``split_lookbehind``) and
written as intersections and complements by ``strings``; so is a lookaround anywhere else
(``split_lookarounds``), unless it stands in a repeated group. Backreferences, word boundaries,
inline flags and anchors in the middle raise ``PatternError``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from stencil.grammar.base import MAX_REPEAT_COUNT
from stencil.grammar.charclass import shorthand
from stencil.grammar import charset as cs
from stencil.grammar.json_schema.rx import Rx, alt, repeat, seq


class PatternError(ValueError):
    """The pattern uses syntax we cannot translate exactly; ``position`` is a character offset."""

    def __init__(self, message: str, position: int):
        super().__init__(f"{message} at position {position}")
        self.message = message
        self.position = position


@dataclass(frozen=True, slots=True)
class Atom:
    chars: cs.CharSet  # decoded characters this atom may match (a subset of Python's meaning)


@dataclass(frozen=True, slots=True)
class Seq:
    items: tuple


@dataclass(frozen=True, slots=True)
class Alt:
    items: tuple


@dataclass(frozen=True, slots=True)
class Rep:
    item: object
    lo: int
    hi: int | None


@dataclass(frozen=True, slots=True)
class Anchor:
    start: bool  # True: ^ or \A; False: $ (newline allowed before the end) or \Z
    newline_ok: bool = False


_DOT = Atom(cs.complement(cs.chars("\n")))


@functools.lru_cache(maxsize=1024)
def _literal(c: str) -> Atom:
    """The atom of one literal character (atoms are immutable: one per character serves all)."""
    return Atom(cs.chars(c))


_SIMPLE_ESCAPES = {"t": 9, "n": 10, "r": 13, "f": 12, "v": 11, "a": 7, "0": 0}


def _copies(node) -> int:
    """The largest product of nested counted repetitions under ``node`` (an unbounded one counts
    its lower bound): the copies of its innermost part a matcher unrolls."""
    if isinstance(node, Rep):
        count = node.lo if node.hi is None else node.hi
        return max(count, 1) * _copies(node.item)
    if isinstance(node, (Seq, Alt)):
        return max((_copies(x) for x in node.items), default=1)
    return 1


class _Parser:
    def __init__(self, text: str, over: bool = False):
        self.text = text
        self.i = 0
        self.over = over  # atoms take their over-approximation (a superset of Python's meaning)

    def error(self, message: str) -> PatternError:
        return PatternError(message, self.i)

    def peek(self) -> str | None:
        return self.text[self.i] if self.i < len(self.text) else None

    def parse(self):
        node = self.alternation()
        if self.i != len(self.text):
            raise self.error("unbalanced ')'")
        copies = _copies(node)
        if copies > MAX_REPEAT_COUNT:
            raise self.error(f"counted repetitions nest to {copies} copies of their innermost part, above the "
                             f"{MAX_REPEAT_COUNT} a grammar can count")
        return node

    def alternation(self):
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else Alt(tuple(branches))

    def sequence(self):
        items = []
        while self.peek() not in (None, "|", ")"):
            items.append(self.quantified(self.atom()))
        return Seq(tuple(items))

    def quantified(self, node):
        while True:
            c = self.peek()
            if c in ("*", "+", "?"):
                self.i += 1
                lo, hi = {"*": (0, None), "+": (1, None), "?": (0, 1)}[c]
            elif c == "{" and (bounds := self._braces()) is not None:
                lo, hi = bounds
            else:
                return node
            if isinstance(node, Anchor):
                raise self.error("quantified anchor")
            if self.peek() == "?":
                self.i += 1  # lazy: same language
            elif self.peek() == "+":
                raise self.error("possessive quantifier")
            node = Rep(node, lo, hi)

    def _braces(self) -> tuple[int, int | None] | None:
        end = self.text.find("}", self.i)
        if end < 0:
            return None
        body = self.text[self.i + 1:end]
        lo_s, comma, hi_s = body.partition(",")
        if not (lo_s.isdigit() or (comma and lo_s == "" and hi_s.isdigit())):
            return None
        if hi_s and not hi_s.isdigit():
            return None
        lo = int(lo_s) if lo_s else 0
        hi = (int(hi_s) if hi_s else None) if comma else lo
        if hi is not None and hi < lo:
            raise self.error("quantifier range out of order")
        if max(lo, hi or 0) > MAX_REPEAT_COUNT:
            raise self.error(f"repetition count {max(lo, hi or 0)} is above the {MAX_REPEAT_COUNT} "
                             "a grammar can count")
        self.i = end + 1
        return lo, hi

    def atom(self):
        c = self.peek()
        if c == "(":
            return self.group()
        if c == "[":
            return self.char_class()
        if c == ".":
            self.i += 1
            return _DOT
        if c == "^":
            self.i += 1
            return Anchor(start=True)
        if c == "$":
            self.i += 1
            return Anchor(start=False, newline_ok=True)
        if c in ("*", "+", "?"):
            raise self.error("nothing to repeat")
        if c == "\\":
            return self.escape(in_class=False)
        self.i += 1
        return _literal(c)

    def group(self):
        self.i += 1
        if self.text.startswith("?:", self.i):
            self.i += 2
        elif self.text.startswith("?P<", self.i) or (self.text.startswith("?<", self.i)
                                                     and self.text[self.i + 2:self.i + 3] not in ("=", "!")):
            end = self.text.find(">", self.i)
            if end < 0:
                raise self.error("unterminated group name")
            self.i = end + 1
        elif self.peek() == "?":
            raise self.error("unsupported group construct (inline flags, a conditional, a named backreference "
                             "or a lookaround inside a lookbehind)")
        node = self.alternation()
        if self.peek() != ")":
            raise self.error("missing ')'")
        self.i += 1
        return node

    def escape(self, in_class: bool):
        """Parse an escape; returns Atom/Anchor, or (under, over) sets inside a class."""
        self.i += 1
        c = self.peek()
        if c is None:
            raise self.error("trailing backslash")
        self.i += 1
        if c in "dDwWsS":
            under, over = shorthand(c)
            return (under, over) if in_class else Atom(over if self.over else under)
        if c in _SIMPLE_ESCAPES:
            cp = _SIMPLE_ESCAPES[c]
        elif c == "b" and in_class:
            cp = 8
        elif c in "xuU":
            width = {"x": 2, "u": 4, "U": 8}[c]
            digits = self.text[self.i:self.i + width]
            if len(digits) != width or any(d not in "0123456789abcdefABCDEF" for d in digits):
                raise self.error(f"bad \\{c} escape")
            self.i += width
            cp = int(digits, 16)
        elif not in_class and c in "AZ":
            return Anchor(start=(c == "A"))
        elif c.isdigit() and c != "0" and not in_class:
            raise PatternError(f"a backreference (\\{c}) is not regular", self.i - 2)
        elif c.isalnum():
            raise PatternError(f"unsupported escape \\{c}", self.i - 2)
        else:
            cp = ord(c)
        s = cs.charset((cp, cp))
        return (s, s) if in_class else Atom(s)

    def char_class(self) -> Atom:
        self.i += 1
        negate = self.peek() == "^"
        if negate:
            self.i += 1
        under: list[cs.CharSet] = []
        over: list[cs.CharSet] = []
        first = True
        while True:
            c = self.peek()
            if c is None:
                raise self.error("unterminated character class")
            if c == "]" and not first:
                self.i += 1
                break
            first = False
            lo_pair = self._class_item()
            if (self.peek() == "-" and self.text[self.i + 1:self.i + 2] not in ("]", "")
                    and len(lo_pair[0]) == 1 and lo_pair[0][0][0] == lo_pair[0][0][1]):
                self.i += 1
                hi_pair = self._class_item()
                if len(hi_pair[0]) != 1 or hi_pair[0][0][0] != hi_pair[0][0][1]:
                    raise self.error("bad class range")
                lo, hi = lo_pair[0][0][0], hi_pair[0][0][0]
                if hi < lo:
                    raise self.error("class range out of order")
                lo_pair = (((lo, hi),), ((lo, hi),))
            under.append(lo_pair[0])
            over.append(lo_pair[1])
        if negate:
            return Atom(cs.complement(cs.union(*(under if self.over else over))))
        return Atom(cs.union(*(over if self.over else under)))

    def _class_item(self) -> tuple[cs.CharSet, cs.CharSet]:
        c = self.peek()
        if c == "\\":
            return self.escape(in_class=True)
        self.i += 1
        s = cs.chars(c)
        return s, s


def parse(pattern: str, over: bool = False):
    """Parse ``pattern`` into the AST above; raises ``PatternError``. ``over``: each atom takes a
    superset of Python's meaning instead of a subset (``\\d`` → every Unicode digit), so that
    the language is a superset of what ``re.search`` accepts: the form a complement needs."""
    return _Parser(pattern, over).parse()


def split_lookaheads(pattern: str) -> tuple[str, list[tuple[bool, str, int]]] | None:
    """``^(?=X)(?!Y)REST`` as ``("^REST", [(False, X, 4), (True, Y, 10)])`` (True: a negative
    lookahead; then where its body starts in ``pattern``); None where ``pattern`` does not open
    with ``^`` (or ``\\A``) and a lookahead.

    After a leading ``^`` the lookaheads all look from the string's start, so the pattern
    matches (``re.search``) exactly the strings that ``^REST`` matches, that each ``^(?:X)``
    matches and that no ``^(?:Y)`` matches: an intersection and complements, which the grammar
    can write. None too where ``REST`` holds a top-level ``|`` (``^(?=X)a|b`` is
    ``(?:^(?=X)a)|b``: ``split_lookarounds`` reads that).

    Raises:
        PatternError: an unterminated group.
    """
    i = 1 if pattern.startswith("^") else 2 if pattern.startswith("\\A") else 0
    if not i or not pattern.startswith(("(?=", "(?!"), i):
        return None
    anchor, looks = pattern[:i], []
    while pattern.startswith(("(?=", "(?!"), i):
        end = _group_end(pattern, i)
        looks.append((pattern[i + 2] == "!", pattern[i + 3:end], i + 3))
        i = end + 1
    rest = pattern[i:]
    if _scan(rest)[0] is not None:
        return None  # ``^(?=X)a|b`` is ``(?:^(?=X)a)|b``: ``split_lookarounds`` reads it
    if rest.startswith(anchor):  # ``^(?!X)^a``: the second anchor says nothing more
        rest = rest[len(anchor):]
    return anchor + rest, looks


def split_lookbehind(pattern: str) -> tuple[str, bool, str, int, bool] | None:
    """``HEAD(?<!X)$`` as ``(HEAD, True, X, where X starts, True)`` (True: a negative
    lookbehind; the last: ``$`` rather than ``\\Z``); None where ``pattern`` does not end with
    a lookbehind and an end anchor, or has a top-level ``|``.

    The lookbehind then looks back from where ``HEAD`` ends, so the strings are ``HEAD\\Z``'s
    that end (or do not end) with one of ``X``'s, then for ``$`` an optional newline:
    an intersection or a complement with ``.*X``, which the grammar can write.

    Raises:
        PatternError: a lookbehind whose strings differ in length (Python refuses it too).
    """
    end = 1 if pattern.endswith("$") and not pattern.endswith("\\$") else 2 if pattern.endswith("\\Z") else 0
    if not end or not pattern.endswith(")", 0, len(pattern) - end):
        return None
    bar, last = _scan(pattern)
    if bar is not None or last is None or _group_end(pattern, last) != len(pattern) - end - 1:
        return None
    if not pattern.startswith(("(?<=", "(?<!"), last):
        return None
    look = pattern[last + 4:len(pattern) - end - 1]
    try:
        lo, hi = length_range(parse(look))
    except PatternError as exc:
        raise PatternError(exc.message, exc.position + last + 4) from None
    if lo != hi:
        raise PatternError("a lookbehind must match strings of one length", last)
    return pattern[:last], pattern[last + 3] == "!", look, last + 4, end == 1


def top_branches(text: str) -> list[tuple[str, int]]:
    """``text``'s top-level alternatives, each with where it starts in ``text``.

    Raises:
        PatternError: an unterminated group.
    """
    out, start = [], 0
    while (bar := _scan(text, start)[0]) is not None:
        out.append((text[start:bar], start))
        start = bar + 1
    return out + [(text[start:], start)]


def _scan(text: str, i: int = 0) -> tuple[int | None, int | None]:
    """Where ``text``'s first top-level ``|`` from ``i`` on is, and where its last top-level
    group before that opens."""
    last = None
    while i < len(text):
        nxt, c = _step(text, i)
        if c == "|":
            return i, last
        if c == "(":
            last, nxt = i, _group_end(text, i) + 1
        i = nxt
    return None, last


def _step(text: str, i: int) -> tuple[int, str | None]:
    """Where the piece at ``text[i]`` ends, and its character: ``None`` for an escape or a
    character class (a single step, where ``(``, ``)`` and ``|`` are literal)."""
    c = text[i]
    if c == "\\":
        return i + 2, None
    if c == "[":
        return _class_end(text, i) + 1, None
    return i + 1, c


def _class_end(text: str, i: int) -> int:
    """The index of the ``]`` that closes the class opened at ``text[i]`` (or the text's end)."""
    i += 1
    if i < len(text) and text[i] == "^":
        i += 1
    if i < len(text) and text[i] == "]":  # a ']' first in a class is literal
        i += 1
    while i < len(text) and text[i] != "]":
        i += 2 if text[i] == "\\" else 1
    return i


def _group_end(text: str, start: int) -> int:
    """The index of the ``)`` that closes the group opened at ``text[start]``; skips escapes and
    character classes (where ``(`` and ``)`` are literal).

    Raises:
        PatternError: the group is not closed.
    """
    depth, i = 0, start
    while i < len(text):
        nxt, c = _step(text, i)
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i = nxt
    raise PatternError("missing ')'", start)


def length_range(node) -> tuple[int, int | None]:
    """(min, max) number of decoded characters ``node`` matches (max None = unbounded)."""
    if isinstance(node, Atom):
        return 1, 1
    if isinstance(node, Anchor):
        return 0, 0
    if isinstance(node, Seq):
        lo, hi = 0, 0
        for item in node.items:
            a, b = length_range(item)
            lo += a
            hi = None if hi is None or b is None else hi + b
        return lo, hi
    if isinstance(node, Alt):
        ranges = [length_range(b) for b in node.items]
        return min(r[0] for r in ranges), (None if any(r[1] is None for r in ranges)
                                           else max(r[1] for r in ranges))
    a, b = length_range(node.item)
    return a * node.lo, (None if node.hi is None or b is None else b * node.hi)


def emit(node) -> Rx:
    """Regex over canonical JSON string text for an anchor-free AST (None = empty language)."""
    if isinstance(node, Atom):
        return cs.json_char(node.chars)
    if isinstance(node, Seq):
        return seq(*(emit(i) for i in node.items))
    if isinstance(node, Alt):
        return alt([emit(b) for b in node.items])
    if isinstance(node, Rep):
        return repeat(emit(node.item), node.lo, node.hi)
    raise PatternError("anchor inside the pattern", 0)


@dataclass(frozen=True, slots=True)
class Branch:
    """One top-level alternative with its end anchors removed."""

    body: object
    start: bool
    end: bool
    newline_ok: bool


def branches(node) -> list[Branch]:
    """Split the top-level alternatives and strip their anchors; raises on anchors elsewhere."""
    top = node.items if isinstance(node, Alt) else (node,)
    out = []
    for b in top:
        items = list(b.items) if isinstance(b, Seq) else [b]
        if len(items) == 1 and isinstance(items[0], Alt):
            out.extend(branches(items[0]))
            continue
        start = bool(items) and isinstance(items[0], Anchor) and items[0].start
        if start:
            items = items[1:]
        end = bool(items) and isinstance(items[-1], Anchor) and not items[-1].start
        newline_ok = end and items[-1].newline_ok
        if end:
            items = items[:-1]
        if len(items) == 1 and isinstance(items[0], Alt) and (start or end):
            for sub in branches(items[0]):
                if sub.start or sub.end:
                    raise PatternError("anchor inside the pattern", 0)
                out.append(Branch(sub.body, start, end, newline_ok))
            continue
        body = Seq(tuple(items))
        if _has_anchor(body):
            raise PatternError("anchor inside the pattern", 0)
        out.append(Branch(body, start, end, newline_ok))
    return out


def _has_anchor(node) -> bool:
    if isinstance(node, Anchor):
        return True
    if isinstance(node, (Seq, Alt)):
        return any(_has_anchor(i) for i in node.items)
    if isinstance(node, Rep):
        return _has_anchor(node.item)
    return False


# -- lookaround anywhere ------------------------------------------------------------------------------

_LOOKS = ("(?=", "(?!", "(?<=", "(?<!")


@dataclass(frozen=True, slots=True)
class Placed:
    """A text rewritten from a pattern, with where each of its characters stands in the pattern
    (``where[i]``: the pattern offset of ``text[i]``), so that an error in the rewritten text
    names the place the user wrote."""

    text: str
    where: tuple[int, ...]

    def __getitem__(self, s: slice) -> "Placed":
        return Placed(self.text[s], self.where[s])

    def __add__(self, other: "Placed") -> "Placed":
        return Placed(self.text + other.text, self.where + other.where)

    def at(self, position: int | None) -> int | None:
        """The pattern offset of ``position`` in ``text`` (past the end: after the last one)."""
        if position is None or not self.where:
            return position
        return self.where[position] if 0 <= position < len(self.where) else self.where[-1] + 1

    @staticmethod
    def put(text: str, where: int) -> "Placed":
        """Text the rewrite adds (an anchor, a group), placed at one pattern offset."""
        return Placed(text, (where,) * len(text))


@dataclass(frozen=True, slots=True)
class LookSplit:
    """One alternative of a pattern, ``HEAD (?=LOOK) TAIL`` (or ``(?!``, ``(?<=``, ``(?<!``), at
    its first lookaround outside every group: the strings are a ``HEAD`` match followed by a
    ``TAIL`` match that (for ``behind``: a ``HEAD`` match that) the lookaround admits.

    Attributes:
        head: the text before the lookaround, with the alternative's leading anchor.
        negative: ``(?!`` or ``(?<!``.
        behind: ``(?<=`` or ``(?<!``.
        look: the lookaround's body.
        tail: the text after it, with the alternative's end anchor.
        where: the pattern offset of the lookaround's ``(``.
    """

    head: Placed
    negative: bool
    behind: bool
    look: Placed
    tail: Placed
    where: int


def has_lookaround(text: str) -> bool:
    """Whether a lookaround group opens anywhere in ``text`` (not in a class or an escape)."""
    return _has_group(text, _LOOKS)


def _has_group(text: str, openings: tuple[str, ...]) -> bool:
    i = 0
    while i < len(text):
        nxt, c = _step(text, i)
        if c == "(" and text.startswith(openings, i):
            return True
        i = nxt
    return False


def split_lookarounds(pattern: Placed) -> list[Placed | LookSplit]:
    """``pattern``'s alternatives, each either without lookaround (a ``Placed`` text) or split at
    its first lookaround outside every group (``LookSplit``).

    A group that holds a lookaround is written out into its alternatives first (``a(b|c(?=d))e``
    is ``abe`` or ``ac(?=d)e``), which keeps the language since the group is not repeated: then
    each lookaround stands in the top sequence of an alternative, and what follows (or precedes)
    it there is the rest of the string the lookaround looks at.

    Raises:
        PatternError: a lookaround in a repeated group or itself repeated, a lookbehind whose
            strings differ in length (Python refuses it too), an unterminated group; positions
            are the pattern's.
    """
    out: list[Placed | LookSplit] = []
    for text in _written_out(pattern):
        out.append(_split_first(text))
    return out


def _written_out(text: Placed) -> list[Placed]:
    """``text``'s alternatives with every group that holds a lookaround written out."""
    out: list[Placed] = []
    for branch, offset in top_branches(text.text):
        b = text[offset:offset + len(branch)]
        out.extend(_open_groups(b))
    return out


def _open_groups(b: Placed) -> list[Placed]:
    t, i = b.text, 0
    while i < len(t):
        nxt, c = _step(t, i)
        if c == "(":
            end = _group_end(t, i)
            if not t.startswith(_LOOKS, i) and has_lookaround(t[i + 1:end]):
                if _quantifier_end(t, end + 1) != end + 1:
                    raise PatternError("a lookaround inside a repeated group", b.where[i])
                body = i + 1 + _group_opening(t, i)
                out = []
                for sub, offset in top_branches(t[body:end]):
                    inner = b[body + offset:body + offset + len(sub)]
                    out.extend(_open_groups(b[:i] + inner + b[end + 1:]))
                return out
            nxt = end + 1
        i = nxt
    return [b]


def _group_opening(t: str, i: int) -> int:
    """How many characters after the ``(`` at ``t[i]`` open the group (``?:``, ``?P<n>``)."""
    if t.startswith("?:", i + 1):
        return 2
    if t.startswith(("?P<", "?<"), i + 1):
        close = t.find(">", i + 1)
        return close - i if close >= 0 else 0
    return 0


def _quantifier_end(t: str, i: int) -> int:
    """Where a quantifier starting at ``t[i]`` ends (``i`` itself when none starts there)."""
    if i < len(t) and t[i] in "*+?":
        end = i + 1
    elif i < len(t) and t[i] == "{":
        close = t.find("}", i)
        lo, comma, hi = t[i + 1:close].partition(",") if close > 0 else ("x", "", "")
        if not (lo.isdigit() or (comma and lo == "" and hi.isdigit())) or (hi and not hi.isdigit()):
            return i
        end = close + 1
    else:
        return i
    return end + 1 if end < len(t) and t[end] in "?+" else end


def _split_first(b: Placed) -> Placed | LookSplit:
    """Split ``b`` at its last lookbehind, or where it has none at its first lookahead: then
    every lookaround left in the head is a lookbehind, which looks back within the head, and
    every one in the tail a lookahead, which looks on within the tail, so that each part reads
    as a string of its own."""
    t, i, found = b.text, 0, []
    while i < len(t):
        nxt, c = _step(t, i)
        if c == "(":
            end = _group_end(t, i)
            if t.startswith(_LOOKS, i):
                if _quantifier_end(t, end + 1) != end + 1:
                    raise PatternError("a repeated lookaround", b.where[end + 1])
                found.append((i, end, t[i + 2] == "<"))
            nxt = end + 1
        i = nxt
    if not found:
        return b
    behinds = [f for f in found if f[2]]
    first_ahead = next((f for f in found if not f[2]), None)
    if behinds and first_ahead is not None and first_ahead[0] < behinds[-1][0]:
        raise PatternError("a lookbehind after a lookahead (each would look into the other's part)",
                           b.where[behinds[-1][0]])
    i, end, behind = behinds[-1] if behinds else first_ahead
    body = i + (4 if behind else 3)
    look = b[body:end]
    if behind:
        lo, hi = length_range(_parse_placed(look))
        if lo != hi:
            raise PatternError("a lookbehind must match strings of one length", b.where[i])
    elif has_lookbehind(look.text) and b.text[:i] not in ("^", "\\A"):
        raise PatternError("a lookbehind inside a lookahead that is not at the start", b.where[i])
    return LookSplit(b[:i], t[body - 1] == "!", behind, look, b[end + 1:], b.where[i])


def has_lookbehind(text: str) -> bool:
    """Whether a lookbehind group opens anywhere in ``text``."""
    return _has_group(text, ("(?<=", "(?<!"))


def has_lookahead(text: str) -> bool:
    """Whether a lookahead group opens anywhere in ``text``."""
    return _has_group(text, ("(?=", "(?!"))


def _parse_placed(text: Placed):
    try:
        return parse(text.text)
    except PatternError as exc:
        raise PatternError(exc.message, text.at(exc.position)) from None
