"""User regexes for outlines-core: checks with positions, literal escaping, choice alternations.

outlines-core compiles regexes with Rust's ``regex-automata`` into a DFA. That rules out
lookaround, backreferences, atomic groups, conditionals and inner anchors / word boundaries, and
its errors ("error building NFA") carry no position. So unsupported constructs are found here by
a small scanner with exact character offsets, and syntax errors are located afterwards with
Python's ``re`` parser (``re.error.pos``), whose syntax agrees with Rust's on the common core.

Regexes are implicitly anchored at both ends; a leading ``^`` and a trailing ``$`` are accepted and
dropped (they change nothing under full matching).
"""

from __future__ import annotations

import re
import warnings

from stencil.grammar.base import MAX_REPEAT_COUNT, MAX_TOTAL_COPIES, GrammarError

# Rust regex-syntax's own escape set (``regex_syntax::escape``); others may not be escaped
# (``\<`` is a word boundary in Rust).
_RUST_META = set("\\.+*?()|[]{}^$#&-~")

_COUNTED = re.compile(r"\{(\d*)(?:,(\d*))?\}")  # a counted quantifier's bounds
_ANCHORS = {"A": "\\A", "z": "\\z", "Z": "\\Z", "b": "word boundary \\b", "B": "\\B",
            "<": "word boundary \\<", ">": "word boundary \\>"}


def strip_outer_anchors(pattern: str) -> tuple[str, int]:
    """Drop a leading ``^`` and an unescaped trailing ``$``.

    Returns:
        ``(core, offset)`` where ``offset`` (0 or 1) maps core positions back to ``pattern``.
    """
    start = 1 if pattern.startswith("^") else 0
    end = len(pattern)
    if end > start and pattern.endswith("$"):
        backslashes = len(pattern[start:end - 1]) - len(pattern[start:end - 1].rstrip("\\"))
        if backslashes % 2 == 0:
            end -= 1
    return pattern[start:end], start


def check_supported(pattern: str) -> str:
    """Validate the constructs of ``pattern`` that a DFA cannot express.

    Returns:
        The pattern without its outer anchors, ready to compile.

    Raises:
        GrammarError: with ``position`` (offset in ``pattern``) of the first lookaround,
            backreference, atomic group, conditional, inner anchor / word boundary, unbalanced
            parenthesis, trailing backslash or repetition count above ``MAX_REPEAT_COUNT``, or of
            the count that nests counted repetitions to more copies than that
            (``(b{1000}){1000}``: a million, at the second ``{``), or that brings the copies of
            all the counts, summed, above ``MAX_TOTAL_COPIES``. Balance matters beyond syntax: the pattern is
            wrapped as ``(?:pattern)\\x01``, and ``x)|(y`` would otherwise parse, leaving one
            branch without the end sentinel.
    """
    core, offset = strip_outer_anchors(pattern)
    i, n = 0, len(core)
    class_depth = class_start = 0
    open_groups: list[int] = []
    # Copies a matcher unrolls: per open group [the most inside it, the last item's], a counted
    # repetition multiplying its item's (``(a{100}){50}``: 5000; ``*``, ``+``, ``?`` add none).
    frames: list[list[int]] = [[1, 1]]
    total = 0  # the copies of every count so far
    while i < n:
        c = core[i]
        pos = i + offset
        if c == "\\":
            nxt = core[i + 1:i + 2]
            if not nxt:
                raise GrammarError("trailing backslash", position=pos)
            if class_depth == 0:
                if nxt.isdigit() and nxt != "0":
                    raise GrammarError("backreferences are not supported", position=pos)
                if nxt in ("k", "g") and core[i + 2:i + 3] in ("<", "{", "'"):
                    raise GrammarError("backreferences are not supported", position=pos)
                if nxt and nxt in _ANCHORS:
                    raise GrammarError(f"anchor {_ANCHORS[nxt]} is not supported (the regex is "
                                       "matched as a whole)", position=pos)
                frames[-1][1] = 1
            i += 2
            continue
        if class_depth:
            if c == "[":
                class_depth += 1  # Rust nests classes ([a-z&&[^aeiou]], [[:alpha:]])
            elif c == "]":
                class_depth -= 1
            i += 1
            continue
        if c == "[":
            class_depth, class_start = 1, pos
            frames[-1][1] = 1
            i += 1
            if core[i:i + 1] == "^":
                i += 1
            if core[i:i + 1] == "]":
                i += 1  # a leading ] is literal
            continue
        if c == "{" and (count := _COUNTED.match(core, i)) is not None:
            times = max((int(x) for x in count.groups() if x), default=0)
            if times > MAX_REPEAT_COUNT:
                raise GrammarError(f"repetition count {times} is above the {MAX_REPEAT_COUNT} a grammar can "
                                   "count", position=pos)
            frame = frames[-1]
            frame[1] *= max(times, 1)
            frame[0] = max(frame[0], frame[1])
            if frame[1] > MAX_REPEAT_COUNT:
                raise GrammarError(f"the regex's counted repetitions nest to {frame[1]} copies of their innermost "
                                   f"part, above the {MAX_REPEAT_COUNT} a grammar can count", position=pos)
            total += frame[1]
            if total > MAX_TOTAL_COPIES:
                raise GrammarError(f"the regex's counted repetitions unroll to {total} copies in all, above the "
                                   f"{MAX_TOTAL_COPIES} a grammar can count", position=pos)
            i = count.end()
            continue
        if c == "(":
            open_groups.append(pos)
            frames.append([1, 1])
        elif c == ")":
            if not open_groups:
                raise GrammarError("unbalanced parenthesis", position=pos)
            open_groups.pop()
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        elif c == "|":
            frames[-1][1] = 1
        elif c not in "*+?":
            frames[-1][1] = 1  # a literal: the item a following count repeats
        if c in "^$":
            raise GrammarError(f"anchor {c!r} inside the regex is not supported (the regex is "
                               "matched as a whole)", position=pos)
        if c == "(" and core[i + 1:i + 2] == "?":
            head = core[i + 2:i + 4]
            if head[:1] in ("=", "!") or head in ("<=", "<!"):
                raise GrammarError("lookaround assertions are not supported in a regex (a JSON Schema "
                                   "string's \"pattern\" takes them: response_schema {\"type\": \"string\", "
                                   "\"pattern\": ...})", position=pos)
            if head == "P=":
                raise GrammarError("backreferences are not supported", position=pos)
            if head[:1] == ">":
                raise GrammarError("atomic groups are not supported", position=pos)
            if head[:1] == "(":
                raise GrammarError("conditional groups are not supported", position=pos)
        i += 1
    if class_depth:
        raise GrammarError("unterminated character class", position=class_start)
    if open_groups:
        raise GrammarError("missing ), unterminated group", position=open_groups[-1])
    return core


