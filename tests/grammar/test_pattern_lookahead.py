"""Lookaheads after a leading ``^`` and a lookbehind before the final ``$``/``\\Z`` in ``pattern``:
compiled exactly as intersections and complements (lazy backend). Oracle: Python's ``re.search`` over every string of a small alphabet, for random
patterns (hypothesis), under ``pattern``, ``not: {pattern}`` and with ``minLength``; inside an object
too (the path where llguidance is not handed the schema)."""

from __future__ import annotations

import itertools
import json
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.vocab import TokenVocabulary

ALPHABET = "ab01\n"
CHARS = 'ab01n"\\{}:,k'  # what the JSON text of those strings (and a one-key object) spells
ID = {c: i for i, c in enumerate(CHARS)}
EOS = 20
STRINGS = ["".join(t) for n in range(5) for t in itertools.product(ALPHABET, repeat=n)]


@pytest.fixture(scope="module")
def compiler():
    vocab = TokenVocabulary.from_token_bytes({i: c.encode() for i, c in enumerate(CHARS)}, EOS, 32)
    with GrammarCompiler(vocab, 32, max_workers=1, backend="lazy", cache_size=0) as c:
        yield c


def accepts(grammar, value) -> bool:
    m = grammar.matcher()
    return m.accept_tokens([ID[ch] for ch in json.dumps(value, separators=(",", ":"))]) and m.accept_tokens([EOS])


def _mismatches(compiler, schema: dict, admits, wrap=lambda s: s) -> list[str]:
    try:
        grammar = compiler.compile(GrammarSpec.json_schema(schema))
    except GrammarError as e:  # an empty language (``^(?!a?)``): then no string may match
        assert "no token sequence can produce" in str(e) or "admits no value" in str(e)
        return [s for s in STRINGS if admits(s)]
    return [s for s in STRINGS if accepts(grammar, wrap(s)) != admits(s)]


ATOMS = ["a", "b", "0", "1", ".", "[ab]", "\\d", "[^a]", "(?:a|1)"]
QUANTIFIERS = ["", "", "*", "+", "?", "{1,2}"]
piece = st.builds(lambda a, q: a + q, st.sampled_from(ATOMS), st.sampled_from(QUANTIFIERS))
sequence = st.lists(piece, min_size=0, max_size=3).map("".join)
look_body = st.one_of(sequence, st.builds(lambda x, y: f"{x}|{y}", sequence, sequence),
                      sequence.map(lambda x: x + "$"), sequence.map(lambda x: x + "|$"))
lookahead = st.builds(lambda neg, body: ("(?!" if neg else "(?=") + body + ")", st.booleans(), look_body)
lookbehind = st.builds(lambda neg, body: ("(?<!" if neg else "(?<=") + "".join(body) + ")", st.booleans(),
                       st.lists(st.sampled_from(ATOMS), min_size=0, max_size=2))  # (one length, as Python wants)


def _pattern(looks, rest, behind, end):
    if behind and not end:
        end = "$"
    return ("^" + "".join(looks) if looks else "") + rest + behind + end


pattern = st.one_of(
    st.builds(_pattern, st.lists(lookahead, min_size=1, max_size=3), sequence, st.just(""),
              st.sampled_from(["", "$", "\\Z"])),
    st.builds(_pattern, st.lists(lookahead, max_size=2), sequence, lookbehind, st.sampled_from(["$", "\\Z"])))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=pattern, lengths=st.sampled_from([(0, None), (0, None), (2, None), (0, 2), (1, 3)]))
def test_lookarounds_match_re_search(compiler, pattern, lengths):
    lo, hi = lengths
    schema = {"type": "string", "pattern": pattern, "minLength": lo, **({} if hi is None else {"maxLength": hi})}
    admits = lambda s: bool(re.search(pattern, s)) and lo <= len(s) <= (hi if hi is not None else len(s))  # noqa: E731
    assert _mismatches(compiler, schema, admits) == []


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=pattern)
def test_not_a_pattern_with_lookarounds_matches_re_search(compiler, pattern):
    schema = {"type": "string", "not": {"pattern": pattern}}
    assert _mismatches(compiler, schema, lambda s: not re.search(pattern, s)) == []


def test_a_password_rule_inside_an_object(compiler):
    pattern = r"^(?=.*\d)(?=.*[ab])(?!.*\n).{3,}(?<!0)$"
    schema = {"type": "object", "properties": {"k": {"type": "string", "pattern": pattern}}, "required": ["k"],
              "additionalProperties": False}
    admitted = [s for s in STRINGS if re.search(pattern, s)]
    assert "a01" in admitted and "ab\n0" not in admitted and "000" not in admitted and "a10" not in admitted
    assert _mismatches(compiler, schema, lambda s: bool(re.search(pattern, s)), wrap=lambda s: {"k": s}) == []


@pytest.mark.parametrize("pattern, position, words", [
    ("^(?=a)a|b", 6, "top-level '|'"),  # the lookahead binds to the first branch only
    ("a(?=b)", 2, "lookaround"),  # not after a leading '^': still refused
    ("^a(?=b)", 3, "lookaround"),
    ("^(?<=a)b", 2, "lookaround"),  # a lookbehind not before the end
    ("^a(?<=a)b$", 3, "lookaround"),
    ("^a|b(?<=b)$", 5, "lookaround"),  # (with a top-level '|')
    ("^a(?<!b+)$", 2, "one length"),
    ("^(?=a", 1, "missing ')'"),
    ("^(?=a)b(?=c)", 8, "lookaround"),  # in the rest: the whole pattern's position
    ("^(?=a)(?!b(?<=c))", 11, "lookaround"),  # in a lookahead's body: the same
    ("^(?=a)(?!b|(?<=c))", 12, "lookaround"),  # (a body with a '|', grouped to be read)
])
def test_what_stays_refused_says_where(compiler, pattern, position, words):
    with pytest.raises(GrammarError) as info:
        compiler.compile(GrammarSpec.json_schema({"type": "string", "pattern": pattern}))
    assert info.value.keyword == "pattern" and info.value.position == position
    assert words in str(info.value)


def test_the_eager_backend_refuses_a_lookahead_naming_the_lazy_one(compiler):
    vocab = compiler.vocab
    with GrammarCompiler(vocab, 32, max_workers=1, backend="eager") as eager:
        with pytest.raises(GrammarError, match="lazy backend") as info:
            eager.compile(GrammarSpec.json_schema({"type": "string", "pattern": "^(?=a)[ab]"}))
    assert (info.value.keyword, info.value.position) == ("pattern", 1)


def test_an_intersection_without_named_pieces_reaches_llguidance_as_lark(compiler):
    """A short program with ``&`` and no named terminal was handed to llguidance's regex mode,
    its intersection marks read as characters: nothing matched, not even ``"a"`` here."""
    schema = {"type": "string", "pattern": "^a?$", "not": {"pattern": "^$"}}
    grammar = compiler.compile(GrammarSpec.json_schema(schema))
    assert grammar.program.kind == "regex" and not grammar.program.terminals and not grammar.program.regular
    assert [s for s in STRINGS if accepts(grammar, s)] == ["a", "a\n"]
