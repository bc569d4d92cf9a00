"""Matcher behaviour on tiny hand-made vocabularies, against interegular / ``re`` as oracles.

The oracle: after text ``s``, token ``t`` is allowed iff ``s + t`` is a prefix of some full match
(the interegular FSM state after it is live); EOS is allowed iff ``s`` fully matches.
"""

from __future__ import annotations

import random
import re

import interegular
import pytest
import torch

from stencil.grammar.base import GrammarSpec
from stencil.grammar.bitmask import allocate_bitmask, bitmask_to_bool
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.vocab import TokenVocabulary

EOS = 30
MODEL_VOCAB = 40  # > tokenizer ids: 31..39 are padding, never allowed
CHARS = "abcdxyz0123456789.-"
MULTI = ["bc", "cd", "12", "xyz", "5."]
TOKENS = {i: ch.encode() for i, ch in enumerate(CHARS)} | {
    len(CHARS) + k: s.encode() for k, s in enumerate(MULTI)}
ID = {b.decode(): i for i, b in TOKENS.items()}


@pytest.fixture(scope="module")
def vocab() -> TokenVocabulary:
    return TokenVocabulary.from_token_bytes(TOKENS, EOS, MODEL_VOCAB)


@pytest.fixture(scope="module", params=["eager", "lazy"])
def compiler(vocab, request):
    """Every matcher test runs on both backends: the same behaviour is pinned on each."""
    with GrammarCompiler(vocab, MODEL_VOCAB, max_workers=1, backend=request.param) as c:
        yield c


def regex_matcher(compiler, pattern):
    return compiler.compile(GrammarSpec("regex", pattern)).matcher()


def ids(*pieces: str) -> list[int]:
    return [ID[p] for p in pieces]


def allowed_set(matcher) -> set:
    """Allowed tokens as strings ("EOS" for EOS, "#n" for anything else) read from the bitmask."""
    bm = allocate_bitmask(1, MODEL_VOCAB)
    matcher.fill_bitmask(bm, 0)
    row = bitmask_to_bool(bm, MODEL_VOCAB)[0]
    out = set()
    for t in row.nonzero().flatten().tolist():
        out.add("EOS" if t == EOS else TOKENS[t].decode() if t in TOKENS else f"#{t}")
    return out


def oracle_allowed(fsm, text: str) -> set:
    def live(s: str) -> bool:
        state = fsm.initial
        for ch in s:
            state = fsm.map[state].get(fsm.alphabet[ch])
            if state is None:
                return False
        return fsm.islive(state)

    out = {b.decode() for b in TOKENS.values() if live(text + b.decode())}
    if fsm.accepts(text):
        out.add("EOS")
    return out


# -- the outlines-core 0.2.14 defect, pinned: a token that passes through an accepting state and ends
# inside a longer match is dropped; the end sentinel (stencil.grammar.vocab.END_SENTINEL) keeps it -----------

def test_number_reaches_fraction_and_eos_only_when_complete(compiler):
    m = regex_matcher(compiler, r"-?\d+(\.\d+)?")
    assert "EOS" not in allowed_set(m)
    assert m.accept_tokens(ids("1", "2"))
    assert {".", "EOS", "5."} <= allowed_set(m)  # "." continues past the accepting state
    assert m.is_accepting()
    assert m.accept_tokens(ids("."))
    assert "EOS" not in allowed_set(m) and not m.is_accepting()
    assert m.accept_tokens(ids("5"))
    assert "EOS" in allowed_set(m) and m.is_accepting()
    assert m.accept_tokens([EOS])
    assert m.is_terminated()


def test_token_crossing_an_accepting_state_is_kept(compiler):
    m = regex_matcher(compiler, "ab(cd)?")
    assert m.accept_tokens(ids("a"))
    assert allowed_set(m) == {"b", "bc"}  # "bc" ends inside the optional "cd"
    assert m.validate_tokens(ids("bc", "d")) == 2
    assert m.accept_tokens(ids("b"))
    assert allowed_set(m) == {"c", "cd", "EOS"}
    assert m.validate_tokens(ids("c", "d") + [EOS]) == 3
    assert m.validate_tokens(ids("c") + [EOS]) == 1


# -- accept / validate / rollback --------------------------------------------------------------