_LARK_COUNT = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")  # item ~ n, item ~ n..m


def _lark_error(text: str, message: str, at: int) -> GrammarError:
    """A 400 naming ``grammar`` at offset ``at`` of ``text`` (its line and column, from 1)."""
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    return GrammarError(f"invalid Lark grammar at line {line}, column {column}: {message}",
                        keyword="grammar", line=line, column=column)


# the body of a string or regex terminal after its opening quote or slash, to its closing one
# (or the end of the line), an escape two characters (the backslash and any one after it); written
# as runs of plain characters between escapes, which ``re`` scans four times as fast as one
# alternation a character (1.5 -> 0.4 ms over a 100-function tool answer's 96 KB)
_QUOTED_BODY = {q: re.compile(r"[^" + q + r"\\\n]*(?:\\.[^" + q + r"\\\n]*)*", re.S) for q in "\"/"}


def _quoted_at(text: str, i: int) -> tuple[str, int, int] | None:
    """What starts at ``text[i]`` of a Lark text: a ``//`` comment (``("comment", e, e)``, ``e`` its
    line's end), a string or a regex (``('"' or "/", its body's end, the index after its closing
    delimiter)``), or None."""
    c = text[i]
    if c == "/" and text[i + 1:i + 2] == "/":
        end = text.find("\n", i)
        end = len(text) if end < 0 else end
        return "comment", end, end
    if c in "\"/":
        j = _QUOTED_BODY[c].match(text, i + 1).end()  # (a C scan: tool answers hold 100 KB of them)
        return c, j, j + 1
    return None


def lark_regex_bodies(text: str):
    """``(start, end)`` of each ``/regex/`` body in Lark text ``text`` (after its opening slash,
    before its closing one), in order; strings and ``//`` comments are skipped."""
    i, n = 0, len(text)
    while i < n:
        quoted = _quoted_at(text, i)
        if quoted is None:
            i += 1
            continue
        kind, body_end, i_next = quoted
        if kind == "/":
            yield i + 1, body_end
        i = i_next


