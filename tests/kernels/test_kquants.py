"""GGUF block readers (engine/models/kquants.py) against gguf-py's dequantize, bit for bit, and
the block GEMM (kernels/ggml_blocks.py, csrc/gguf_gemm.c) and layers (engine/models/gguf_layers.py)
against exact fp64 products, with their batch invariance, on random valid blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize

from stencil.engine.models import gguf_layers, kquants, quant
from stencil.kernels import ggml_blocks, native

TYPES = sorted(kquants.QUANT_TYPES)
HALF_FIELDS = {"Q4_0": [0], "Q4_1": [0, 2], "Q5_0": [0], "Q5_1": [0, 2], "Q8_0": [0], "Q4_K": [0, 2],
               "Q5_K": [0, 2], "Q6_K": [208]}  # byte offsets of each block's fp16 fields
needs_kernel = pytest.mark.skipif(not ggml_blocks.available(), reason="the GGUF block kernel needs a C compiler")


def random_blocks(qtype: str, n: int, k: int, seed: int, scale: float = 0.01) -> np.ndarray:
    """uint8 ``[n, row_bytes]``: random bytes, fp16 fields finite (normal ``* scale``)."""
    rng = np.random.default_rng(seed)
    weights, nbytes = kquants.BLOCK_SHAPES[qtype]
    raw = rng.integers(0, 256, (n, k // weights, nbytes), dtype=np.uint8)
    for at in HALF_FIELDS[qtype]:
        h = (rng.standard_normal((n, k // weights)) * scale).astype(np.float16)
        raw[..., at:at + 2] = h.view(np.uint8).reshape(n, k // weights, 2)
    return raw.reshape(n, -1)


def reference(qtype: str, raw: np.ndarray) -> np.ndarray:
    return gguf_dequantize(raw, GGMLQuantizationType[qtype]).reshape(raw.shape[0], -1)


@pytest.mark.parametrize("qtype", TYPES)
@pytest.mark.parametrize("scale", [1e-6, 0.01, 300.0])  # fp16 subnormals, typical, large
def test_reader_equals_gguf_dequantize_bit_for_bit(qtype, scale):
    raw = random_blocks(qtype, 6, 512, seed=hash((qtype, scale)) % 1000, scale=scale)
    ref = reference(qtype, raw)
    got = kquants.dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == (6, 512)
    assert np.array_equal(got.view(np.uint32), ref.view(np.uint32))
    # the kernel's form (codes, scales, offsets) is the same weight, up to gguf's one fp32 rounding
    exact = kquants.units(raw, qtype).dequantize()
    assert np.all(np.abs(exact - ref) <= 2.0 ** -24 * np.abs(ref))


def test_reader_refuses_unknown_types_and_partial_blocks():
    with pytest.raises(ValueError, match="unsupported GGUF tensor type IQ2_XS; supported: .*Q4_K"):
        kquants.dequantize(np.zeros((1, 66), np.uint8), "IQ2_XS")
    with pytest.raises(ValueError, match="whole 144-byte blocks"):
        kquants.dequantize(np.zeros((1, 100), np.uint8), "Q4_K")
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q2_K; supported: BF16, F16, F32, Q4_0"):
        gguf_layers.linear_from_gguf("Q2_K", np.zeros((2, 84), np.uint8), 256)


@needs_kernel
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_rows_equal_gguf_dequantize_bit_for_bit(qtype):
    raw = random_blocks(qtype, 9, 768, seed=3, scale=0.5)
    ref = reference(qtype, raw)
    rows = torch.tensor([8, 0, 3, 3])
    got = ggml_blocks.dequantize_rows(qtype, torch.from_numpy(raw), 768, rows).numpy()
    assert np.array_equal(got.view(np.uint32), ref[rows.numpy()].view(np.uint32))


@needs_kernel
@pytest.mark.parametrize("group", [32, 256])
def test_activations_are_the_two_term_reference(group):
    x = torch.randn(5, 512) * torch.logspace(-3, 2, 512)  # groups of very different ranges
    x[1, :64] = 0.0  # an all-zero group: step 0
    a = ggml_blocks.quantize(x, group)
    ref = ggml_blocks.reference_activations(x, group)
    dx = a.dx.repeat_interleave(32, dim=1)[:, :512].double()
    assert torch.equal(dx * (256 * a.q1.double() + a.q2.double()), ref)  # the same arithmetic
    amax = x.abs().reshape(5, -1, group).amax(-1).repeat_interleave(group, 1).double()
    assert bool(((ref - x.double()).abs() <= amax / 32512 * (1 + 2**-10)).all())  # the stated bound
    if group == 256:  # k-quants: the exact integer sums of 16 activations, in units of dx
        units = 256 * a.q1.to(torch.int32) + a.q2.to(torch.int32)
        assert torch.equal(a.x16, units.reshape(5, 32, 16).sum(-1))
        return
    halves = x.reshape(5, 32, 2, 8)
    v = halves[:, :, 0] + halves[:, :, 1]  # the sums of 16 inputs in the kernel's order, in fp32
    seq = ((v[..., 0] + v[..., 4]) + (v[..., 2] + v[..., 6])) + ((v[..., 1] + v[..., 5]) + (v[..., 3] + v[..., 7]))
    assert torch.equal(a.x16[:, :32], seq)


def exact_and_bound(qtype: str, raw: np.ndarray, x: torch.Tensor, terms: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    """The target product (fp64, W from gguf) and the module docstring's bound: with two terms
    ``x @ W.T`` itself; with one, llama.cpp's ``xq @ W.T`` of the quantized activations
    ``xq = reference_activations(x, group, 1)``, within fp32 rounding."""
    w = torch.from_numpy(reference(qtype, raw)).double()
    u = kquants.units(raw, qtype)
    group = kquants.BLOCK_SHAPES[qtype][0]
    k = x.shape[1]
    xh = ggml_blocks.reference_activations(x, group, terms)
    cs = torch.from_numpy(u.codes * np.repeat(u.scales.astype(np.float64), 16, axis=1)).abs()
    z = torch.from_numpy(u.offsets).double().abs()
    rounding = 2.0 ** -24 * (k / 32 + 16)
    if terms == 1:
        x16 = xh.abs().reshape(x.shape[0], -1, 16).sum(-1)
        bound = rounding * (xh.abs() @ cs.T + 2 * x16 @ z.T) + 2.0 ** -24 * (xh.abs() @ w.abs().T)
        return xh @ w.T, bound
    amax = x.abs().reshape(x.shape[0], -1, group).amax(-1).repeat_interleave(group, 1).double()
    x16 = x.double().reshape(x.shape[0], -1, 16).sum(-1).abs()
    bound = ((amax / 32512) @ cs.T + rounding * (xh.abs() @ cs.T + x16 @ z.T)
             + 2.0 ** -24 * (x.double().abs() @ w.abs().T))
    if group == 256:  # k-quants: the offsets meet the quantized activations too (16 inputs a z)
        bound = bound + (16 * amax.reshape(x.shape[0], -1, 16)[..., 0] / 32512) @ z.T
    return x.double() @ w.T, bound


@needs_kernel
@pytest.mark.parametrize("terms", [2, 1])
@pytest.mark.parametrize("qtype", TYPES)
def test_gemm_within_bound_of_exact_product(qtype, terms):
    k = 1280 if qtype.endswith("_K") else 640  # 640: a last span of 4 blocks (Gemma 3's hidden size)
    raw = random_blocks(qtype, 37, k, seed=5)
    x = torch.randn(11, k) * 3
    x[2] *= 1e-4  # a row of tiny activations
    y = ggml_blocks.gemm(qtype, torch.from_numpy(raw), ggml_blocks.quantize(x, ggml_blocks.BLOCKS[qtype][1], terms=terms))
    exact, bound = exact_and_bound(qtype, raw, x, terms)
    err = (y.double() - exact).abs()
    assert bool((err <= bound).all()), float((err / bound).max())
    assert float(err.max()) > 0  # not trivially exact: the bound is what is tested


@needs_kernel
@pytest.mark.parametrize("terms", [2, 1])
@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q8_0"])
def test_each_row_gets_the_same_bits_at_any_row_count_columns_and_threads(qtype, terms):
    raw = torch.from_numpy(random_blocks(qtype, 70, 512, seed=7))
    group = ggml_blocks.BLOCKS[qtype][1]
    x = torch.randn(41, 512)  # 41 rows: a full row block of 32 and tiles of 4, 4 and 1
    whole = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, group, terms=terms), threads=2)
    for rows in ([0], [40], [3, 4, 5], list(range(9)), list(range(33))):
        part = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x[rows], group, terms=terms), threads=1)
        assert torch.equal(part, whole[rows])
    # one at a time, eight at once, sixteen and eight (the k-quants' column paths at many rows)
    for cols in (torch.tensor([69, 2, 2, 31]), torch.arange(8) + 3, torch.arange(24).flip(0)):
        assert torch.equal(ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, group, terms=terms), cols),
                           whole[:, cols])


@needs_kernel
@pytest.mark.parametrize("terms", [2, 1])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"])
def test_block_types_at_many_rows_get_the_bits_of_one_row(qtype, terms):
    """The 32-weight types from four rows on read sixteen transposed columns at once (blocks16,
    AVX512-VNNI builds): Gemma 3's 640 inputs (two spans and a half: the last span's missing units),
    37 columns (two groups of sixteen and five), row counts on both sides of the threshold and two
    threads must give every output the bits of its row alone, one column at a time."""
    k = 640
    raw = torch.from_numpy(random_blocks(qtype, 37, k, seed=5))
    x = torch.randn(35, k) * 4
    whole = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, 32, terms=terms), threads=2)
    for r in (0, 17, 34):
        one = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x[r:r + 1], 32, terms=terms), threads=1)
        assert torch.equal(one, whole[r:r + 1])
    for rows in (range(3), range(4), range(5, 14)):
        part = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x[list(rows)], 32, terms=terms), threads=1)
        assert torch.equal(part, whole[list(rows)])
    cols = torch.tensor([36, 0, 0, 19, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 30])  # sixteen and one
    assert torch.equal(ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, 32, terms=terms), cols), whole[:, cols])


@needs_kernel
@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_long_rows_get_the_same_bits_from_every_path(qtype):
    """Rows of more than 16 spans (4,096 weights) take their own few-row order (Q6_K's span by span,
    Q4_K's prefetches between its loops): a decode row's bits must still be those of the same row in
    a batch (the sixteen-column path) and of one column at a time."""
    k = 18 * 256
    raw = torch.from_numpy(random_blocks(qtype, 27, k, seed=3))  # 27: sixteen, eight and three columns
    x = torch.randn(6, k)
    whole = ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x, 256))
    for r in range(6):
        assert torch.equal(ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x[r:r + 1], 256)), whole[r:r + 1])
    cols = torch.tensor([26, 5, 9])
    assert torch.equal(ggml_blocks.gemm(qtype, raw, ggml_blocks.quantize(x[:1], 256), cols), whole[:1, cols])


def _cpu_flags() -> set[str]:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@needs_kernel
@pytest.mark.parametrize("isa", ["plain", "avx2"])
def test_other_isa_builds_give_the_same_bits_as_this_build(isa, tmp_path, monkeypatch):
    """The ISA paths differ only in how they compute exact integer dot products (and which of the
    k-quant column paths they have), so a build for a baseline x86-64 (plain C) or for AVX2 alone
    must give this build's bits, at one row (a decode step) and at six (a prompt)."""
    import ctypes
    import shutil

    if isa == "avx2" and not {"avx2", "fma", "f16c"} <= _cpu_flags():
        pytest.skip("this CPU runs no AVX2 build")
    monkeypatch.setenv("STENCIL_CACHE_DIR", str(tmp_path))
    march = ["-march=x86-64"] if isa == "plain" else ["-march=x86-64", "-mavx2", "-mfma", "-mf16c"]
    flags = [f for f in ggml_blocks._FLAGS if f not in ("-march=native", "-O3")] + ["-O1", *march]
    other = ctypes.CDLL(str(native._build([shutil.which("cc") or "gcc"], [ggml_blocks.SOURCE], flags, isa)))
    assert other.stencil_gguf_isa() == (0 if isa == "plain" else 1)
    lib = ggml_blocks.library()
    other.stencil_gguf_gemm.argtypes = lib.stencil_gguf_gemm.argtypes
    cases = [(512, q, t) for q, t in (("Q4_K", 2), ("Q5_K", 2), ("Q6_K", 2), ("Q5_0", 2), ("Q8_0", 2), ("Q4_1", 2),
                                      ("Q5_1", 2), ("Q4_K", 1), ("Q8_0", 1), ("Q4_0", 1))]
    cases += [(18 * 256, "Q4_K", 2), (18 * 256, "Q6_K", 2)]  # long rows: the few-row paths span by span
    for rows in (1, 6):
        for k, qtype, terms in cases:
            x = torch.randn(rows, k)
            raw = torch.from_numpy(random_blocks(qtype, 20, k, seed=11))  # 20: eight-column groups and a rest
            group = ggml_blocks.BLOCKS[qtype][1]
            a = ggml_blocks.quantize(x, group, terms=terms)
            want = ggml_blocks.gemm(qtype, raw, a)
            y = torch.empty_like(want)
            assert other.stencil_gguf_gemm(ggml_blocks.BLOCKS[qtype][0], raw.data_ptr(), raw.shape[1], k, None, 20,
                                           group, *a.pointers(), rows, y.data_ptr(), 20, 1) == 0
            assert torch.equal(y, want), (qtype, terms, rows, k)


@needs_kernel
def test_fused_layer_of_mixed_types_equals_its_parts_and_columns_equal_forward():
    k = 512
    parts = [("Q4_K", 96), ("Q6_K", 32), ("Q8_0", 48)]  # q, k, v of different types
    raws = [random_blocks(t, n, k, seed=i) for i, (t, n) in enumerate(parts)]
    biases = [torch.randn(n) for _, n in parts]
    layers = [gguf_layers.linear_from_gguf(t, r, k, b) for (t, _), r, b in zip(parts, raws, biases)]
    fused = quant.fuse(*layers)
    assert fused.out_features == 176 and fused.padded_out_features == 192
    assert fused.nbytes() == sum(r.nbytes for r in raws)  # the file's bytes, nothing more
    x = torch.randn(5, k)
    y = fused(x)
    assert torch.equal(y, torch.cat([la(x) for la in layers], dim=1))
    cols = fused.forward_columns(x[1:2], torch.tensor([2, 0]))
    assert torch.equal(cols[:, :48], y[1:2, 128:176]) and not bool(cols[:, 48:64].any())
    assert torch.equal(cols[:, 64:], y[1:2, :64])


@needs_kernel
def test_fused_neighbours_of_one_type_become_one_part_with_the_same_bits():
    k = 512
    parts = [("Q5_0", 64), ("Q5_0", 32), ("Q8_0", 32), ("Q5_0", 16)]  # q, k of one type; v; another
    raws = [random_blocks(t, n, k, seed=10 + i) for i, (t, n) in enumerate(parts)]
    layers = [gguf_layers.linear_from_gguf(t, r, k) for (t, _), r in zip(parts, raws)]
    fused = quant.fuse(*layers)
    assert fused.qtypes == ["Q5_0", "Q8_0", "Q5_0"] and [p.stop for p in fused.parts] == [96, 128, 144]
    assert fused.nbytes() == sum(r.nbytes for r in raws)
    x = torch.randn(3, k)
    assert torch.equal(fused(x), torch.cat([la(x) for la in layers], dim=1))
    pair = quant.fuse(layers[0], layers[1])  # one part: the single-part path
    assert pair.qtypes == ["Q5_0"] and torch.equal(pair(x), torch.cat([layers[0](x), layers[1](x)], dim=1))


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_0", "F16"])
def test_torch_fallback_within_fp32_rounding_of_exact(qtype):
    k, n = 512, 40
    if qtype == "F16":
        raw = np.random.default_rng(0).standard_normal((n, k)).astype(np.float16)
        w = torch.from_numpy(raw.astype(np.float64))
    else:
        raw = random_blocks(qtype, n, k, seed=2)
        w = torch.from_numpy(reference(qtype, raw)).double()
    layer = gguf_layers.linear_from_gguf(qtype, raw, k, native=False)
    x = torch.randn(3, k)
    err = (layer(x).double() - x.double() @ w.T).abs()
    assert bool((err <= (k + 2) * 2.0 ** -24 * (x.double().abs() @ w.abs().T)).all())


@pytest.mark.parametrize("native_rows", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q6_K", "Q4_K"])
def test_embedding_rows_bit_exact_and_tied_head_shares_the_bytes(qtype, native_rows):
    raw = random_blocks(qtype, 50, 256, seed=4)
    emb = quant.embedding_from_gguf(qtype, raw, 256, native=native_rows)
    ids = torch.tensor([[3, 49, 3], [0, 7, 7]])
    got = emb(ids)
    assert got.shape == (2, 3, 256)
    assert np.array_equal(got.reshape(-1, 256).numpy().view(np.uint32),
                          reference(qtype, raw)[ids.flatten().numpy()].view(np.uint32))
    with pytest.raises(IndexError):
        emb(torch.tensor([50]))
    head = gguf_layers.tied_lm_head(emb)
    assert head.parts[0].data.data_ptr() == emb.data.data_ptr() and head.out_features == 50
