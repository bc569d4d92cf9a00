"""Reasoning before the answer: free thinking, then the constrained answer, in one ``max_tokens``.

:class:`ReasoningMatcher` is a ``GrammarMatcher`` (``stencil.grammar.base``) that wraps the answer's
matcher (a budget-aware :class:`stencil.grammar.budget.BudgetMatcher`, a plain backend matcher, or
``None`` for a free answer). The output goes through four phases::

    start_ids (forced) → reasoning (free) → end_ids + after_ids (forced) → the answer

* **Start.** ``start_ids`` ("<think>\\n" when the prompt did not open the region) are forced.
* **Reasoning.** Any token of the grammar alphabet (``TokenVocabulary.token_bytes``: no EOS, no
  stop token, no special or added token) plus the end marker's first token. The reasoning's text
  never contains ``end_text``: the matcher follows the text with the marker's KMP state ``k``
  (the longest suffix of the reasoning's bytes that is a proper prefix of the marker's bytes); a
  token whose bytes would complete the marker before their end is refused, and one that completes
  it exactly at its end ends the reasoning as the marker token would (then only ``after_ids`` are
  forced). The allowed tokens of each ``k`` are computed once per vocabulary and marker
  (:func:`reasoning_rows`: only tokens holding the marker's last byte can complete it, so the rest
  are settled without a scan) and kept as packed bitmask rows; a step's mask is one row copy.
* **The cut.** With ``left = max_tokens - tokens so far``, the end marker is the only token
  allowed (so forced) once ``left <= len(end_ids) + len(after_ids) + d + margin``, where ``d`` is
  the answer's shortest completion from its start (the closing automaton's token distance,
  ``BudgetMatcher.distance``; the grammar's ``min_output_tokens(0)`` for a plain matcher; 0 for a
  free answer), and once the reasoning holds ``max_reasoning_tokens`` tokens. A reasoning token
  is only ever allowed with ``left > need``, so after it at least ``need`` tokens are left: the
  marker, the separator and the answer's shortest completion always fit.
* **The answer.** When it starts, the answer's ``BudgetMatcher`` is given what is left as its
  budget (``set_budget``: it counts only the answer's tokens), so a structured answer closes
  complete within ``max_tokens``. A free answer allows every token; EOS ends it.

Admission (``stencil.engine.structured_output.check_budget``) asks ``max_tokens >= start + end +
after + the answer's minimum``: from there, the cut leaves the answer at least its minimum.

State is a small tuple per accepted token, so ``rollback`` over any phase change (drafts that
cross the end marker, forced tokens simulated by ``forced_tokens`` and ``validate_tokens``) is
exact, and the answer's matcher is rolled back by the answer tokens undone. Every rule is a
function of the tokens accepted so far, so masks with and without speculation agree, and greedy
outputs are identical.

What the engine reads besides the protocol: ``reasoning_start`` / ``reasoning_end`` (the
output-token span of the reasoning's own tokens), ``answer_start`` (the first answer token's
index, None before), ``reasoning_cut`` (the end marker was forced), and the answer matcher's
``closed_by_budget``, ``narrowed``, ``guarded`` and ``disabled`` (answer byte offsets).
"""

from __future__ import annotations

import threading
from typing import Callable

import numpy as np
import torch

from stencil.grammar.vocab import TokenVocabulary

START, THINK, END, ANSWER = 0, 1, 2, 3  # the phases

_ROWS: dict[tuple, "ReasoningRows"] = {}
_ROWS_LOCK = threading.Lock()


