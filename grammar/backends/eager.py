"""Compiled grammars (shared, immutable) and their per-request matchers.

A :class:`CompiledGrammar` wraps an outlines-core ``Index`` built from ``(?:REGEX)\\x01`` over the
vocabulary plus the sentinel token (see :data:`grammar.vocab.END_SENTINEL`). "The sentinel is
allowed" is read as "EOS is allowed"; accepting EOS advances the index over the sentinel, into
its only final state. So EOS is allowed exactly in the regex's accepting states, and after EOS
nothing else is.

A :class:`Matcher` is a cursor: an outlines-core ``Guide`` (which writes masks and keeps the
state history used by :meth:`Matcher.rollback`) plus a terminated flag. Source of the Guide /
Index API: outlines-core 0.2.14 ``src/python_bindings/mod.rs``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from outlines_core import Guide

from grammar.base import GrammarSpec
from grammar.vocab import TokenVocabulary

# Guide keeps one u32 per accepted token (no preallocation); generations are bounded by the
# model length long before this.
_MAX_ROLLBACK = 1 << 20
_UNKNOWN = object()


@dataclass(frozen=True, slots=True, eq=False)
class CompiledGrammar:
    """An immutable compiled constraint, shared by every request with the same spec.

    Attributes:
        spec: what was compiled.
        regex: the regex the output must fully match (without the end sentinel).
        index: the ``outlines_core.Index`` of ``(?:regex)\\x01`` over ``vocab`` + sentinel.
        vocab: the grammar alphabet (EOS ids, sentinel id, model vocab size).
        warnings: notes from the JSON-Schema translation (keywords not enforced, ...).
        index_bytes: size of the index in outlines-core's binary form (a memory estimate).
    """

    spec: GrammarSpec
    regex: str
    index: object
    vocab: TokenVocabulary
    warnings: tuple[str, ...] = ()
    index_bytes: int = 0
    # state → (token, next state) when exactly one token is allowed there, else None. Filled
    # lazily (a state's token list can be 49 k long); dict writes are atomic under the GIL and
    # every writer stores the same value, so sharing across threads is safe.
    _forced: dict = field(default_factory=dict, repr=False)
    # state → (byte, next state) when every allowed token starts with the same byte and the
    # output may not end there (see ``forced_byte``); filled lazily like ``_forced``.
    _forced_bytes: dict = field(default_factory=dict, repr=False)
    _byte_tokens: dict = field(default_factory=dict, repr=False)  # byte value → single-byte token id

    def matcher(self) -> "Matcher":
        """A fresh cursor at the start of the grammar."""
        return Matcher(self)

    def forced_step(self, state: int) -> tuple[int, int] | None:
        """``(token_id, next_state)`` if ``state`` allows exactly one token, else ``None``."""
        hit = self._forced.get(state, _UNKNOWN)
        if hit is _UNKNOWN:
            allowed = self.index.get_allowed_tokens(state) or []
            hit = None
            if len(allowed) == 1:
                hit = (allowed[0], self.index.get_next_state(state, allowed[0]))
            self._forced[state] = hit
        return hit


    def forced_byte(self, state: int, max_allowed: int = 4096) -> tuple[int, int] | None:
        """``(byte, next_state)`` if the grammar forces the next *byte* from ``state``, else None.

        The byte is forced when the output may not end at ``state`` and every allowed token
        starts with it; the next state is the one reached through the token made of that byte
        alone (byte-level vocabularies have one for every byte). States allowing more than
        ``max_allowed`` tokens (free text) are not examined: they are never forced.
        """
        hit = self._forced_bytes.get(state, _UNKNOWN)
        if hit is not _UNKNOWN:
            return hit
        hit = None
        index, sentinel = self.index, self.vocab.sentinel_id
        allowed = index.get_allowed_tokens(state) or []
        if 0 < len(allowed) <= max_allowed:
            tb = self.vocab.token_bytes
            first = {tb[t][0] for t in allowed if t != sentinel and t in tb}
            if len(first) == 1 and sentinel not in allowed:
                b = first.pop()
                tid = self._single_byte_token(b)
                nxt = index.get_next_state(state, tid) if tid is not None else None
                if nxt is not None:
                    hit = (b, nxt)
        self._forced_bytes[state] = hit
        return hit

    def _single_byte_token(self, b: int) -> int | None:
        if not self._byte_tokens:
            for tid, bs in self.vocab.token_bytes.items():
                if len(bs) == 1:
                    self._byte_tokens.setdefault(bs[0], tid)
            self._byte_tokens.setdefault(-1, -1)  # marks the table as built
        return self._byte_tokens.get(b)


class Matcher:
    """Per-request cursor over a :class:`CompiledGrammar` (implements ``GrammarMatcher``).

    Not thread-safe; owned by one request.
    """

    __slots__ = ("_grammar", "_index", "_guide", "_sentinel", "_eos", "_size", "_num_tokens",
                 "_terminated")

    def __init__(self, grammar: CompiledGrammar):
        self._grammar = grammar
        self._index = grammar.index
        self._guide = Guide(grammar.index, max_rollback=_MAX_ROLLBACK)
        self._sentinel = grammar.vocab.sentinel_id
        self._eos = frozenset(grammar.vocab.eos_token_ids)
        self._size = grammar.vocab.model_vocab_size
        self._num_tokens = 0
        self._terminated = False

    @property
    def grammar(self) -> CompiledGrammar:
        return self._grammar

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far (EOS included), i.e. how far :meth:`rollback` can go."""
        return self._num_tokens

    def is_terminated(self) -> bool:
        """True once EOS has been accepted."""
        return self._terminated

    def is_accepting(self) -> bool:
        """True when the output so far fully matches, i.e. EOS is allowed now."""
        return (not self._terminated
                and self._index.get_next_state(self._guide.get_state(), self._sentinel) is not None)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """Length of the longest prefix of ``token_ids`` the grammar admits; no state change.

        EOS counts as admitted only in an accepting state, and nothing is admitted after it.
        """
        if self._terminated:
            return 0
        index, state = self._index, self._guide.get_state()
        for k, tid in enumerate(token_ids):
            if tid in self._eos:
                return k + 1 if index.get_next_state(state, self._sentinel) is not None else k
            if tid == self._sentinel or not 0 <= tid < self._size:
                return k
            state = index.get_next_state(state, tid)
            if state is None:
                return k
        return len(token_ids)

    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance over all of ``token_ids``; if any is refused, return False and change nothing."""
        if self.validate_tokens(token_ids) != len(token_ids):
            return False
        for tid in token_ids:
            if tid in self._eos:
                self._guide.advance(self._sentinel, return_tokens=False)
                self._terminated = True
            else:
                self._guide.advance(tid, return_tokens=False)
        self._num_tokens += len(token_ids)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (an accepted EOS included).

        Raises:
            ValueError: ``num_tokens`` negative or more than were accepted.
        """
        if not 0 <= num_tokens <= self._num_tokens:
            raise ValueError(f"cannot roll back {num_tokens} of {self._num_tokens} tokens")
        if num_tokens == 0:
            return
        self._guide.rollback_state(num_tokens)
        self._num_tokens -= num_tokens
        self._terminated = False  # EOS can only be the last token accepted

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits of the current state into ``bitmask[row]``.

        Args:
            bitmask: int32 ``[R, ceil(model_vocab_size / 32)]`` on the CPU, rows contiguous.
            row: the row to overwrite.

        After EOS the row allows only the EOS ids (a harmless row if the engine still asks).
        Cost: outlines-core fills the row from the state's token list (no Python list); the
        sentinel→EOS fix-up is two numpy word writes.

        Raises:
            ValueError: wrong dtype, device, width or layout.
        """
        words = self._grammar.vocab.bitmask_words
        if (bitmask.dtype != torch.int32 or bitmask.device.type != "cpu"
                or bitmask.dim() != 2 or bitmask.shape[1] != words or bitmask.stride(1) != 1):
            raise ValueError(f"bitmask must be a CPU int32 [R, {words}] tensor with contiguous "
                             f"rows, got {bitmask.dtype} {tuple(bitmask.shape)} on {bitmask.device}")
        if not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"row {row} outside [0, {bitmask.shape[0]})")
        view = bitmask.numpy().view(np.uint32)
        if self._terminated:
            view[row] = 0
            self._set_eos_bits(view[row])
            return
        ptr = bitmask.data_ptr() + row * bitmask.stride(0) * bitmask.element_size()
        self._guide.write_mask_into(ptr, words, 4)
        if self._index.get_next_state(self._guide.get_state(), self._sentinel) is not None:
            s = self._sentinel
            view[row, s >> 5] &= np.uint32(~(1 << (s & 31)) & 0xFFFFFFFF)
            self._set_eos_bits(view[row])

    def forced_tokens(self, max_n: int) -> list[int]:
        """The tokens the grammar allows alone, in a row, from the current state (≤ ``max_n``).

        EOS is included (as ``vocab.eos_token_id``, and last) when it is the only token allowed.
        No state change. A state whose one allowed token is a multi-character string counts;
        one where the *text* is forced but several tokenizations exist does not.
        """
        if self._terminated:
            return []
        out: list[int] = []
        state = self._guide.get_state()
        while len(out) < max_n:
            step = self._grammar.forced_step(state)
            if step is None:
                break
            tid, state = step
            if tid == self._sentinel:
                out.append(self._grammar.vocab.eos_token_id)
                break
            out.append(tid)
        return out

    def forced_text(self, max_bytes: int = 64) -> bytes:
        """The bytes the grammar forces next from the current state, up to ``max_bytes``; no state change.

        Unlike :meth:`forced_tokens` this sees through tokenization: after ``{"name":"Ada"`` in
        a schema with a following ``age`` field it returns ``b',"age":'`` although many token
        sequences spell it. Used to draft tokens that the model then verifies (exact).
        """
        if self._terminated:
            return b""
        return self._forced_from(self._guide.get_state(), max_bytes)

    def forced_text_after(self, token_ids: list[int], max_bytes: int = 64) -> bytes | None:
        """The bytes the grammar would force after ``token_ids``; no state change.

        Returns None when the grammar refuses ``token_ids`` (EOS included). Lets a drafter ask
        "if the model closed the string here, what would follow?" without advancing.
        """
        if self._terminated or self.validate_tokens(token_ids) != len(token_ids):
            return None
        if any(t in self._eos for t in token_ids):
            return None
        index, state = self._index, self._guide.get_state()
        for tid in token_ids:
            state = index.get_next_state(state, tid)
        return self._forced_from(state, max_bytes)

    def _forced_from(self, state: int, max_bytes: int) -> bytes:
        out = bytearray()
        while len(out) < max_bytes:
            step = self._grammar.forced_byte(state)
            if step is None:
                break
            b, state = step
            out.append(b)
        return bytes(out)

    def _set_eos_bits(self, row_view: np.ndarray) -> None:
        for e in self._grammar.vocab.eos_token_ids:
            row_view[e >> 5] |= np.uint32(1 << (e & 31))
