"""``multipleOf`` beyond what a regex can say: the remainder automaton as grammar rules.

A canonical JSON number ``v`` is a multiple of ``a * 10**-n`` (``a``, ``n`` integers) exactly when
the integer ``m = v * 10**n`` is divisible by ``a``. Reading its digits left to right, the remainder
after each digit is ``(10 * r + d) mod a`` (Horner's rule): a finite automaton with ``a`` states per
position, written here as right-linear grammar rules (one per state) for the lazy backend.
Integers take ``n = 0``. The numbers written are canonical: no leading zeros, no exponent, a
fraction (when there is one) not ending in 0, never ``-0``.

Bounds (``minimum`` and the rest, on either side or both) are a range ``[lo, hi]`` of the scaled
integers ``m``. Each sign's magnitudes are split by their integer part ``I = |m| div 10**n``:

* the integer parts strictly inside the range take every fraction the automaton allows. They are
  the classic digit-range split (``int_pieces``): a fixed prefix, one digit from a range, then a
  number of free digits, exactly that many or (above an unbounded side) at least that many. The
  remainder after the prefix and the digit is known, so each piece is that text followed by the
  rule "exactly (or at least) k more digits from remainder r, then the end";
* an integer part on a bound whose fraction is cut by it (``minimum: 2.25`` with step 0.25) takes
  the few fractions inside, listed (at most ``10**n / a`` of them: 2**n for a binary-fraction
  step).

The pieces' texts are then merged into a tree of single characters (``_tree``), so that every
lexeme the Lark grammar has is one character: see there why.

Rules are made when first named and shared by every bound of one compile with the same step;
more than ``MAX_STATES`` of them refuses the range (``AutomatonTooLarge``; the rules of that range
are then not given to the compiler, and the numbers they took stay unused).
"""

from __future__ import annotations

from typing import Callable

from stencil.grammar.program import ref

MAX_STATES = 4096  # rules of one step's automaton: beyond it the step is refused
MAX_LISTED = 4096  # values listed on a bound's integer part
MAX_BOUND_DIGITS = 40  # a bound's scaled magnitude past 10**40 is refused (1e300: seconds, 100s of KB)


class AutomatonTooLarge(Exception):
    """The step needs more than ``MAX_STATES`` rules (or a bound more than ``MAX_LISTED`` values)."""


