"""The torch reference backend against dense causal SDPA on unpaged K/V, and the registry."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from stencil.kernels.attention_backend import AttentionMetadata
from stencil.kernels.registry import backend_names, get_backend
from stencil.kernels.torch_ref import TorchAttentionBackend

BLOCK = 16


def paged_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, dim: int, seed: int,
               num_blocks: int = 64, *, nan_filled: bool = False, block: int = BLOCK,
               dtype: torch.dtype = torch.float32, device="cpu"):
    """Random Q/K/V for ``seqs`` = [(cached_len, q_len), ...] stored in a shuffled paged cache.

    The cached prefix is written straight into the cache; the new tokens' K/V are returned flat,
    for ``reshape_and_cache``. The cache is pre-filled with large garbage, or NaN with
    ``nan_filled``, so any read of a slot outside a sequence shows up in the output. Returns
    (query, new_k, new_v, k_cache, v_cache, meta, dense) on ``device``, ``dense`` holding each
    whole sequence's (q, k, v) on the CPU.
    """
    g = torch.Generator().manual_seed(seed)
    if nan_filled:
        k_cache = torch.full((num_blocks, block, kv_heads, dim), float("nan"), dtype=dtype)
        v_cache = torch.full_like(k_cache, float("nan"))
    else:
        k_cache = (torch.randn(num_blocks, block, kv_heads, dim, generator=g) * 100).to(dtype)
        v_cache = (torch.randn(num_blocks, block, kv_heads, dim, generator=g) * 100).to(dtype)
    free = torch.randperm(num_blocks, generator=g).tolist()
    max_blocks = max(-(-(c + n) // block) for c, n in seqs)
    tables = torch.zeros(len(seqs), max_blocks, dtype=torch.int32)
    dense, new_q, new_k, new_v, slots, starts = [], [], [], [], [], [0]
    for i, (cached, q_len) in enumerate(seqs):
        total = cached + q_len
        blocks = [free.pop() for _ in range(-(-total // block))]
        tables[i, : len(blocks)] = torch.tensor(blocks)
        q = torch.randn(total, heads, dim, generator=g).to(dtype)
        k = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
        v = torch.randn(total, kv_heads, dim, generator=g).to(dtype)
        dense.append((q, k, v))
        seq_slots = torch.tensor([blocks[p // block] * block + p % block for p in range(total)])
        k_cache.view(-1, kv_heads, dim)[seq_slots[:cached]] = k[:cached]
        v_cache.view(-1, kv_heads, dim)[seq_slots[:cached]] = v[:cached]
        new_q.append(q[cached:])
        new_k.append(k[cached:])
        new_v.append(v[cached:])
        slots.append(seq_slots[cached:])
        starts.append(starts[-1] + q_len)
    seq_lens = [c + n for c, n in seqs]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        slot_mapping=torch.cat(slots).long().to(device),
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    moved = [t.to(device) for t in (torch.cat(new_q), torch.cat(new_k), torch.cat(new_v), k_cache, v_cache)]
    return (*moved, meta, dense)


def dense_reference(dense, seqs, scale: float) -> torch.Tensor:
    """Full causal SDPA over each whole sequence, keeping the rows of the new tokens."""
    outs = []
    for (q, k, v), (cached, _) in zip(dense, seqs):
        group = q.shape[1] // k.shape[1]
        kr = k.repeat_interleave(group, dim=1).transpose(0, 1)
        vr = v.repeat_interleave(group, dim=1).transpose(0, 1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), kr, vr, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1)[cached:])
    return torch.cat(outs)


def run_backend(seqs, heads, kv_heads, dim, seed):
    q, k, v, k_cache, v_cache, meta, dense = paged_case(seqs, heads, kv_heads, dim, seed)
    backend = TorchAttentionBackend()
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = dim ** -0.5
    out = backend.forward(q, k_cache, v_cache, meta, scale)
    return out, dense_reference(dense, seqs, scale)


def random_seqs(seed: int, n: int, decode_only: bool = False) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(1000 + seed)
    seqs = []
    for _ in range(n):
        cached = int(torch.randint(0, 70, (1,), generator=g))
        if decode_only:
            q_len = 1
        else:
            q_len = int(torch.randint(1, 40, (1,), generator=g))
        seqs.append((cached, q_len))
    return seqs


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_mixed_varlen_batch_matches_dense_sdpa(seed, heads, kv_heads):
    # Fixed members make sure each batch has a fresh prefill, a decode, and a chunk after a
    # cached prefix that does not end on a block boundary.
    seqs = random_seqs(seed, 4) + [(0, 23), (37, 1), (19, 5)]
    out, ref = run_backend(seqs, heads, kv_heads, 32, seed)
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(4))
def test_decode_only_batch_matches_dense_sdpa(seed):
    seqs = random_seqs(seed, 7, decode_only=True) + [(0, 1), (15, 1), (16, 1)]
    out, ref = run_backend(seqs, 9, 3, 64, seed)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
def test_decode_and_short_rows_are_batch_invariant_bit_for_bit(seed):
    """Decode rows and forced-token / draft rows (2-16 behind cached prefixes) give the same bits
    in a mixed batch as their sequence alone, and match the dense reference."""
    seqs = [(40, 2), (3, 16), (17, 5), (64, 1), (0, 9), (31, 3), (16, 17), (200, 1)]
    q, k, v, k_cache, v_cache, meta, dense = paged_case(seqs, 9, 3, 32, seed)
    backend = TorchAttentionBackend()
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = backend.forward(q, k_cache, v_cache, meta, 32 ** -0.5)
    torch.testing.assert_close(out, dense_reference(dense, seqs, 32 ** -0.5), atol=1e-5, rtol=1e-5)
    starts = meta.query_start_loc_cpu
    for i, (cached, n) in enumerate(seqs):
        if n > 16 or cached == 0:
            continue  # prefill paths: one call per sequence anyway
        lone = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32), meta.seq_lens[i:i + 1],
                                 meta.block_tables[i:i + 1], meta.slot_mapping[starts[i]:starts[i + 1]],
                                 n, cached + n, [0, n], [cached + n])
        alone = backend.forward(q[starts[i]:starts[i + 1]], k_cache, v_cache, lone, 32 ** -0.5)
        assert torch.equal(alone, out[starts[i]:starts[i + 1]]), (cached, n)


@pytest.mark.parametrize("cached", [5, 33, 400])
def test_lone_sequence_rows_equal_decoding_them_one_by_one_bit_for_bit(cached):
    """A lone request's forced tokens / drafts (4 rows behind its prefix) give exactly the bits
    that decoding those tokens one at a time gives, so speculation cannot change its output."""
    q, k, v, k_cache, v_cache, meta, dense = paged_case([(cached, 4)], 9, 3, 64, seed=cached)
    backend = TorchAttentionBackend()
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    rows = backend.forward(q, k_cache, v_cache, meta, 0.125)
    for j in range(4):
        n = cached + j + 1
        one = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                                meta.block_tables, meta.slot_mapping[j:j + 1], 1, n, [0, 1], [n])
        assert torch.equal(backend.forward(q[j:j + 1], k_cache, v_cache, one, 0.125)[0], rows[j])
    torch.testing.assert_close(rows, dense_reference(dense, [(cached, 4)], 0.125), atol=1e-5, rtol=1e-5)


def test_multi_token_query_after_prefix_sees_whole_prefix():
    """A 4-token draft after 33 cached tokens: its first row must attend to all 34 keys."""
    seqs = [(33, 4)]
    out, ref = run_backend(seqs, 4, 2, 16, seed=7)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_reshape_and_cache_writes_exactly_the_mapped_slots():
    g = torch.Generator().manual_seed(0)
    k_cache = torch.zeros(5, BLOCK, 2, 8)
    v_cache = torch.zeros(5, BLOCK, 2, 8)
    key, value = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    slots = torch.tensor([3 * BLOCK + 15, 0, 1 * BLOCK + 4])
    TorchAttentionBackend().reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache[3, 15], key[0])
    assert torch.equal(k_cache[0, 0], key[1])
    assert torch.equal(v_cache[1, 4], value[2])
    assert int((k_cache != 0).any(-1).any(-1).sum()) == 3
    assert int((v_cache != 0).any(-1).any(-1).sum()) == 3


def test_bf16_cache_output_close_to_fp32_reference():
    seqs = [(20, 1), (0, 9), (5, 3)]
    q, k, v, k_cache, v_cache, meta, dense = paged_case(seqs, 4, 2, 16, seed=3)
    backend = TorchAttentionBackend()
    kc, vc = k_cache.bfloat16(), v_cache.bfloat16()
    backend.reshape_and_cache(k.bfloat16(), v.bfloat16(), kc, vc, meta.slot_mapping)
    out = backend.forward(q.bfloat16(), kc, vc, meta, 0.25)
    assert out.dtype == torch.bfloat16
    ref = dense_reference(dense, seqs, 0.25)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_registry_names_and_errors():
    assert isinstance(get_backend("torch", "cpu"), TorchAttentionBackend)
    from stencil.kernels import native

    # auto on CPU: the native kernel where it builds, else the torch reference
    assert get_backend("auto", torch.device("cpu")).name == ("cpu" if native.available() else "torch")
    with pytest.raises(ValueError, match="choices.*torch.*cpu.*flash.*triton"):
        get_backend("flashinfer", "cpu")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        get_backend("flash", "cpu")
    assert set(backend_names()) == {"torch", "cpu", "flash", "triton", "auto"}


def test_registry_import_does_not_import_cuda_libraries():
    code = ("import sys, stencil.kernels.registry as r; r.get_backend('auto', 'cpu');"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('flash_attn', 'triton')))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert res.stdout.strip() == "[]"