class ReasoningRows:
    """The reasoning's allowed tokens per marker state, for one vocabulary and marker.

    Attributes:
        marker: the end marker's bytes (``end_text`` in UTF-8).
        end_id: the marker's first token id.
        end_is_text: whether ``end_id`` is a text token of the alphabet (a marker spelled in
            several ordinary tokens); then choosing it is ordinary text, not the marker.
        packed: int32 ``[len(marker), words]``: row ``k`` allows what may follow a reasoning
            whose bytes end in ``marker[:k]`` (the end marker's first token included).
        allowed: bool ``[len(marker), model_vocab_size]``, the same rows unpacked.
    """

    def __init__(self, vocab: TokenVocabulary, marker: bytes, end_id: int):
        self.marker = marker
        self.end_id = end_id
        self.end_is_text = end_id in vocab.token_bytes
        size, m = vocab.model_vocab_size, len(marker)
        base = np.zeros(size, dtype=bool)
        ids = np.fromiter(vocab.token_bytes.keys(), dtype=np.int64, count=len(vocab.token_bytes))
        base[ids] = True
        allowed = np.repeat(base[None, :], m, axis=0)
        last = marker[-1]
        for tid, data in vocab.token_bytes.items():
            if last not in data:
                continue  # the marker cannot be completed inside these bytes from any state
            for k in range(m):
                s = marker[:k] + data
                i = s.find(marker)
                if i >= 0 and i + m != len(s):
                    allowed[k, tid] = False  # the marker would end inside the token
        if not self.end_is_text and 0 <= end_id < size:
            allowed[:, end_id] = True
        self.allowed = allowed
        words = vocab.bitmask_words
        padded = np.zeros((m, words * 32), dtype=bool)
        padded[:, :size] = allowed
        self.packed = np.packbits(padded, axis=1, bitorder="little").view(np.int32)

    def advance(self, k: int, data: bytes) -> int:
        """The marker state after ``data`` from state ``k``: ``len(marker)`` when the marker ends
        exactly at ``data``'s end, -1 when it ends inside it (refused), else the new state."""
        marker, m = self.marker, len(self.marker)
        s = marker[:k] + data
        i = s.find(marker)
        if i >= 0:
            return m if i + m == len(s) else -1
        for j in range(min(m - 1, len(s)), 0, -1):
            if s.endswith(marker[:j]):
                return j
        return 0


def reasoning_rows(vocab: TokenVocabulary, end_text: str, end_id: int) -> ReasoningRows:
    """The :class:`ReasoningRows` of ``vocab`` and this marker, built once and cached (a scan of
    the tokens holding the marker's last byte: about 2 ms on SmolLM2's 49,152 tokens)."""
    key = (vocab.fingerprint, end_text, end_id)
    with _ROWS_LOCK:
        rows = _ROWS.get(key)
    if rows is None:
        rows = ReasoningRows(vocab, end_text.encode("utf-8"), end_id)
        with _ROWS_LOCK:
            rows = _ROWS.setdefault(key, rows)
    return rows


class FreeAnswer:
    """The grammar of an unconstrained answer after reasoning: any text (a request without a
    constraint whose ``SamplingParams.reasoning`` is set still runs a :class:`ReasoningMatcher`
    for the cut and the cap). Its shortest output is no token."""

    def __init__(self, vocab: TokenVocabulary):
        self.vocab = vocab

    def min_output_tokens(self, max_tokens: int) -> int | None:
        return None