class Multiples:
    """The rules of the canonical numbers ``v`` with ``v * 10**n`` divisible by ``a``, for one
    compile: ``text(lo, hi)`` is the regex (with rule references) of those inside a range.

    Args:
        a: the step's digits after scaling (> 0).
        n: fraction digits of the step (0 for integer steps).
        new_rule: allocates one rule number.
        set_rule: gives rule ``number`` its body.
    """

    def __init__(self, a: int, n: int, new_rule: Callable[[], int], set_rule: Callable[[int, str], None]):
        if a <= 0 or n < 0:
            raise ValueError(f"a step of {a} * 10**-{n}")
        self.a, self.n = a, n
        self._new_rule, self._set_rule = new_rule, set_rule
        self._rules: dict[tuple, int] = {}  # (kind, r, k) → rule number
        self._pending: list[tuple[int, Callable[[], str]]] = []  # rules named, bodies not yet written
        self._alive: dict[tuple, bool] = {}
        self._nodes = 0  # tree nodes made rules (``_tree``), for their keys

    # -- the states ------------------------------------------------------------------------
    def _rule(self, key: tuple, body: Callable[[], str]) -> str:
        number = self._rules.get(key)
        if number is None:
            if len(self._rules) >= MAX_STATES:
                raise AutomatonTooLarge(f"its remainder automaton needs more than {MAX_STATES} grammar rules "
                                        "(a step's digits times the bounds' digits, about)")
            number = self._rules[key] = self._new_rule()
            # (its body is written later, by ``text``: a chain of remainders would otherwise
            # recurse once per state)
            self._pending.append((number, body))
        return ref(number)

    def _frac_alive(self, r: int, j: int) -> bool:
        """Whether j fraction digits read with remainder r can end (a last digit not 0)."""
        key = ("F", r, j)
        if key not in self._alive:
            a, n = self.a, self.n
            self._alive[key] = any(
                (d and (10 * r + d) % a * 10 ** (n - j - 1) % a == 0)
                or (j + 1 < n and self._frac_alive((10 * r + d) % a, j + 1)) for d in range(10))
        return self._alive[key]

    def _fraction(self, r: int, j: int) -> str:
        """Rule: fraction digits from position j on, remainder r so far (only where alive)."""
        def body() -> str:
            a, n = self.a, self.n
            options = []
            for d in range(10):
                r2 = (10 * r + d) % a
                if d and r2 * 10 ** (n - j - 1) % a == 0:
                    options.append(str(d))
                if j + 1 < n and self._frac_alive(r2, j + 1):
                    options.append(f"{d}{self._fraction(r2, j + 1)}")
            return "(?:" + "|".join(options) + ")"
        return self._rule(("F", r, j), body)

    def _end_alive(self, r: int) -> bool:
        return r * 10 ** self.n % self.a == 0 or (self.n > 0 and self._frac_alive(r, 0))

    def _end(self, r: int) -> str:
        """Regex: the end of an integer part with remainder r (nothing, or a fraction)."""
        options = [""] if r * 10 ** self.n % self.a == 0 else []
        if self.n and self._frac_alive(r, 0):
            options.append("\\." + self._fraction(r, 0))
        assert options, "an end named where none is alive"
        return options[0] if options == [""] else "(?:" + "|".join(options) + ")"

    def _more(self, r: int) -> str:
        """Rule: any number of further integer digits from remainder r, then the end."""
        def body() -> str:
            options = [f"{d}{self._more((10 * r + d) % self.a)}" for d in range(10)]
            if self._end_alive(r):
                options.append(self._end(r))
            return "(?:" + "|".join(options) + ")"
        return self._rule(("I", r, 0), body)

    def _exact_alive(self, r: int, k: int) -> bool:
        key = ("X", r, k)
        if key not in self._alive:
            self._alive[key] = self._end_alive(r) if k == 0 else \
                any(self._exact_alive((10 * r + d) % self.a, k - 1) for d in range(10))
        return self._alive[key]

    def _exact(self, r: int, k: int) -> str:
        """Regex: exactly k more integer digits from remainder r, then the end (where alive)."""
        if k == 0:
            return self._end(r)

        def body() -> str:
            return "(?:" + "|".join(f"{d}{self._exact((10 * r + d) % self.a, k - 1)}" for d in range(10)
                                    if self._exact_alive((10 * r + d) % self.a, k - 1)) + ")"
        return self._rule(("X", r, k), body)

    def _at_least(self, r: int, k: int) -> str:
        """Rule: at least k more integer digits from remainder r, then the end (always alive:
        enough digits reach every remainder)."""
        if k == 0:
            return self._more(r)
        return self._rule(("A", r, k), lambda: "(?:" + "|".join(
            f"{d}{self._at_least((10 * r + d) % self.a, k - 1)}" for d in range(10)) + ")")

    # -- ranges ----------------------------------------------------------------------------
    def text(self, lo: int | None, hi: int | None) -> str | None:
        """Regex of the multiples ``m`` (scaled: ``v * 10**n``) with ``lo <= m <= hi`` (None:
        unbounded on that side) as canonical numbers; None when there is none.

        Raises:
            AutomatonTooLarge: the automaton or a bound's list would be too large, or a bound
                has more than ``MAX_BOUND_DIGITS`` digits.
        """
        if any(b is not None and abs(b) >= 10 ** MAX_BOUND_DIGITS for b in (lo, hi)):
            raise AutomatonTooLarge(f"a bound, counted in steps of 10**-{self.n}, has more than "
                                    f"{MAX_BOUND_DIGITS} digits")
        before = set(self._rules)
        try:
            pieces = []
            if hi is None or hi >= 0:  # m >= 0, "0" included
                pieces += self._magnitudes(max(lo, 0) if lo is not None else 0, hi)
            if lo is None or lo < 0:  # m < 0: "-" and a magnitude of at least 1
                pieces += [("-" + text, then) for text, then in
                           self._magnitudes(max(1, -hi) if hi is not None else 1, None if lo is None else -lo)]
            out = self._tree(pieces)
            written = []
            while self._pending:
                number, body = self._pending.pop()
                written.append((number, body()))
        except AutomatonTooLarge:
            # nothing of this range is kept: its rules are forgotten (their numbers stay unused)
            for key in set(self._rules) - before:
                del self._rules[key]
            self._pending.clear()
            raise
        for number, body_text in written:
            self._set_rule(number, body_text)
        return out

    def _tree(self, pieces: list[tuple[str, str]]) -> str | None:
        """One regex of the pieces ``(literal text, then regex)``: their texts merged into a tree
        of single characters, each node with children a rule of its own; None when there is no
        piece (no value).

        Why: llguidance's lexer takes the longest lexeme it can, and the Lark writer joins
        adjacent literal characters into one lexeme. Pieces written side by side, as
        ``/155/ | /1/ r7``, make ``/155/`` a lexeme that swallows the "55" of "1555", which only
        ``/1/ r7`` can finish. Here every lexeme is one character (a node's children are behind
        its rule's reference), so no lexeme is the start of another."""
        if not pieces:
            return None
        root: dict = {}
        for text, then in pieces:
            node = root
            for ch in text:
                node = node.setdefault(ch, {})
            node.setdefault("", []).append(then)

        def emit(node: dict) -> str:
            options = []
            for ch, child in node.items():
                if ch == "":
                    options += list(dict.fromkeys(child))
                    continue
                lexeme = "\\" + ch if ch in ".-" else ch
                if len(child) > 1 or "" not in child:  # more than ends here: a rule
                    self._nodes += 1
                    options.append(lexeme + self._rule(("T", self._nodes), lambda c=child: emit(c)))
                else:
                    ends = list(dict.fromkeys(child[""]))
                    options.append(lexeme + (ends[0] if len(ends) == 1 else "(?:" + "|".join(ends) + ")"))
            return "(?:" + "|".join(options) + ")"

        return emit(root)

    def _magnitudes(self, lo: int, hi: int | None) -> list[tuple[str, str]]:
        """The multiples with magnitude in ``[lo, hi]`` (``lo >= 0``) as pieces ``(text, then)``:
        literal text, then a regex (a rule reference, an end, or nothing)."""
        if hi is not None and hi < lo:
            return []
        scale = 10 ** self.n
        i_lo, f_lo = divmod(lo, scale)
        i_hi, f_hi = divmod(hi, scale) if hi is not None else (None, None)
        out: list[tuple[str, str]] = []
        if i_hi is not None and i_lo == i_hi:
            return self._listed(i_lo, f_lo, f_hi)
        first, last = i_lo, i_hi
        if f_lo > 0:  # the lower bound's integer part takes only the fractions above f_lo
            out += self._listed(i_lo, f_lo, scale - 1)
            first += 1
        if i_hi is not None and f_hi < scale - 1:  # and the upper one's those below f_hi
            last -= 1
        if last is None or first <= last:
            for prefix, d_lo, d_hi, free, tail in int_pieces(first, last):
                r0 = int(prefix) % self.a if prefix else 0
                for d in range(d_lo, d_hi + 1):
                    r = (10 * r0 + d) % self.a
                    if tail:
                        out.append((f"{prefix}{d}", self._at_least(r, free)))
                    elif self._exact_alive(r, free):
                        out.append((f"{prefix}{d}", self._exact(r, free)))
        if i_hi is not None and f_hi < scale - 1:
            out += self._listed(i_hi, 0, f_hi)
        return out

    def _listed(self, whole: int, f_lo: int, f_hi: int) -> list[tuple[str, str]]:
        """The multiples with integer part ``whole`` and fraction digits in ``[f_lo, f_hi]``
        (scaled), each as its canonical text (a piece with nothing after it)."""
        scale, a = 10 ** self.n, self.a
        base = whole * scale
        first = base + f_lo + (-(base + f_lo)) % a
        values = range(first, base + f_hi + 1, a)
        if len(values) > MAX_LISTED:
            raise AutomatonTooLarge(f"it would list more than {MAX_LISTED} values at a bound")
        out = []
        for m in values:
            frac = str(m - base).rjust(self.n, "0").rstrip("0") if self.n else ""
            out.append((str(whole) + ("." + frac if frac else ""), ""))
        return out


