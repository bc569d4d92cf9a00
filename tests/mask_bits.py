"""Reading a matcher's mask in grammar tests: its words, the token ids they allow, the text of ids."""

from __future__ import annotations

import numpy as np


def mask_words(matcher, bitmask) -> np.ndarray:
    """Row 0 of ``bitmask`` filled by ``matcher``, as a copy of its uint32 words."""
    matcher.fill_bitmask(bitmask, 0)
    return bitmask[0].numpy().view(np.uint32).copy()


def allowed_ids(mask: np.ndarray, vocab_size: int) -> list[int]:
    """The token ids whose bit is set in ``mask``."""
    return [t for t in range(vocab_size) if int(mask[t >> 5]) >> (t & 31) & 1]


def spelled(ids: list[int], tokens: dict[int, bytes]) -> str:
    """The text ``ids`` spell with the byte strings of ``tokens`` (bad UTF-8 replaced)."""
    return b"".join(tokens[t] for t in ids).decode(errors="replace")


def walk_both(first, second, bitmask, rng, eos: int, vocab_size: int, steps: int, eos_rate: float = 0.5,
              check=None) -> list[int] | None:
    """One random walk of two grammars' matchers side by side: at every step their masks are
    asserted equal (``check(a, b, ids)`` may assert more), then one allowed token is taken by both
    (EOS, when allowed, with probability ``eos_rate``). Returns the ids before EOS, or None when the
    walk ran ``steps`` tokens without ending."""
    a, b = first.matcher(), second.matcher()
    ids: list[int] = []
    for _ in range(steps):
        ma, mb = mask_words(a, bitmask), mask_words(b, bitmask)
        assert np.array_equal(ma, mb), (ids, sorted(set(allowed_ids(ma, vocab_size)) ^ set(allowed_ids(mb, vocab_size))))
        if check is not None:
            check(a, b, ids)
        allowed = allowed_ids(ma, vocab_size)
        t = eos if eos in allowed and rng.random() < eos_rate else rng.choice(allowed)
        assert a.accept_tokens([t]) and b.accept_tokens([t])
        if t == eos:
            return ids
        ids.append(t)
    return None
