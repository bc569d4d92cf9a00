"""A hand-written Lark grammar as the closing automaton's input (``stencil.grammar.closing``).

The ``lark`` library (lark-parser, MIT) compiles the grammar text into BNF rules and terminal
regexes; each rule becomes regex text whose symbols are rule and terminal references
(``stencil.grammar.program``: ``ref``, ``term_ref``), and an ``%ignore`` terminal may appear between any two symbols,
as between lexemes. Grammars that use llguidance's extensions to Lark (``%llguidance``,
``%json``, special tokens, ``{m,n}`` on rules) do not load here: they are served without the
budget rule.
"""

from __future__ import annotations

import re

from stencil.grammar.base import Program
from stencil.grammar.closing import ClosingUnsupported
from stencil.grammar.program import ref, term_ref
from stencil.grammar.regex_tools import lark_regex_bodies

# an escape pair in a regex body, or an escaped backslash with the quote after it
_PAIR = re.compile(r'\\(\\"|.)', re.S)


def as_lark_reads(text: str) -> str:
    """``text`` with each ``/regex/`` body's escaped backslash before a quote (``\\\\"``: a
    backslash, then a quote) written ``\\\\\\x22``: the same regex, which the ``lark``
    library reads as llguidance does. ``lark`` unescapes ``\\"`` in a regex literal to a bare
    quote (its ``_fix_escaping``), so ``\\\\"`` became ``\\"``, a quote alone: every JSON string
    pattern (``(?:[^"\\\\]|\\\\"|...)*``) then took a bare quote inside, and the closing
    automaton planned ends the served grammar refused (the budget turned itself off)."""
    if "\\\\\"" not in text:  # (most grammars: no scan)
        return text
    out, last = [], 0
    for start, end in lark_regex_bodies(text):
        out.append(text[last:start])
        out.append(_PAIR.sub(lambda m: "\\\\\\x22" if m.group(1) == '\\"' else m.group(0), text[start:end]))
        last = end
    out.append(text[last:])
    return "".join(out)


def lark_program(text: str) -> Program:
    """``text`` as a program the closing automaton reads (``root``, ``rules``, ``terminals``).

    Raises:
        ClosingUnsupported: the grammar does not load in the ``lark`` library.
    """
    try:
        from lark.load_grammar import load_grammar

        grammar, _ = load_grammar(as_lark_reads(text), "<request>", [], False)
        terminals, rules, ignore = grammar.compile(["start"], set())
    except Exception as e:  # noqa: BLE001 - any Lark error: no budget for this grammar
        raise ClosingUnsupported(f"the grammar does not load in lark: {type(e).__name__}") from None
    term_ids = {t.name: k for k, t in enumerate(terminals)}
    term_texts = [t.pattern.to_regexp() for t in terminals]
    names = sorted({r.origin.name for r in rules})
    rule_ids = {name: k for k, name in enumerate(names)}
    skip = ""
    if ignore:
        skip = "(?:" + "|".join(term_ref(term_ids[n]) for n in ignore if n in term_ids) + ")*"
    bodies: dict[int, list[list[str]]] = {k: [] for k in rule_ids.values()}
    tails: dict[int, list[list[str]]] = {k: [] for k in rule_ids.values()}  # A -> A tail (left recursion)
    for r in rules:
        parts = []
        expansion = list(r.expansion)
        left = bool(expansion) and expansion[0].name == r.origin.name
        if left:  # lark writes repetitions as A -> A x: read as A -> (others) (x)*
            expansion = expansion[1:]
        for sym in expansion:
            name = sym.name
            if name in term_ids:
                parts.append(term_ref(term_ids[name]))
            elif name in rule_ids:
                parts.append(ref(rule_ids[name]))
            else:
                raise ClosingUnsupported(f"unknown symbol {name}")
        (tails if left else bodies)[rule_ids[r.origin.name]].append(parts)
    if "start" not in rule_ids:
        raise ClosingUnsupported("no start rule")
    def factored(alts: list[list[str]], lead: str) -> str:
        # Alternatives sharing a first symbol are written once with their rests inside: lark
        # expands ``a b?`` into ``a | a b``, and two calls of ``a`` would double the
        # automaton's stack configurations at every nesting level (2^depth sets).
        order: list[str | None] = []
        groups: dict[str | None, list[list[str]]] = {}
        for a in alts:
            key = a[0] if a else None
            if key not in groups:
                groups[key] = []
                order.append(key)
            if a:
                groups[key].append(a[1:])
        out = []
        for key in order:
            if key is None:
                out.append("")
            elif all(not r for r in groups[key]):
                out.append(lead + key)
            elif len(groups[key]) == 1:  # one rest: written flat, not nested one group a symbol
                out.append(lead + key + "".join(skip + sym for sym in groups[key][0]))
            else:
                out.append(lead + key + "(?:" + factored(groups[key], skip) + ")")
        return "|".join(f"(?:{o})" for o in out)

    def body(k: int) -> str:
        head = "(?:" + factored(bodies[k], "") + ")"
        if not tails[k]:
            return head
        return head + "(?:" + skip + "(?:" + factored(tails[k], "") + "))*"

    try:
        rule_texts = tuple((k, body(k)) for k in bodies)
    except RecursionError:  # alternatives sharing thousands of leading symbols: not modelled
        raise ClosingUnsupported("the grammar's rules nest too deeply for the closing automaton") from None
    root = skip + ref(rule_ids["start"]) + skip
    return Program("lark", text, (), tuple(term_texts), root, rule_texts)
