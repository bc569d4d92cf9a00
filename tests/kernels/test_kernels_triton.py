"""The Triton paged-attention and cache-write kernels against dense causal SDPA.

Without a GPU the kernels run in Triton's interpreter on CPU tensors: ``TRITON_INTERPRET=1``
is set here, before triton is first imported (the interpreter needs triton's own library
decorated in that mode). With a GPU the same kernels run compiled, in the ``gpu`` tests.
Every case stores the sequences in a NaN-filled cache through a shuffled block table, so a
read of any slot outside a sequence turns the output into NaN.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available() and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

triton = pytest.importorskip("triton")

from stencil.kernels.torch_ref import TorchAttentionBackend  # noqa: E402
from stencil.kernels.triton import TritonAttentionBackend  # noqa: E402
from stencil.kernels.triton.launch import is_interpreted  # noqa: E402
from stencil.kernels.triton.paged_attention import _paged_attention_kernel, paged_attention  # noqa: E402
from stencil.kernels.triton.reshape_and_cache import reshape_and_cache  # noqa: E402
from test_kernels_torch import paged_case  # noqa: E402

BLOCK = 16
INTERPRETED = is_interpreted(_paged_attention_kernel)
interpreter = pytest.mark.skipif(not INTERPRETED, reason="kernels compiled: see the gpu tests")
compiled_cuda = pytest.mark.skipif(not torch.cuda.is_available() or INTERPRETED,
                                   reason="needs CUDA and compiled Triton kernels")


def make_case(seqs, heads, kv_heads, dim, *, dtype=torch.float32, device="cpu", seed=0,
              extra_blocks=3):
    """``paged_case`` in a NaN-filled cache of just enough blocks and ``extra_blocks`` more.

    Returns (query, new_k, new_v, k_cache, v_cache, meta, dense) where the cached prefixes are
    already in the cache, the new tokens' K/V are flat for ``reshape_and_cache`` and ``dense``
    holds each whole sequence's (q, k, v).
    """
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in seqs) + extra_blocks
    return paged_case(seqs, heads, kv_heads, dim, seed, num_blocks, nan_filled=True, dtype=dtype, device=device)


def dense_sdpa(dense, seqs, scale: float) -> torch.Tensor:
    """fp32 causal SDPA over each whole, unpaged sequence; rows of the new tokens only."""
    outs = []
    for (q, k, v), (cached, _) in zip(dense, seqs):
        group = q.shape[1] // k.shape[1]
        q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))
        k = k.repeat_interleave(group, dim=0)
        v = v.repeat_interleave(group, dim=0)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        outs.append(o.transpose(0, 1)[cached:])
    return torch.cat(outs)


def run_triton(seqs, heads, kv_heads, dim, *, dtype=torch.float32, device="cpu", seed=0):
    q, k, v, k_cache, v_cache, meta, dense = make_case(seqs, heads, kv_heads, dim, dtype=dtype,
                                                       device=device, seed=seed)
    backend = TritonAttentionBackend(device)
    backend.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = dim ** -0.5
    out = backend.forward(q, k_cache, v_cache, meta, scale)
    return out, dense_sdpa(dense, seqs, scale), (q, k_cache, v_cache, meta, scale)


def random_seqs(seed: int, n: int) -> list[tuple[int, int]]:
    g = torch.Generator().manual_seed(100 + seed)
    return [(int(torch.randint(0, 50, (1,), generator=g)),
             int(torch.randint(1, 20, (1,), generator=g))) for _ in range(n)]


# A fresh prefill, a decode row, a chunk after a prefix ending mid-block, a draft run after an
# exactly full block, and a query longer than one program's tile.
MIXED = [(0, 23), (37, 1), (19, 5), (16, 4), (0, 1), (3, 40)]


@interpreter
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (6, 2), (4, 1)])
def test_mixed_varlen_batch_fp32_matches_dense_sdpa(heads, kv_heads):
    out, ref, _ = run_triton(MIXED, heads, kv_heads, 16, seed=heads * 10 + kv_heads)
    assert out.shape == ref.shape and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@interpreter
@pytest.mark.parametrize("seed", range(2))
def test_random_varlen_batch_with_gqa_matches_dense_sdpa(seed):
    seqs = random_seqs(seed, 5)
    out, ref, _ = run_triton(seqs, 6, 3, 32, seed=seed)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@interpreter
def test_decode_batch_smollm_heads_matches_torch_reference():
    """SmolLM2's 9 query / 3 KV heads of dim 64; also equal to the torch reference backend."""
    seqs = [(0, 1), (15, 1), (16, 1), (70, 1), (33, 1)]
    out, ref, (q, k_cache, v_cache, meta, scale) = run_triton(seqs, 9, 3, 64, seed=3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    # The reference gathers whole blocks and masks afterwards, so it needs finite padding.
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    torch_out = TorchAttentionBackend().forward(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, torch_out, atol=2e-5, rtol=2e-5)


@interpreter
def test_head_dim_not_a_power_of_two_is_masked():
    out, ref, _ = run_triton([(5, 7), (20, 1)], 4, 2, 24, seed=5)
    assert out.shape[-1] == 24
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@interpreter
@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float16, 2e-3)])
def test_half_precision_inputs_accumulate_in_fp32(dtype, tol):
    seqs = [(21, 3), (0, 9), (40, 1)]
    out, ref, _ = run_triton(seqs, 4, 2, 32, dtype=dtype, seed=11)
    assert out.dtype == dtype
    # The oracle sees the same rounded inputs; only the output rounding and the order of the
    # fp32 sums differ.
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@interpreter
def test_small_tiles_cover_many_programs_and_kv_tiles():
    """block_q_rows/block_n at their minimum: many query tiles per sequence, one page per tile."""
    seqs = [(9, 30), (33, 2)]
    q, k, v, k_cache, v_cache, meta, dense = make_case(seqs, 2, 1, 16, seed=2)
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    out = paged_attention(q, k_cache, v_cache, meta, 0.25, block_q_rows=16, block_n=16)
    torch.testing.assert_close(out, dense_sdpa(dense, seqs, 0.25), atol=2e-5, rtol=2e-5)


