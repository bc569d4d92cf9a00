"""The program a grammar backend runs (``Program``), and its format: regex text with references,
written out as Lark (llguidance's dialect) or as a plain regex.

With ``stencil.grammar.charclass`` and ``stencil.grammar.charset`` this is the ground floor of
``grammar/``: of the package it imports only ``charclass``, which imports only ``charset``, which
imports nothing (``tests/test_layout.py`` keeps it so).

The schema compiler writes regex text (:mod:`stencil.grammar.json_schema.rx`) with two kinds of
references, each two private-use characters around a number (the compiler never emits those
characters otherwise: :func:`stencil.grammar.charset.literal` escapes them):

* a *terminal reference* ``\\ue002<n>\\ue003`` (:func:`term_ref`) stands for a piece of regex the
  compiler wrote once and uses many times (the JSON string pattern, a ``$ref`` definition);
  :func:`expand` writes the plain regex (what the eager backend needs), and in Lark it is a named
  terminal, part of the lexeme around it (or a lexeme of its own, below), so llguidance parses
  each piece once (Kubernetes schemas: 102 k characters of regex, 3 k of distinct text, ten times
  faster to build);
* a *rule reference* ``\\ue000<n>\\ue001`` (:func:`ref`) stands for a definition that refers to
  itself (recursion), which no regex can say; rule ``n``'s body is that definition's text.

:func:`to_lark` parses the texts in the compiler's regex dialect and writes the grammar: rule
bodies as Lark rules in which every maximal piece without rule references is one lexeme (a named
terminal), terminals as terminal definitions. A schema's program also names its *value
terminals* (``Program.value_terms``: every key's and value's regex): the Lark form cuts lexemes
there too, so that llguidance's lexemes are JSON's own tokens (keys, scalars, and the punctuation
and whitespace between them), whose lexer states every string of one kind shares.

The lexer's caveat: llguidance lexes greedily and never backs up (a lexeme that can go on does),
so where one lexeme could both end and continue into what the next one starts with, documents the
regex accepts are refused (never more accepted). Cut at JSON's tokens, no lexeme is a proper
prefix of another's continuation, numbers aside (followed by none of their own characters); a
run between two rule references kept whole was not so (``"a":1(,"b":2)?`` then ``,"c":``), and a
container's literal text beside the same place's structure is not: :func:`cuttable` says when a
program is cut, and the differential tests (``tests/grammar/test_value_lexemes.py``) check it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from stencil.grammar.charclass import class_ranges

REF_OPEN, REF_CLOSE = "\ue000", "\ue001"
TERM_OPEN, TERM_CLOSE = "\ue002", "\ue003"
AND_OPEN, AND_MID, AND_CLOSE = "\ue004", "\ue005", "\ue006"
AND_NOT_MID = "\ue007"  # in place of AND_MID: the left side minus the right one (``a & ~b``)
MARKS = frozenset(map(ord, REF_OPEN + REF_CLOSE + TERM_OPEN + TERM_CLOSE + AND_OPEN + AND_MID + AND_CLOSE
                      + AND_NOT_MID))
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


def minus(a: str | None, b: str | None) -> str | None:
    """The strings of ``a`` that ``b`` does not match (``None``: empty); llguidance's ``a & ~b``,
    lazy backend only, like :func:`both`."""
    if a is None or b is None:
        return a
    return f"{AND_OPEN}{a}{AND_NOT_MID}{b}{AND_CLOSE}"


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
                sizes[n] = size(terminals[n]) + (0 if _one_group(terminals[n]) else 4)  # "(?:" + ")"
            total += m.start() - last + sizes[n]
            last = m.end()
        return total + len(t) - last

    return size(text)


def _one_group(rx: str) -> bool:
    """Whether ``rx`` is one group, ``(...)`` from its first character to its last."""
    if not rx.startswith("(") or not rx.endswith(")"):
        return False
    depth, i, n = 0, 0, len(rx)
    while i < n:
        c = rx[i]
        if c == "\\":
            i += 2
            continue
        if c == "[":  # a class: to its closing bracket (one right after the opening is a member)
            i += 2 if rx.startswith("[^", i) else 1
            i += 1 if i < n and rx[i] == "]" else 0
            while i < n and rx[i] != "]":
                i += 2 if rx[i] == "\\" else 1
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i == n - 1
        i += 1
    return False


def expand(text: str, terminals: list[str] | tuple[str, ...]) -> str:
    """``text`` with every terminal reference replaced by its regex, grouped unless it is one
    group already (a plain regex)."""
    done: dict[int, str] = {}

    def sub(m: re.Match) -> str:
        n = int(m.group(1))
        if n not in done:
            body = _TERM.sub(sub, terminals[n])
            done[n] = body if _one_group(body) else "(?:" + body + ")"
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
    negated: bool = False  # an "and" node whose right side is complemented (``minus``)
    has_ref: bool = False  # refers to a rule somewhere inside
    has_term: bool = False  # refers to a terminal somewhere inside


# A run of characters that are atoms on their own (no metacharacter, class, escape or mark).


def _parse(text: str, cache: dict | None = None, shallow: bool = False) -> "_Node":
    """The parse tree of ``text``, from ``cache`` (text → tree) when it is there.

    ``shallow``: a group without references is one childless node (what :func:`to_lark` and
    :func:`is_empty` need: they write such a group verbatim), not parsed inside; a cache holds
    shallow and full trees under different keys."""
    if cache is None:
        return _Parser(text, shallow).parse()
    key = (text, True) if shallow else text
    tree = cache.get(key)
    if tree is None:
        tree = cache[key] = _Parser(text, shallow).parse()
    return tree


_MARK_CHARS = "".join(chr(c) for c in range(0xE000, 0xE008))
# One token of the dialect; a run of plain characters is one token (scanned in C, not per char).
_TOKEN = re.compile(
    r"(?P<plain>[^\\()|?*+{\[" + _MARK_CHARS + r"]+)"
    r"|(?P<esc>\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.))"
    r"|(?P<cls>\[\^?\]?(?:\\.|[^\]\\])*\])"
    r"|(?P<open>\(\?:)|(?P<close>\))|(?P<bar>\|)"
    r"|(?P<quant>[?*+]|\{\d+(?:,\d*)?\})"
    r"|(?P<ref>\ue000\d+\ue001)|(?P<term>\ue002\d+\ue003)"
    r"|(?P<and>\ue004)|(?P<mid>[\ue005\ue007])|(?P<end>\ue006)", re.S)


_ATOM = (r"(?:[^\\()|?*+{\[" + _MARK_CHARS + r"]|\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)"
         r"|\[\^?\]?(?:\\.|[^\]\\])*\])")
# A group with no group, reference or intersection inside (``(?:0|-?[1-9][0-9]*)``), written
# verbatim by the shallow writers.
_FLAT_GROUP = (r"\(\?:(?:[^\\()\[" + _MARK_CHARS + r"]++|\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)"
               r"|\[\^?\]?(?:\\.|[^\]\\])*+\])*+\)")
# Shallow parses: a run of atoms, flat groups and their quantifiers (no other group, no bar or
# reference outside a flat group) is one token, starting at an atom or a flat group so that a
# quantifier after any other group stays that group's. Fewer tokens: the Lark writer's Python
# loop runs once a token, on every request's path to its first mask.
_TOKEN_SHALLOW = re.compile(
    r"(?P<lit>(?:" + _ATOM + "|" + _FLAT_GROUP + r")(?:[^\\()|{\[" + _MARK_CHARS + r"]++"
    r"|\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)|" + _FLAT_GROUP +
    r"|\[\^?\]?(?:\\.|[^\]\\])*+\]|\{\d+(?:,\d*)?\})*+)|" + _TOKEN.pattern, re.S)


class _Parser:
    """A parser for the compiler's regex dialect: ``(?:...)``, ``|``, quantifiers ``? * + {m}
    {m,} {m,n}``, classes ``[...]``, escapes ``\\c``/``\\xHH``/``\\uHHHH``, references.

    The text is cut into tokens first (one C-level scan; a run of literal characters is one
    token, split before a quantifier so that it binds to the last character only)."""

    def __init__(self, text: str, shallow: bool = False):
        self.s = text
        toks: list[tuple[str, int, int]] = []
        pos = 0
        for m in (_TOKEN_SHALLOW if shallow else _TOKEN).finditer(text):
            if m.start() != pos:
                raise ValueError(f"unexpected {text[pos]!r} at {pos}")
            kind = m.lastgroup
            if kind == "quant" and toks and toks[-1][0] == "plain" and toks[-1][2] - toks[-1][1] > 1:
                _, a, b = toks.pop()
                toks.append(("plain", a, b - 1))
                toks.append(("plain", b - 1, b))
            toks.append((kind, m.start(), m.end()))
            pos = m.end()
        if pos != len(text):
            raise ValueError(f"unexpected {text[pos]!r} at {pos}")
        self.toks = toks
        self.k = 0
        # shallow: open token → its close token, for groups with no reference or intersection
        self.skip: dict[int, int] = {}
        if shallow:
            stack: list[list[int]] = []  # [open index, marks inside]
            for i, (kind, _, _) in enumerate(toks):
                if kind == "open":
                    stack.append([i, 0])
                elif kind == "close" and stack:
                    j, marks = stack.pop()
                    if marks == 0:
                        self.skip[j] = i
                    elif stack:
                        stack[-1][1] += marks
                elif kind in _MARK_KINDS and stack:
                    stack[-1][1] += 1

    def _peek(self) -> str | None:
        return self.toks[self.k][0] if self.k < len(self.toks) else None

    def _pos(self) -> int:
        return self.toks[self.k][1] if self.k < len(self.toks) else len(self.s)

    def parse(self) -> _Node:
        node = self._alt()
        if self.k != len(self.toks):
            raise ValueError(f"unexpected {self.s[self._pos()]!r} at {self._pos()}")
        return node

    def _alt(self) -> _Node:
        start = self._pos()
        branches = [self._seq()]
        while self._peek() == "bar":
            self.k += 1
            branches.append(self._seq())
        if len(branches) == 1:
            return branches[0]
        return _Node("alt", start, self._pos(), branches, has_ref=any(b.has_ref for b in branches),
                     has_term=any(b.has_term for b in branches))

    def _seq(self) -> _Node:
        start = self._pos()
        items: list[_Node] = []
        while self._peek() not in _SEQ_STOP:
            items.append(self._quantified())
        return _Node("seq", start, self._pos(), items, has_ref=any(n.has_ref for n in items),
                     has_term=any(n.has_term for n in items))

    def _quantified(self) -> _Node:
        atom = self._atom()
        while self._peek() == "quant":
            _, a, b = self.toks[self.k]
            q = self.s[a:b]
            if q[0] == "{":
                lo_s, _, hi_s = q[1:-1].partition(",")
                lo = int(lo_s)
                hi = lo if "," not in q else (int(hi_s) if hi_s else None)
            else:
                lo, hi = {"?": (0, 1), "*": (0, None), "+": (1, None)}[q]
            self.k += 1
            atom = _Node("rep", atom.start, b, [atom], lo, hi, has_ref=atom.has_ref, has_term=atom.has_term)
        return atom

    def _atom(self) -> _Node:
        if self.k >= len(self.toks):
            raise ValueError("unexpected end of regex")
        kind, a, b = self.toks[self.k]
        self.k += 1
        if kind in ("plain", "esc", "cls", "lit"):
            return _Node("atom", a, b)
        if kind in ("ref", "term"):
            rule = kind == "ref"
            return _Node(kind, a, b, number=int(self.s[a + 1:b - 1]), has_ref=rule, has_term=not rule)
        if kind == "open":
            close = self.skip.get(self.k - 1)
            if close is not None:
                self.k = close + 1
                return _Node("group", a, self.toks[close][2])
            inner = self._alt()
            if self._peek() != "close":
                raise ValueError(f"unclosed group at {a}")
            end = self.toks[self.k][2]
            self.k += 1
            return _Node("group", a, end, [inner], has_ref=inner.has_ref, has_term=inner.has_term)
        if kind == "and":
            left = self._alt()
            if self._peek() != "mid":
                raise ValueError(f"unclosed intersection at {a}")
            negated = self.s[self.toks[self.k][1]] == AND_NOT_MID
            self.k += 1
            right = self._alt()
            if self._peek() != "end":
                raise ValueError(f"unclosed intersection at {a}")
            end = self.toks[self.k][2]
            self.k += 1
            return _Node("and", a, end, [left, right], has_ref=left.has_ref or right.has_ref, has_term=True,
                         negated=negated)
        raise ValueError(f"unexpected {self.s[a:b]!r} at {a}")


_SEQ_STOP = frozenset({None, "bar", "close", "mid", "end"})
_ANY_MARK = re.compile("[" + _MARK_CHARS + "]")
_MARK_KINDS = frozenset({"ref", "term", "and", "mid", "end"})


def is_empty(root: str, rules: dict[int, str], cache: dict | None = None) -> bool:
    """Whether the grammar admits no finite document (every derivation of ``root`` recurses
    forever): the usual fixpoint of productive rules (Hopcroft and Ullman 1979, §4.4).
    ``cache``: text → parse tree, shared with :func:`to_lark`."""
    trees = {n: _parse(body, cache, True) for n, body in rules.items()}
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
    return not derives(_parse(root, cache, True))


def to_lark(root: str, rules: dict[int, str], terminals: list[str] | tuple[str, ...] = (),
            cache: dict | None = None, values: frozenset[int] | set[int] = frozenset(),
            forms: dict[int, str] | None = None) -> str:
    """A Lark grammar whose ``start`` is ``root``; rule ``n`` is named ``r<n>``, terminal ``n``
    ``T<n>``. ``values``: terminals of whole JSON values (``SchemaCompiler.value_terms``), where
    one lexeme ends and the next begins: each is its own lexeme ``T<n>``, or a rule ``v<n>`` when
    values are inside it, and what lies between them (brackets, commas, colons, whitespace) is
    one lexeme a run (see ``cuttable`` for when that is exact, and why the masks are faster:
    llguidance builds lexer states per lexeme, shared by every string of one kind, instead of
    states of one lexeme spelling the whole document). Without rules or value terminals it is
    one terminal (``start: MAIN``): the regex's language exactly. ``forms``: terminal number →
    the text written for it instead (the same language, read faster: ``Program.lark_forms``).

    Raises:
        ValueError: text outside the compiler's regex dialect (a bug, not a user error).
    """
    w = _Writer(terminals, {} if cache is None else cache, values, forms)
    if not rules and not has_refs(root) and not values:
        lines = ["start: MAIN", f"MAIN: {w.terminal_text(root)}"]
    else:
        lines = [f"start: {w.rule(root)}"]
        lines += [f"r{n}: {w.rule(rules[n])}" for n in sorted(rules)]
    return "\n".join(lines + w.defs) + "\n"


# An empty object or array, ``\{`` and ``\}`` with at most the whitespace terminal between.
_EMPTY_CONTAINER = re.compile(r"\\[\[{](?:" + TERM_OPEN + r"\d+" + TERM_CLOSE + r")?\\[\]}]")


def cuttable(values, terminals) -> bool:
    """Whether cutting lexemes at ``values`` (value terminals) is exact.

    llguidance's lexer takes the longest match and never backs up: where two lexemes are allowed
    at one place, a string that one of them may still continue is not ended as the other.
    Lexemes cut at whole values are JSON's own tokens (strings, numbers, literals) and the
    punctuation and whitespace between them, the same in every branch of an alternation: none
    is a proper prefix of what another allowed one continues with, but a number, and a number
    is followed by none of its own characters. A container written as one lexeme breaks that:
    ``{"a":1}`` of an enum beside an object whose structure is cut (``{`` then ``"a"``), where
    the literal lexeme would swallow ``{"a":2`` and die. So nothing is cut when some value
    terminal is a container's literal text (brackets, no value terminal inside; an empty one is
    harmless: it ends where the cut ``{`` does), or a container sits inside an intersection or
    in a terminal that is not a value's. The test reads texts: a string whose pattern holds a
    bracket counts as a container too (what is lost is speed, not strings).
    """
    for n, text in enumerate(terminals):
        if "\\{" not in text and "\\[" not in text:
            continue
        inner = any(int(m.group(1)) in values for m in _TERM.finditer(text)) if TERM_OPEN in text else False
        if n in values:
            if not inner and _EMPTY_CONTAINER.fullmatch(text) is None or AND_OPEN in text:
                return False
        elif inner or AND_OPEN in text:
            return False
    return True


def lark_terminals(texts: list[str], terminals: list[str] | tuple[str, ...]) -> tuple[list[str], list[str]]:
    """Lark terminal syntax for each rule-free regex text of ``texts`` (references to
    ``terminals`` written as their names, ``T<n>``), and the definitions those names need (lines
    ``T<n>: ...``, each once). A text without references is one ``/regex/``.

    Raises:
        ValueError: a rule reference, or text outside the compiler's regex dialect.
    """
    w = _Writer(terminals, {})
    bodies = []
    for text in texts:
        if REF_OPEN in text:
            raise ValueError("a terminal cannot hold a rule reference")
        bodies.append(w.terminal_text(text))
    return bodies, w.defs


def renumbered(text: str, numbers: dict[int, int] | list[int]) -> str:
    """``text`` with terminal reference ``n`` written as ``numbers[n]``."""
    if TERM_OPEN not in text:
        return text
    return _TERM.sub(lambda m: term_ref(numbers[int(m.group(1))]), text)


_WORD_END = frozenset("0123456789_ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz")


def _join(pieces: list[str]) -> str:
    """Lark items side by side, a space only between two names (``T1 T2``) or two delimiters
    (``/a/ /b/``: never a ``//`` comment to a reader that misses the first regex's end): llguidance
    reads about 1 us an item, plus a little a character, before a request's first mask. A ``/regex/`` or
    ``"string"`` is never followed by a name starting with a flag letter (ours are ``T``, ``L``,
    ``N``, ``r``, ``q``, ``v``), nor a name directly a quantifier (``)?v3`` reads as the name ``?v3``)."""
    if not pieces:
        return ""
    out = [pieces[0]]
    for p in pieces[1:]:
        if p and out[-1] and ((out[-1][-1] in _WORD_END or out[-1][-1] in "?*+}") and p[0] in _WORD_END
                              or out[-1][-1] == p[0] and p[0] in '/"'):
            out.append(" ")
        out.append(p)
    return "".join(out)


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

    def __init__(self, terminals, cache: dict, values: frozenset[int] | set[int] = frozenset(),
                 forms: dict[int, str] | None = None):
        self.terminals = terminals
        self.forms = forms or {}  # terminal number → the text its definition is written from
        self.cache = cache
        self.values = values  # terminals of whole JSON values: rules of their own (``_splits``)
        self.split_memo: dict[int, bool] = {}  # id(node) → ``_splits(node)``
        self.value_rules: set[int] = set()  # value terminals written as rules ``v<n>``
        self.value_leaves: set[int] = set()  # value terminals written as lexemes ``T<n>`` (none inside)
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
        return self._rule(_parse(text, self.cache, True), text) or '""'

    def _name_terminal(self, n: int) -> str:
        if n not in self.named:
            self.named.add(n)
            body = self.forms.get(n) or self.terminals[n]
            self.defs.append(f"T{n}: {self.terminal_text(body)}")
        return f"T{n}"

    def terminal_text(self, text: str) -> str:
        """Lark terminal syntax for a rule-free ``text``: the token-level writer, or the tree
        writer where that one declines."""
        out = self._flat(text)
        if out is None:
            out = self.terminal(_parse(text, self.cache, True), text)
        return out or '""'

    def _flat(self, text: str) -> str | None:
        """Lark for a rule-free ``text`` in one pass over its tokens, without a parse tree: runs of
        mark-free tokens (groups without marks whole, with their quantifiers) are one ``/regex/``;
        groups holding terminal references or intersections become Lark groups; an empty
        alternative is ``""``; a piece that would nest deeper than ``_MAX_NESTING`` is a named
        terminal of its own. Returns None where the text has a rule reference."""
        if _ANY_MARK.search(text) is None:
            return _lexeme(text) if text else ""  # the common small piece: one regex as it is
        toks = []
        pos = 0
        for m in _TOKEN_SHALLOW.finditer(text):
            if m.start() != pos:
                raise ValueError(f"unexpected {text[pos]!r} at {pos}")
            toks.append((m.lastgroup, m.start(), m.end()))
            pos = m.end()
        if pos != len(text):
            raise ValueError(f"unexpected {text[pos]!r} at {pos}")
        # Each open token's close (``plain_group``: with no mark between them), each and's end.
        close_of: dict[int, int] = {}
        plain_group: set[int] = set()
        stack: list[list[int]] = []
        ands: list[int] = []
        for i, (kind, _, _) in enumerate(toks):
            if kind == "open":
                stack.append([i, 0])
            elif kind == "close" and stack:
                j, marks = stack.pop()
                close_of[j] = i
                if marks == 0:
                    plain_group.add(j)
                elif stack:
                    stack[-1][1] += marks
            elif kind in _MARK_KINDS:
                if kind == "ref":
                    return None
                if kind == "and":
                    ands.append(i)
                elif kind == "end" and ands:
                    close_of[ands.pop()] = i
                if stack:
                    stack[-1][1] += 1
        out: list[str] = []
        buf: list[str] = []  # mark-free regex text not written yet
        empty = True  # nothing written in the current alternative
        depth = 0
        buf_last = False  # the previous token went to ``buf`` (a quantifier after it joins it)

        def flush() -> None:
            if buf:
                out.append(_lexeme("".join(buf)))
                buf.clear()

        i, n = 0, len(toks)
        while i < n:
            kind, a, b = toks[i]
            if kind in ("lit", "plain", "esc", "cls") or (kind == "quant" and buf_last):
                buf.append(text[a:b])
                empty, buf_last = False, True
            elif kind == "open" and i in plain_group:
                j = close_of[i]
                buf.append(text[a:toks[j][2]])
                empty, buf_last = False, True
                i = j
            elif kind == "quant":
                out[-1] += text[a:b]  # binds to the group, terminal or intersection before it
            else:
                flush()
                buf_last = False
                if kind == "term":
                    out.append(self._name_terminal(int(text[a + 1:b - 1])))
                    empty = False
                elif kind in ("open", "and"):
                    if depth + (2 if kind == "and" else 1) > _MAX_NESTING:
                        # Deeper than llguidance reads: the piece gets a name of its own.
                        j = close_of[i]
                        piece = text[b:toks[j][1]] if kind == "open" else text[a:toks[j][2]]
                        out.append(self._deep_name("terminal", piece, lambda: self.terminal_text(piece)))
                        empty = False
                        i = j + 1
                        continue
                    depth += 2 if kind == "and" else 1
                    out.append("((" if kind == "and" else "(")
                    empty = True
                elif kind in ("bar", "mid"):
                    if empty:
                        out.append('""')
                    out.append("|" if kind == "bar" else (")&(" if text[a] == AND_MID else ")&~("))
                    empty = True
                elif kind in ("close", "end"):
                    if empty:
                        out.append('""')
                    depth -= 2 if kind == "end" else 1
                    out.append("))" if kind == "end" else ")")
                    empty = False
                else:
                    raise ValueError(f"unexpected {text[a:b]!r} at {a}")
            i += 1
        flush()
        return _join(out)

    def _lexeme(self, src: str, node: _Node) -> str:
        """One lexeme for the rule-free ``node`` of ``src``: a regex, or a named terminal when it
        uses terminals (written from the parse tree at hand, never parsed again)."""
        text = src[node.start:node.end]
        if not text:
            return ""
        if TERM_OPEN not in text and AND_OPEN not in text:
            return _lexeme(text)
        name = self.pieces.get(text)
        if name is None:
            name = self.pieces[text] = f"L{len(self.pieces)}"
            self.defs.append(f"{name}: {self.terminal_text(text)}")
        return name

    @staticmethod
    def _run(run: list[_Node]) -> _Node:
        """Rule-free neighbours of a sequence as one node (spans into the same text)."""
        if len(run) == 1:
            return run[0]
        return _Node("seq", run[0].start, run[-1].end, run, has_term=any(n.has_term for n in run))

    def _splits(self, node: _Node) -> bool:
        """Whether ``node`` refers to a value terminal outside any intersection: a place where one
        lexeme may end and the next begin."""
        if not node.has_term or not self.values:
            return False
        if node.kind == "term":
            return node.number in self.values
        if node.kind == "and":
            return False
        out = self.split_memo.get(id(node))
        if out is None:
            out = self.split_memo[id(node)] = any(self._splits(c) for c in node.children)
        return out

    def _value_rule(self, n: int) -> str:
        """Value terminal ``n`` at rule level: its own lexeme ``T<n>`` when no value terminal is
        inside it (a scalar, a literal), else a rule ``v<n>`` split the same way."""
        if n in self.value_rules:
            return f"v{n}"
        if n in self.value_leaves:
            return f"T{n}"
        body = self.terminals[n]
        if TERM_OPEN not in body or not any(int(m.group(1)) in self.values for m in _TERM.finditer(body)):
            self.value_leaves.add(n)
            return self._name_terminal(n)
        self.value_rules.add(n)
        self.defs.append(f"v{n}: {self.rule(body)}")
        return f"v{n}"

    def _rule(self, node: _Node, text: str, depth: int = 0) -> str:
        split = node.has_ref or self._splits(node)
        if depth > _MAX_NESTING and split and node.kind in ("group", "alt", "rep"):
            return self._deep_name("rule", text[node.start:node.end], lambda: self._rule(node, text))
        depth += 1
        if not split:
            return self._lexeme(text, node)
        if node.kind == "ref":
            return f"r{node.number}"
        if node.kind == "term":
            return self._value_rule(node.number)
        if node.kind == "group":
            inner = self._rule(node.children[0], text, depth)
            return f"({inner})" if inner else ""
        if node.kind == "seq":
            parts, run = [], []
            for child in node.children:  # rule-free neighbours stay one lexeme
                if child.has_ref or self._splits(child):
                    if run:
                        parts.append(self._lexeme(text, self._run(run)))
                        run = []
                    parts.append(self._rule(child, text, depth))
                else:
                    run.append(child)
            if run:
                parts.append(self._lexeme(text, self._run(run)))
            return _join([p for p in parts if p])
        if node.kind == "alt":
            branches = [self._rule(b, text, depth) for b in node.children]
            nonempty = [b for b in branches if b]
            body = "(" + "|".join(nonempty) + ")"
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
            return f"(({a}) & ~({b}))" if node.negated else f"(({a}) & ({b}))"
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
            return _join(parts)
        if node.kind == "alt":
            branches = [self.terminal(b, text, depth) for b in node.children]
            nonempty = [b for b in branches if b]
            body = "(" + "|".join(nonempty) + ")"
            return body + "?" if len(nonempty) < len(branches) else body
        if node.kind == "rep":
            inner = node.children[0]
            inner = inner.children[0] if inner.kind == "group" else inner
            return f"({self.terminal(inner, text, depth)}){_op(node.lo, node.hi)}"
        raise ValueError(f"unexpected node {node.kind}")


def min_bytes(text: str, terminals=(), rules: dict[int, str] | None = None, *, upper: bool = False) -> int:
    """Bytes of the shortest string in the language of ``text`` (terminal and rule references
    resolved; rules by fixpoint), counting each character by its shortest UTF-8 encoding.

    ``upper``: the bytes of *some* string of the language instead, an upper bound of the
    shortest's, read without parsing most of the grammar: an alternation takes the least of its
    branches that refer to no terminal or rule, then of its other branches only the first with a
    known length (a tool-call answer of 100 functions is one alternation of 100 terminals of
    ~1.5 KB regex each: one is parsed, not 100). An intersection counts as unknown
    (:data:`INF_LEN`) there, as :data:`INF_LEN` means no string was found."""
    import re._parser as sre_parse

    rules = rules or {}
    cache: dict = {}
    term_len: dict[int, int] = {}
    rule_len = {n: INF_LEN for n in rules}

    def atom_len(t: str) -> int:
        if t.startswith("["):
            try:
                (_, av), = sre_parse.parse(t)
                ranges = class_ranges(av)
            except Exception:  # noqa: BLE001 - 1 byte: a lower bound
                return 1
            return min((len(chr(lo).encode()) for lo, _ in ranges if not 0xD800 <= lo <= 0xDFFF), default=1)
        if t.startswith("\\x"):
            return len(chr(int(t[2:4], 16)).encode())
        if t.startswith("\\u"):
            return len(chr(int(t[2:6], 16)).encode())
        if t.startswith("\\"):
            return 1
        return len(t.encode())

    def length(node: _Node, src: str) -> int:
        k = node.kind
        if k == "atom":
            return atom_len(src[node.start:node.end])
        if k == "term":
            n = node.number
            if n not in term_len:
                body = terminals[n]
                term_len[n] = length(_parse(body, cache), body)
            return term_len[n]
        if k == "ref":
            return rule_len.get(node.number, INF_LEN)
        if k == "seq":
            return min(INF_LEN, sum(length(c, src) for c in node.children))
        if k == "alt":
            if not upper:
                return min(length(c, src) for c in node.children)
            best = min((length(c, src) for c in node.children if not (c.has_term or c.has_ref)), default=INF_LEN)
            for c in node.children:
                if best == 0:
                    break
                if c.has_term or c.has_ref:
                    n = length(c, src)
                    if n < INF_LEN:
                        return min(best, n)
            return best
        if k == "group":
            return length(node.children[0], src)
        if k == "rep":
            return min(INF_LEN, node.lo * length(node.children[0], src)) if node.lo else 0
        if k == "and":
            if upper:  # (no string of it is known without the automata)
                return INF_LEN
            if node.negated:  # a lower bound: the left side's
                return length(node.children[0], src)
            return max(length(c, src) for c in node.children)  # a lower bound
        raise ValueError(k)

    for _ in range(64):
        new = {n: length(_parse(b, cache), b) for n, b in rules.items()}
        if new == rule_len:
            break
        rule_len = new
    return length(_parse(text, cache), text)


INF_LEN = 1 << 30


@dataclass(frozen=True, slots=True)
class Program:
    """What the front end hands a backend: a regex (Python ``re`` / Rust ``regex`` common
    dialect, implicitly anchored), a Lark grammar in llguidance's dialect (``start`` rule), or a
    JSON Schema for llguidance's own JSON front end (``json_schema.handover``: only where its
    language is provably the one Stencil's compiler writes for the spec; the eager index and
    the closing automaton translate the spec themselves, ``CompiledGrammar.own_program``).

    Attributes:
        kind: "regex", "lark" or "json".
        text: the regex or the grammar. A schema's regex may use *terminal references* to
            ``terminals`` (pieces written once, used many times; see the module docstring).
        warnings: notes from the translation (keywords relaxed, bounds applied).
        terminals: the regex pieces ``text`` (or ``root``) refers to.
        root, rules: for a Lark program written by the JSON Schema compiler, its start and its
            rules as regex text with references (what the closing automaton reads); ``None`` /
            empty for regexes and hand-written grammars.
        own_warnings: a "json" program whose notes are those of Stencil's own translation of
            the spec (a bound capped as that compiler caps it, which alone knows the paths):
            ``CompiledGrammar.warnings`` reads them from ``own_program`` when asked, off the
            compile's path.
        value_terms: terminals of whole JSON values, where the Lark form cuts lexemes
            (``to_lark``; empty: one lexeme a run between rule references).
        lark_forms: (terminal number, text) pairs: in the Lark form the terminal is written
            from that text, the same language as the terminal's regex but with llguidance's
            ``& ~`` (``SchemaCompiler.excluded_strings``); the regex forms keep the plain regex.
    """

    kind: Literal["regex", "lark", "json"]
    text: str
    warnings: tuple[str, ...] = ()
    terminals: tuple[str, ...] = ()
    root: str | None = None
    rules: tuple[tuple[int, str], ...] = ()
    own_warnings: bool = False
    value_terms: frozenset[int] = frozenset()
    lark_forms: tuple[tuple[int, str], ...] = ()

    @property
    def regular(self) -> bool:
        """Whether a plain regex says this program (what the eager backend needs)."""
        if self.kind != "regex":
            return False
        return is_regular_text(self.text, self.terminals)

    def regex_size(self) -> int:
        """Characters of the plain regex (terminals written out), without writing it."""
        if not self.terminals:
            return len(self.text)
        return expanded_size(self.text, self.terminals)

    def regex(self) -> str:
        """The plain regex (terminals written out); for regex programs only."""
        if self.kind != "regex":
            raise ValueError("a Lark program has no regex")
        if not self.terminals:
            return self.text
        return expand(self.text, self.terminals)

    def lark(self) -> str:
        """The program as a Lark grammar (a regex program: one terminal, the same language; a
        JSON one: llguidance's ``%json``)."""
        if self.kind == "lark":
            return self.text
        if self.kind == "json":
            return "start: %json " + self.text + "\n"
        return to_lark(self.text, {}, self.terminals, values=self.value_terms, forms=dict(self.lark_forms))
