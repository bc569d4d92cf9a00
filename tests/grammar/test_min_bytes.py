"""``stencil.grammar.program.min_bytes``: the shortest output's bytes (exact) and the bytes of some
output (``upper``), which the budget's admission check reads before the closing automaton.

Oracle: the regex written out (:func:`expand`) as an interegular automaton; the lengths of the
strings it accepts found by a breadth-first walk over (state, length). ASCII atoms only, so a
character is a byte.
"""

from __future__ import annotations

import interegular
from hypothesis import given, settings
from hypothesis import strategies as st

from stencil.grammar.program import expand, min_bytes, term_ref

_ATOMS = ["a", "b", "ab", "[a-c]", "[xy]", "\\.", "c"]


@st.composite
def _regex(draw, terms: int, depth: int = 0) -> str:
    """A regex of the compiler's dialect over ASCII atoms, referring to terminals ``0..terms-1``."""
    kinds = ["atom", "atom"] + (["term"] if terms else []) + (["seq", "alt", "rep", "group"] if depth < 3 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "atom":
        return draw(st.sampled_from(_ATOMS))
    if kind == "term":
        return term_ref(draw(st.integers(0, terms - 1)))
    if kind == "seq":
        return "".join(draw(st.lists(_regex(terms, depth + 1), min_size=2, max_size=3)))
    if kind == "alt":
        branches = draw(st.lists(_regex(terms, depth + 1) | st.just(""), min_size=2, max_size=4))
        return "(?:" + "|".join(branches) + ")"
    inner = "(?:" + draw(_regex(terms, depth + 1)) + ")"
    if kind == "group":
        return inner
    return inner + draw(st.sampled_from(["?", "*", "+", "{2}", "{1,3}", "{2,}"]))


@st.composite
def _program(draw) -> tuple[str, tuple[str, ...]]:
    """A regex and its terminals (each terminal refers only to those before it)."""
    terminals: list[str] = []
    for i in range(draw(st.integers(0, 3))):
        terminals.append(draw(_regex(i)))
    return draw(_regex(len(terminals))), tuple(terminals)


def _lengths(regex: str, limit: int) -> set[int]:
    """The lengths up to ``limit`` of the strings ``regex`` matches whole."""
    fsm = interegular.parse_pattern(regex).to_fsm()
    found, frontier = set(), {fsm.initial}
    for n in range(limit + 1):
        if frontier & set(fsm.finals):
            found.add(n)
        frontier = {fsm.map[s][c] for s in frontier for c in fsm.map.get(s, {}) if fsm.map[s][c] is not None}
        if not frontier:
            break
    return found


@settings(max_examples=400, deadline=None)
@given(_program())
def test_min_bytes_is_the_shortest_and_upper_is_some_string(program):
    text, terminals = program
    exact = min_bytes(text, terminals)
    upper = min_bytes(text, terminals, upper=True)
    lengths = _lengths(expand(text, terminals), max(exact, upper) + 1)
    assert min(lengths) == exact, (text, terminals)
    assert upper >= exact
    assert upper in lengths, (text, terminals, upper, sorted(lengths))


def test_upper_reads_one_branch_of_a_large_alternation():
    """A tool-call answer's shape: one alternation of many terminals; ``upper`` parses the first
    only (the others are not valid regexes here: reading one would raise)."""
    terminals = ("abc(?:d|e)",) + tuple("(?:broken" for _ in range(50))
    text = "(?:" + "|".join(term_ref(i) for i in range(len(terminals))) + ")+"
    assert min_bytes(text, terminals, upper=True) == 4
    # a branch without references counts first, whatever its place: here the empty one
    assert min_bytes("(?:" + text + "|)", terminals, upper=True) == 0
