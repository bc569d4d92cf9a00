"""The flash-attn backend: lazy import, the K/V gather, and its calls into flash-attn.

flash-attn needs CUDA, so on CPU the backend's calls go to a stand-in ``flash_attn`` module
written from flash-attn 2's documented semantics (signatures, bottom-right causal alignment,
GQA head mapping, paged reads only for block sizes that are multiples of 256). That checks our
argument plumbing and both block-size paths against dense SDPA; the ``gpu`` test runs the real
library against the torch reference.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

import pytest
import torch
import torch.nn.functional as F

from stencil.kernels.torch_ref import TorchAttentionBackend
from test_kernels_torch import dense_reference, paged_case


def make_case(seqs, heads, kv_heads, dim, *, block=16, dtype=torch.float32, device="cpu",
              seed=0):
    """Random sequences [(cached_len, q_len), ...] written whole into a shuffled paged cache
    filled with NaN elsewhere. Returns (query, k_cache, v_cache, meta, reference output)."""
    num_blocks = sum(-(-(c + n) // block) for c, n in seqs) + 2
    q, k, v, k_cache, v_cache, meta, dense = paged_case(seqs, heads, kv_heads, dim, seed, num_blocks, nan_filled=True,
                                                        block=block, dtype=dtype, device=device)
    k_cache.view(-1, kv_heads, dim)[meta.slot_mapping] = k
    v_cache.view(-1, kv_heads, dim)[meta.slot_mapping] = v
    ref = dense_reference([tuple(t.float() for t in qkv) for qkv in dense], seqs, dim ** -0.5)
    return q, k_cache, v_cache, meta, ref


# --- a stand-in flash_attn, from flash-attn 2's docstrings ----------------------------------

def _bottom_right_causal(q, k, v, scale, window_size=(-1, -1)):
    """q [Lq, H, D], k/v [Lk, KVH, D]: row j sees keys 0..Lk - Lq + j (flash-attn's causal);
    with ``window_size=(left, 0)``, only keys from ``Lk - Lq + j - left`` on (its local mode)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    lq, lk = q.shape[0], k.shape[0]
    pos = torch.arange(lq)[:, None] + (lk - lq)
    mask = torch.arange(lk)[None, :] <= pos
    if window_size[0] >= 0:
        mask &= torch.arange(lk)[None, :] >= pos - window_size[0]
    o = F.scaled_dot_product_attention(q.transpose(0, 1).float(), k.transpose(0, 1).float(),
                                       v.transpose(0, 1).float(), attn_mask=mask, scale=scale)
    return o.transpose(0, 1).to(q.dtype)


def _pages(cache, table_row, length):
    if cache.shape[1] % 256:
        raise RuntimeError("Paged KV cache block size must be divisible by 256")
    return cache[table_row.long()].flatten(0, 1)[:length]


def _varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
            softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0,
            alibi_slopes=None, deterministic=False, return_attn_probs=False, block_table=None):
    assert causal and cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    assert max_seqlen_q == max(b - a for a, b in zip(cq, cq[1:]))
    assert max_seqlen_k == max(b - a for a, b in zip(ck, ck[1:]))
    out = []
    for i in range(len(cq) - 1):
        length = ck[i + 1] - ck[i]
        if block_table is None:
            ki, vi = k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        else:
            ki, vi = _pages(k, block_table[i], length), _pages(v, block_table[i], length)
        out.append(_bottom_right_causal(q[cq[i]:cq[i + 1]], ki, vi, softmax_scale, window_size))
    return torch.cat(out)


def _with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None,
                  cache_seqlens=None, cache_batch_idx=None, cache_leftpad=None,
                  block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1),
                  softcap=0.0, rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                  return_softmax_lse=False):
    assert causal and k is None and v is None and q.dim() == 4
    out = []
    for i, length in enumerate(cache_seqlens.tolist()):
        ki = _pages(k_cache, block_table[i], length)
        vi = _pages(v_cache, block_table[i], length)
        out.append(_bottom_right_causal(q[i], ki, vi, softmax_scale, window_size))
    return torch.stack(out)


@pytest.fixture
def fake_flash(monkeypatch):
    """Install the stand-in as ``flash_attn``; count calls per entry point."""
    calls = {"varlen": 0, "kvcache": 0}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = counted("varlen", _varlen)
    module.flash_attn_with_kvcache = counted("kvcache", _with_kvcache)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    return calls


# --- CPU tests -----------------------------------------------------------------------------

def test_import_does_not_import_flash_attn_and_construction_says_missing(monkeypatch):
    monkeypatch.delitem(sys.modules, "stencil.kernels.flash", raising=False)
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # any import of it raises
    module = importlib.import_module("stencil.kernels.flash")
    with pytest.raises(RuntimeError, match="flash-attn is not installed"):
        module.FlashAttentionBackend("cuda")