@interpreter
def test_out_buffer_is_written_in_place():
    seqs = [(4, 3)]
    q, k, v, k_cache, v_cache, meta, dense = make_case(seqs, 2, 2, 16, seed=4)
    reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)
    buf = torch.zeros(5, 2, 16)
    ret = paged_attention(q, k_cache, v_cache, meta, 0.25, out=buf[1:4])
    assert ret.data_ptr() == buf[1:4].data_ptr()
    torch.testing.assert_close(buf[1:4], dense_sdpa(dense, seqs, 0.25), atol=2e-5, rtol=2e-5)
    assert buf[0].eq(0).all() and buf[4].eq(0).all()


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reshape_and_cache_writes_exactly_the_slots_from_strided_views(dtype):
    kv_heads, dim, tokens = 3, 8, 5
    qkv = torch.randn(tokens, (4 + 2 * kv_heads) * dim).to(dtype)  # fused projection output
    key = qkv[:, 4 * dim:(4 + kv_heads) * dim].view(tokens, kv_heads, dim)
    value = qkv[:, (4 + kv_heads) * dim:].view(tokens, kv_heads, dim)
    assert not key.is_contiguous()
    k_cache = torch.full((4, BLOCK, kv_heads, dim), -7.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, -7.0)
    slots = torch.tensor([17, 3, -1, 63, 16])  # -1: a padding token, skipped
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    want_k = torch.full_like(k_cache, -7.0).view(-1, kv_heads, dim)
    want_v = want_k.clone()
    keep = slots >= 0
    want_k[slots[keep]] = key[keep]
    want_v[slots[keep]] = value[keep]
    assert torch.equal(k_cache.view(-1, kv_heads, dim), want_k)
    assert torch.equal(v_cache.view(-1, kv_heads, dim), want_v)


