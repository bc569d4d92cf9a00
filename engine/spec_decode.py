"""N-gram (prompt-lookup) draft proposals, trimmed by the grammar, with an adaptive off-switch.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): find
the longest suffix of the request's tokens, of length ``prompt_lookup_min..prompt_lookup_max``,
that occurred earlier in prompt + output, and propose the tokens that followed that earlier
occurrence. Extraction copies names, dates and numbers from the document, so such drafts are
often right, and verifying k drafts costs one forward whose price on a weight-bound CPU hardly
grows with k.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(slots=True)
class SpecConfig:
    """Speculation settings (server default, overridable per request).

    Attributes:
        method: "ngram" or "off".
        num_speculative_tokens: most draft tokens per step.
        prompt_lookup_min / prompt_lookup_max: suffix lengths searched (tokens).
        max_batch_size: speculation is skipped when more requests than this are running
            (verification then costs real compute instead of riding on weight reads).
        max_draft_tokens_per_step: rows one step may spend on drafts, less the step's other
            rows beyond the first (a decode row per running request, plus its grammar-forced
            tokens). Grammar drafts take their share first; n-gram drafts then get the rest by
            expected value (``LLMEngine._propose_drafts``). On a CPU every verified row costs
            compute (SmolLM2 int4 at concurrency 8: about 10 ms a step plus 1.4 ms a row), so
            this bounds the step's time as well as its rows.
        row_tile: rows the model's matmul kernel processes together (0: the engine's choice, 4
            with torch's int4 kernel, 1 otherwise); drafts that would spill a row or two into a
            new tile are dropped (``llm_engine._trim_to_tile``).
        cost_aware: keep an n-gram draft only while its estimated chance of acceptance pays for
            the row it costs (``StepCost.threshold``); grammar drafts are kept.
        min_acceptance: a request whose recent acceptance rate falls below this stops proposing
            for ``backoff_steps`` steps, once ``min_evidence`` (decayed) drafts were judged.
        grammar_drafts: for constrained requests, draft the text the grammar forces next (e.g.
            ``,"age":`` after a string field), tokenized.
        text_lookup: look the output's last characters up in the prompt *text* (not token ids:
            a name copied into a JSON string is tokenized differently from the same name in
            running prose) and draft the text that follows, tokenized.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    max_batch_size: int = 8
    max_draft_tokens_per_step: int = 20
    row_tile: int = 0
    cost_aware: bool = True
    min_acceptance: float = 0.15
    min_evidence: float = 12.0
    backoff_steps: int = 16
    grammar_drafts: bool = True
    text_lookup: bool = True

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpecConfig | None":
        """Parse ``{"method": "ngram", ...}``; ``None`` or method "off" → None.

        Raises:
            ValueError: an unknown key or method, a value of the wrong JSON type, or an
                out-of-range number; the message names the field.
        """
        if not d:
            return None
        if not isinstance(d, dict):
            raise ValueError(f"speculative must be an object, got {type(d).__name__}")
        allowed = set(cls.__dataclass_fields__)
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"speculative: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
        for name, value in d.items():  # JSON types: a bool is not a number, a number not a bool
            want = type(cls.__dataclass_fields__[name].default)
            ok = (isinstance(value, str) if want is str else isinstance(value, bool) if want is bool
                  else isinstance(value, int) and not isinstance(value, bool) if want is int
                  else isinstance(value, (int, float)) and not isinstance(value, bool))
            if not ok:
                kind = {str: "a string", bool: "a boolean", int: "an integer"}.get(want, "a number")
                raise ValueError(f"speculative.{name} must be {kind}, got {value!r}")
        cfg = cls(**d)
        if cfg.method == "off":
            return None
        if cfg.method != "ngram":
            raise ValueError(f"speculative.method must be 'ngram' or 'off', got {cfg.method!r}")
        if not (1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max):
            raise ValueError("speculative: need 1 <= prompt_lookup_min <= prompt_lookup_max")
        if not (1 <= cfg.num_speculative_tokens <= 64):
            raise ValueError("speculative.num_speculative_tokens must be in 1..64")
        if cfg.max_draft_tokens_per_step < 0:
            raise ValueError("speculative.max_draft_tokens_per_step must be >= 0")
        if not (0 <= cfg.row_tile <= 64):
            raise ValueError("speculative.row_tile must be in 0..64")
        if cfg.max_batch_size < 1:
            raise ValueError("speculative.max_batch_size must be >= 1")
        if not (0.0 <= cfg.min_acceptance <= 1.0):
            raise ValueError("speculative.min_acceptance must be in 0..1")
        if cfg.min_evidence < 0 or cfg.backoff_steps < 0:
            raise ValueError("speculative: min_evidence and backoff_steps must be >= 0")
        return cfg


@dataclass(slots=True)
class SpecState:
    """Per-request acceptance tracking for the adaptive off-switch."""

    proposed: float = 0.0  # exponentially decayed counts (n-gram drafts only)
    accepted: float = 0.0
    rejected: float = 0.0  # verifications that stopped at a rejected draft (decayed)
    backoff: int = 0
    from_grammar: bool = False  # the drafts in flight came from the grammar, not from n-grams
    prompt_text: str | None = None  # decoded prompt, for text lookup (filled on first use)
    dropped: int | None = None  # the last token of forced text left out of the drafts in flight
    dropped_at: int = 0  # ... after this many drafts
    splits: "TokenSplits | None" = None  # this request's lessons on the model's tokenization

    def record(self, proposed: int, accepted: int, decay: float = 0.7) -> None:
        if self.from_grammar:
            return  # grammar drafts are cheap and usually right: they never trigger the off-switch
        self.proposed = self.proposed * decay + proposed
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < proposed else 0.0)

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 1.0

    def token_acceptance(self, prior: float = 0.8, weight: float = 2.0) -> float:
        """Chance that the next draft is accepted given the previous one was: the geometric
        model's estimate ``accepted / (accepted + rejections)``, shrunk towards ``prior`` by
        ``weight`` pseudo-drafts while there is little evidence."""
        return (self.accepted + prior * weight) / (self.accepted + self.rejected + weight)


