"""Prompt lookup: draft tokens by finding what the output just wrote earlier in the document.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): find
the longest suffix of the request's tokens, of length ``prompt_lookup_min..prompt_lookup_max``,
that occurred earlier in prompt + output, and propose the tokens that followed that earlier
occurrence. Extraction copies names, dates and numbers from the document, so such drafts are
often right. The text variants look characters up instead of token ids, since a name copied
into a JSON string is tokenized differently from the same name in running prose.
"""

from __future__ import annotations

import re

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    """Draft up to ``k`` tokens by prompt lookup.

    Args:
        tokens: int64 ``[num_tokens]``, the request's prompt + output.
        k: most tokens to propose.
        n_min, n_max: suffix lengths to try, longest first.

    Returns:
        The tokens that followed the most recent earlier occurrence of the longest matching
        suffix (possibly fewer than ``k``), or ``[]``.
    """
    n_tok = tokens.shape[0]
    for n in range(min(n_max, n_tok - 1), n_min - 1, -1):
        suffix = tokens[n_tok - n:]
        # Windows starting at 0..n_tok-n-1: every earlier occurrence, excluding the suffix itself.
        windows = sliding_window_view(tokens[:n_tok - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


def propose_text(source: str, generated: str, min_chars: int = 3, max_chars: int = 24,
                 max_out_chars: int = 48) -> str:
    """Draft text by looking the end of ``generated`` up in ``source`` (prompt lookup on characters).

    Tries suffixes of ``generated`` from ``max_chars`` down to ``min_chars`` characters and
    returns up to ``max_out_chars`` characters that follow the last occurrence of the longest
    one found in ``source``, or "".
    """
    n = len(generated)
    for length in range(min(max_chars, n), min_chars - 1, -1):
        pos = source.rfind(generated[n - length:])
        if pos >= 0:
            start = pos + length
            return source[start:start + max_out_chars]
    return ""


_VALUE_START = re.compile(r'[^"{}\[\]:,]*$')


def propose_value(source: str, generated: str, max_out_chars: int = 48) -> str:
    """Draft text for a value just begun: look up only its characters since the JSON
    punctuation that opened it (``"20`` → ``20``), which ``propose_text`` misses because the
    quote before them is not in the document. One or two characters must occur once in ``source``
    (or be followed by the same 8 characters at their first and last occurrence); three or
    more may occur anywhere (the last occurrence is taken). Returns up to
    ``max_out_chars`` characters that follow, or ""."""
    value = _VALUE_START.search(generated[-64:]).group().lstrip()  # a value just begun is short
    if not value:
        return ""
    pos = source.rfind(value)
    if pos < 0:
        return ""
    start = pos + len(value)
    first = source.find(value) + len(value)
    if len(value) < 3 and first != start and source[first:first + 8] != source[start:start + 8]:
        return ""  # a short prefix seen before different continuations: no guess
    return source[start:start + max_out_chars]


_PAUSES = frozenset(',;()[]{}\n"!?')


def span_end(text: str) -> int:
    """Where a value copied from prose most likely ends in ``text``: the first pause
    (``,;()[]{}!?``, a newline, a quote, or ``.``/``:`` followed by a space or the end), or
    ``len(text)`` when there is none. Dots inside ``mail.test`` or ``3.5`` do not count."""
    for i, ch in enumerate(text):
        if ch in _PAUSES:
            return i
        if ch in ".:" and (i + 1 == len(text) or text[i + 1].isspace()):
            return i
    return len(text)
