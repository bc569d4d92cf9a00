"""``multipleOf`` with bounds on either side or both (``multiples.Multiples``): integer steps and
steps a float holds exactly (0.5, 0.25, 2.5, 0.0625), under ``minimum`` / ``maximum`` and their
exclusive forms, negative, fractional or absent. jsonschema is the oracle: every canonical number
of a window around the bounds and zero (and random far ones) is accepted by the served grammar
(llguidance, one token per character) exactly when jsonschema validates it.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from char_vocab import EOS, char_compiler
from stencil.grammar.base import GrammarError, GrammarSpec
from stencil.grammar.frontend import to_program
from stencil.grammar.json_schema.multiples import MAX_STATES, AutomatonTooLarge, Multiples, int_pieces

CHARS = "0123456789-."


@pytest.fixture(scope="module")
def compiler():
    with char_compiler(CHARS) as c:
        yield c


def _accepts(grammar, text: str) -> bool:
    m = grammar.matcher()
    return m.accept_tokens([CHARS.index(ch) for ch in text]) and m.accept_tokens([EOS])


def _canonical(m: int, n: int) -> str:
    """The canonical text of ``m * 10**-n``: no exponent, no trailing fraction zero, no -0."""
    whole, frac = divmod(abs(m), 10 ** n)
    digits = str(frac).rjust(n, "0").rstrip("0") if n else ""
    return ("-" if m < 0 else "") + str(whole) + ("." + digits if digits else "")


def _random_schema(rng: random.Random) -> tuple[dict, int]:
    """A bounded multipleOf schema and the fraction digits its candidates need."""
    if rng.random() < 0.5:
        # (an integer with a binary-fraction step, 2.5 or 0.75, takes the integer multiples: of 5, of 3)
        schema, n = {"type": "integer", "multipleOf": rng.choice([2, 3, 7, 10, 12, 25, 1000, 2.5, 0.75])}, 0
    else:
        schema, n = {"type": "number", "multipleOf": rng.choice([0.5, 0.25, 2.5, 0.75, 0.125, 0.0625, 5])}, 6
    for low in (True, False):
        if rng.random() < 0.8:
            bound = rng.choice([0, rng.randint(-400, 400), rng.randint(-9, 9) + rng.choice([0.25, 0.5, 0.3]),
                                rng.randint(-10 ** 6, 10 ** 6)])
            exclusive = rng.random() < 0.5
            key = ("exclusiveMinimum" if exclusive else "minimum") if low else \
                ("exclusiveMaximum" if exclusive else "maximum")
            schema[key] = bound
    return schema, n


@pytest.mark.parametrize("seed", range(6))
def test_bounded_multiples_agree_with_jsonschema_on_every_number_near_the_bounds(compiler, seed):
    rng = random.Random(seed)
    checked = 0
    for _ in range(12):
        schema, n = _random_schema(rng)
        try:
            grammar = compiler.compile(GrammarSpec.json_schema(schema, whitespace="compact"))
        except GrammarError as e:  # only an empty range is refused, and jsonschema agrees
            assert "unsatisfiable" in str(e), schema
            continue
        validator = jsonschema.Draft202012Validator(schema)
        scale = 10 ** n
        near = [int(schema[k] * scale) + d for k in schema if k != "type" and k != "multipleOf"
                for d in range(-3 * scale if n else -60, 3 * scale if n else 60, 1 if not n else scale // 8)]
        values = set(range(-300, 300)) | set(near) | {rng.randint(-10 ** 12, 10 ** 12) for _ in range(150)}
        for m in values:
            text = _canonical(m, n)
            want = validator.is_valid(json.loads(text))
            assert _accepts(grammar, text) == want, (schema, text, want)
            checked += want
    assert checked > 100  # the windows hold valid numbers, not only refusals


@pytest.mark.parametrize("schema,valid,invalid", [
    ({"type": "integer", "minimum": 1, "multipleOf": 5}, ["5", "10", "1555", "100000"], ["0", "-5", "3", "1556"]),
    ({"type": "integer", "exclusiveMinimum": 0, "multipleOf": 5}, ["5", "50", "505"], ["0", "-5"]),
    ({"type": "integer", "minimum": 0, "maximum": 20, "multipleOf": 2.5}, ["0", "5", "20"], ["2", "2.5", "25"]),
    ({"type": "integer", "maximum": -153, "multipleOf": 5}, ["-155", "-1555", "-1550", "-100000"], ["-150", "0"]),
    ({"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.25}, ["0", "0.25", "99.75", "100", "50.5"],
     ["100.25", "-0.25", "0.3", "1.0"]),
    ({"type": "number", "exclusiveMinimum": 2.25, "multipleOf": 0.5}, ["2.5", "3", "1000.5"], ["2", "2.25", "2.0"]),
    ({"type": "number", "minimum": -1.75, "exclusiveMaximum": 1, "multipleOf": 0.25},
     ["-1.75", "-0.5", "0", "0.75"], ["-2", "1", "-0", "-0.0"]),
])
def test_named_bounded_multiples(compiler, schema, valid, invalid):
    grammar = compiler.compile(GrammarSpec.json_schema(schema, whitespace="compact"))
    for text in valid:
        assert _accepts(grammar, text), (schema, text)
    for text in invalid:
        assert not _accepts(grammar, text), (schema, text)


def test_an_empty_bounded_range_of_multiples_is_unsatisfiable():
    with pytest.raises(GrammarError, match="unsatisfiable"):
        to_program(GrammarSpec.json_schema({"type": "integer", "minimum": 1, "maximum": 4, "multipleOf": 5}))
    with pytest.raises(GrammarError, match="unsatisfiable"):
        to_program(GrammarSpec.json_schema({"type": "number", "exclusiveMinimum": 0.5, "exclusiveMaximum": 1,
                                            "multipleOf": 0.5}))


def testint_pieces_cover_each_integer_of_the_range_once():
    rng = random.Random(0)
    for _ in range(200):
        lo = rng.choice([0, 1, rng.randint(0, 99), rng.randint(0, 10 ** 5)])
        hi = None if rng.random() < 0.3 else lo + rng.choice([0, 1, rng.randint(0, 50), rng.randint(0, 10 ** 5)])
        parts = int_pieces(lo, hi)
        top = (hi if hi is not None else lo) + 2000
        for v in range(max(0, lo - 50), top):
            text = str(v)
            hits = sum(1 for prefix, d_lo, d_hi, free, tail in parts
                       if text.startswith(prefix) and len(text) > len(prefix)
                       and d_lo <= int(text[len(prefix)]) <= d_hi
                       and (len(text) - len(prefix) - 1 >= free if tail else len(text) - len(prefix) - 1 == free))
            assert hits == (1 if lo <= v and (hi is None or v <= hi) else 0), (lo, hi, v, parts)


def test_a_step_too_large_for_the_automaton_is_refused_and_leaves_no_rule():
    rules: dict[int, str] = {}
    numbers = iter(range(10 ** 6))
    automaton = Multiples(MAX_STATES + 1, 0, lambda: next(numbers), rules.__setitem__)
    with pytest.raises(AutomatonTooLarge):
        automaton.text(1, None)
    assert rules == {}  # nothing of the refused range reached the compiler
    assert automaton.text(0, 0) == "(?:0)"  # and the automaton still serves what fits
    with pytest.raises(GrammarError) as e:
        to_program(GrammarSpec.json_schema({"type": "integer", "minimum": 1, "multipleOf": MAX_STATES + 1}))
    assert e.value.keyword == "multipleOf"


def test_a_step_with_a_bound_near_forty_digits_is_refused_by_the_step_not_compiled_for_seconds():
    # 0.25 with a 39-digit bound: 41 digits once scaled (the automaton's own limit)
    with pytest.raises(GrammarError) as e:
        to_program(GrammarSpec.json_schema({"type": "number", "multipleOf": 0.25, "maximum": 10 ** 39}))
    assert e.value.keyword == "multipleOf"
    # an int64 range is far inside the limit
    program = to_program(GrammarSpec.json_schema({"type": "integer", "multipleOf": 7,
                                                  "minimum": -2 ** 63, "maximum": 2 ** 63 - 1}))
    assert program.kind == "lark"


@pytest.mark.parametrize("key,bound", [("maximum", 1e300), ("exclusiveMinimum", -1.7976931348623157e308),
                                       ("maximum", 1.5e-300)])
def test_a_bound_past_forty_digits_is_refused_by_its_keyword(key, bound):
    """Its digit-by-digit regex would nest past any regex engine's limit: a 400 naming the
    bound (strict), or the bound dropped with a warning (not strict)."""
    schema = {"type": "number", key: bound}
    with pytest.raises(GrammarError, match="40 decimal digits") as e:
        to_program(GrammarSpec.json_schema(schema))
    assert e.value.keyword == key
    program = to_program(GrammarSpec.json_schema({**schema, "minimum": 0}, strict=False))
    assert any(w.startswith(f"{key} at #:") for w in program.warnings)
    assert to_program(GrammarSpec.json_schema({"type": "number", key: 1e39})).kind in ("regex", "json")


def test_each_refusal_of_a_step_says_why():
    def error(schema, **kw):
        with pytest.raises(GrammarError) as e:
            to_program(GrammarSpec.json_schema(schema), **kw)
        assert e.value.keyword == "multipleOf"
        return str(e.value)

    assert "grammar rules" in error({"type": "integer", "minimum": 1, "multipleOf": 7}, grammar=False)
    assert "grammar rules" in error({"type": "number", "minimum": 1, "multipleOf": 0.25}, grammar=False)
    assert f"more than {MAX_STATES} grammar rules" in error({"type": "integer", "minimum": 1,
                                                             "multipleOf": MAX_STATES + 1})
    assert "float represents them exactly" in error({"type": "number", "multipleOf": 0.01})
