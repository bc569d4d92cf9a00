"""``stencil.kernels.layer_ops.rope_and_cache``: RoPE on q and k and the paged-cache write in one native
call, against the torch path it replaces (``apply_rope`` and ``index_copy_``): the same bits,
for fp32 and bf16 caches, strided q/k/v views of a fused QKV output, and bad slots refused.
``stencil.kernels.layer_ops.rms_norm``: against ``F.rms_norm`` and the exact fp64 norm, each row the same
bits alone or in a batch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from stencil.kernels import layer_ops
from stencil.kernels.torch_ref import TorchAttentionBackend

needs_kernel = pytest.mark.skipif(layer_ops.library() is None, reason="no C compiler (or STENCIL_NATIVE=0)")


def _case(t: int, heads: int, kv_heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim, generator=g) * 3
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q, k, v = q.view(t, heads, dim), k.view(t, kv_heads, dim), v.view(t, kv_heads, dim)
    angle = torch.rand(t, dim // 2, generator=g) * 100
    return q, k, v, angle.cos(), angle.sin()


WRITE = TorchAttentionBackend().reshape_and_cache  # the flat layout's write (the cpu backend inherits it)


def _torch_path(q, k, v, cos, sin, k_cache, v_cache, slots):
    q2, k2 = layer_ops.apply_rope(q, cos, sin), layer_ops.apply_rope(k, cos, sin)
    WRITE(k2, v, k_cache, v_cache, slots)
    return q2


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 9, 3, 64), (37, 4, 1, 256), (5, 2, 2, 6)])
def test_same_bits_as_the_torch_path(dtype, shape):
    t, heads, kv_heads, dim = shape
    q, k, v, cos, sin = _case(t, heads, kv_heads, dim, seed=t)
    slots = torch.randperm(8 * 16)[:t]
    caches = [torch.zeros(8, 16, kv_heads, dim, dtype=dtype) for _ in range(4)]
    want = _torch_path(q, k, v, cos, sin, caches[0], caches[1], slots)
    got = layer_ops.rope_and_cache(q, k, v, cos, sin, caches[2], caches[3], slots, WRITE)
    assert torch.equal(got, want) and got.is_contiguous()
    for a, b in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert torch.equal(a.view(torch.int32 if dtype == torch.float32 else torch.int16),
                           b.view(torch.int32 if dtype == torch.float32 else torch.int16))  # bit for bit
    assert bool(caches[2].flatten(0, 1)[slots].ne(0).any())


@needs_kernel
def test_fp16_cache_writes_round_as_torch_rounds_at_every_edge():
    """Subnormals, ties, the largest half, overflow to infinity, signed zeros, NaN: each value
    written to an fp16 cache is torch's ``.to(torch.float16)`` of it, bit for bit."""
    edges = torch.tensor([0.0, -0.0, 1.0, -1.5, 65504.0, 65519.0, 65520.0, -70000.0, float("inf"), float("-inf"),
                          2.0 ** -14, 2.0 ** -24, 2.0 ** -25, 3 * 2.0 ** -26, 2.0 ** -25 * 1.0001, 5.96e-8, 6.1e-5,
                          1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 1e-40, -3e-6, 0.1, 1000.06, 2049.0, 4095.5])
    values = torch.cat([edges, torch.randn(999) * torch.logspace(-9, 5, 999)])
    n = values.numel() // 8 * 8
    v = values[:n].reshape(n // 8, 1, 8)
    q, k, _, cos, sin = _case(n // 8, 1, 1, 8, seed=3)
    caches = [torch.zeros(n // 8, 1, 1, 8, dtype=torch.float16) for _ in range(2)]
    layer_ops.rope_and_cache(q, k, v, cos, sin, *caches, torch.arange(n // 8), WRITE)
    assert torch.equal(caches[1].view(torch.int16).flatten(), v.to(torch.float16).view(torch.int16).flatten())
    nan = v.clone()
    nan[0, 0, 0] = float("nan")
    layer_ops.rope_and_cache(q, k, nan, cos, sin, *caches, torch.arange(n // 8), WRITE)
    assert bool(caches[1][0, 0, 0, 0].isnan())


@needs_kernel
def test_a_nan_stays_a_nan_in_a_bf16_cache():
    q, k, v, cos, sin = _case(1, 1, 1, 8, seed=2)
    v[0, 0, 3] = float("nan")
    caches = [torch.zeros(1, 16, 1, 8, dtype=torch.bfloat16) for _ in range(2)]
    layer_ops.rope_and_cache(q, k, v, cos, sin, *caches, torch.tensor([4]), WRITE)
    assert bool(caches[1][0, 4, 0, 3].isnan()) and torch.equal(caches[1][0, 4, 0, :3], v[0, 0, :3].bfloat16())


@needs_kernel
def test_a_slot_outside_the_cache_is_refused_and_other_backends_write_themselves():
    q, k, v, cos, sin = _case(2, 2, 1, 8, seed=3)
    caches = [torch.zeros(2, 16, 1, 8) for _ in range(2)]
    with pytest.raises(IndexError, match="outside"):
        layer_ops.rope_and_cache(q, k, v, cos, sin, *caches, torch.tensor([0, 32]), WRITE)
    written = []
    got = layer_ops.rope_and_cache(q, k, v, cos, sin, *caches, torch.tensor([0, 1]),
                                   lambda *a: written.append(a), flat_cache=False)
    assert torch.equal(got, layer_ops.apply_rope(q, cos, sin)) and len(written) == 1
    assert torch.equal(written[0][0], layer_ops.apply_rope(k, cos, sin)) and not bool(caches[0].any())


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 640), (37, 576), (3, 4, 256), (2, 5, 13)])
def test_rms_norm_is_torchs_up_to_the_order_of_its_sum(shape):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(*shape, generator=g) * 4
    w = torch.randn(shape[-1], generator=g)
    got = layer_ops.rms_norm(x, w, 1e-6)
    exact = x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6) * w.double()
    # both round each product once; only the sum of squares (an ulp or so of r) may differ
    assert (got.double() - exact).abs().max() <= 4e-7 * exact.abs().max()
    assert torch.allclose(got, F.rms_norm(x, w.shape, w, eps=1e-6), rtol=1e-6, atol=1e-6)


@needs_kernel
def test_rms_norm_of_a_row_never_depends_on_the_batch_and_reads_strided_heads():
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(40, 6 * 256, generator=g)
    q = qkv[:, : 4 * 256].view(40, 4, 256)  # rows of a fused projection: x[t] is one block
    w = torch.randn(256, generator=g)
    whole = layer_ops.rms_norm(q, w, 1e-6)  # 40 rows x 4 heads: the threaded path
    assert whole.is_contiguous() and whole.shape == q.shape
    assert torch.equal(whole, layer_ops.rms_norm(q.contiguous(), w, 1e-6))
    for t in (0, 17, 39):
        assert torch.equal(whole[t:t + 1], layer_ops.rms_norm(q[t:t + 1], w, 1e-6))


def test_rms_norm_falls_back_to_torch_where_the_kernel_does_not_apply():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 64, generator=g)
    w = torch.randn(64, generator=g)
    cols = x.t()  # rows not contiguous blocks
    assert torch.equal(layer_ops.rms_norm(cols, w[:8], 1e-5), F.rms_norm(cols, (8,), w[:8], eps=1e-5))
    xb, wb = x.to(torch.bfloat16), w.to(torch.bfloat16)
    assert torch.equal(layer_ops.rms_norm(xb, wb, 1e-5), F.rms_norm(xb, (64,), wb, eps=1e-5))


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_glu_is_torchs_activation_times_up_within_a_few_ulp(kind):
    g = torch.Generator().manual_seed(5)
    gate_up = torch.randn(9, 2 * 300, generator=g) * 4  # 300: a tail past whole 8-lane groups
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -100.0, 100.0, 90.0, -90.0, 3.0])
    ours = layer_ops.glu(gate_up, kind)
    gate, up = gate_up.double().chunk(2, dim=-1)
    act = F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")
    want = act * up
    assert ours.shape == (9, 300) and ours.dtype == torch.float32
    # within 1e-6 of |gate * up| (torch's own fp32 is within 2e-7 here); exact zeros stay zero
    assert float(((ours.double() - want).abs() / (gate * up).abs().clamp_min(1e-30)).max()) < 1e-6
    assert ours[0, 0] == 0 and ours[0, 1] == 0


@pytest.mark.parametrize("kind", ["silu", "gelu_tanh"])
def test_glu_bits_depend_on_the_value_alone(kind):
    """The same (gate, up) pair gives the same bits at any column, in any row and batch, from a
    strided view of a wider projection (the C decoder's padded output) or a contiguous one."""
    g = torch.Generator().manual_seed(6)
    gate, up = torch.randn(1, 37, generator=g) * 3, torch.randn(1, 37, generator=g)
    one = layer_ops.glu(torch.cat([gate, up], 1), kind)
    perm = torch.randperm(37, generator=g)
    wide = torch.zeros(20, 90)
    wide[11, :74] = torch.cat([gate[:, perm], up[:, perm]], 1)[0]
    many = layer_ops.glu(wide[:, :74], kind)  # row stride 90
    assert torch.equal(many[11], one[0, perm])
    with pytest.raises(ValueError, match="unknown gated activation"):
        layer_ops.glu(wide, "relu")
