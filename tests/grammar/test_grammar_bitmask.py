"""Packed bitmasks against a per-bit Python reference."""

from __future__ import annotations

import pytest
import torch

from stencil.grammar.bitmask import allocate_bitmask, apply_bitmask_, bitmask_to_bool


def reference_bool(bitmask: torch.Tensor, vocab_size: int) -> list[list[bool]]:
    rows = []
    for r in range(bitmask.shape[0]):
        words = [w & 0xFFFFFFFF for w in bitmask[r].tolist()]
        rows.append([bool(words[t // 32] >> (t % 32) & 1) for t in range(vocab_size)])
    return rows


def random_bitmask(rows: int, vocab_size: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = (vocab_size + 31) // 32
    return torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int32)


def test_allocate_allows_everything():
    bm = allocate_bitmask(3, 70)
    assert bm.shape == (3, 3) and bm.dtype == torch.int32
    assert bitmask_to_bool(bm, 70).all()


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 70, 96])
def test_bitmask_to_bool_matches_reference(vocab_size):
    bm = random_bitmask(4, vocab_size, seed=vocab_size)
    bm[0, 0] = -2**31  # only bit 31: the sign bit must unpack as token 31, not spread
    got = bitmask_to_bool(bm, vocab_size)
    assert got.shape == (4, vocab_size) and got.dtype == torch.bool
    assert got.tolist() == reference_bool(bm, vocab_size)


def test_apply_sets_exactly_the_disallowed_logits_to_minus_inf():
    vocab = 70
    bm = random_bitmask(5, vocab, seed=1)
    bm[2] = -1  # an unconstrained row
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(2))
    logits[0, 3] = float("inf")
    logits[1, 4] = float("nan")
    original = logits.clone()
    apply_bitmask_(logits, bm)
    ref = reference_bool(bm, vocab)
    for r in range(5):
        for t in range(vocab):
            if ref[r][t]:
                a, b = logits[r, t].view(torch.int32).item(), original[r, t].view(torch.int32).item()
                assert a == b, (r, t)  # bit-identical, NaN and inf included
            else:
                assert logits[r, t].item() == float("-inf"), (r, t)


@pytest.mark.parametrize("extra_words", [0, 2])
def test_apply_mixed_rows_matches_reference(extra_words):
    """Rows that allow few tokens, forbid few, allow one, allow none, allow all, and bits set past
    the vocabulary: each row comes out as the per-bit reference says (the CPU path writes the
    smaller side of each row)."""
    vocab = 1000  # not a multiple of 32: the last word has bits past the vocabulary
    words = (vocab + 31) // 32 + extra_words
    g = torch.Generator().manual_seed(5)
    bm = torch.full((8, words), -1, dtype=torch.int32)
    bm[0] = 0
    bm[0, 3], bm[0, 30] = 0x00010001, -2**31  # few allowed (token 3*32, 3*32+16, 991)
    bm[1, 7] = 0x7FFFFFFF  # one forbidden (token 7*32+31)
    bm[2] = 0
    bm[2, 31] = 1 << 7  # one allowed: token 999
    bm[3] = 0  # nothing allowed
    # row 4 stays all-allowed (an unconstrained request)
    bm[5] = torch.randint(-2**31, 2**31 - 1, (words,), generator=g, dtype=torch.int32)
    bm[6] = 0
    bm[6, :4] = -1  # the first 128 tokens
    bm[7] = -1
    bm[7, 31] = 0  # bits past the vocabulary cleared, last 8 tokens forbidden
    logits = torch.randn(8, vocab, generator=g)
    original = logits.clone()
    apply_bitmask_(logits, bm)
    ref = torch.tensor(reference_bool(bm, vocab))
    assert torch.equal(logits[ref], original[ref])
    assert (logits[~ref] == float("-inf")).all()


def test_apply_with_all_bits_set_changes_nothing():
    logits = torch.randn(3, 64)
    before = logits.clone()
    apply_bitmask_(logits, allocate_bitmask(3, 64))
    assert torch.equal(logits, before)


def test_apply_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 64), allocate_bitmask(3, 64))
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 65), allocate_bitmask(2, 64))
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 64, dtype=torch.float16), allocate_bitmask(2, 64))
    with pytest.raises(ValueError):
        apply_bitmask_(torch.zeros(2, 64), allocate_bitmask(2, 64).to(torch.int64))
