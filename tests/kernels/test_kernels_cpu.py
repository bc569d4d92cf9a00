"""The native CPU attention backend (kernels/cpu.py: the AVX512 kernel where it builds, else the
portable one) against dense causal SDPA, and its exact batch invariance: every row, prefill rows
included, the same bits in any batch or chunking."""

from __future__ import annotations

import pytest
import torch

from stencil.kernels import native, vec_attention
from stencil.kernels.attention_backend import AttentionMetadata
from test_kernels_torch import dense_reference, paged_case, random_seqs

pytestmark = pytest.mark.skipif(not (native.available() or vec_attention.available()),
                                reason="native attention needs a C compiler on x86-64")


def _backend():
    from stencil.kernels.cpu import CpuAttentionBackend

    return CpuAttentionBackend("cpu")


def _run(seqs, heads, kv_heads, dim, seed):
    q, k, v, k_cache, v_cache, meta, dense = paged_case(seqs, heads, kv_heads, dim, seed)
    backend = _backend()
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    return backend, q, k_cache, v_cache, meta, dense


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 4, 32), (6, 2, 16), (9, 3, 64), (8, 1, 128), (4, 1, 256)])
def test_mixed_varlen_batch_matches_dense_sdpa(seed, heads, kv_heads, dim):
    seqs = random_seqs(seed, 4) + [(0, 23), (37, 1), (19, 5), (300, 2)]
    backend, q, k_cache, v_cache, meta, dense = _run(seqs, heads, kv_heads, dim, seed)
    out = backend.forward(q, k_cache, v_cache, meta, dim ** -0.5)
    torch.testing.assert_close(out, dense_reference(dense, seqs, dim ** -0.5), atol=2e-5, rtol=2e-5)


def assert_each_row_alone_is_the_same_bits(backend, q, k_cache, v_cache, meta, seqs, **kw) -> None:
    """Every row of ``backend.forward`` over the batch (scale 0.125, keyword arguments ``kw``) is,
    bit for bit, the row computed alone: one query over its exact keys."""
    out = backend.forward(q, k_cache, v_cache, meta, 0.125, **kw)
    starts = meta.query_start_loc_cpu
    for i, (cached, n) in enumerate(seqs):
        for j in range(n):
            t, keys = starts[i] + j, cached + j + 1
            one = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([keys], dtype=torch.int32),
                                    meta.block_tables[i:i + 1], meta.slot_mapping[t:t + 1], 1, keys, [0, 1], [keys])
            alone = backend.forward(q[t:t + 1], k_cache, v_cache, one, 0.125, **kw)
            assert torch.equal(alone[0], out[t]), (i, j)


@pytest.mark.parametrize("seed", range(3))
def test_every_row_is_the_same_bits_alone_in_any_batch_or_chunk(seed):
    """A row computed alone (one query, its exact keys) equals the same row inside a mixed batch,
    whether it belongs to a decode, a draft run or a fresh 60-token prefill."""
    seqs = [(40, 2), (3, 16), (0, 60), (64, 1), (31, 3), (16, 17), (200, 1)]
    backend, q, k_cache, v_cache, meta, _ = _run(seqs, 9, 3, 64, seed)
    assert_each_row_alone_is_the_same_bits(backend, q, k_cache, v_cache, meta, seqs)


