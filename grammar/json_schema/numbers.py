"""Exact regexes for JSON numbers inside numeric bounds.

Integers are written canonically (RFC 8259 §6 ``int``: no leading zeros, never ``-0``).
Bounded numbers are written without exponent: ``-?int(\\.[0-9]+)?``. The construction is the
classic digit-range split (numbers of one length at a time, then the first differing digit;
``multiples.int_pieces``),
extended to fractions by comparing the fraction digits left to right. Bounds are
``decimal.Decimal`` values so that 0.1 means one tenth exactly. ``compile_number`` is the
compiler's ``number``/``integer`` type: a schema's bounds and ``multipleOf`` to one of these
regexes, the multiples listed, or the remainder automaton (``multiples``).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import TYPE_CHECKING

from stencil.grammar.base import GrammarError
from stencil.grammar.json_schema.multiples import MAX_BOUND_DIGITS, AutomatonTooLarge, Multiples, int_pieces
from stencil.grammar.json_schema.rx import Rx, alt, repeat, seq

if TYPE_CHECKING:
    from stencil.grammar.json_schema.schema_compiler import SchemaCompiler

DIGIT = "[0-9]"
INTEGER = "(?:0|-?[1-9][0-9]*)"
NUMBER = "-?(?:0|[1-9][0-9]*)" + "(?:\\.[0-9]+)?(?:[eE][+-]?[0-9]+)?"
_ANY_FRACTION = "(?:\\.[0-9]+)?"


def _digit_class(lo: int, hi: int) -> Rx:
    if lo > hi:
        return None
    if lo == hi:
        return str(lo)
    if lo == 0 and hi == 9:
        return DIGIT
    return f"[{lo}-{hi}]"


def nonneg_int_range(lo: int, hi: int | None) -> Rx:
    """Canonical decimal integers in ``[lo, hi]`` with ``0 <= lo`` (``hi=None``: unbounded): the
    pieces of ``multiples.int_pieces``, each a regex, side by side."""
    return alt([prefix + _digit_class(d_lo, d_hi) + repeat(DIGIT, free, None if tail else free)
                for prefix, d_lo, d_hi, free, tail in int_pieces(lo, hi)])


def int_range(lo: int | None, hi: int | None) -> Rx:
    """Canonical JSON integers ``v`` with ``lo <= v <= hi`` (None: unbounded on that side)."""
    if lo is None and hi is None:
        return INTEGER
    if lo is not None and hi is not None and hi < lo:
        return None
    parts = []
    if hi is None or hi >= 0:
        parts.append(nonneg_int_range(max(lo, 0) if lo is not None else 0, hi))
    if lo is None or lo < 0:
        mag_lo = max(1, -hi) if hi is not None else 1
        mag = nonneg_int_range(mag_lo, None if lo is None else -lo)
        parts.append(seq("-", mag))
    return alt(parts)


def _split(d: Decimal) -> tuple[int, str]:
    """Integer part and fraction digits (trailing zeros dropped) of a non-negative decimal."""
    text = format(d, "f")
    whole, _, frac = text.partition(".")
    return int(whole), frac.rstrip("0")


def _frac(lo: str | None, hi: str | None, lo_strict: bool, hi_strict: bool) -> tuple[bool, Rx]:
    """Fraction digit strings ``s`` with ``0.lo <=/< 0.s <=/< 0.hi``.

    ``lo=None`` / ``hi=None`` mean that side is already satisfied strictly. Returns (whether the
    empty string is admitted, regex for the non-empty strings).
    """
    lo_ok = lo is None or (lo == "" and not lo_strict)
    hi_ok = hi is None or hi != "" or not hi_strict
    empty_ok = lo_ok and hi_ok
    if lo is None and hi is None:
        return True, DIGIT + "+"
    if hi == "":
        # Equal to the upper bound so far: only zeros keep it in range.
        return (empty_ok, "0+" if empty_ok else None)
    if lo == "" and hi is None:
        return (not lo_strict), (DIGIT + "+" if not lo_strict else "0*[1-9][0-9]*")
    l0 = int(lo[0]) if lo else 0
    h0 = int(hi[0]) if hi else 9
    parts: list[Rx] = []
    free_lo = l0 + 1 if lo is not None else 0
    free_hi = h0 - 1 if hi is not None else 9
    parts.append(seq(_digit_class(free_lo, free_hi), DIGIT + "*"))
    for d in sorted({l0 if lo is not None else None, h0 if hi is not None else None} - {None}):
        next_lo = lo[1:].rstrip("0") if lo is not None and d == l0 else None
        if lo is not None and d == l0 and lo == "":
            next_lo = ""
        next_hi = hi[1:].rstrip("0") if hi is not None and d == h0 else None
        if lo is not None and d < l0 or hi is not None and d > h0:
            continue
        if lo is not None and d > l0:
            next_lo = None
        if hi is not None and d < h0:
            next_hi = None
        rest_empty, rest = _frac(next_lo, next_hi, lo_strict, hi_strict)
        parts.append(seq(str(d), alt(["" if rest_empty else None, rest])))
    return empty_ok, alt(parts)


def _fraction_text(empty_ok: bool, nonempty: Rx) -> Rx:
    return alt(["" if empty_ok else None, seq("\\.", nonempty)])


def _nonneg_decimal(lo: Decimal, lo_strict: bool, hi: Decimal | None, hi_strict: bool) -> Rx:
    li, lf = _split(lo)
    if hi is None:
        return alt([
            seq(nonneg_int_range(li + 1, None), _ANY_FRACTION),
            seq(str(li), _fraction_text(*_frac(lf, None, lo_strict, hi_strict))),
        ])
    hi_i, hf = _split(hi)
    if li == hi_i:
        return seq(str(li), _fraction_text(*_frac(lf, hf, lo_strict, hi_strict)))
    return alt([
        seq(str(li), _fraction_text(*_frac(lf, None, lo_strict, hi_strict))),
        seq(nonneg_int_range(li + 1, hi_i - 1), _ANY_FRACTION) if hi_i - 1 >= li + 1 else None,
        seq(str(hi_i), _fraction_text(*_frac(None, hf, lo_strict, hi_strict))),
    ])


def number_range(lo: Decimal | None, lo_strict: bool, hi: Decimal | None, hi_strict: bool) -> Rx:
    """JSON numbers ``v`` within the bounds, written without exponent; None if none exist.

    ``lo_strict`` / ``hi_strict`` make a bound exclusive. Zero is written ``0`` (never ``-0``).
    """
    if lo is None and hi is None:
        return NUMBER
    if lo is not None and hi is not None and (hi < lo or (hi == lo and (lo_strict or hi_strict))):
        return None
    parts: list[Rx] = []
    if hi is None or hi > 0 or (hi == 0 and not hi_strict):
        if lo is None or lo < 0:
            parts.append(_nonneg_decimal(Decimal(0), False, hi, hi_strict))
        else:
            parts.append(_nonneg_decimal(lo, lo_strict, hi, hi_strict))
    if lo is None or lo < 0:
        if hi is not None and hi < 0:
            mag = _nonneg_decimal(-hi, hi_strict, None if lo is None else -lo, lo_strict)
        else:
            mag = _nonneg_decimal(Decimal(0), True, None if lo is None else -lo, lo_strict)
        parts.append(seq("-", mag))
    return alt(parts)


# -- a schema's numbers (the compiler's ``number``/``integer`` types) --------------------------


def compile_number(c: "SchemaCompiler", schema: dict, path: str, integer: bool) -> Rx:
    """The regex of the JSON numbers (integers with ``integer``) ``schema``'s bounds and
    ``multipleOf`` admit: a range (``number_range``/``int_range``), the multiples listed or, in
    grammar mode, the remainder automaton (``multiples``); an unsupported step goes to
    ``c.unsupported`` (an error, or a warning and the bounds alone).

    Raises:
        GrammarError: ``multipleOf`` not positive, or (strict) not enforceable exactly.
    """
    long = [k for k in _BOUND_KEYS if _too_long(_dec(schema.get(k)))]
    if long:  # (their digit-by-digit regex would nest a group a digit: past any regex engine's limit)
        for key in long:
            c.unsupported(key, path, f"{key} {schema[key]!r} has more than {MAX_BOUND_DIGITS} decimal digits "
                                     f"before or after the point: bounds are compiled from 1e-{MAX_BOUND_DIGITS} "
                                     f"to below 1e{MAX_BOUND_DIGITS}")
        schema = {k: v for k, v in schema.items() if k not in long}
    lo, lo_x, hi, hi_x = bounds(schema)
    mult = schema.get("multipleOf")
    if integer or (mult is not None and _is_int(mult)):
        ilo, ihi = integer_range(lo, lo_x, hi, hi_x)
        if mult is not None and not _is_int(mult):
            return _int_fraction_multiple(c, mult, ilo, ihi, path)
        return _int_multiple(c, int(Decimal(str(mult))) if mult is not None else 1, ilo, ihi, path)
    if mult is not None:
        step = _dyadic_step(mult)
        if step is None:
            c.unsupported("multipleOf", path, f"multipleOf {mult!r}: decimal steps are enforced where a float "
                          "represents them exactly (0.5, 0.25, 2.5); jsonschema divides floats, and refuses "
                          "most multiples of 0.1 or 0.01")
        elif not c.opts.grammar:
            c.unsupported("multipleOf", path, _NEEDS_RULES.format(mult=mult))
        else:
            a, n = step
            scaled = integer_range(None if lo is None else lo.scaleb(n), lo_x,
                                   None if hi is None else hi.scaleb(n), hi_x)
            try:
                return _multiples(c, a, n).text(*scaled)
            except AutomatonTooLarge as e:
                c.unsupported("multipleOf", path, f"multipleOf {mult!r}: {e}")
    return number_range(lo, lo_x, hi, hi_x)


_NEEDS_RULES = ("multipleOf {mult!r} with these bounds is enforced by grammar rules (a remainder automaton), "
                "which a translation to one regex cannot hold: the eager backend's index, a tool call's "
                "arguments; the lazy backend serves it in a response format (grammar_backend \"lazy\" or \"auto\")")


def _multiples(c: "SchemaCompiler", a: int, n: int) -> Multiples:
    """Grammar mode: this compile's remainder automaton of the step ``a * 10**-n``
    (``multiples.Multiples``), its rules numbered among the compiler's."""
    key = ("multiple", a, n)
    automaton = c.bodies.get(key)
    if automaton is None:
        def new_rule() -> int:
            number = len(c.rule_ids)
            c.rule_ids[f"multiple:{a}:{n}:{number}"] = number
            return number

        automaton = c.bodies[key] = Multiples(a, n, new_rule, c.rules.__setitem__)
    return automaton


