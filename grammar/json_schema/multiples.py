"""``multipleOf`` beyond what a regex can say: the remainder automaton as grammar rules.

A canonical JSON number ``v`` is a multiple of ``a * 10**-n`` (``a``, ``n`` integers) exactly when
the integer ``v * 10**n`` is divisible by ``a``. Reading its digits left to right, the remainder
after each digit is ``(10 * r + d) mod a`` (Horner's rule): a finite automaton with ``a`` states per
fraction position, written here as right-linear grammar rules (one per state) for the lazy backend.
Integers take ``n = 0``. The numbers written are canonical: no leading zeros, no exponent, a
fraction (when there is one) not ending in 0.
"""

from __future__ import annotations

from typing import Callable

from stencil.grammar.program import ref

MAX_STATES = 4096  # a * (n + 1) rules at most: a larger automaton is refused


def multiple_rules(a: int, n: int, new_rules: Callable[[int], list[int]],
                   set_rule: Callable[[int, str], None], negative: bool = True) -> str | None:
    """Regex text (with rule references) of the canonical numbers ``v`` with ``v * 10**n``
    divisible by ``a``; ``None`` when the automaton is too large.

    Args:
        a: the step's integer part after scaling (> 0).
        n: fraction digits of the step (0 for integer steps).
        new_rules: allocates that many rule numbers.
        set_rule: gives rule ``number`` its body.
        negative: also negative numbers (else only ``v >= 0``).
    """
    if a <= 0 or a * (n + 1) > MAX_STATES:
        return None
    ints = new_rules(a)  # I_r: integer digits read, remainder r
    fracs = {j: new_rules(a) for j in range(n)}  # D_{r,j}: j fraction digits read
    alive: dict[tuple[int, int], bool] = {}
    for j in range(n - 1, -1, -1):  # bottom-up, so a fraction state knows what it can reach
        for r in range(a):
            options = []
            for d in range(10):
                r2 = (10 * r + d) % a
                if d and r2 * 10 ** (n - j - 1) % a == 0:
                    options.append(str(d))
                if j + 1 < n and alive[(r2, j + 1)]:
                    options.append(f"{d}{ref(fracs[j + 1][r2])}")
            alive[(r, j)] = bool(options)
            if options:
                set_rule(fracs[j][r], "(?:" + "|".join(options) + ")")

    def end_of_integer(r: int) -> list[str]:
        out = [""] if r * 10 ** n % a == 0 else []
        if n and alive[(r, 0)]:
            out.append("\\." + ref(fracs[0][r]))
        return out

    for r in range(a):
        options = [f"{d}{ref(ints[(10 * r + d) % a])}" for d in range(10)] + end_of_integer(r)
        set_rule(ints[r], "(?:" + "|".join(options) + ")")
    zero = end_of_integer(0)
    parts = ["0" + ("(?:" + "|".join(zero) + ")" if zero else "")] if zero else []
    if negative and n and alive[(0, 0)]:
        parts.append("-0\\." + ref(fracs[0][0]))
    lead = "-?" if negative else ""
    parts.append(lead + "(?:" + "|".join(f"{d}{ref(ints[d % a])}" for d in range(1, 10)) + ")")
    return "(?:" + "|".join(parts) + ")"
