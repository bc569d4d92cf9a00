"""Budget-aware matching: a structured answer that is admitted always closes within ``max_tokens``.

:class:`BudgetMatcher` wraps any backend's matcher. With ``r`` tokens left, a token is allowed only
if the state it leads to can still reach an accepting state within ``r - 1`` tokens, by the
closing automaton's token distance (:mod:`stencil.grammar.closing`: the least tokenization of a shortest
completion, a real token sequence). The *plan* — that token sequence from the current state — is
kept so that one allowed token always exists: its first token is allowed even where the
distance of the state it leads to was measured through another completion. So from an admitted
start (distance ≤ ``max_tokens``) the invariant "distance ≤ tokens left" holds to the end, and the
output is complete when the budget runs out.

Far from the end nothing is computed: a row is narrowed only when ``r - 1`` is less than the
current distance plus the grammar's *slack* (the largest increase of the distance one token has
been seen to cause on this grammar, at least ``MIN_SLACK``); near it, the model chooses freely
among every token that still closes. Drafts and forced tokens go through :meth:`validate_tokens`,
which applies the same rule, so a draft that would strand the budget is trimmed like one the
grammar refuses.

The run-on guard (:class:`SoftLimits`) follows the output with a JSON scanner of its own
(``_JsonScan``) rather than the service's (``stencil.service.json_scan``, a layer above, which
keeps the text, each value's offsets and its member's key for callbacks) or the drafter's
(``stencil.engine.speculative.layout``, whitespace between tokens): it reads bytes, one accepted
token at a time inside the engine's step, counts only what the bounds count (a string's
characters, a number's digits, the open arrays' items), and is saved before each token and
restored when a draft is rolled back, as one flat tuple. The three share only the few lines that
step over a string's escapes.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass

import numpy as np
import torch

from stencil.grammar.closing import ClosingAutomaton

log = logging.getLogger(__name__)

MIN_SLACK = 48  # tokens

_WHOLE_CHARS: dict[str, np.ndarray] = {}


def whole_char_tokens(vocab) -> np.ndarray:
    """bool ``[model_vocab_size]``: tokens whose bytes are whole UTF-8 characters (False for a
    byte-fallback piece of a character, and for ids outside the alphabet). Cached per vocabulary."""
    out = _WHOLE_CHARS.get(vocab.fingerprint)
    if out is None:
        out = np.zeros(vocab.model_vocab_size, dtype=bool)
        for tid, data in vocab.token_bytes.items():
            try:
                data.decode("utf-8")
            except UnicodeDecodeError:
                continue
            out[tid] = True
        _WHOLE_CHARS[vocab.fingerprint] = out
    return out


@dataclass(frozen=True, slots=True)
class SoftLimits:
    """The run-on guard: a JSON output that goes past one of these bounds (a string of more than
    ``string_chars`` characters, a number of more than ``number_digits`` digits, an array of more
    than ``array_items`` items) may from then on only move toward its end — each token must lower
    the distance to a complete document — so the value closes. Not part of the schema: the output
    stays valid, and the service lists every bound that bound in its warnings."""

    string_chars: int = 300
    number_digits: int = 40
    array_items: int = 64

    @classmethod
    def from_dict(cls, d: dict) -> "SoftLimits":
        """``{"string_chars": 100, ...}`` (any subset; the rest keep their defaults).

        Raises:
            SoftLimitsError: an unknown key, or a value that is not an integer >= 1; its
                ``field`` names the key (``soft_limits.string_chars``).
        """
        known = set(cls.__dataclass_fields__)
        for k, v in d.items():
            if k not in known:
                raise SoftLimitsError(f"soft_limits.{k} is not a field; known: {sorted(known)}", f"soft_limits.{k}")
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SoftLimitsError(f"soft_limits.{k} must be an integer >= 1, got {v!r}", f"soft_limits.{k}")
        return cls(**d)


class SoftLimitsError(ValueError):
    """Run-on guard bounds that cannot be used; ``field`` names the key at fault."""

    def __init__(self, message: str, field: str = "soft_limits"):
        super().__init__(message)
        self.field = field


class _JsonScan:
    """Where a JSON text stands, byte by byte: inside a string (characters so far), a number
    (digits so far), and the item count of each open array."""

    __slots__ = ("in_string", "escape", "chars", "digits", "arrays", "expect_item")

    def __init__(self):
        self.in_string = self.escape = False
        self.chars = self.digits = 0
        self.arrays: list[int] = []  # items so far in each open array ([] for objects: -1)
        self.expect_item = False

    def feed(self, data: bytes) -> None:
        for b in data:
            if self.in_string:
                if self.escape:
                    self.escape = False
                elif b == 0x5C:
                    self.escape = True
                    self.chars += 1
                elif b == 0x22:
                    self.in_string = False
                elif b & 0xC0 != 0x80:  # a character starts (UTF-8 lead or ASCII)
                    self.chars += 1
                continue
            if 0x30 <= b <= 0x39 or b in b"-+.eE":
                if self.digits == 0:
                    self._item()
                self.digits += 1
                continue
            self.digits = 0
            if b == 0x22:
                self._item()
                self.in_string, self.chars = True, 0
            elif b in b"[{":
                self._item()
                self.arrays.append(0 if b == 0x5B else -1)
                self.expect_item = b == 0x5B
            elif b in b"]}":
                if self.arrays:
                    self.arrays.pop()
            elif b == 0x2C and self.arrays and self.arrays[-1] >= 0:
                self.expect_item = True
            elif b in b"tfn":
                self._item()

    def _item(self) -> None:
        if self.expect_item and self.arrays and self.arrays[-1] >= 0:
            self.arrays[-1] += 1
        self.expect_item = False

    def snapshot(self) -> tuple:
        return (self.in_string, self.escape, self.chars, self.digits, tuple(self.arrays), self.expect_item)

    def restore(self, snap: tuple) -> None:
        self.in_string, self.escape, self.chars, self.digits, arrays, self.expect_item = snap
        self.arrays = list(arrays)

    def over(self, limits: SoftLimits) -> str | None:
        if self.in_string and self.chars >= limits.string_chars:
            return f"a string reached {limits.string_chars} characters"
        if self.digits >= limits.number_digits:
            return f"a number reached {limits.number_digits} digits"
        if self.arrays and self.arrays[-1] >= limits.array_items:
            return f"an array reached {limits.array_items} items"
        return None


class BudgetMatcher:
    """A ``GrammarMatcher`` that also keeps the output closable within ``max_tokens`` tokens.

    Args:
        inner: the backend's matcher (eager or lazy).
        automaton: the grammar's :class:`ClosingAutomaton`, or a ``Future`` of one (it is built
            in the background after the compile; the matcher waits for it only when a row is
            near its budget).
        max_tokens: the request's budget (every accepted token counts, EOS included).
        soft_limits: the run-on guard for JSON outputs (``None``: off).

    Attributes:
        narrowed: output byte offsets at which the budget removed a token the grammar allowed.
        guarded: what the run-on guard bound, with the output byte offset, in order.
        disabled: why the budget is not enforced for this request (``None`` when it is).
    """

    def __init__(self, inner, automaton: "ClosingAutomaton | Future", max_tokens: int,
                 soft_limits: SoftLimits | None = None):
        self.inner = inner
        self.soft_limits = soft_limits
        self._scan = _JsonScan() if soft_limits is not None else None
        self._scan_snaps: list[tuple] = []  # the scanner before each accepted token (rollback)
        self.guarded: list[tuple[str, int]] = []
        self._automaton = automaton
        self.max_tokens = max_tokens
        self._states: list[int] = []  # DFA state after each accepted token (index = count)
        self._pending: list[int] = []  # tokens accepted before the automaton was ready
        self._plan: list[int] | None = None
        self._out_bytes = 0
        self._offsets: list[int] = [0]
        self.narrowed: list[int] = []
        self.disabled: str | None = None

    # -- delegation ---------------------------------------------------------------------------
    @property
    def grammar(self):
        return self.inner.grammar

    @property
    def backend(self) -> str:
        return self.inner.backend

    @property
    def num_tokens(self) -> int:
        return self.inner.num_tokens

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()

    def is_accepting(self) -> bool:
        return self.inner.is_accepting()

    def forced_text(self, max_bytes: int = 64) -> bytes:
        return self.inner.forced_text(max_bytes)

    def forced_text_after(self, token_ids: list[int], max_bytes: int = 64) -> bytes | None:
        return self.inner.forced_text_after(token_ids, max_bytes)

    @property
    def remaining(self) -> int:
        """Tokens left in the budget."""
        return self.max_tokens - self.inner.num_tokens

    def set_budget(self, max_tokens: int) -> None:
        """Give the output a new budget (a reasoning region ended: the answer gets what is left,
        ``stencil.grammar.reasoning``); the cached plan is dropped."""
        self.max_tokens = max_tokens
        self._plan = None

    @property
    def closed_by_budget(self) -> bool:
        """Whether the budget narrowed any mask of this output."""
        return bool(self.narrowed)

    # -- the automaton ------------------------------------------------------------------------
    def _ready(self, wait: bool) -> ClosingAutomaton | None:
        a = self._automaton
        if isinstance(a, Future):
            if not a.done() and not wait:
                return None
            try:
                a = self._automaton = a.result()
            except Exception as e:  # noqa: BLE001 - unsupported grammar: serve without a budget
                self._automaton = None
                self.disabled = f"no closing automaton: {e}"
                return None
        if a is None:
            return None
        if not self._states:
            self._states.append(a.start)
        return a

    def _sync(self, a: ClosingAutomaton) -> None:
        """Move the cursor over the tokens accepted since it last moved."""
        if self._pending:
            tb = self.inner.grammar.vocab.token_bytes
            eos = set(self.inner.grammar.vocab.eos_token_ids)
            for t in self._pending:
                s = self._states[-1]
                self._states.append(s if t in eos else a.step(s, tb.get(t, b"")))
            self._pending.clear()

    def _state(self) -> int:
        return self._states[-1]

    def distance(self, wait: bool = True) -> int | None:
        """Tokens needed to end from here (an upper bound met by a real sequence), or None."""
        a = self._ready(wait)
        if a is None or self.disabled:
            return None
        self._sync(a)
        return a.token_distance(self._state())

    def _current_plan(self, a: ClosingAutomaton) -> list[int] | None:
        self._sync(a)
        if self._plan is None:
            plan = a.plan(self._state(), limit=self.remaining)
            if plan is not None and self.inner.validate_tokens(plan + [self._eos()]) < len(plan) + 1:
                self.disabled = "the closing automaton's plan is refused by the grammar"
                log.warning("budget disabled: %s", self.disabled)
                return None
            self._plan = plan
        return self._plan

    def _eos(self) -> int:
        return self.inner.grammar.vocab.eos_token_id

    def _far(self, a: ClosingAutomaton, tokens_ahead: int = 1) -> bool:
        """Whether no state of the grammar is within reach of the budget's end: then the cursor is
        not even moved (tokens wait in ``_pending``), so rows far from the end cost nothing."""
        return self.remaining - tokens_ahead >= a.max_distance + tokens_ahead * max(MIN_SLACK, a.slack)

    def _near(self, a: ClosingAutomaton, tokens_ahead: int = 1) -> bool:
        if self._far(a, tokens_ahead):
            return False
        self._sync(a)
        d = a.token_distance(self._state(), limit=self.remaining)
        return self.remaining - tokens_ahead < d + tokens_ahead * max(MIN_SLACK, a.slack)

    # -- GrammarMatcher -----------------------------------------------------------------------
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """The backend's row, narrowed (near the end) to the tokens that still close in time."""
        self.inner.fill_bitmask(bitmask, row)
        if self.disabled or self.inner.is_terminated():
            return
        a = self._ready(wait=False)
        if a is None:
            if self.disabled or self.remaining > 4 * MIN_SLACK:
                return
            a = self._ready(wait=True)  # close to a small budget: the automaton is needed now
            if a is None:
                return
        guard = self._scan.over(self.soft_limits) if self._scan is not None else None
        if not guard and not self._near(a):
            return
        self._sync(a)
        s = self._state()
        if s == a.dead:
            self.disabled = "the output left the closing automaton"
            return
        words = bitmask[row].numpy().view(np.uint32)
        allowed = np.unpackbits(words.view(np.uint8), bitorder="little")[:a.vocab.model_vocab_size].astype(bool)
        nd = a.next_token_distances(s, allowed, limit=self.remaining)
        keep = nd <= self.remaining - 1
        if guard:  # run-on guard: only tokens that bring the end nearer
            keep &= nd < a.token_distance(s, limit=self.remaining)
        plan = self._current_plan(a)
        if plan and len(plan) <= self.remaining:
            keep[plan[0]] = True
        elif self.inner.is_accepting():
            for e in self.inner.grammar.vocab.eos_token_ids:
                keep[e] = True
        new = allowed & keep
        if not new.any():
            self.disabled = "no token closes within the budget"
            return
        if (new != allowed).any():
            packed = np.packbits(np.pad(new, (0, words.size * 32 - new.size)), bitorder="little")
            words[:] = packed.view(np.uint32)
            if guard:
                if not self.guarded or self.guarded[-1][0] != guard:
                    self.guarded.append((guard, self._out_bytes))
            elif ((allowed & ~new) & whole_char_tokens(a.vocab)).any() and (
                    not self.narrowed or self.narrowed[-1] != self._out_bytes):
                # Only a removed token of whole characters is a narrowed answer: removing a
                # token that ends mid-character (the last row of free text) steers nothing.
                self.narrowed.append(self._out_bytes)

    def validate_tokens(self, token_ids: list[int]) -> int:
        """The backend's verdict, shortened where a token would leave the output unable to close
        within the budget."""
        n = self.inner.validate_tokens(token_ids)
        if n == 0 or self.disabled:
            return n
        a = self._ready(wait=False)
        if a is None or not self._near(a, tokens_ahead=n):
            return n
        tb = a.vocab.token_bytes
        eos = set(a.vocab.eos_token_ids)
        plan = self._current_plan(a) or []
        self._sync(a)
        s, left = self._state(), self.remaining
        for k, t in enumerate(token_ids[:n]):
            if t in eos:
                return k + 1 if a.accepting(s) else k
            on_plan = token_ids[:k + 1] == plan[:k + 1]
            s = a.step(s, tb.get(t, b""))
            if not on_plan and a.token_distance(s, limit=left) > left - k - 1:
                return k
        return n

    def accept_tokens(self, token_ids: list[int]) -> bool:
        if not self.inner.accept_tokens(token_ids):
            return False
        tb = self.inner.grammar.vocab.token_bytes
        for t in token_ids:
            self._out_bytes += len(tb.get(t, b""))
            self._offsets.append(self._out_bytes)
            if self._scan is not None:
                self._scan_snaps.append(self._scan.snapshot())
                self._scan.feed(tb.get(t, b""))
        self._pending.extend(token_ids)  # the cursor moves only when a row nears the budget
        plan = self._plan
        if plan is not None and token_ids == plan[:len(token_ids)]:
            self._plan = plan[len(token_ids):]
        else:
            self._plan = None
        return True

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)
        if num_tokens:
            del self._offsets[-num_tokens:]
            self._out_bytes = self._offsets[-1]
            if self._scan is not None:
                self._scan.restore(self._scan_snaps[-num_tokens])
                del self._scan_snaps[-num_tokens:]
            if self._pending:
                drop = min(num_tokens, len(self._pending))
                del self._pending[len(self._pending) - drop:]
                num_tokens -= drop
            if num_tokens:
                del self._states[-num_tokens:]
            self._plan = None

    def forced_tokens(self, max_n: int) -> list[int]:
        forced = self.inner.forced_tokens(max_n)
        if not forced:
            return forced
        return forced[:self.validate_tokens(forced)]