def check_lark_counts(text: str) -> None:
    """Refuse a Lark grammar whose counted repetitions exceed what a grammar can count, as
    :func:`check_supported` refuses a regex: an ``item ~ n`` or ``~ n..m`` above
    ``MAX_REPEAT_COUNT``, counts nested in parentheses of one rule that multiply above it
    (``("a"~1000)~1000``), counts whose copies sum above ``MAX_TOTAL_COPIES`` over the grammar,
    and a count above it inside a regex terminal (``/a{20000}/``). Strings,
    regex terminals and ``//`` comments are skipped when looking for ``~``.

    Why: llguidance builds such a grammar lazily, but the budget's closing automaton
    (``stencil.grammar.closing``, through the ``lark`` library) unrolls every copy, in Python, holding
    the interpreter lock: ``"a"~1000000`` stalled every other request for 46 s. Counts are not
    multiplied across rules (``start: x~10000`` with ``x: "a"~10000`` passes): the automaton
    keeps one machine per rule, and the budget never writes an end longer than the tokens it
    has could hold (``ClosingAutomaton.token_distance``'s ``limit``, ``EXACT_END_BYTES``).

    Raises:
        GrammarError: ``keyword="grammar"`` with the ``line`` and ``column`` of the count.
    """
    frames: list[list[int]] = [[1, 1]]  # per open parenthesis: [most copies inside, last item's]
    total = 0  # the copies of every count so far
    i, n = 0, len(text)
    while i < n:
        quoted = _quoted_at(text, i)
        if quoted is not None:  # a comment, string or regex terminal: skipped (a regex's own counts checked)
            kind, j, i_next = quoted
            if kind == "/":
                for m in _COUNTED.finditer(text, i + 1, j):
                    times = max((int(x) for x in m.groups() if x), default=0)
                    if times > MAX_REPEAT_COUNT:
                        raise _lark_error(text, f"repetition count {times} is above the {MAX_REPEAT_COUNT} a "
                                                "grammar can count", m.start())
            if kind != "comment":
                frames[-1][1] = 1
            i = i_next
            continue
        c = text[i]
        if c == "~" and (m := _LARK_COUNT.match(text, i)) is not None:
            times = max(int(x) for x in m.groups() if x)
            if times > MAX_REPEAT_COUNT:
                raise _lark_error(text, f"repetition count {times} is above the {MAX_REPEAT_COUNT} a grammar "
                                        "can count", i)
            frame = frames[-1]
            frame[1] *= max(times, 1)
            frame[0] = max(frame[0], frame[1])
            if frame[1] > MAX_REPEAT_COUNT:
                raise _lark_error(text, f"counted repetitions nest to {frame[1]} copies of their innermost part, "
                                        f"above the {MAX_REPEAT_COUNT} a grammar can count", i)
            total += frame[1]
            if total > MAX_TOTAL_COPIES:
                raise _lark_error(text, f"counted repetitions unroll to {total} copies in all, above the "
                                        f"{MAX_TOTAL_COPIES} a grammar can count", i)
            i = m.end()
            continue
        if c == "(":
            frames.append([1, 1])
        elif c == ")" and len(frames) > 1:
            inner = frames.pop()[0]
            frames[-1][1] = inner
            frames[-1][0] = max(frames[-1][0], inner)
        elif c == "\n" and len(frames) == 1:
            frames[-1][1] = 1
        elif not c.isspace() and c not in "*+?":
            frames[-1][1] = 1  # a name or other item: what a following count repeats
            while i + 1 < n and (text[i + 1].isalnum() or text[i + 1] in "_."):
                i += 1
        i += 1


MAX_LARK_DEFINITIONS = 1000  # rules and terminals a Lark grammar may define
MAX_TERMINAL_CHARS = 100_000  # a Lark terminal with the terminals it names written in
# the names in a terminal's body outside its strings and regexes (uppercase: terminals)
_TERMINAL_REFS = re.compile(r'"[^"\\\n]*(?:\\.[^"\\\n]*)*"i?|/(?=[^/\n])[^/\\\n]*(?:\\.[^/\\\n]*)*/[imslux]*'
                            r'|\b(_?[A-Z][A-Z_0-9]*)\b')  # (strings and regexes as _QUOTED_BODY scans them)