def _int_fraction_multiple(c: "SchemaCompiler", mult, lo, hi, path) -> Rx:
    """Integers that are multiples of a step that is not an integer."""
    # Every integer is a multiple of 1/k for integer k.
    inv = Decimal(1) / Decimal(str(mult))
    if inv == inv.to_integral_value():
        return int_range(lo, hi)
    # A binary-fraction step a * 10**-n (2.5, 0.75): v * 10**n is divisible by a exactly when v is
    # by a / gcd(a, 10**n) (2.5: 5), and jsonschema's float division is exact on these.
    step = _dyadic_step(mult)
    if step is not None:
        a, n = step
        return _int_multiple(c, a // math.gcd(a, 10 ** n), lo, hi, path)
    c.unsupported("multipleOf", path)
    return int_range(lo, hi)


def _int_multiple(c: "SchemaCompiler", k: int, lo: int | None, hi: int | None, path: str) -> Rx:
    if k <= 0:
        raise GrammarError("multipleOf must be positive", keyword="multipleOf", path=path)
    if k == 1:
        return int_range(lo, hi)
    if lo is not None and hi is not None and (hi - lo) // k <= 256:
        first = -(-lo // k) * k
        return alt([str(v) for v in range(first, hi + 1, k)])
    if lo is None and hi is None and k in (2, 5, 10):
        return "(?:" + _multiple_tail(k) + ")"
    if not c.opts.grammar:
        c.unsupported("multipleOf", path, _NEEDS_RULES.format(mult=k))
        return int_range(lo, hi)
    try:
        return _multiples(c, k, 0).text(lo, hi)
    except AutomatonTooLarge as e:
        c.unsupported("multipleOf", path, f"multipleOf {k}: {e}")
    return int_range(lo, hi)


def _dyadic_step(mult) -> tuple[int, int] | None:
    """``(a, n)`` with ``mult == a * 10**-n`` when the float ``mult`` is that decimal exactly (a
    binary fraction such as 0.5, 0.25 or 2.5), so jsonschema's float division agrees with decimal
    arithmetic on the multiples the grammar writes; else None."""
    if isinstance(mult, bool) or not isinstance(mult, (int, float)) or mult <= 0:
        return None
    dec = Decimal(repr(mult)) if isinstance(mult, float) else Decimal(mult)
    if isinstance(mult, float) and Decimal(mult) != dec:
        return None
    exp = -dec.as_tuple().exponent if dec.as_tuple().exponent < 0 else 0
    if exp > 6:
        return None
    return int(dec.scaleb(exp)), exp


def _multiple_tail(k: int) -> str:
    """Canonical integers divisible by 2, 5 or 10 (last digit decides), zero not negated."""
    last = {2: "[02468]", 5: "[05]", 10: "0"}[k]
    nonzero_last = {2: "[2468]", 5: "5", 10: None}[k]
    parts = ["0", f"-?[1-9][0-9]*{last}"]
    if nonzero_last:
        parts.append(f"-?{nonzero_last}")
    return "|".join(parts)


_BOUND_KEYS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")


def _too_long(d: Decimal | None) -> bool:
    """Whether bound ``d`` has more than ``MAX_BOUND_DIGITS`` digits before the point (1e300) or
    after it (1.5e-300), as ``bounds`` reads it (a float past 2**53 by its exact value)."""
    if d is None or not d.is_finite() or d == 0:
        return False
    d = d.normalize()
    return d.adjusted() >= MAX_BOUND_DIGITS or -d.as_tuple().exponent > MAX_BOUND_DIGITS


def _is_int(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and float(x).is_integer()


def _dec(x: object) -> Decimal | None:
    """A bound as a ``Decimal`` (None where it is no number). A float is read as its shortest
    decimal (``repr``: what the schema's text said) below 2**53, where no integer lies between
    that decimal and the float's exact value; from 2**53 on, as its exact value, an integer, which
    is what Python's validator compares an integer instance with (``2**60`` written
    ``1.152921504606847e18`` admits no integer above 1152921504606846976)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return None
    if isinstance(x, float):
        return Decimal(x) if abs(x) >= 2 ** 53 else Decimal(repr(x))
    return Decimal(x)


def bounds(s: dict, dec=_dec) -> tuple[Decimal | None, bool, Decimal | None, bool]:
    """``(lo, lo exclusive, hi, hi exclusive)`` of ``s`` (after ``schema_compiler._normalize``):
    the tighter of ``minimum``/``exclusiveMinimum`` and of ``maximum``/``exclusiveMaximum``,
    each read by ``dec`` (a number to a ``Decimal``, None where it is not one).

    Raises:
        GrammarError: a bound is NaN or infinite (what a Python schema may hold; JSON cannot).
    """
    for key in _BOUND_KEYS:
        v = s.get(key)
        if isinstance(v, float) and not math.isfinite(v):
            raise GrammarError(f"{key} must be a finite number, got {v!r}", keyword=key)
    lo, lo_x = dec(s.get("minimum")), False
    emin = dec(s.get("exclusiveMinimum"))
    if emin is not None and (lo is None or emin >= lo):
        lo, lo_x = emin, True
    hi, hi_x = dec(s.get("maximum")), False
    emax = dec(s.get("exclusiveMaximum"))
    if emax is not None and (hi is None or emax <= hi):
        hi, hi_x = emax, True
    return lo, lo_x, hi, hi_x


def integer_range(lo: Decimal | None, lo_x: bool, hi: Decimal | None, hi_x: bool) -> tuple[int | None, int | None]:
    """The integers inside ``bounds``: ``[first, last]`` (None: unbounded on that side)."""
    ilo = None if lo is None else int(lo.to_integral_value("ROUND_CEILING"))
    if lo is not None and lo_x and ilo == lo:
        ilo += 1
    ihi = None if hi is None else int(hi.to_integral_value("ROUND_FLOOR"))
    if hi is not None and hi_x and ihi == hi:
        ihi -= 1
    return ilo, ihi
