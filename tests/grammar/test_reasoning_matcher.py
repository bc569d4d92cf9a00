"""The reasoning wrapper alone, on a tiny byte vocabulary (``stencil.grammar.reasoning``): the marker
rows against their byte-level definition, and random walks over many budgets — every output ends
with a complete answer, the reasoning never holds the marker, the masks, forced tokens,
validation and rollback agree across phase changes."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest

from stencil.engine.request import ReasoningParams, SamplingParams
from stencil.engine.structured_output import BudgetError, check_budget, make_matcher
from stencil.grammar.base import GrammarSpec
from stencil.grammar.bitmask import allocate_bitmask, bitmask_to_bool
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.reasoning import ANSWER, FreeAnswer, reasoning_rows
from stencil.grammar.vocab import TokenVocabulary

CHARS = "abt<>/\n xyz0123456789\",:{}[]"
MULTI = ["</", "t>", "</t", "a</t>", "x</t>b", "</t></", "ab", "\n\n", "<</t"]
TOKENS = {i: ch.encode() for i, ch in enumerate(CHARS)} | {len(CHARS) + k: s.encode() for k, s in enumerate(MULTI)}
END, START, EOS, OTHER = 40, 41, 42, 43  # END/START: added tokens outside the alphabet
SIZE = 44
SEP = len(CHARS) + MULTI.index("\n\n")
MARKER = b"</t>"
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 999}, "b": {"enum": ["x", "yz"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return TokenVocabulary.from_token_bytes(TOKENS, EOS, SIZE, excluded_ids={END, START, OTHER})


@pytest.fixture(scope="module")
def grammar(vocab):
    with GrammarCompiler(vocab, SIZE, backend="lazy") as c:
        yield c.compile(GrammarSpec.json_schema(SCHEMA))


def _params(**kw) -> ReasoningParams:
    return ReasoningParams("</t>", (END,), **{"start_ids": (START,), "after_ids": (SEP,), "margin": 2, **kw})


def _allowed(m) -> list[int]:
    bm = allocate_bitmask(1, SIZE)
    m.fill_bitmask(bm, 0)
    return [i for i, b in enumerate(bitmask_to_bool(bm, SIZE)[0].tolist()) if b]


def test_rows_follow_the_byte_level_rule(vocab):
    rows = reasoning_rows(vocab, "</t>", END)
    for k in range(len(MARKER)):
        for t in range(SIZE):
            data = TOKENS.get(t)
            if t == END:
                want = True
            elif data is None:
                want = False  # EOS, the start marker, other control tokens
            else:
                s = MARKER[:k] + data
                i = s.find(MARKER)
                want = i < 0 or i + len(MARKER) == len(s)
            assert bool(rows.allowed[k, t]) == want, (k, t, data)
    assert rows.advance(0, b"a</t>") == 4 and rows.advance(2, b"t>") == 4
    assert rows.advance(0, b"</t></") == -1 and rows.advance(0, b"<</t") == 3 and rows.advance(3, b"x") == 0


def _walk(m, rng: random.Random, max_tokens: int, end_bias: float) -> list[int]:
    """Random allowed tokens (the end marker chosen with probability ``end_bias`` when allowed),
    checking the protocol's agreements at every step."""
    out: list[int] = []
    while len(out) < max_tokens and not m.is_terminated():
        allowed = _allowed(m)
        assert allowed, "no token allowed"
        forced = m.forced_tokens(8)
        if forced:
            assert allowed == [forced[0]]
            assert m.validate_tokens(forced) == len(forced)
        # rollback is exact: a few random tokens on, then back, and the mask is the same
        n = m.num_tokens
        probe = []
        for _ in range(rng.randint(1, 4)):
            a = _allowed(m)
            if not a or m.is_terminated():
                break
            t = rng.choice(a)
            assert m.accept_tokens([t])
            probe.append(t)
        m.rollback(len(probe))
        assert m.num_tokens == n and _allowed(m) == allowed
        assert m.validate_tokens(probe) == len(probe)
        t = END if END in allowed and rng.random() < end_bias else rng.choice(allowed)
        refused = [x for x in range(SIZE) if x not in allowed]
        if refused and m.phase != ANSWER:  # (in the answer, accept_tokens is the grammar's alone)
            assert not m.accept_tokens([rng.choice(refused)]) and _allowed(m) == allowed
        assert m.accept_tokens([t])
        out.append(t)
    return out


