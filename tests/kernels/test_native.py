"""The native int4 kernels (kernels/native.py: csrc/int4_gemm.c with bf16 activations,
csrc/vnni_gemm.c with int8 activations) against exact fp64 products of the weights they pack,
and their batch invariance over every register-tile shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from stencil.kernels import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native int4 kernel needs a C compiler and AVX512-BF16")


VNNI = [False, pytest.param(True, marks=pytest.mark.skipif(not native.vnni_available(),
                                                          reason="the int8-activation kernel needs AVX512-VNNI"))]


def _packed(planes: int, n: int, k: int, seed: int, vnni: bool = False) -> tuple[native.PackedInt4, torch.Tensor]:
    """``planes`` 1 or 2 random int4 planes, or 0: GGUF Q8_0's split of random int8 codes."""
    g = torch.Generator().manual_seed(seed)
    if planes == 0:
        q = torch.randint(-128, 128, (n, k), generator=g)
        d = torch.rand(n, k // 32, generator=g) * 0.01
        codes = torch.stack([(q + 128) // 16, (q + 128) % 16]).to(torch.uint8)
        scales, zeros = torch.stack([16 * d, d]), torch.stack([8 * d, torch.zeros_like(d)])
    else:
        codes = torch.randint(0, 16, (planes, n, k), generator=g, dtype=torch.uint8)
        scales = torch.rand(planes, n, k // 32, generator=g) * 0.05
        zeros = torch.randn(planes, n, k // 32, generator=g) * 0.02
    w = ((codes.double() - 8) * scales.double().repeat_interleave(32, -1)
         + zeros.double().repeat_interleave(32, -1)).sum(0)
    return native.PackedInt4(codes, scales, zeros, vnni=vnni), w


def _reference(pk: native.PackedInt4, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel computes in exact arithmetic, fp64 ``[M, N_padded]``, and the sum of
    absolute terms its fp32 rounding is bounded by."""
    w = pk.dequantize()
    if not pk.vnni:
        xb = x.bfloat16().double()
        return xb @ w.T, xb.abs() @ w.abs().T
    xh = native.reference_activations(x)  # the quantized activations meet the codes
    zeros = torch.zeros_like(w)  # and the fp32 sums of x meet the zeros
    if pk.planes == 1:
        zeros = pk.zeros.transpose(1, 2).reshape(w.shape[0], -1).double().repeat_interleave(32, -1)
    return (xh @ w.T + (x.double() - xh) @ zeros.T,
            xh.abs() @ w.abs().T + x.double().abs() @ zeros.abs().T)


@pytest.mark.parametrize("vnni", VNNI)
@pytest.mark.parametrize("planes", [0, 1, 2])
def test_packing_round_trips_the_weight(planes, vnni):
    pk, w = _packed(planes, 40, 96, seed=1, vnni=vnni)  # 40 columns: padded to 48 with exact zeros
    assert pk.vnni == (vnni and planes < 2)  # two planes that are not Q8_0 keep the bf16 kernel
    got = pk.dequantize()
    assert got.shape == (48, 96)
    # Exact up to the planes' zeros, which are added in fp32 when packing (one rounding; the
    # VNNI layout folds the codes' offset of 8 into the zero, so |zero| grows to ~0.4).
    atol = 1e-7 if pk.vnni else 1e-8
    assert torch.allclose(got[:40], w, rtol=0, atol=atol) and torch.equal(got[40:], torch.zeros(8, 96))


@pytest.mark.parametrize("vnni", VNNI)
@pytest.mark.parametrize("planes", [0, 1, 2])
def test_every_row_count_matches_fp64_and_each_row_alone(planes, vnni):
    """1..30 rows cover every tile (bf16: 1-12 rows of one plane, 1-8 of two; VNNI: 1-8 rows),
    wide and narrow column groups, the tail of column blocks, and several row chunks."""
    pk, w = _packed(planes, 80, 128, seed=2, vnni=vnni)  # 5 column blocks: wide groups leave a tail
    x = torch.randn(30, 128)
    if not pk.vnni:
        x = x.bfloat16()
    full = pk.matmul(x)
    ref, scale = _reference(pk, x.float())
    assert bool(((full[:, :80].double() - ref[:, :80]).abs() <= 136 * 2.0 ** -24 * scale[:, :80] + 1e-12).all())
    # The kernel really is that close to the layer's own weight: within the activations'
    # rounding (bf16: 2^-8 relative; VNNI: a group's max / 32512) of x @ W.T.
    exact = x.double() @ w.T
    tol = 2.0 ** -8 if not pk.vnni else 1 / 32512 * 32
    assert bool(((full[:, :80].double() - exact).abs() <= tol * x.double().abs() @ w.abs().T + 1e-9).all())
    alone = torch.cat([pk.matmul(x[i:i + 1]) for i in range(30)])
    assert torch.equal(full, alone)
    for m in range(1, 30):
        assert torch.equal(pk.matmul(x[:m]), full[:m]), m


@pytest.mark.parametrize("vnni", VNNI)
def test_chosen_column_blocks_and_threads_give_the_same_bits(vnni):
    pk, _ = _packed(0 if vnni else 2, 256, 64, seed=3, vnni=vnni)
    x = torch.randn(13, 64)
    if not vnni:
        x = x.bfloat16()
    full = pk.matmul(x)
    for blocks in ([0], [15], [3, 1], [0, 5, 6, 7, 9]):
        b = torch.tensor(blocks)
        cols = (b[:, None] * 16 + torch.arange(16)).flatten()
        assert torch.equal(pk.matmul(x, b), full[:, cols])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.equal(pk.matmul(x), full)
            assert torch.equal(pk.matmul(torch.cat([x] * 2)), torch.cat([full] * 2))  # 26 rows: parallel quantization
    finally:
        torch.set_num_threads(before)


def test_refuses_bad_shapes():
    with pytest.raises(ValueError, match="K % 32"):
        native.PackedInt4(torch.zeros(1, 16, 48, dtype=torch.uint8), torch.zeros(1, 16, 1), torch.zeros(1, 16, 1))
    with pytest.raises(ValueError, match="planes"):
        native.PackedInt4(torch.zeros(3, 16, 32, dtype=torch.uint8), torch.zeros(3, 16, 1), torch.zeros(3, 16, 1))


@pytest.mark.parametrize(("variable", "printed"), [("STENCIL_NATIVE", "False False"),
                                                   ("STENCIL_VNNI", "True False")])
def test_switched_off_by_environment(variable, printed):
    code = "from stencil.kernels import native; print(native.available(), native.vnni_available())"
    env = {**os.environ, variable: "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.stdout.strip() == printed


@pytest.mark.skipif(not native.vnni_available(), reason="the int8-activation kernel needs AVX512-VNNI")
def test_q8_packing_in_chunks_and_rows_read_back(monkeypatch):
    whole, w = _packed(0, 70, 96, seed=4, vnni=True)  # 70 columns: 5 column blocks, the last padded
    monkeypatch.setattr(native, "_PACK_CHUNK", 2)  # 3 chunks of column blocks, the last one short
    chunked, _ = _packed(0, 70, 96, seed=4, vnni=True)
    assert torch.equal(chunked.codes, whole.codes) and torch.equal(chunked.zeros, whole.zeros)
    assert whole.holds_q8_rows
    ids = torch.tensor([0, 69, 16, 15, 33, 33])
    # rows read back from the packed bytes are the weight's rows exactly (q times fp32 d)
    assert torch.equal(whole.rows(ids), w[ids].float())  # the exact product, rounded once
    one_plane, _ = _packed(1, 32, 64, seed=5, vnni=True)
    assert not one_plane.holds_q8_rows
    with pytest.raises(ValueError, match="Q8_0"):
        one_plane.rows(ids[:1])