class ReasoningMatcher:
    """A ``GrammarMatcher`` over reasoning then answer (the module's docstring has the rules).

    Args:
        answer: the answer's matcher: a ``BudgetMatcher`` (its budget is set when the answer
            starts), a plain matcher, or ``None`` (a free answer).
        vocab: the grammar alphabet.
        params: the ``stencil.engine.request.ReasoningParams`` (end_text, end_ids, start_ids,
            after_ids, max_reasoning_tokens, margin).
        max_tokens: the whole output's budget (reasoning and answer).
        answer_min: the answer's shortest completion in tokens, or a callable giving it (called
            once, at the first reasoning step; ``None`` from it counts as 0). Default: the
            answer's ``distance()`` where it has one, else 0.

    Attributes:
        reasoning_start: output index of the reasoning's first token (``len(start_ids)``).
        reasoning_end: output index just past the reasoning's tokens (the marker's first forced
            or chosen token; just past the token whose text completed the marker), None before.
        answer_start: output index of the answer's first token, None before.
        reasoning_cut: the end marker was forced (budget or cap).
    """

    def __init__(self, answer, vocab: TokenVocabulary, params, max_tokens: int,
                 answer_min: int | Callable[[], int | None] | None = None):
        self.answer = answer
        self.vocab = vocab
        self.params = params
        self.max_tokens = max_tokens
        self.rows = reasoning_rows(vocab, params.end_text, params.end_ids[0])
        self._answer_min = answer_min
        self._min: int | None = None
        self._eos = frozenset(vocab.eos_token_ids)
        self.reasoning_start = len(params.start_ids)
        # The state: (phase, index in the forced run, forced run, marker state k, reasoning
        # tokens, cut, reasoning_end, answer_start, free answer ended); one per accepted token.
        self._st = (START, 0, tuple(params.start_ids), 0, 0, False, None, None, False)
        if not params.start_ids:
            self._st = (THINK, 0, (), 0, 0, False, None, None, False)
        self._hist: list[tuple] = []

    # -- what the engine reads ----------------------------------------------------------------
    @property
    def inner(self):
        """The answer's matcher (``stencil.grammar.prefetch`` unwraps it)."""
        return self.answer

    @property
    def grammar(self):
        return getattr(self.answer, "grammar", None)

    @property
    def backend(self) -> str:
        return getattr(self.answer, "backend", "free")

    @property
    def phase(self) -> int:
        return self._st[0]

    @property
    def reasoning_end(self) -> int | None:
        return self._st[6]

    @property
    def answer_start(self) -> int | None:
        return self._st[7]

    @property
    def reasoning_cut(self) -> bool:
        return self._st[5]

    @property
    def num_tokens(self) -> int:
        return len(self._hist)

    @property
    def closed_by_budget(self) -> bool:
        return bool(getattr(self.answer, "closed_by_budget", False))

    @property
    def narrowed(self) -> list[int]:
        return getattr(self.answer, "narrowed", [])

    @property
    def guarded(self) -> list:
        return getattr(self.answer, "guarded", [])

    @property
    def disabled(self) -> str | None:
        return getattr(self.answer, "disabled", None)

    # -- the rules ----------------------------------------------------------------------------
    def answer_min(self) -> int:
        """The answer's shortest completion from its start, in tokens (computed once)."""
        if self._min is None:
            m = self._answer_min
            if callable(m):
                m = m()
            elif m is None:
                dist = getattr(self.answer, "distance", None)
                m = dist() if dist is not None else 0
            self._min = int(m or 0)
        return self._min

    def need(self) -> int:
        """Tokens kept for the marker, the separator and the answer when reasoning is cut."""
        p = self.params
        return len(p.end_ids) + len(p.after_ids) + self.answer_min() + p.margin

    def _must_end(self) -> bool:
        """In the reasoning: whether the end marker is due now (the cap, or the budget)."""
        cap = self.params.max_reasoning_tokens
        if cap is not None and self._st[4] >= cap:
            return True
        return self.max_tokens - len(self._hist) <= self.need()

    def _forced(self) -> int | None:
        """The one token allowed now outside the answer, or None where the reasoning is free."""
        phase, i, run = self._st[0], self._st[1], self._st[2]
        if phase in (START, END):
            return run[i]
        if phase == THINK and self._must_end():
            return self.params.end_ids[0]
        return None

    def _step(self, t: int) -> bool:
        """Accept one token before the answer (the start, the reasoning, the marker, the
        separator), moving to the next phase where it ends one; False, state unchanged, when
        refused."""
        phase, i, run, k, n, cut, r_end, a_start, ended = st = self._st
        pos = len(self._hist)
        p = self.params
        if phase in (START, END):
            if t != run[i]:
                return False
            i += 1
            if i == len(run):
                if phase == START:
                    phase, i, run = THINK, 0, ()
                else:
                    phase, i, run, a_start = ANSWER, 0, (), pos + 1
        elif phase == THINK:
            forced = self._must_end()
            end_id = p.end_ids[0]
            if forced or (t == end_id and not self.rows.end_is_text):
                if t != end_id:
                    return False
                cut, r_end = forced, pos
                phase, i, run = END, 0, tuple(p.end_ids[1:]) + tuple(p.after_ids)
            else:
                data = self.vocab.token_bytes.get(t)
                if data is None or not self.rows.allowed[k, t]:
                    return False
                k = self.rows.advance(k, data)
                if k < 0:
                    return False
                if k == len(self.rows.marker):  # the text completed the marker: the reasoning ends
                    k, r_end = 0, pos + 1
                    phase, i, run = END, 0, tuple(p.after_ids)
                else:
                    n += 1
            if phase == END and not run:
                phase, a_start = ANSWER, pos + 1
        else:
            raise AssertionError("_step is not for the answer")
        self._hist.append(st)
        self._st = (phase, i, run, k, n, cut, r_end, a_start, ended)
        if phase == ANSWER:
            self._start_answer()
        return True

    def _start_answer(self) -> None:
        set_budget = getattr(self.answer, "set_budget", None)
        if set_budget is not None:
            set_budget(self.max_tokens - self._st[7])

    def _answer_tokens(self) -> int:
        st = self._st
        return len(self._hist) - st[7] if st[0] == ANSWER else 0

    # -- GrammarMatcher -----------------------------------------------------------------------
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over all tokens; False (and no state change) if any is refused."""
        done = 0
        for j, t in enumerate(token_ids):
            if self._st[0] == ANSWER:
                rest = token_ids[j:]
                if not self._accept_answer(rest):
                    self.rollback(done)
                    return False
                return True
            if not self._step(t):
                self.rollback(done)
                return False
            done += 1
        return True

    def _accept_answer(self, tokens: list[int]) -> bool:
        st = self._st
        if self.answer is not None:
            if not self.answer.accept_tokens(tokens):
                return False
            self._hist.extend([st] * len(tokens))
            return True
        for j, t in enumerate(tokens):
            if self._st[8]:  # the free answer ended with EOS: nothing follows
                self.rollback(j)
                return False
            self._hist.append(self._st)
            if t in self._eos:
                self._st = self._st[:8] + (True,)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (across phases)."""
        if num_tokens <= 0:
            return
        before = self._answer_tokens()
        self._st = self._hist[-num_tokens]
        del self._hist[-num_tokens:]
        undo = before - self._answer_tokens()
        if undo and self.answer is not None:
            self.answer.rollback(undo)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest prefix admitted (the answer's matcher judges its part, budget
        included); state unchanged."""
        done = 0
        n = 0
        for j, t in enumerate(token_ids):
            if self._st[0] == ANSWER:
                n = j + self._validate_answer(token_ids[j:])
                break
            if not self._step(t):
                n = j
                break
            done += 1
            n = j + 1
        self.rollback(done)
        return n

    def _validate_answer(self, tokens: list[int]) -> int:
        if self.answer is not None:
            return self.answer.validate_tokens(tokens)
        if self._st[8]:
            return 0
        for j, t in enumerate(tokens):
            if t in self._eos:
                return j + 1
        return len(tokens)

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The allowed tokens now: the forced token alone, the reasoning's row for its marker
        state, or the answer's row (every token for a free answer)."""
        if self._st[0] == ANSWER:
            if self.answer is not None:
                self.answer.fill_bitmask(bitmask, row)
            elif self._st[8]:
                bitmask[row] = 0
            else:
                bitmask[row] = -1
            return
        words = bitmask[row].numpy()
        forced = self._forced()
        if forced is not None:
            words[:] = 0
            bit = 1 << (forced & 31)
            words[forced >> 5] = bit - (1 << 32) if bit >= 1 << 31 else bit
            return
        src = self.rows.packed[self._st[3]]
        w = min(words.size, src.size)
        words[:w] = src[:w]
        words[w:] = 0

    def forced_tokens(self, max_n: int) -> list[int]:
        """Tokens allowed alone from here, across phase changes (the start, the cut's marker and
        separator, then the answer's own forced tokens); no state change."""
        out: list[int] = []
        done = 0
        while len(out) < max_n:
            if self._st[0] == ANSWER:
                if self.answer is not None and not self.answer.is_terminated():
                    out += self.answer.forced_tokens(max_n - len(out))
                break
            t = self._forced()
            if t is None or not self._step(t):
                break
            out.append(t)
            done += 1
        self.rollback(done)
        return out

    def is_terminated(self) -> bool:
        st = self._st
        if st[0] != ANSWER:
            return False
        return self.answer.is_terminated() if self.answer is not None else st[8]

    def is_accepting(self) -> bool:
        """True in the answer where it is complete (a free answer always is); never before."""
        if self._st[0] != ANSWER:
            return False
        return self.answer.is_accepting() if self.answer is not None else True

    def forced_text(self, max_bytes: int = 64) -> bytes:
        """The answer's forced bytes; nothing before the answer (the marker and the separator
        are forced as tokens, ``forced_tokens``)."""
        if self._st[0] != ANSWER or self.answer is None:
            return b""
        return self.answer.forced_text(max_bytes)

    def forced_text_after(self, token_ids: list[int], max_bytes: int = 64) -> bytes | None:
        """As :meth:`forced_text` after ``token_ids`` (None if refused); no state change."""
        if not token_ids:
            return self.forced_text(max_bytes)
        if self._st[0] == ANSWER and self.answer is not None:
            return self.answer.forced_text_after(token_ids, max_bytes)
        if not self.accept_tokens(token_ids):
            return None
        try:
            return self.forced_text(max_bytes)
        finally:
            self.rollback(len(token_ids))