def test_accept_is_all_or_nothing(compiler):
    m = regex_matcher(compiler, "ab(cd)?")
    before = allowed_set(m)
    assert not m.accept_tokens(ids("a", "c"))
    assert allowed_set(m) == before and m.num_tokens == 0
    assert m.accept_tokens(ids("a", "b", "cd"))
    assert not m.accept_tokens(ids("a"))
    assert m.num_tokens == 3


def test_validate_tokens_prefix_length_and_eos(compiler):
    m = regex_matcher(compiler, "ab(cd)?")
    assert m.validate_tokens([]) == 0
    assert m.validate_tokens(ids("a", "b", "c", "d")) == 4
    assert m.validate_tokens(ids("a", "b", "c", "c")) == 3
    assert m.validate_tokens(ids("a", "b") + [EOS]) == 3
    assert m.validate_tokens(ids("a", "b") + [EOS] + ids("c")) == 3  # nothing after EOS
    assert m.validate_tokens(ids("a") + [EOS]) == 1
    assert m.validate_tokens([vocab_sentinel(m)]) == 0  # the sentinel id is not a token
    assert m.validate_tokens([35, -1]) == 0  # padding / invalid ids
    assert m.num_tokens == 0


def vocab_sentinel(m) -> int:
    return m.grammar.vocab.sentinel_id


def test_rollback_restores_state_and_mask_on_random_walks(compiler):
    pattern = r"-?\d+(\.\d+)?|ab(cd)?|x(yz)+"
    rng = random.Random(0)
    for _ in range(30):
        m = regex_matcher(compiler, pattern)
        history = [allowed_set(m)]
        while not m.is_terminated() and len(history) < 8:
            choices = sorted(allowed_set(m))
            pick = rng.choice(choices)
            assert m.accept_tokens([EOS if pick == "EOS" else ID[pick]])
            history.append(allowed_set(m))
        k = rng.randint(0, m.num_tokens)
        m.rollback(k)
        assert allowed_set(m) == history[len(history) - 1 - k]
        assert not m.is_terminated() or k == 0
    with pytest.raises(ValueError):
        regex_matcher(compiler, pattern).rollback(1)


def test_rollback_of_eos_reopens_the_matcher(compiler):
    m = regex_matcher(compiler, "ab")
    assert m.accept_tokens(ids("a", "b") + [EOS])
    assert m.is_terminated() and allowed_set(m) == {"EOS"}
    m.rollback(1)
    assert not m.is_terminated() and m.is_accepting() and allowed_set(m) == {"EOS"}
    m.rollback(1)
    assert allowed_set(m) == {"b"}  # "bc" overshoots "ab"


# -- masks against the oracle -------------------------------------------------------------------

@pytest.mark.parametrize("pattern", [r"-?\d+(\.\d+)?", "ab(cd)?", r"(x(yz)*|a[bc]+d)\.?",
                                     r"[a-d]{2,3}(-[0-9])?"])
def test_mask_equals_oracle_on_random_walks(compiler, pattern):
    fsm = interegular.parse_pattern(pattern).to_fsm()
    rng = random.Random(hash(pattern) & 0xFFFF)
    for _ in range(15):
        m = regex_matcher(compiler, pattern)
        text = ""
        for _ in range(10):
            got = allowed_set(m)
            assert got == oracle_allowed(fsm, text), (pattern, text)
            assert m.is_accepting() == ("EOS" in got) == bool(re.fullmatch(pattern, text))
            if not got:
                break
            pick = rng.choice(sorted(got))
            if pick == "EOS":
                assert m.accept_tokens([EOS])
                break
            assert m.accept_tokens([ID[pick]])
            text += pick


def test_padding_and_special_ids_never_allowed(compiler, vocab):
    m = regex_matcher(compiler, ".*")  # every byte sequence
    bm = allocate_bitmask(2, MODEL_VOCAB)
    m.fill_bitmask(bm, 1)
    row = bitmask_to_bool(bm, MODEL_VOCAB)[1].tolist()
    assert [t for t in range(MODEL_VOCAB) if row[t]] == sorted(TOKENS) + [EOS]
    assert bitmask_to_bool(bm, MODEL_VOCAB)[0].all()  # other rows untouched
    assert bm[1, -1].item() & ~((1 << (MODEL_VOCAB - 32)) - 1) == 0  # bits past the vocab clear


