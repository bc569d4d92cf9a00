"""Each step's draft tokens: the text the grammar forces, prompt lookup, token n-grams.

``Drafter.propose(requests, budget)`` is the engine's one call: it proposes drafts for every
request that may speculate, prices them (a draft whose chance of acceptance is below the
budget's threshold is not worth its row) and shares the step's rows among them by expected
value. ``Drafter.learn`` teaches each request how the model spells forced text from the
step's verification. Grammars are used through the matcher interface only
(``forced_text``, ``forced_text_after``, ``validate_tokens``), never through their internals.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from stencil.engine.speculative.layout import JsonLayout, position
from stencil.engine.speculative.lookup import propose_ngram, propose_text, propose_value, span_end
from stencil.engine.speculative.splits import TokenSplits
from stencil.engine.speculative.spec_state import SpecState

if TYPE_CHECKING:
    from stencil.engine.request import Request
    from stencil.engine.scheduler import SchedulerOutput

_JSON_PUNCT = frozenset('"{}[]:, ')
_CLOSERS = ('"', ",", "}")  # what may end a value copied into JSON: a string, a number
_STRUCTURAL = ('"', ":", ",", "}", "]")  # what may follow free whitespace in JSON, besides a value
_AFTER_VALUE = frozenset('"}]:,{[')  # ends after which a number or literal cannot go on


@dataclass(frozen=True, slots=True)
class DraftBudget:
    """What the next step may spend on drafts.

    Attributes:
        threshold: least chance of acceptance at which a draft is worth its row
            (``stencil.engine.speculative.goodput.Goodput.threshold``; 0: every draft is). Applies to
            requests whose settings are ``cost_aware``.
        tile: rows the model's matmul kernel multiplies together (1: no tiles); a request's
            ``row_tile`` setting overrides it.
        max_drafts: most drafts per request (None: its ``num_speculative_tokens``).
    """

    threshold: float = 0.0
    tile: int = 1
    max_drafts: int | None = None


@dataclass(slots=True)
class Drafts:
    """What ``Drafter.propose`` decided.

    Attributes:
        tokens: request id -> its draft tokens for the next step (requests without drafts
            are absent).
        failed: requests whose proposer raised, with the exception (the engine fails them).
        proposed: requests the proposers ran for.
    """

    tokens: dict[str, list[int]] = field(default_factory=dict)
    failed: list[tuple["Request", Exception]] = field(default_factory=list)
    proposed: int = 0


# Texts an encoder shortcut must spell exactly as ``tokenizer.encode`` does before it is used.
_ENCODE_PROBES = ('{"name": "Ada Lovelace", "age": 36}', '",\n  "city": "', "  Hello World!\t\u00e9\u4e2d ",
                  "<|im_start|>user", "INV-22773 was issued", "\u00a0\r\n", "'s don't 123.45e-6")


def plain_encoder(tokenizer) -> Callable[[str], list[int]]:
    """``text -> token ids`` without special tokens, exactly as ``tokenizer.encode(text,
    add_special_tokens=False)``.

    A transformers fast tokenizer is called through its Rust ``backend_tokenizer`` directly:
    the same ids at under half the cost (SmolLM2's tokenizer: 12 against 29 µs a call, the
    rest being transformers' argument handling). The drafter encodes short texts many times a
    step (forced text, whitespace probes, looked-up spans): about half of what proposing took
    at concurrency 8 (2.4 → 1.55 ms a step on the copy workload). The shortcut is taken only where it spells a set of
    probe texts (JSON, whitespace, non-ASCII, a chat special token) exactly as ``encode``
    does; any other tokenizer keeps its ``encode``.
    """
    def slow(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return slow

    def fast(text: str) -> list[int]:
        return backend.encode(text, add_special_tokens=False).ids

    try:
        same = all(fast(t) == list(slow(t)) for t in _ENCODE_PROBES)
    except Exception:  # noqa: BLE001 - an unusual backend: keep the tokenizer's own encode
        same = False
    return fast if same else slow


def pending_rows(requests: list["Request"]) -> int:
    """Rows the next step feeds the requests besides drafts: the tokens not yet computed
    (a sampled token, grammar-forced tokens), at least one each."""
    return sum(max(r.num_tokens - r.num_computed_tokens, 1) for r in requests)


class Drafter:
    """Proposes, prices and shares draft tokens.

    Args:
        tokenizer: the model's tokenizer (``encode``, ``decode``).
        text_of: request -> its output text so far ("" when unknown).
        may_draft: whether drafts may follow a request's pending tokens this step
            (``Scheduler.may_draft``).
        max_model_len: longest prompt + output (tokens).
    """

    def __init__(self, tokenizer, text_of: Callable[["Request"], str],
                 may_draft: Callable[["Request"], bool], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.text_of = text_of
        self.may_draft = may_draft
        self.max_model_len = max_model_len
        self.encode = plain_encoder(tokenizer)
        # How the model spells grammar-forced text, learned from its choices over drafts.
        self.splits = TokenSplits(tokenizer.decode, self.encode)

    def propose(self, requests: list["Request"], budget: DraftBudget) -> Drafts:
        """Draft tokens for the next step of ``requests`` (the running batch).

        Rows are shared: the step's rows without drafts (``pending_rows``) count against
        ``max_draft_tokens_per_step`` beyond the first. Every request drafts one kind: the
        grammar's forced text, or lookup (``draft``). The drafts then get the rows by expected
        value, best first: under the geometric model the j-th draft of a request is accepted
        with chance ``p ** j`` (``p``: that request's per-token acceptance for that kind), so a
        request that keeps being right gets long drafts and one that keeps being wrong gets
        few, wherever it stands in the batch. With ``cost_aware``, a draft whose chance is
        below ``budget.threshold`` is dropped; a request priced out entirely lets its record
        fade, so it is tried again later. Last, drafts are trimmed so the step does not open a
        new matmul tile for a row or two (``trim_to_tile``).
        """
        out = Drafts()
        base = pending_rows(requests)
        used = base - 1  # rows beyond the first count against the draft budget
        # (-chance of acceptance, order, request id, its drafts, its settings) per draft position
        candidates: list[tuple[float, int, str, list[int], object]] = []
        for req in requests:
            st: SpecState | None = req.spec_state
            if st is None or not self.may_draft(req) or len(requests) > st.config.max_batch_size:
                continue
            spec = st.config
            room = min(spec.num_speculative_tokens, req.params.max_tokens - req.num_output_tokens - 1,
                       self.max_model_len - req.num_tokens - 1, budget.max_drafts or spec.num_speculative_tokens)
            if room <= 0:
                continue
            out.proposed += 1
            try:
                drafts = self.draft(req, room)
            except Exception as e:  # noqa: BLE001 - one request's grammar must not stop the batch
                out.failed.append((req, e))
                continue
            p, chance = st.in_flight.per_token(), 1.0
            for j in range(len(drafts)):
                chance *= p
                if spec.cost_aware and chance < budget.threshold:
                    if j == 0:
                        st.in_flight.forget(0.9)
                    break
                candidates.append((-chance, len(candidates), req.request_id, drafts, spec))
        tile = 1
        for _, _, rid, drafts, spec in sorted(candidates, key=lambda c: (c[0], c[1])):
            if used >= spec.max_draft_tokens_per_step:
                continue
            taken = out.tokens.get(rid, [])
            out.tokens[rid] = drafts[:len(taken) + 1]
            used += 1
            tile = max(tile, spec.row_tile or budget.tile)
        if out.tokens and tile > 1:
            trim_to_tile(out.tokens, base, tile)
        return out

    def draft(self, req: "Request", room: int) -> list[int]:
        """Up to ``room`` draft tokens for ``req``, trimmed by its grammar.

        Grammar drafts first: the text the grammar forces next (``","age":``), spelled as the
        model spells it (``forced_drafts``). Without forced text, and unless the recent
        acceptance switched lookup off: prompt lookup on characters (the output's end, or a
        value just begun, found in the document: ``span_drafts``), else on token n-grams, except
        right after JSON punctuation, where a token n-gram only matches the previous key's
        punctuation and proposes the previous value.

        Raises:
            Whatever the request's matcher raises (``propose`` fails that request alone).
        """
        st: SpecState = req.spec_state
        spec = st.config
        st.from_grammar = False
        if spec.grammar_drafts and req.matcher is not None:
            forced = self.forced_text(req.matcher, self.text_of(req))
            if forced:
                drafts = self.forced_drafts(forced, st)[:room]
                if drafts:
                    st.from_grammar = True
                    return drafts[:req.matcher.validate_tokens(drafts)]
        if st.backoff > 0:
            st.backoff -= 1
            return []
        if st.ngram.proposed >= spec.min_evidence and st.ngram.rate < spec.min_acceptance:
            # Lookup drafts keep failing here: stop paying for their verification for a while.
            st.backoff = spec.backoff_steps
            st.ngram.clear()
            return []
        drafts: list[int] = []
        text = self.text_of(req)
        if spec.text_lookup and text:
            if st.prompt_text is None:
                st.prompt_text = self.tokenizer.decode(req.prompt_token_ids, skip_special_tokens=True)
            found = propose_text(st.prompt_text, text) or propose_value(st.prompt_text, text)
            if found:
                drafts = self.span_drafts(req, found)[:room]
        just_opened = req.matcher is not None and bool(text) and _JSON_PUNCT.issuperset(text[-3:])
        if not drafts and not just_opened:
            tokens = np.asarray(req.all_token_ids, dtype=np.int64)
            drafts = propose_ngram(tokens, room, spec.prompt_lookup_min, spec.prompt_lookup_max)
        if drafts and req.matcher is not None:
            drafts = drafts[:req.matcher.validate_tokens(drafts)]
        return drafts

    def forced_text(self, m, written: str, draft: str = "", max_chars: int = 64) -> str | None:
        """``draft`` and the text the grammar forces after it, carried on across free whitespace.

        Where the grammar leaves whitespace free (``whitespace="flexible"`` JSON), it forces
        nothing at a separator; there the answer's own layout (``stencil.engine.speculative.layout``: a line
        break and the indent, a space after the colon, as ``written`` shows them) is guessed,
        and past it the forcing goes on (``",\n  \"age\": "`` instead of ``","``); after a
        value, the one structural character the grammar allows next (a comma, or a closer
        after the layout's line break) is taken too. The guess is a draft like any other: the
        model verifies it.

        Args:
            m: the request's matcher (``forced_text``, ``forced_text_after``).
            written: the output text so far.
            draft: text to draft first (a value looked up in the prompt and its closer).

        Returns:
            The text, or None when the grammar refuses ``draft``.
        """
        encode = self._encode
        forced = m.forced_text_after(encode(draft)) if draft else m.forced_text(max_chars)
        if forced is None:
            return None
        out = draft + forced.decode("utf-8", errors="ignore")
        layout = None
        for _ in range(8):
            if len(out) - len(draft) >= max_chars or m.forced_text_after(encode(out + " ")) is None:
                break  # no free whitespace here: a real choice, or compact JSON
            at = position(written + out)
            if at.in_string:
                break
            layout = layout or JsonLayout.of(written + out)
            ws = layout.after(at) or ""
            # A run already begun (the model wrote "\n " as one token): the rest of it.
            ws = ws[len(at.trailing_ws):] if ws.startswith(at.trailing_ws) else ""
            if ws:
                more = m.forced_text_after(encode(out + ws))
                if more is None:
                    break
                out += ws + more.decode("utf-8", errors="ignore")
                continue
            # Whitespace written (or none in this layout): the next structural character, if
            # the grammar allows only one of them (a value's own first character is a choice;
            # a number may go on with more digits).
            if not at.trailing_ws and at.last not in _AFTER_VALUE:
                break
            options = []
            for ch in _STRUCTURAL:
                piece = ch
                if ch in "}]" and at.last not in "{[":
                    close = layout.before_close(at)
                    piece = (close[len(at.trailing_ws):] if close.startswith(at.trailing_ws) else "") + ch
                more = m.forced_text_after(encode(out + piece))
                if more is not None:
                    options.append(piece + more.decode("utf-8", errors="ignore"))
            if len(options) != 1:
                break
            out += options[0]
        return out

    def _encode(self, text: str) -> list[int]:
        return self.encode(text) if text else []

    def forced_drafts(self, text: str, st: SpecState) -> list[int]:
        """Tokens for ``text``, which ends where the grammar stops forcing: spelled as the model
        spells it (``self.splits``), minus the last token unless a learned split made it (a
        piece the model writes on its own, like the lone quote that opens a string)."""
        if st.splits is None:
            st.splits = self.splits.child()
        tokens, last_split = st.splits.tokenize(text)
        if last_split or not tokens:
            return tokens
        st.dropped, st.dropped_at = tokens[-1], len(tokens) - 1
        return tokens[:-1]

    def span_drafts(self, req: "Request", text: str) -> list[int]:
        """Draft tokens for ``text``, the document text that follows what the output just copied.

        A copied value usually ends where the prose pauses (``Wirth, who joined...``) or where
        the grammar stops admitting it (``INV-22773 was issued`` for an ``INV-[0-9]{5}``
        pattern). Where the grammar lets the value close there (a quote for a string, a comma
        or brace after a number), the draft is the span, the closer and the text the grammar
        then forces (``Wirth","age":``), so one verification can take a value's end and the
        next key together. Otherwise the looked-up text itself, minus its last token: it ends at
        an arbitrary character, so that token is likely a fragment of the one the model picks.
        """
        tokens = self.encode(text)
        m = req.matcher
        if m is not None:
            cuts = [span_end(text)]  # the prose's pause first, then where the grammar stops
            valid = m.validate_tokens(tokens)
            if valid < len(tokens):
                cuts.append(len(self.tokenizer.decode(tokens[:valid])))
            written = self.text_of(req)
            for cut in [c for i, c in enumerate(cuts) if c < len(text) and c not in cuts[:i]]:
                for closer in _CLOSERS:
                    closed = text[:cut] + closer
                    forced = self.forced_text(m, written, closed)
                    if forced is not None:
                        return self.forced_drafts(forced, req.spec_state)
        return tokens[:-1]

    def learn(self, sched: "SchedulerOutput", sampled: list[list[int]]) -> None:
        """Teach each request's ``TokenSplits`` what the model chose over its drafts.

        Args:
            sched: the step's schedule (drafts still on the requests: call before the update).
            sampled: per sampled request, in order, the accepted drafts then one sampled token.
        """
        k = 0
        for sr in sched.scheduled:
            if not sr.sample:
                continue
            tokens = sampled[k]
            k += 1
            st = sr.request.spec_state
            # A request failed in this step (its grammar raised while its draft rows were
            # filled) is finished and its drafts are gone: nothing to learn from it.
            if st is None or st.splits is None or not tokens or sr.request.is_finished:
                continue
            drafts = sr.request.draft_token_ids
            if len(tokens) <= min(sr.num_drafts, len(drafts)):  # the last token replaced draft len(tokens) - 1
                st.splits.learn(drafts[len(tokens) - 1], tokens[-1])
            elif st.dropped is not None and st.dropped_at == sr.num_drafts:
                # Every draft taken: the bonus token stands where the dropped one would have.
                st.splits.learn(st.dropped, tokens[-1], dropped=True)
            st.dropped = None


def trim_to_tile(drafts: dict[str, list[int]], base_rows: int, tile: int) -> None:
    """Drop draft tokens (in place) so a step of ``base_rows`` rows plus ``drafts`` does not
    spill one or two rows into a new tile of ``tile`` rows.

    torch's CPU int4 kernel multiplies activations in tiles of 4 rows: one sequence's step costs
    13.9 ms with 1 row, 19.7 ms with 4 and 25.9 ms with 5 (SmolLM2-135M, one thread), so a fifth
    row costs three times a fourth. A spill of at most ``tile // 2`` rows is removed, longest
    draft lists first (their last drafts are the least likely to be accepted).
    """
    rows = base_rows + sum(len(d) for d in drafts.values())
    spill = rows % tile
    if rows <= tile or spill == 0 or spill > tile // 2:
        return
    for _ in range(spill):
        longest = max(drafts, key=lambda rid: len(drafts[rid]))
        if not drafts[longest]:
            break
        drafts[longest] = drafts[longest][:-1]