def int_pieces(lo: int, hi: int | None) -> list[tuple[str, int, int, int, bool]]:
    """The canonical decimal texts of the integers in ``[lo, hi]`` (``0 <= lo``; ``hi`` None:
    unbounded) as disjoint pieces ``(prefix, first digit, last digit, free, tail)``: the prefix,
    one digit in that range, then exactly ``free`` digits (``tail``: at least ``free``). The
    classic digit-range split, flat (no piece inside another): ``numbers.nonneg_int_range``
    writes each piece as a regex, ``Multiples`` follows each with its remainder rule."""
    if hi is not None and hi < lo:
        return []
    width = len(str(lo))
    top = width if hi is None else len(str(hi))
    parts: list[tuple[str, int, int, int, bool]] = []
    for length in range(width, top + 1):
        a = lo if length == width else 10 ** (length - 1)
        b = hi if hi is not None and length == top else 10 ** length - 1
        parts += _same_length(str(a), str(b))
    if hi is None:  # every number longer than the lower bound
        parts.append(("", 1, 9, width, True))
    return parts


def _same_length(a: str, b: str) -> list[tuple[str, int, int, int, bool]]:
    """Pieces of the digit strings t of ``len(a)`` with ``a <= t <= b`` (``a <= b``)."""
    i = 0
    while i < len(a) and a[i] == b[i]:
        i += 1
    if i == len(a):
        return [(a[:-1], int(a[-1]), int(a[-1]), 0, False)]
    rest = len(a) - i - 1
    lo_free = a[i + 1:].strip("0") == ""
    hi_free = b[i + 1:].strip("9") == ""
    out = [] if lo_free else _above(a[:i + 1], a[i + 1:])
    d_lo = int(a[i]) + (0 if lo_free else 1)
    d_hi = int(b[i]) - (0 if hi_free else 1)
    if d_lo <= d_hi:
        out.append((a[:i], d_lo, d_hi, rest, False))
    return out + ([] if hi_free else _below(b[:i + 1], b[i + 1:]))


def _above(prefix: str, s: str) -> list[tuple[str, int, int, int, bool]]:
    """Pieces of ``prefix`` + t for the digit strings t of ``len(s)`` with ``t >= s``."""
    out = [(prefix + s[:j], int(s[j]) + 1, 9, len(s) - j - 1, False) for j in range(len(s)) if s[j] != "9"]
    return out + [(prefix + s[:-1], int(s[-1]), int(s[-1]), 0, False)]


def _below(prefix: str, s: str) -> list[tuple[str, int, int, int, bool]]:
    """Pieces of ``prefix`` + t for the digit strings t of ``len(s)`` with ``t <= s``."""
    out = [(prefix + s[:j], 0, int(s[j]) - 1, len(s) - j - 1, False) for j in range(len(s)) if s[j] != "0"]
    return out + [(prefix + s[:-1], int(s[-1]), int(s[-1]), 0, False)]