_LARK_DEFINITION = re.compile(r"^[ \t]*[?!]?([A-Za-z_][A-Za-z_0-9]*)(?:\.-?\d+)?[ \t]*:", re.M)


def check_lark_size(text: str) -> None:
    """Refuse a Lark grammar that defines more than ``MAX_LARK_DEFINITIONS`` rules and
    terminals (counted by name, as definitions at the start of a line).

    Why: llguidance 1.9.1 walks a chain of rules (``r0: r1 | "x"``, ``r1: r2 | "x"``, ...)
    recursively when it builds the grammar; about 2,700 links overflowed an 8 MB thread stack
    and killed the server with a segmentation fault (a 51 KB grammar, below every other limit).
    A chain is at most as long as the grammar has definitions; 1,000 keeps a wide margin (its
    recursion measured at about 3 KB of stack a link) and is far above what hand-written
    grammars define.

    A terminal is refused too when, with the terminals it names written into it (as lark and
    the budget's automaton write a terminal: one regex), it holds more than ``MAX_TERMINAL_CHARS``
    characters (counted, not written).

    Raises:
        GrammarError: ``keyword="grammar"`` with the line and column of the first definition
            past the limit, or of the terminal too large.
    """
    names: set[str] = set()
    found = list(_LARK_DEFINITION.finditer(text))
    for m in found:
        names.add(m.group(1))
        if len(names) > MAX_LARK_DEFINITIONS:
            raise _lark_error(text, f"the grammar defines more than {MAX_LARK_DEFINITIONS} rules and terminals, "
                                    "the most it may", m.start(1))
    # Terminals are regexes, each written out in full with the terminals it names inside: a
    # terminal naming the next one twice, twenty deep (``T0: T1 T1``, ... 220 bytes), is a regex
    # of millions of characters, which the budget's automaton held the server's memory (8 GB)
    # and CPU with for more than ten minutes.
    bodies: dict[str, tuple[int, str]] = {}
    for k, m in enumerate(found):
        name = m.group(1)
        if name.lstrip("_").isupper() and name not in bodies:
            end = found[k + 1].start() if k + 1 < len(found) else len(text)
            bodies[name] = (m.start(1), text[m.end():end])
    refs_of = {t: [r for r in _TERMINAL_REFS.findall(body) if r in bodies] for t, (_, body) in bodies.items()}
    size: dict[str, int] = {}
    visiting: set[str] = set()  # on the walk's path: a cycle is lark's error to report, counted as nothing here
    for name in bodies:
        stack = [(name, False)]
        while stack:  # (iterative: a chain of a thousand terminals)
            t, done = stack.pop()
            if t in size or (not done and t in visiting):
                continue
            refs = refs_of[t]
            if not done:
                visiting.add(t)
                stack.append((t, True))
                stack.extend((r, False) for r in refs if r not in size and r not in visiting)
                continue
            visiting.discard(t)
            size[t] = len(bodies[t][1]) + sum(size.get(r, 0) for r in refs)
            if size[t] > MAX_TERMINAL_CHARS:
                raise _lark_error(text, f"terminal {t} is a regex of more than {MAX_TERMINAL_CHARS} characters once "
                                        "the terminals it names are written into it; name shared parts with rules "
                                        "(lowercase), which are not copied", bodies[t][0])


def locate_syntax_error(pattern: str) -> tuple[int | None, str | None]:
    """Where Python's ``re`` parser stops on ``pattern``: ``(position, message)``, or
    ``(None, None)`` if Python accepts it (a Rust-only difference)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "possible nested set" for Rust-style classes
            re.compile(pattern)
    except re.error as e:
        return e.pos, e.msg
    except (OverflowError, RecursionError) as e:
        return None, str(e)
    return None, None


def escape_literal(text: str) -> str:
    """Escape ``text`` so a Rust regex matches it literally."""
    return "".join("\\" + ch if ch in _RUST_META else ch for ch in text)


def choice_regex(choices: list[str]) -> str:
    """An alternation matching exactly one of ``choices``.

    Raises:
        GrammarError: an empty list, or a choice holding byte 0x01 (the grammar end sentinel,
            which no output can contain).
    """
    if not choices:
        raise GrammarError("choice needs at least one string")
    for k, ch in enumerate(choices):
        if "\x01" in ch:
            raise GrammarError(f"choice {k} contains U+0001, which outputs cannot contain")
    return "(?:" + "|".join(escape_literal(ch) for ch in choices) + ")"
