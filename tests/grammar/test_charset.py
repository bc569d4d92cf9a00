"""Character-set algebra (``stencil.grammar.charset``) against sets of code points."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from stencil.grammar import charset as cs

# Small code points, and the top of the range, where complements end.
_POINTS = st.one_of(st.integers(0, 40), st.integers(cs.MAX_CP - 5, cs.MAX_CP))
_RANGES = st.lists(st.tuples(_POINTS, _POINTS), max_size=6)


def _members(s: cs.CharSet, probe: list[int]) -> set[int]:
    return {p for p in probe if cs.contains(s, p)}


def _normal(s: cs.CharSet) -> bool:
    return all(lo <= hi for lo, hi in s) and all(a[1] + 1 < b[0] for a, b in zip(s, s[1:]))


@settings(max_examples=300, deadline=None)
@given(_RANGES, _RANGES)
def test_intersect_subtract_union_complement_are_the_set_operations(ra, rb):
    a, b = cs.charset(*ra), cs.charset(*rb)
    probe = list(range(0, 42)) + list(range(cs.MAX_CP - 6, cs.MAX_CP + 1))
    ma, mb = _members(a, probe), _members(b, probe)
    every = set(probe)
    cases = {"intersect": (cs.intersect(a, b), ma & mb), "subtract": (cs.subtract(a, b), ma - mb),
             "union": (cs.union(a, b), ma | mb), "complement": (cs.complement(a), every - ma)}
    for name, (got, want) in cases.items():
        assert _normal(got), (name, got)
        assert _members(got, probe) == want, name
    # the forms are canonical: equal sets are equal tuples
    assert cs.intersect(a, b) == cs.complement(cs.union(cs.complement(a), cs.complement(b)))
    assert cs.subtract(a, b) == cs.intersect(a, cs.complement(b))
