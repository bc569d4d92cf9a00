"""``prefetch_masks``: the masks computed for many matchers at once (on threads for llguidance's
C API matchers, by its ``LLExecutor`` for the Python bindings') are the masks each matcher
computes alone, and a failing matcher still fails alone."""

from __future__ import annotations

import random

import pytest
import torch

from stencil.grammar.base import GrammarSpec
from stencil.grammar.bitmask import allocate_bitmask
from stencil.grammar.compiler import GrammarCompiler
from stencil.grammar.prefetch import prefetch_masks
from stencil.grammar.vocab import TokenVocabulary

EOS = 30
MODEL_VOCAB = 40
CHARS = "abcdxyz0123456789.-"
TOKENS = {i: ch.encode() for i, ch in enumerate(CHARS)} | {20: b"bc", 21: b"12", 22: b"xyz"}
ID = {b.decode(): i for i, b in TOKENS.items()}


def _walk(m, rng: random.Random, steps: int) -> None:
    """Advance a matcher by up to ``steps`` random allowed tokens (stops at EOS)."""
    for _ in range(steps):
        bm = allocate_bitmask(1, MODEL_VOCAB)
        m.fill_bitmask(bm, 0)
        allowed = [t for t in range(MODEL_VOCAB) if int(bm[0, t // 32]) >> (t % 32) & 1]
        t = rng.choice(allowed)
        assert m.accept_tokens([t])
        if t == EOS:
            return


@pytest.fixture(params=["c_api", "python_bindings"])
def api(request, monkeypatch):
    """Which llguidance API the lazy backend builds regexes through: without the C library
    (another llguidance release) it takes the Python bindings."""
    if request.param == "python_bindings":
        import stencil.grammar.backends.llg_c as llg_c

        monkeypatch.setattr(llg_c, "library", lambda: None)
    return request.param


def test_prefetched_masks_equal_the_masks_computed_one_by_one(api):
    vocab = TokenVocabulary.from_token_bytes(TOKENS, EOS, MODEL_VOCAB)
    with GrammarCompiler(vocab, MODEL_VOCAB, max_workers=1, backend="lazy") as c:
        grammars = [c.compile(GrammarSpec("regex", r"(ab|xyz)[0-9]{1,4}(\.[0-9]+)?-?")),
                    c.compile(GrammarSpec("regex", r"[a-d]+(x|y)z*"))]
        rng = random.Random(7)
        for _ in range(20):
            matchers, twins = [], []
            for k in range(12):
                g = grammars[k % 2]
                seed, steps = rng.randrange(1 << 30), rng.randint(0, 6)
                pair = []
                for _ in range(2):
                    m = g.budget_matcher(40) if k % 3 == 0 else g.matcher()
                    _walk(m, random.Random(seed), steps)
                    pair.append(m)
                matchers.append(pair[0])
                twins.append(pair[1])
            prefetch_masks(matchers)
            assert sum(getattr(m, "inner", m).needs_mask for m in matchers) == 0
            inner = [getattr(m, "inner", m)._m for m in matchers]
            assert all(type(x).__name__ == ("CMatcher" if api == "c_api" else "LLMatcher")
                       for x in inner if x is not None)
            got, want = allocate_bitmask(12, MODEL_VOCAB), allocate_bitmask(12, MODEL_VOCAB)
            for i, (m, t) in enumerate(zip(matchers, twins)):
                m.fill_bitmask(got, i)
                t.fill_bitmask(want, i)
                assert m.forced_tokens(4) == t.forced_tokens(4)
            assert torch.equal(got, want)


def test_a_matcher_that_fails_after_prefetch_fails_on_its_own_call(api):
    vocab = TokenVocabulary.from_token_bytes(TOKENS, EOS, MODEL_VOCAB)
    with GrammarCompiler(vocab, MODEL_VOCAB, max_workers=1, backend="lazy") as c:
        ok = c.compile(GrammarSpec("regex", r"ab[0-9]"))
        # After "a" this grammar needs "é", which no token spells: that mask is a dead end.
        stuck = c.compile(GrammarSpec("regex", "a\u00e9"))
        good = [ok.matcher() for _ in range(3)]
        for m in good:
            assert m.accept_tokens([ID["a"]])
        bad = stuck.matcher()
        assert bad.accept_tokens([ID["a"]])
        prefetch_masks(good + [bad])
        bm = allocate_bitmask(3, MODEL_VOCAB)
        for i, m in enumerate(good):
            m.fill_bitmask(bm, i)
            assert [t for t in range(MODEL_VOCAB) if int(bm[i, t // 32]) >> (t % 32) & 1] == [ID["b"]]
        with pytest.raises(RuntimeError, match="no token can continue"):
            bad.fill_bitmask(allocate_bitmask(1, MODEL_VOCAB), 0)