@interpreter
def test_bad_inputs_raise_value_error():
    q, k, v, k_cache, v_cache, meta, _ = make_case([(3, 2)], 4, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        paged_attention(q[:, :3], k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(q.half(), k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match="dtypes"):
        reshape_and_cache(k.half(), v.half(), k_cache, v_cache, meta.slot_mapping)
    with pytest.raises(ValueError, match="rows"):
        paged_attention(q[:1], k_cache, v_cache, meta, 0.25)


def test_backend_without_triton_raises_runtime_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "triton" else real(name, *a))
    with pytest.raises(RuntimeError, match="triton is not installed"):
        TritonAttentionBackend("cuda")


def test_package_imports_without_triton():
    """In a fresh interpreter with triton hidden, ``import stencil.kernels.triton`` works and pulls in
    no kernel module."""
    script = ("import sys; sys.modules['triton'] = None\n"
              "import stencil.kernels.triton\n"
              "assert 'stencil.kernels.triton.paged_attention' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", script], check=True)


COMPILE_SCRIPT = """
import torch
from stencil.kernels.triton.aot import compile_paged_attention, compile_reshape_and_cache
from stencil.kernels.triton.paged_attention import launch_config
from stencil.kernels.triton.reshape_and_cache import reshape_and_cache

kv = torch.zeros(1, 1, 16)
cache = torch.zeros(1, 16, 1, 16)
try:
    reshape_and_cache(kv, kv, cache, cache, torch.zeros(1, dtype=torch.long))
except RuntimeError as e:
    assert "TRITON_INTERPRET=1" in str(e), e
else:
    raise SystemExit("a compiled kernel accepted CPU tensors")

for dtype, heads, kv_heads, dim, max_q in [(torch.bfloat16, 9, 3, 64, 1),
                                           (torch.bfloat16, 32, 8, 128, 300),
                                           (torch.float32, 8, 2, 64, 100)]:
    config = launch_config(dtype, heads, kv_heads, dim, 16, max_q, 8)
    kernel = compile_paged_attention(dtype, config, capability=90)
    assert kernel.asm["cubin"], config
compile_reshape_and_cache(torch.bfloat16, 8, 128, capability=90)
"""


def test_compiled_mode_refuses_cpu_and_kernels_compile_for_hopper():
    """Without the interpreter: a CPU launch says what to set, and the launch configurations
    of a decode batch, a long bf16 prefill and an fp32 batch compile to sm_90 cubins (Triton's
    type checks and code generation, which the interpreter skips)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], check=True, env=env)


# --- compiled on a GPU -------------------------------------------------------------------

GPU_SEQS = [(0, 300), (517, 1), (1000, 1), (129, 7), (64, 64), (0, 1), (2047, 4), (33, 200)]


@pytest.mark.gpu
@compiled_cuda
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2),
                                       (torch.float16, 3e-3)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (32, 8, 128), (16, 16, 64)])
def test_gpu_compiled_kernel_matches_dense_sdpa_and_torch_reference(dtype, tol, heads, kv_heads,
                                                                     dim):
    out, ref, (q, k_cache, v_cache, meta, scale) = run_triton(
        GPU_SEQS, heads, kv_heads, dim, dtype=dtype, device="cuda", seed=dim + heads)
    torch.testing.assert_close(out.float().cpu(), ref, atol=tol, rtol=tol)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    torch_out = TorchAttentionBackend("cuda").forward(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out.float(), torch_out.float(), atol=tol, rtol=tol)


@pytest.mark.gpu
@compiled_cuda
def test_gpu_reshape_and_cache_matches_index_copy():
    tokens, kv_heads, dim = 300, 8, 128
    key = torch.randn(tokens, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    value = torch.randn_like(key)
    k_cache = torch.zeros(64, BLOCK, kv_heads, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(64 * BLOCK, device="cuda")[:tokens]
    reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(-1, kv_heads, dim)[slots], key)
    assert torch.equal(v_cache.view(-1, kv_heads, dim)[slots], value)