def test_fill_bitmask_rejects_bad_buffers(compiler):
    m = regex_matcher(compiler, "ab")
    with pytest.raises(ValueError):
        m.fill_bitmask(torch.zeros(1, 2, dtype=torch.int64), 0)
    with pytest.raises(ValueError):
        m.fill_bitmask(torch.zeros(1, 1, dtype=torch.int32), 0)  # too narrow for 40 ids
    with pytest.raises(ValueError):
        m.fill_bitmask(allocate_bitmask(1, MODEL_VOCAB), 1)


# -- forced tokens ------------------------------------------------------------------------------

def test_forced_tokens_on_a_literal_run(compiler):
    m = regex_matcher(compiler, "ay(0|1)")
    assert m.forced_tokens(10) == ids("a", "y")
    assert m.forced_tokens(1) == ids("a")
    assert m.forced_tokens(0) == []
    assert m.num_tokens == 0 and allowed_set(m) == {"a"}  # no state change
    m.accept_tokens(ids("a", "y"))
    assert m.forced_tokens(5) == []  # two choices
    m.accept_tokens(ids("1"))
    assert m.forced_tokens(5) == [EOS]  # EOS alone
    m.accept_tokens([EOS])
    assert m.forced_tokens(5) == []


def test_forced_stops_where_tokenizations_diverge(compiler):
    # "xyz" can be one token or three: the text is forced but no single token is.
    m = regex_matcher(compiler, "xyz")
    assert m.forced_tokens(5) == []
    m.accept_tokens(ids("x"))
    assert m.forced_tokens(5) == ids("y", "z") + [EOS]


def test_forced_text_sees_through_tokenization():
    """``forced_text`` returns the bytes every continuation must start with, however tokenized."""
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.compiler import GrammarCompiler
    from stencil.grammar.vocab import TokenVocabulary

    pieces = [b"{", b'"', b"a", b"b", b":", b",", b"}", b"1", b"2", b'{"', b'":', b',"', b"ab", b'"b":']
    vocab = TokenVocabulary.from_token_bytes({i + 3: t for i, t in enumerate(pieces)}, eos_token_ids=(1,),
                                             model_vocab_size=32)
    with GrammarCompiler(vocab, 32) as comp:
        g = comp.compile(GrammarSpec("regex", r'\{"a":[12]+,"b":[12]\}'))
        m = g.matcher()
        assert m.forced_text() == b'{"a":'
        ids = {t: i + 3 for i, t in enumerate(pieces)}
        assert m.accept_tokens([ids[b'{"'], ids[b"a"], ids[b'":'], ids[b"1"]])
        assert m.forced_text() == b""  # another digit or the comma: not forced
        assert m.accept_tokens([ids[b","]])
        assert m.forced_text() == b'"b":'
        assert m.num_tokens == 5  # forced_text changed nothing
        assert m.accept_tokens([ids[b'"b":'], ids[b"2"]])
        assert m.forced_text() == b"}"
        assert m.accept_tokens([ids[b"}"]])
        assert m.forced_text() == b""  # may end here: EOS is not a byte


def test_forced_text_after_asks_what_would_follow_without_moving():
    from stencil.grammar.base import GrammarSpec
    from stencil.grammar.compiler import GrammarCompiler
    from stencil.grammar.vocab import TokenVocabulary

    pieces = [b"{", b'"', b"a", b"b", b":", b",", b"}", b"x", b"y", b'{"a":"', b'"']
    vocab = TokenVocabulary.from_token_bytes({i + 3: t for i, t in enumerate(pieces)}, eos_token_ids=(1,),
                                             model_vocab_size=32)
    ids = {t: i + 3 for i, t in enumerate(pieces)}
    with GrammarCompiler(vocab, 32) as comp:
        m = comp.compile(GrammarSpec("regex", r'\{"a":"[xy]*","b":[xy]\}')).matcher()
        assert m.accept_tokens([ids[b'{"a":"'], ids[b"x"]])
        # If the string closed after "y", the grammar would force ',"b":'.
        assert m.forced_text_after([ids[b"y"], ids[b'"']]) == b',"b":'
        assert m.forced_text_after([ids[b"y"]]) == b""  # still inside the string: nothing forced
        assert m.forced_text_after([ids[b"}"]]) is None  # refused
        assert m.forced_text_after([1]) is None  # EOS is never "followed"
        assert m.num_tokens == 2 and m.forced_text() == b""  # nothing moved