def _check(m, out: list[int], rp: ReasoningParams, max_tokens: int, free: bool = False) -> dict:
    assert len(out) <= max_tokens
    assert out[:len(rp.start_ids)] == list(rp.start_ids)
    assert m.answer_start is not None, "the answer never began"
    end = m.reasoning_end
    reasoning = b"".join(TOKENS[t] for t in out[len(rp.start_ids):end])
    if out[end] != END:  # the reasoning's own text completed the marker
        assert reasoning.endswith(MARKER)
        reasoning = reasoning[:-len(MARKER)]
        assert out[end:m.answer_start] == list(rp.after_ids)
    else:
        assert out[end:m.answer_start] == list(rp.end_ids + rp.after_ids)
    assert MARKER not in reasoning
    if rp.max_reasoning_tokens is not None:
        assert end - len(rp.start_ids) <= rp.max_reasoning_tokens
    answer = out[m.answer_start:]
    if not free:
        assert m.is_terminated() or m.is_accepting()
        text = b"".join(TOKENS.get(t, b"") for t in answer if t != EOS)
        jsonschema.validate(json.loads(text), SCHEMA)
    kind = "cut" if m.reasoning_cut else "token" if out[end] == END else "text"
    return {"kind": kind, "reasoning_tokens": end - len(rp.start_ids)}


def test_random_walks_end_with_a_complete_answer_at_every_budget(vocab, grammar):
    rng = random.Random(7)
    rp = _params()
    minimum = None
    for mt in range(1, 40):
        try:
            check_budget(grammar, SamplingParams(max_tokens=mt, reasoning=rp))
            minimum = mt if minimum is None else minimum
        except BudgetError as e:
            assert minimum is None, "admission is monotone in max_tokens"
            assert f"max_tokens {mt}" in str(e)
    m0 = make_matcher(grammar, SamplingParams(max_tokens=100, reasoning=rp))
    assert minimum == rp.fixed_tokens + m0.answer_min()
    kinds = {"cut": 0, "token": 0, "text": 0}  # how the reasoning ended
    for mt in [minimum, minimum + 1, minimum + 2] + [rng.randint(minimum, 120) for _ in range(60)]:
        for cap in (None, rng.randint(0, 12)):
            prp = _params(max_reasoning_tokens=cap, margin=rng.randint(0, 4))
            p = SamplingParams(max_tokens=mt, reasoning=prp)
            m = make_matcher(grammar, p)
            out = _walk(m, rng, mt, end_bias=rng.choice([0.0, 0.05, 0.3]))
            info = _check(m, out, prp, mt)
            kinds[info["kind"]] += 1
            if cap == 0:
                assert info["reasoning_tokens"] == 0 and m.reasoning_cut
    # 126 walks (63 budgets, each uncapped and capped); each way of ending is seen
    assert sum(kinds.values()) == 126 and min(kinds.values()) >= 10, kinds


def test_a_free_answer_is_cut_and_capped_too(vocab):
    rng = random.Random(3)
    free = FreeAnswer(vocab)
    for mt in range(1, 60):
        rp = _params(max_reasoning_tokens=rng.choice([None, 0, 5]))
        p = SamplingParams(max_tokens=mt, reasoning=rp)
        if mt < rp.fixed_tokens:
            with pytest.raises(BudgetError, match=f"at least {rp.fixed_tokens} tokens"):
                check_budget(free, p)
            continue
        check_budget(free, p)
        m = make_matcher(free, p)
        out = _walk(m, rng, mt, end_bias=0.02)
        _check(m, out, rp, mt, free=True)
        assert m.phase == ANSWER
        if rp.max_reasoning_tokens is None and m.reasoning_cut and mt - 3 - rp.margin > 0:
            assert m.answer_start == mt - rp.margin  # the cut left the margin to the answer


def test_drafts_and_forced_tokens_cross_the_marker_exactly(grammar):
    rp = _params()
    p = SamplingParams(max_tokens=60, reasoning=rp)
    m = make_matcher(grammar, p)
    assert m.forced_tokens(4) == [START]  # then the reasoning is free
    assert m.accept_tokens([START])
    # "a", "b", "</t", "x" (the marker's state goes back to nothing), then "a</t>": the reasoning's
    # own text completes the marker at the token's end, which ends the reasoning
    seq = [0, 1, len(CHARS) + MULTI.index("</t"), 8, len(CHARS) + MULTI.index("a</t>")]
    n = m.validate_tokens(seq)
    assert n == len(seq)
    assert m.accept_tokens(seq)
    assert m.phase != ANSWER and m.reasoning_end == 1 + len(seq)
    # the separator is forced, then the answer's own forced text ('{"a":') follows
    forced = m.forced_tokens(16)
    assert forced[0] == SEP and len(forced) > 1
    before = _allowed(m)
    assert m.accept_tokens(forced) and m.phase == ANSWER and m.answer_start == 2 + len(seq)
    m.rollback(len(forced) + 2)
    assert m.phase != ANSWER and m.answer_start is None
    assert m.accept_tokens(seq[-2:]) and _allowed(m) == before
    # a token that would end the marker inside itself is refused
    m2 = make_matcher(grammar, p)
    bad = len(CHARS) + MULTI.index("x</t>b")
    assert m2.validate_tokens([START, 0, bad]) == 2 and not m2.accept_tokens([START, 0, bad])
    assert m2.num_tokens == 0
