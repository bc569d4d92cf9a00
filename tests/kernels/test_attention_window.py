"""Sliding-window attention (``window=`` of ``stencil.kernels.attention_backend``) in every backend against dense SDPA
under the window mask: a row at position p sees keys p - W + 1 .. p exactly."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stencil.kernels import native, vec_attention
from stencil.kernels.torch_ref import TorchAttentionBackend
from test_kernels_flash import fake_flash  # noqa: F401 - the stand-in flash_attn fixture
from test_kernels_cpu import assert_each_row_alone_is_the_same_bits
from test_kernels_torch import paged_case

# A fresh prefill longer than the windows, decode rows far past them, a prefill chunk behind a
# prefix, short draft-like runs, and a sequence shorter than any window.
SEQS = [(0, 60), (100, 1), (40, 20), (31, 3), (16, 17), (2, 1), (70, 16)]
WINDOWS = [1, 5, 16, 37, 500]


def windowed_reference(dense, seqs, scale: float, window: int) -> torch.Tensor:
    """fp32 SDPA over each whole sequence with key k visible from row p when p - W < k <= p."""
    outs = []
    for (q, k, v), (cached, _) in zip(dense, seqs):
        group = q.shape[1] // k.shape[1]
        pos = torch.arange(q.shape[0])
        visible = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.repeat_interleave(group, 1).transpose(0, 1),
            v.repeat_interleave(group, 1).transpose(0, 1), attn_mask=visible, scale=scale)
        outs.append(o.transpose(0, 1)[cached:])
    return torch.cat(outs)


def _backends():
    out = [pytest.param(TorchAttentionBackend, id="torch")]
    if native.available() or vec_attention.available():
        from stencil.kernels.cpu import CpuAttentionBackend

        out.append(pytest.param(CpuAttentionBackend, id="cpu"))
    return out


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("make", _backends())
@pytest.mark.parametrize("heads,kv_heads,dim", [(4, 1, 32), (9, 3, 64)])
def test_windowed_batch_matches_masked_dense_sdpa(make, window, heads, kv_heads, dim):
    q, k, v, k_cache, v_cache, meta, dense = paged_case(SEQS, heads, kv_heads, dim, seed=window, num_blocks=80)
    backend = make("cpu")
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = backend.forward(q, k_cache, v_cache, meta, dim ** -0.5, window=window)
    ref = windowed_reference(dense, SEQS, dim ** -0.5, window)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    if window < 60:  # the window matters: attending to the whole prefix is far off
        full = backend.forward(q, k_cache, v_cache, meta, dim ** -0.5)
        assert float((full - ref).abs().max()) > 0.1


@pytest.mark.skipif(not (native.available() or vec_attention.available()),
                    reason="native attention needs a C compiler on x86-64")
@pytest.mark.parametrize("window", [5, 16, 37])
def test_native_windowed_rows_are_the_same_bits_alone_and_in_a_batch(window):
    from stencil.kernels.cpu import CpuAttentionBackend

    q, k, v, k_cache, v_cache, meta, _ = paged_case(SEQS, 9, 3, 64, seed=7, num_blocks=80)
    backend = CpuAttentionBackend("cpu")
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    assert_each_row_alone_is_the_same_bits(backend, q, k_cache, v_cache, meta, SEQS, window=window)
    # A window no row reaches past is no window, bit for bit.
    assert torch.equal(backend.forward(q, k_cache, v_cache, meta, 0.125, window=10_000),
                       backend.forward(q, k_cache, v_cache, meta, 0.125))


def _out_of_window(tables: torch.Tensor, seqs, window: int, block: int, null: int) -> torch.Tensor:
    """``tables`` with every entry no row of its sequence can see pointed at block ``null``, as a
    hybrid cache's window group leaves them (``stencil.engine.kv_cache_manager.release_out_of_window``:
    blocks wholly before the first row's first visible key, position ``cached - window + 1``)."""
    tables = tables.clone()
    for i, (cached, _) in enumerate(seqs):
        tables[i, :max(0, cached - window + 1) // block] = null
    return tables


@pytest.mark.parametrize("window", [5, 16, 37])
@pytest.mark.parametrize("make", _backends())
def test_entries_out_of_every_window_are_never_read(make, window):
    """The window group's freed entries point at its null block: a backend that skips blocks
    outside each row's window gives the same bits when that block holds NaN."""
    from dataclasses import replace

    q, k, v, k_cache, v_cache, meta, _ = paged_case(SEQS, 9, 3, 64, seed=window, num_blocks=81)
    backend = make("cpu")
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    want = backend.forward(q, k_cache, v_cache, meta, 0.125, window=window)
    null = sorted(set(range(81)) - set(meta.block_tables.flatten().tolist()))[0]
    k_cache[null], v_cache[null] = float("nan"), float("nan")
    tables = _out_of_window(meta.block_tables, SEQS, window, 16, null)
    assert int((tables == null).sum()) > 5  # the case has entries out of the window
    got = backend.forward(q, k_cache, v_cache, replace(meta, block_tables=tables), 0.125, window=window)
    assert torch.equal(got, want)


def test_flash_reads_out_of_window_entries_as_the_null_blocks_zeros_and_masks_them(fake_flash):
    """``stencil.kernels.flash.gather_kv`` reads every position, the freed ones from the null block (zeros,
    never written): the window mask hides them, so the rows are those of the torch reference."""
    from dataclasses import replace

    from stencil.kernels.flash import FlashAttentionBackend
    from test_kernels_flash import make_case

    seqs = [(0, 30), (40, 1), (19, 5), (300, 2)]
    q, k_cache, v_cache, meta, _ = make_case(seqs, 4, 2, 16, dtype=torch.float16, seed=5)
    null = sorted(set(range(k_cache.shape[0])) - set(meta.block_tables.flatten().tolist()))[0]
    k_cache[null], v_cache[null] = 0.0, 0.0
    windowed = replace(meta, block_tables=_out_of_window(meta.block_tables, seqs, 8, 16, null))
    out = FlashAttentionBackend("cpu").forward(q, k_cache, v_cache, windowed, 0.25, window=8)
    ref = TorchAttentionBackend("cpu").forward(q.float(), k_cache.nan_to_num().float(),
                                               v_cache.nan_to_num().float(), meta, 0.25, window=8)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("make", _backends())
def test_a_window_below_one_token_is_refused(make):
    q, k, v, k_cache, v_cache, meta, _ = paged_case([(3, 2)], 2, 2, 16, seed=0)
    with pytest.raises(ValueError, match="window must be >= 1"):
        make("cpu").forward(q, k_cache, v_cache, meta, 0.25, window=0)


@pytest.mark.parametrize("block", [16, 256])
def test_flash_backend_passes_the_window_as_flash_attn_local_attention(fake_flash, block):
    from stencil.kernels.flash import FlashAttentionBackend
    from test_kernels_flash import make_case

    seqs = [(0, 30), (40, 1), (19, 5), (300, 2)] if block == 16 else [(0, 3), (40, 3), (300, 3)]
    q, k_cache, v_cache, meta, _ = make_case(seqs, 4, 2, 16, block=block, dtype=torch.float16, seed=block)
    out = FlashAttentionBackend("cpu").forward(q, k_cache, v_cache, meta, 0.25, window=8)
    ref = TorchAttentionBackend("cpu").forward(q.float(), k_cache.nan_to_num().float(),
                                               v_cache.nan_to_num().float(), meta, 0.25, window=8)
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


def test_triton_backend_refuses_a_window_rather_than_ignore_it():
    from stencil.kernels.triton.backend import TritonAttentionBackend

    try:
        backend = TritonAttentionBackend("cpu")
    except RuntimeError as e:
        pytest.skip(str(e))
    q, k, v, k_cache, v_cache, meta, _ = paged_case([(3, 2)], 2, 2, 16, seed=0)
    with pytest.raises(ValueError, match="no sliding window"):
        backend.forward(q, k_cache, v_cache, meta, 0.25, window=4)
