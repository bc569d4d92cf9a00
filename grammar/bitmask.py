"""Packed token bitmasks: allocation, application to logits, unpacking.

Layout (the one of xgrammar and outlines-core's kernels): an int32 tensor
``[rows, ceil(vocab_size / 32)]``; bit ``t % 32`` (least significant first) of word ``t // 32`` set
means token ``t`` is allowed. Bits at positions ≥ ``vocab_size`` in the last word are ignored.
"""

from __future__ import annotations

import numpy as np
import torch

_NEG_INF_BITS = -8388608  # 0xFF800000: the IEEE-754 float32 bit pattern of -inf, as int32
_NEG_INF = np.float32(-np.inf)
# A CPU row whose fewer side (allowed or forbidden words) spans more than 1/DENSE_WORDS of its
# words is masked whole (``_apply_cpu_``): where indexing each token costs more than one pass.
DENSE_WORDS = 16


def bitmask_words(vocab_size: int) -> int:
    """Words per row: ``ceil(vocab_size / 32)``."""
    return (vocab_size + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """An int32 bitmask ``[rows, ceil(vocab_size / 32)]`` with every bit set (all tokens allowed)."""
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, device=device)


def _unpack(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """int32 ``[R, W]`` → int32 ``[R, vocab_size]`` of 0/1 (a strided view of ``[R, W*32]``)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]; >> is arithmetic but & 1 keeps one bit
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size]


def bitmask_to_bool(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack ``bitmask`` int32 ``[R, W]`` into bool ``[R, vocab_size]`` (True = allowed).

    Raises:
        ValueError: wrong dtype, or ``W * 32 < vocab_size``.
    """
    _check(bitmask, vocab_size)
    return _unpack(bitmask, vocab_size).bool()


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set disallowed logits to ``-inf``, in place.

    Args:
        logits: float32 ``[R, V]``, contiguous.
        bitmask: int32 ``[R, ceil(V / 32)]`` (or wider), moved to ``logits.device`` if needed.

    One vectorized pass, no loop over rows or tokens: the bits are spread to int32 0/1 by shifts,
    turned into an all-ones/all-zeros keep mask, and merged into the float bit patterns
    (``(x & keep) | (-inf & ~keep)``), which is exact and ≈ 3× cheaper on CPU than
    ``masked_fill_`` with a bool mask.

    Raises:
        ValueError: dtype, shape or layout mismatch.
    """
    if logits.dtype != torch.float32 or logits.dim() != 2 or not logits.is_contiguous():
        raise ValueError(f"logits must be contiguous float32 [R, V], got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    rows, vocab = logits.shape
    _check(bitmask, vocab)
    if bitmask.shape[0] != rows:
        raise ValueError(f"bitmask has {bitmask.shape[0]} rows, logits {rows}")
    if bitmask.device != logits.device:
        bitmask = bitmask.to(logits.device, non_blocking=True)
    if logits.device.type == "cpu":
        _apply_cpu_(logits, bitmask)
        return
    keep = _unpack(bitmask, vocab).neg()  # 0 → 0, 1 → -1 (all ones)
    as_int = logits.view(torch.int32)
    as_int.bitwise_and_(keep)
    as_int.bitwise_or_(keep.bitwise_not_().bitwise_and_(_NEG_INF_BITS))


def _apply_cpu_(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """``apply_bitmask_`` on the CPU, touching only what the masks forbid or allow, whichever is
    fewer, or every logit of a row where both are many.

    Rows whose mask allows everything (unconstrained requests) are skipped. Of the others, a
    row with fewer words holding an allowed token than words holding a forbidden one (a key, a
    digit) is filled with ``-inf`` and its allowed logits put back; a row with few words holding
    a forbidden token (free text inside a JSON string of a small vocabulary) gets ``-inf`` at
    its forbidden tokens. Only the words that matter are unpacked, and each side is one flat
    index operation over every such row at once: a few passes over the int32 words instead of
    several over every logit (≈ 10x less on a 256-row step of a 49k vocabulary). Each index
    costs ~8 ns against ~0.5 ns a logit for a whole-row pass, so a row where the fewer side
    still spans more than 1/``DENSE_WORDS`` of its words (text inside a string of Llama 3's
    128k vocabulary, whose reserved tokens are all forbidden there) is unpacked whole and
    written with one masked copy: 0.6 -> 0.07 ms a row.
    """
    vocab = logits.shape[1]
    words = bitmask.numpy()
    n_words = words.shape[1]
    constrained = np.flatnonzero((words != -1).any(axis=1))
    if constrained.size == 0:
        return
    sub = words[constrained]  # [r, W]
    allowed_words, forbidden_words = np.count_nonzero(sub, axis=1), np.count_nonzero(sub != -1, axis=1)
    sparse = allowed_words <= forbidden_words
    dense = np.minimum(allowed_words, forbidden_words) * DENSE_WORDS > n_words
    flat = logits.view(-1)
    for rows_of, side in ((sparse & ~dense, True), (~sparse & ~dense, False)):
        if not rows_of.any():
            continue
        r = constrained[rows_of]
        w = sub[rows_of]
        pos = np.flatnonzero(w != 0) if side else np.flatnonzero(w != -1)  # words to unpack
        bits = np.unpackbits(w.reshape(-1)[pos].view(np.uint8).reshape(-1, 4), axis=1, bitorder="little")
        hit = np.flatnonzero(bits) if side else np.flatnonzero(bits == 0)  # [k*32] → bit positions
        word = pos[hit // 32]
        col = (word % n_words) * 32 + hit % 32
        ok = col < vocab
        index = torch.from_numpy(r[word[ok] // n_words] * vocab + col[ok])
        if side:
            values = flat[index]
            logits[torch.from_numpy(r)] = float("-inf")
            flat[index] = values
        else:
            flat[index] = float("-inf")
    if dense.any():
        rows = logits.numpy()
        forbid = np.unpackbits(np.ascontiguousarray(sub[dense]).view(np.uint8), axis=1, bitorder="little",
                               count=vocab).view(bool)
        np.logical_not(forbid, out=forbid)
        for i, row in enumerate(constrained[dense].tolist()):
            np.copyto(rows[row], _NEG_INF, where=forbid[i])


def _check(bitmask: torch.Tensor, vocab_size: int) -> None:
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2:
        raise ValueError(f"bitmask must be int32 [R, W], got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.shape[1] * 32 < vocab_size:
        raise ValueError(f"bitmask width {bitmask.shape[1]} words < ceil({vocab_size} / 32)")