class StepCost:
    """Online fit of a decode step's time as ``fixed + per_row * rows`` (ms), from steps that
    read no prompt tokens: exponentially weighted least squares over (rows, ms) pairs.

    Speculation uses it to decide how long a draft may be: a step of ``n`` rows yields ``n``
    tokens at ``fixed / n + per_row`` ms each, and a draft row costs ``per_row``, so a draft
    pays off only if its chance of being accepted is above
    ``threshold(n) = per_row / (fixed / n + per_row)``. On a weight-bound device (a GPU, a
    small batch) ``per_row`` is near 0 and every draft pays; on a compute-bound CPU batch of 8
    (SmolLM2 int4: about 12.6 ms + 1.3 ms per row) only drafts above ~45% do.

    Args:
        decay: weight kept by the past at each new observation.
        min_steps: observations needed before ``threshold`` answers.
    """

    def __init__(self, decay: float = 0.98, min_steps: int = 16) -> None:
        self.decay, self.min_steps = decay, min_steps
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.steps = 0

    def observe(self, rows: int, ms: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + rows
        self._y = self._y * d + ms
        self._xx = self._xx * d + rows * rows
        self._xy = self._xy * d + rows * ms
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """``(fixed_ms, per_row_ms)``, or None before ``min_steps`` steps of at least two sizes."""
        if self.steps < self.min_steps:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 0.25:  # every step had about the same number of rows: no slope to read
            return None
        per_row = max((self._xy / self._w - mx * my) / var, 0.0)
        return max(my - per_row * mx, 0.0), per_row

    def threshold(self, rows: int) -> float:
        """Least acceptance chance at which one more draft row pays, in a step of ``rows``
        other rows (0 when unknown: every draft is kept)."""
        fit = self.fit()
        if fit is None or rows <= 0:
            return 0.0
        fixed, per_row = fit
        per_token = fixed / rows + per_row
        return per_row / per_token if per_token > 0 else 0.0


class TokenSplits:
    """How the model spells grammar-forced text, learned from what it chose over the drafts.

    The canonical tokenization of forced text is not always the model's: in one output SmolLM2
    writes ``":"`` as ``":`` then ``"`` (its strings open with a lone quote), in another as one
    token. Three lessons are kept, per request (its output keeps one style) with the engine's
    table behind it for requests that have not shown theirs yet:

    - a draft ``d`` rejected for ``t`` whose text is a proper prefix of ``d``'s: spell ``d`` as
      ``t`` plus the tokenization of the rest;
    - a draft rejected for a token whose text extends it: the model writes that token whole;
    - the last token of forced text, left out of the drafts because it may merge with the free
      text after it, that the model then wrote exactly: draft it next time.

    Never a correctness matter (every draft is verified); bounded (oldest entries dropped).

    Args:
        decode: token ids -> text (the tokenizer's ``decode``).
        encode: text -> token ids, no special tokens.
        parent: the engine-wide table consulted for tokens this one has no lesson on.
        max_entries: most lessons kept per table.
    """

    def __init__(self, decode, encode, parent: "TokenSplits | None" = None, max_entries: int = 1024) -> None:
        self._decode = decode
        self._encode = encode
        self._parent = parent
        self._max = max_entries
        self.spelling: dict[int, tuple[int, ...]] = {}  # token -> the model's pieces (itself: whole)
        self.ends: dict[int, bool] = {}  # token -> whether the model writes it alone before free text

    def child(self) -> "TokenSplits":
        """A per-request table backed by this one."""
        return TokenSplits(self._decode, self._encode, self, self._max)

    def learn(self, draft: int, chosen: int, dropped: bool = False) -> None:
        """Record that the model chose ``chosen`` where ``draft`` was proposed (or, with
        ``dropped``, where ``draft`` was the forced text's last token, left out)."""
        for table in (self, self._parent):
            if table is not None:
                table._learn(draft, chosen, dropped)

    def _learn(self, draft: int, chosen: int, dropped: bool) -> None:
        if draft == chosen:
            if dropped:
                self._put(self.ends, draft, True)
            return
        d, c = self._decode([draft]), self._decode([chosen])
        if c and len(c) < len(d) and d.startswith(c):
            self._put(self.spelling, draft, (chosen, *self._encode(d[len(c):])))
        elif d and len(d) < len(c) and c.startswith(d):
            self._put(self.spelling, chosen, (chosen,))
            self._put(self.ends, draft, False)

    def _put(self, table: dict, key: int, value) -> None:
        table.pop(key, None)
        if len(table) >= self._max:
            table.pop(next(iter(table)))
        table[key] = value

    def _lookup(self, name: str, key: int):
        table = self
        while table is not None:
            found = getattr(table, name).get(key)
            if found is not None:
                return found
            table = table._parent
        return None

    def tokenize(self, text: str) -> tuple[list[int], bool]:
        """``text`` as the model would likely write it; also whether its last token is one the
        model writes on its own (a learned split's last piece, or a learned end)."""
        out: list[int] = []
        split = False
        for t in self._encode(text):
            pieces = self._lookup("spelling", t) or (t,)
            split = len(pieces) > 1
            out.extend(pieces)
        return out, bool(out) and (split or bool(self._lookup("ends", out[-1])))


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
