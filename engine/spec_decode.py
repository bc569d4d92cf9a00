"""N-gram (prompt-lookup) draft proposals, trimmed by the grammar, with an adaptive off-switch.

Prompt lookup decoding (Saxena 2023, "Prompt Lookup Decoding"; vLLM's ``ngram`` method): find
the longest suffix of the request's tokens, of length ``prompt_lookup_min..prompt_lookup_max``,
that occurred earlier in prompt + output, and propose the tokens that followed that earlier
occurrence. Extraction copies names, dates and numbers from the document, so such drafts are
often right, and verifying k drafts costs one forward whose price on a weight-bound CPU hardly
grows with k.
"""

from __future__ import annotations

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
        max_draft_tokens_per_step: rows one step may spend on drafts, less one per running
            request beyond the first (a decode row each), shared in batch order. On a CPU each
            verified row costs compute (SmolLM2 int4, one sequence: 12.7 ms for 1 row, 16.5 ms
            for 3, 24 ms for 5, 33 ms for 9; 8 sequences decoding already pay for 8 rows), so a
            lone request gets up to ``num_speculative_tokens`` drafts and a batch of 8 almost none.
        min_acceptance: a request whose recent acceptance rate falls below this stops proposing
            for ``backoff_steps`` steps, once ``min_evidence`` (decayed) drafts were judged.
        grammar_drafts: for constrained requests, draft the text the grammar forces next (e.g.
            ``,"age":`` after a string field), tokenized.
        text_lookup: look the output's last characters up in the prompt *text* (not token ids:
            a name copied into a JSON string is tokenized differently from the same name in
            running prose) and draft the text that follows, tokenized.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4  # copy workload, int4, c=1: 4 beat 3, 6 and 8
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    max_batch_size: int = 8
    max_draft_tokens_per_step: int = 8
    min_acceptance: float = 0.15
    min_evidence: float = 12.0
    backoff_steps: int = 16
    grammar_drafts: bool = True
    text_lookup: bool = True

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpecConfig | None":
        """Parse ``{"method": "ngram", ...}``; ``None`` or method "off" → None.

        Raises:
            ValueError: an unknown key or method, or out-of-range numbers.
        """
        if not d:
            return None
        allowed = set(cls.__dataclass_fields__)
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(f"speculative: unknown field(s) {sorted(unknown)}; allowed: {sorted(allowed)}")
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
        return cfg


@dataclass(slots=True)
class SpecState:
    """Per-request acceptance tracking for the adaptive off-switch."""

    proposed: float = 0.0  # exponentially decayed counts (n-gram drafts only)
    accepted: float = 0.0
    backoff: int = 0
    from_grammar: bool = False  # the drafts in flight came from the grammar, not from n-grams
    prompt_text: str | None = None  # decoded prompt, for text lookup (filled on first use)

    def record(self, proposed: int, accepted: int, decay: float = 0.7) -> None:
        if self.from_grammar:
            return  # grammar drafts are cheap and usually right: they never trigger the off-switch
        self.proposed = self.proposed * decay + proposed
        self.accepted = self.accepted * decay + accepted

    @property
    def rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 1.0


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