MIXED = [(0, 23), (37, 1), (19, 5), (16, 4), (300, 2), (5, 40)]


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_gather_kv_returns_each_sequence_contiguously(heads, kv_heads):
    from stencil.kernels.flash import gather_kv

    q, k_cache, v_cache, meta, _ = make_case(MIXED, heads, kv_heads, 8, seed=1)
    k, v, cu = gather_kv(k_cache, v_cache, meta)
    seq_lens = meta.seq_lens_cpu
    assert cu.dtype == torch.int32
    assert cu.tolist() == [sum(seq_lens[:i]) for i in range(len(seq_lens) + 1)]
    assert k.shape == (sum(seq_lens), kv_heads, 8) and not k.isnan().any()
    for i, length in enumerate(seq_lens):
        for p in (0, length // 2, length - 1):
            block = int(meta.block_tables[i, p // 16])
            assert torch.equal(k[cu[i] + p], k_cache[block, p % 16])
            assert torch.equal(v[cu[i] + p], v_cache[block, p % 16])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_block_16_gathers_then_runs_varlen(fake_flash, dtype):
    from stencil.kernels.flash import FlashAttentionBackend

    q, k_cache, v_cache, meta, ref = make_case(MIXED, 6, 2, 16, dtype=dtype, seed=2)
    out = FlashAttentionBackend("cpu").forward(q, k_cache, v_cache, meta, 16 ** -0.5)
    assert fake_flash == {"varlen": 1, "kvcache": 0}
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_block_256_mixed_batch_reads_pages_through_varlen(fake_flash):
    from stencil.kernels.flash import FlashAttentionBackend

    q, k_cache, v_cache, meta, ref = make_case([(0, 7), (300, 1), (250, 9)], 4, 2, 8,
                                               block=256, dtype=torch.float16, seed=3)
    out = FlashAttentionBackend("cpu").forward(q, k_cache, v_cache, meta, 8 ** -0.5)
    assert fake_flash == {"varlen": 1, "kvcache": 0}
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=3e-3)


@pytest.mark.parametrize("q_len", [1, 3])
def test_block_256_uniform_queries_use_kvcache_kernel(fake_flash, q_len):
    from stencil.kernels.flash import FlashAttentionBackend

    seqs = [(0, q_len), (255, q_len), (400, q_len)]
    q, k_cache, v_cache, meta, ref = make_case(seqs, 4, 1, 8, block=256, dtype=torch.bfloat16,
                                               seed=4)
    out = FlashAttentionBackend("cpu").forward(q, k_cache, v_cache, meta, 8 ** -0.5)
    assert fake_flash == {"varlen": 0, "kvcache": 1}
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_fp32_is_refused(fake_flash):
    from stencil.kernels.flash import FlashAttentionBackend

    q, k_cache, v_cache, meta, _ = make_case([(3, 2)], 2, 2, 8)
    with pytest.raises(ValueError, match="fp16 and bf16"):
        FlashAttentionBackend("cpu").forward(q, k_cache, v_cache, meta, 0.5)


def test_reshape_and_cache_writes_the_slots(fake_flash):
    from stencil.kernels.flash import FlashAttentionBackend

    key = torch.randn(3, 2, 8, dtype=torch.float16)
    value = torch.randn_like(key)
    k_cache = torch.zeros(2, 16, 2, 8, dtype=torch.float16)
    v_cache = torch.zeros_like(k_cache)
    FlashAttentionBackend("cpu").reshape_and_cache(key, value, k_cache, v_cache,
                                                   torch.tensor([17, 0, 31]))
    assert torch.equal(k_cache[1, 1], key[0]) and torch.equal(k_cache[0, 0], key[1])
    assert torch.equal(v_cache[1, 15], value[2])
    assert k_cache.count_nonzero() == key.count_nonzero()


# --- the real library on a GPU -------------------------------------------------------------

def _has_flash_attn() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not _has_flash_attn(),
                    reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("block", [16, 256])
@pytest.mark.parametrize("seqs", [[(0, 300), (517, 1), (129, 7), (2047, 4), (33, 200)],
                                  [(517, 1), (1000, 1), (0, 1)]])
def test_gpu_flash_attn_matches_torch_reference(block, seqs):
    from stencil.kernels.flash import FlashAttentionBackend

    q, k_cache, v_cache, meta, ref = make_case(seqs, 32, 8, 128, block=block,
                                               dtype=torch.bfloat16, device="cuda", seed=block)
    out = FlashAttentionBackend("cuda").forward(q, k_cache, v_cache, meta, 128 ** -0.5)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    torch_out = TorchAttentionBackend("cuda").forward(q, k_cache, v_cache, meta, 128 ** -0.5)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=2e-2, rtol=2e-2)