def test_threads_do_not_change_bits():
    seqs = [(40, 2), (0, 30), (100, 1), (7, 9)]
    backend, q, k_cache, v_cache, meta, _ = _run(seqs, 9, 3, 64, seed=5)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = backend.forward(q, k_cache, v_cache, meta, 0.125)
        torch.set_num_threads(2)
        two = backend.forward(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


@pytest.mark.parametrize("half", [False, True])
def test_one_long_prompt_of_one_kv_head_is_shared_by_the_threads_with_the_same_bits(half):
    """A single sequence's prompt under one kv head (Gemma 3's shape: four query heads of 256) is
    split into runs of rows among the threads: every row, with or without a window, fp32 or
    fp16 cache, is the bits of the same row computed alone on one thread."""
    seqs = [(5, 45)]
    backend, q, k_cache, v_cache, meta, _ = _run(seqs, 4, 1, 256, seed=2)
    if half:
        k_cache, v_cache = k_cache.half(), v_cache.half()
    before = torch.get_num_threads()
    try:
        for window in (None, 12):
            torch.set_num_threads(1)
            one = backend.forward(q, k_cache, v_cache, meta, 0.125, window=window)
            torch.set_num_threads(2)
            assert torch.equal(backend.forward(q, k_cache, v_cache, meta, 0.125, window=window), one)
            assert_each_row_alone_is_the_same_bits(backend, q, k_cache, v_cache, meta, seqs, window=window)
    finally:
        torch.set_num_threads(before)


def test_unsupported_inputs_fall_back_to_the_reference():
    seqs = [(20, 1), (0, 9)]
    q, k, v, k_cache, v_cache, meta, dense = paged_case(seqs, 4, 2, 12, seed=3)  # head_dim 12: no kernel's
    backend = _backend()
    assert not backend.supports_cache(k_cache)
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = backend.forward(q, k_cache, v_cache, meta, 12 ** -0.5)
    torch.testing.assert_close(out, dense_reference(dense, seqs, 12 ** -0.5), atol=1e-5, rtol=1e-5)
    kc, vc = k_cache.bfloat16(), v_cache.bfloat16()  # bf16 cache
    out = backend.forward(q.bfloat16(), kc, vc, meta, 12 ** -0.5)
    assert out.dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_cache_matches_the_reference_reading_the_same_values(dtype):
    """bf16 and fp16 K/V are widened exactly, so the kernel agrees with the torch reference over
    the same cache to fp32 rounding, and each row is still the same bits in any batch."""
    from stencil.kernels.torch_ref import TorchAttentionBackend

    seqs = [(40, 2), (0, 30), (100, 1), (7, 9)]
    q, k, v, k_cache, v_cache, meta, _ = paged_case(seqs, 9, 3, 64, seed=8)
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    backend = _backend()
    backend.reshape_and_cache(k, v, kc, vc, meta.slot_mapping)
    out = backend.forward(q, kc, vc, meta, 0.125)
    ref = TorchAttentionBackend().forward(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    starts = meta.query_start_loc_cpu
    t = starts[1] + 12  # row 12 of the fresh 30-token prefill, alone
    one = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([13], dtype=torch.int32),
                            meta.block_tables[1:2], meta.slot_mapping[t:t + 1], 1, 13, [0, 1], [13])
    assert torch.equal(backend.forward(q[t:t + 1], kc, vc, one, 0.125)[0], out[t])


@pytest.mark.skipif(not vec_attention.available(), reason="the portable kernel needs a C compiler on x86-64")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_portable_kernel_reads_each_cache_dtype_as_the_reference_does(dtype):
    """The portable kernel (the default where AVX512 is missing; called directly here, whatever
    this CPU has) over fp32, bf16 and fp16 caches against the torch reference on the same cache."""
    from stencil.kernels.torch_ref import TorchAttentionBackend

    seqs = [(40, 2), (0, 30), (100, 1)]
    q, k, v, k_cache, v_cache, meta, _ = paged_case(seqs, 8, 2, 64, seed=9)
    kc, vc = k_cache.to(dtype), v_cache.to(dtype)
    ref_backend = TorchAttentionBackend()
    ref_backend.reshape_and_cache(k, v, kc, vc, meta.slot_mapping)
    out = vec_attention.paged_attention(q, kc, vc, meta.block_tables, meta.query_start_loc, meta.seq_lens, 0.125)
    ref = ref_backend.forward(q, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, ref.float(), atol=2e-5, rtol=2e-5)
