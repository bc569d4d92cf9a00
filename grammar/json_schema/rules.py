"""Regex text with references → Lark (llguidance's dialect) or plain regex.

The schema compiler writes regex text (:mod:`grammar.json_schema.rx`) with two kinds of
references, each two private-use characters around a number (the compiler never emits those
characters otherwise: :func:`grammar.json_schema.charset.literal` escapes them):

* a *terminal reference* ``\\ue002<n>\\ue003`` (:func:`term_ref`) stands for a piece of regex the
  compiler wrote once and uses many times (the JSON string pattern, a ``$ref`` definition);
  :func:`expand` writes the plain regex (what the eager backend needs), and in Lark it is a named
  terminal: still one lexeme, so the language is the regex's exactly, but llguidance parses each
  piece once (Kubernetes schemas: 102 k characters of regex, 3 k of distinct text, ten times
  faster to build);
* a *rule reference* ``\\ue000<n>\\ue001`` (:func:`ref`) stands for a definition that refers to
  itself (recursion), which no regex can say; rule ``n``'s body is that definition's text.

:func:`to_lark` parses the texts in the compiler's regex dialect and writes the grammar: rule
bodies as Lark rules in which every maximal piece without rule references is one lexeme (a named
terminal), terminals as terminal definitions.

One caveat of the lexer, for rules only: llguidance lexes greedily (a lexeme that can go on
does), so where a lexeme could both end and continue into the next one, some documents the regex
accepts are refused. It can only refuse, never accept more; in JSON, lexemes end at punctuation,
where it does not arise in practice, and the differential tests check it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

REF_OPEN, REF_CLOSE = "\ue000", "\ue001"
TERM_OPEN, TERM_CLOSE = "\ue002", "\ue003"
AND_OPEN, AND_MID, AND_CLOSE = "\ue004", "\ue005", "\ue006"
MARKS = frozenset(map(ord, REF_OPEN + REF_CLOSE + TERM_OPEN + TERM_CLOSE + AND_OPEN + AND_MID + AND_CLOSE))
_TERM = re.compile(TERM_OPEN + r"(\d+)" + TERM_CLOSE)


def ref(n: int) -> str:
    """The regex-text stand-in for rule ``n``."""
    return f"{REF_OPEN}{n}{REF_CLOSE}"


def term_ref(n: int) -> str:
    """The regex-text stand-in for terminal ``n``."""
    return f"{TERM_OPEN}{n}{TERM_CLOSE}"


def both(a: str | None, b: str | None) -> str | None:
    """The intersection of two regexes (``None``: empty); llguidance's ``&``, which a plain
    regex cannot say: a program using it is served by the lazy backend only."""
    if a is None or b is None:
        return None
    return f"{AND_OPEN}{a}{AND_MID}{b}{AND_CLOSE}"


def is_regular_text(text: str, terminals=()) -> bool:
    """Whether ``text`` (with its terminals) can be written as a plain regex (no rule
    references, no intersections)."""
    return (REF_OPEN not in text and AND_OPEN not in text
            and not any(AND_OPEN in t or REF_OPEN in t for t in terminals))


def has_refs(text: str) -> bool:
    """Whether ``text`` refers to a rule (so it is not a regular language as written)."""
    return REF_OPEN in text


def expanded_size(text: str, terminals: list[str] | tuple[str, ...]) -> int:
    """Characters of :func:`expand` ``(text, terminals)`` without writing it (DAG sizes)."""
    sizes: dict[int, int] = {}

    def size(t: str) -> int:
        total, last = 0, 0
        for m in _TERM.finditer(t):
            n = int(m.group(1))
            if n not in sizes:
                sizes[n] = size(terminals[n]) + 4  # "(?:" + ")"
            total += m.start() - last + sizes[n]
            last = m.end()
        return total + len(t) - last

    return size(text)


def expand(text: str, terminals: list[str] | tuple[str, ...]) -> str:
    """``text`` with every terminal reference replaced by its regex, grouped (a plain regex)."""
    done: dict[int, str] = {}

    def sub(m: re.Match) -> str:
        n = int(m.group(1))
        if n not in done:
            done[n] = "(?:" + _TERM.sub(sub, terminals[n]) + ")"
        return done[n]

    out = _TERM.sub(sub, text)
    if AND_OPEN in out:
        raise ValueError("an intersection (&) has no plain-regex form")
    return out


@dataclass(slots=True)
class _Node:
    kind: str  # "seq", "alt", "rep", "group", "atom", "ref" (rule), "term" (terminal)
    start: int
    end: int
    children: list["_Node"] = field(default_factory=list)
    lo: int = 0
    hi: int | None = None
    number: int = -1  # of the rule or terminal referred to
    has_ref: bool = False  # refers to a rule somewhere inside
    has_term: bool = False  # refers to a terminal somewhere inside


_REPEAT = re.compile(r"\{(\d+)(,(\d*))?\}")
_SEQ_END = frozenset("|)" + AND_MID + AND_CLOSE)
_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)", re.S)


class _Parser:
    """A parser for the compiler's regex dialect: ``(?:...)``, ``|``, quantifiers ``? * + {m}
    {m,} {m,n}``, classes ``[...]``, escapes ``\\c``/``\\xHH``/``\\uHHHH``, references."""

    def __init__(self, text: str):
        self.s = text
        self.i = 0

    def parse(self) -> _Node:
        node = self._alt()
        if self.i != len(self.s):
            raise ValueError(f"unexpected {self.s[self.i]!r} at {self.i}")
        return node

    def _alt(self) -> _Node:
        start = self.i
        branches = [self._seq()]
        while self.i < len(self.s) and self.s[self.i] == "|":
            self.i += 1
            branches.append(self._seq())
        if len(branches) == 1:
            return branches[0]
        return _Node("alt", start, self.i, branches, has_ref=any(b.has_ref for b in branches),
                     has_term=any(b.has_term for b in branches))

    def _seq(self) -> _Node:
        start = self.i
        items: list[_Node] = []
        while self.i < len(self.s) and self.s[self.i] not in _SEQ_END:
            items.append(self._quantified())
        return _Node("seq", start, self.i, items, has_ref=any(n.has_ref for n in items),
                     has_term=any(n.has_term for n in items))

    def _quantified(self) -> _Node:
        atom = self._atom()
        s = self.s
        while self.i < len(s) and s[self.i] in "?*+{":
            c = s[self.i]
            if c == "{":
                m = _REPEAT.match(s, self.i)
                if m is None:
                    raise ValueError(f"bad repetition at {self.i}")
                lo = int(m.group(1))
                hi = lo if m.group(2) is None else (int(m.group(3)) if m.group(3) else None)
                self.i = m.end()
            else:
                lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[c]
                self.i += 1
            atom = _Node("rep", atom.start, self.i, [atom], lo, hi, has_ref=atom.has_ref,
                         has_term=atom.has_term)
        return atom

    def _atom(self) -> _Node:
        s, start = self.s, self.i
        c = s[start]
        if c == REF_OPEN or c == TERM_OPEN:
            end = s.index(REF_CLOSE if c == REF_OPEN else TERM_CLOSE, start)
            self.i = end + 1
            rule = c == REF_OPEN
            return _Node("ref" if rule else "term", start, self.i, number=int(s[start + 1:end]),
                         has_ref=rule, has_term=not rule)
        if c == AND_OPEN:
            self.i = start + 1
            left = self._alt()
            if self.i >= len(s) or s[self.i] != AND_MID:
                raise ValueError(f"unclosed intersection at {start}")
            self.i += 1
            right = self._alt()
            if self.i >= len(s) or s[self.i] != AND_CLOSE:
                raise ValueError(f"unclosed intersection at {start}")
            self.i += 1
            return _Node("and", start, self.i, [left, right], has_ref=left.has_ref or right.has_ref,
                         has_term=True)
        if c == "(":
            if not s.startswith("(?:", start):
                raise ValueError(f"only non-capturing groups are written, at {start}")
            self.i = start + 3
            inner = self._alt()
            if self.i >= len(s) or s[self.i] != ")":
                raise ValueError(f"unclosed group at {start}")
            self.i += 1
            return _Node("group", start, self.i, [inner], has_ref=inner.has_ref, has_term=inner.has_term)
        if c == "[":
            j = start + 1
            if j < len(s) and s[j] == "^":
                j += 1
            if j < len(s) and s[j] == "]":
                j += 1
            while j < len(s) and s[j] != "]":
                j += 2 if s[j] == "\\" else 1
            self.i = j + 1
            return _Node("atom", start, self.i)
        if c == "\\":
            self.i = _ESCAPE.match(s, start).end()
            return _Node("atom", start, self.i)
        self.i = start + 1
        return _Node("atom", start, self.i)


def is_empty(root: str, rules: dict[int, str]) -> bool:
    """Whether the grammar admits no finite document (every derivation of ``root`` recurses
    forever): the usual fixpoint of productive rules (Hopcroft and Ullman 1979, §4.4)."""
    trees = {n: _Parser(body).parse() for n, body in rules.items()}
    productive: set[int] = set()

    def derives(node: _Node) -> bool:
        if not node.has_ref:
            return True
        if node.kind == "ref":
            return node.number in productive
        if node.kind == "seq":
            return all(derives(c) for c in node.children)
        if node.kind in ("alt",):
            return any(derives(c) for c in node.children)
        if node.kind == "group":
            return derives(node.children[0])
        return node.lo == 0 or derives(node.children[0])  # rep

    changed = True
    while changed:
        changed = False
        for n, tree in trees.items():
            if n not in productive and derives(tree):
                productive.add(n)
                changed = True
    return not derives(_Parser(root).parse())


def to_lark(root: str, rules: dict[int, str], terminals: list[str] | tuple[str, ...] = ()) -> str:
    """A Lark grammar whose ``start`` is ``root``; rule ``n`` is named ``r<n>``, terminal ``n``
    ``T<n>``. Without rules it is one terminal (``start: MAIN``): the regex's language exactly.

    Raises:
        ValueError: text outside the compiler's regex dialect (a bug, not a user error).
    """
    w = _Writer(terminals)
    if not rules and not has_refs(root):
        lines = [f"start: MAIN", f"MAIN: {w.terminal(_Parser(root).parse(), root) or chr(34) * 2}"]
    else:
        lines = [f"start: {w.rule(root)}"]
        lines += [f"r{n}: {w.rule(rules[n])}" for n in sorted(rules)]
    return "\n".join(lines + w.defs) + "\n"


def _lexeme(text: str) -> str:
    # Lark's /.../ delimiters: a slash inside is escaped; llguidance reads the rest as Rust regex.
    return "/" + text.replace("/", "\\/") + "/"


def _op(lo: int, hi: int | None) -> str:
    op = {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((lo, hi))
    if op is None:
        op = "{" + str(lo) + ("" if hi == lo else "," + ("" if hi is None else str(hi))) + "}"
    return op


_MAX_NESTING = 24  # llguidance refuses Lark nested too deeply; deeper pieces get a name


class _Writer:
    """Writes parsed texts as Lark: rule expressions and terminal definitions (shared)."""

    def __init__(self, terminals):
        self.terminals = terminals
        self.defs: list[str] = []
        self.named: set[int] = set()
        self.pieces: dict[str, str] = {}  # lexeme text with terminal references → its name
        self.deep: dict[tuple[str, str], str] = {}  # (kind, text) of a deep piece → its name

    def _deep_name(self, kind: str, text: str, write) -> str:
        """A name for a piece nested too deeply: a terminal (``N<k>``) or a rule (``q<k>``)."""
        name = self.deep.get((kind, text))
        if name is None:
            name = self.deep[(kind, text)] = f"{'N' if kind == 'terminal' else 'q'}{len(self.deep)}"
            self.defs.append(f"{name}: {write()}")
        return name

    def rule(self, text: str) -> str:
        return self._rule(_Parser(text).parse(), text) or '""'

    def _name_terminal(self, n: int) -> str:
        if n not in self.named:
            self.named.add(n)
            body = self.terminals[n]
            self.defs.append(f"T{n}: {self.terminal(_Parser(body).parse(), body)}")
        return f"T{n}"

    def _lexeme(self, text: str, node: _Node | None = None) -> str:
        """One lexeme for the rule-free ``text``: a regex, or a named terminal when it uses terminals."""
        if not text:
            return ""
        if TERM_OPEN not in text and AND_OPEN not in text:
            return _lexeme(text)
        name = self.pieces.get(text)
        if name is None:
            name = self.pieces[text] = f"L{len(self.pieces)}"
            tree = node if node is not None else _Parser(text).parse()
            self.defs.append(f"{name}: {self.terminal(tree, text)}")
        return name

    def _rule(self, node: _Node, text: str, depth: int = 0) -> str:
        if depth > _MAX_NESTING and node.has_ref and node.kind in ("group", "alt", "rep"):
            return self._deep_name("rule", text[node.start:node.end], lambda: self._rule(node, text))
        depth += 1
        if not node.has_ref:
            if node.start == 0 and node.end == len(text):
                return self._lexeme(text, node)
            return self._lexeme(text[node.start:node.end])
        if node.kind == "ref":
            return f"r{node.number}"
        if node.kind == "group":
            inner = self._rule(node.children[0], text, depth)
            return f"({inner})" if inner else ""
        if node.kind == "seq":
            parts, run = [], []
            for child in node.children:  # rule-free neighbours stay one lexeme
                if child.has_ref:
                    if run:
                        parts.append(self._lexeme(text[run[0].start:run[-1].end]))
                        run = []
                    parts.append(self._rule(child, text, depth))
                else:
                    run.append(child)
            if run:
                parts.append(self._lexeme(text[run[0].start:run[-1].end]))
            return " ".join(p for p in parts if p)
        if node.kind == "alt":
            branches = [self._rule(b, text, depth) for b in node.children]
            nonempty = [b for b in branches if b]
            body = "(" + " | ".join(nonempty) + ")"
            return body + "?" if len(nonempty) < len(branches) else body
        if node.kind == "rep":
            inner = node.children[0]
            inner = inner.children[0] if inner.kind == "group" else inner  # one pair of parentheses
            return f"({self._rule(inner, text, depth)}){_op(node.lo, node.hi)}"
        raise ValueError(f"unexpected node {node.kind}")

    def terminal(self, node: _Node, text: str, depth: int = 0) -> str:
        """Lark terminal syntax for ``node`` (no rule references inside)."""
        if depth > _MAX_NESTING and node.has_term and node.kind in ("group", "alt", "rep"):
            return self._deep_name("terminal", text[node.start:node.end], lambda: self.terminal(node, text))
        depth += 1
        if node.kind == "term":
            return self._name_terminal(node.number)
        if not node.has_term:
            span = text[node.start:node.end]
            return _lexeme(span) if span else ""
        if node.kind == "group":
            return "(" + self.terminal(node.children[0], text, depth) + ")"
        if node.kind == "and":
            a, b = (self.terminal(c, text, depth) or '""' for c in node.children)
            return f"(({a}) & ({b}))"
        if node.kind == "seq":
            parts, run = [], []
            for child in node.children:
                if child.has_term:
                    if run:
                        parts.append(_lexeme(text[run[0].start:run[-1].end]))
                        run = []
                    parts.append(self.terminal(child, text, depth))
                else:
                    run.append(child)
            if run:
                parts.append(_lexeme(text[run[0].start:run[-1].end]))
            return " ".join(parts)
        if node.kind == "alt":
            branches = [self.terminal(b, text, depth) for b in node.children]
            nonempty = [b for b in branches if b]
            body = "(" + " | ".join(nonempty) + ")"
            return body + "?" if len(nonempty) < len(branches) else body
        if node.kind == "rep":
            inner = node.children[0]
            inner = inner.children[0] if inner.kind == "group" else inner
            return f"({self.terminal(inner, text, depth)}){_op(node.lo, node.hi)}"
        raise ValueError(f"unexpected node {node.kind}")
