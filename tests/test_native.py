"""The native int4 kernel (kernels/native.py, kernels/csrc/int4_gemm.c) against exact fp64
products of the weights it packs, and its batch invariance over every register-tile shape."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kernels import native

pytestmark = pytest.mark.skipif(not native.available(),
                                reason="native int4 kernel needs a C compiler and AVX512-BF16")


def _packed(planes: int, n: int, k: int, seed: int) -> tuple[native.PackedInt4, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (planes, n, k), generator=g, dtype=torch.uint8)
    scales = torch.rand(planes, n, k // 32, generator=g) * 0.05
    zeros = torch.randn(planes, n, k // 32, generator=g) * 0.02
    w = ((codes.double() - 8) * scales.double().repeat_interleave(32, -1)
         + zeros.double().repeat_interleave(32, -1)).sum(0)
    return native.PackedInt4(codes, scales, zeros), w


@pytest.mark.parametrize("planes", [1, 2])
def test_packing_round_trips_the_weight(planes):
    pk, w = _packed(planes, 40, 96, seed=1)  # 40 columns: padded to 48 with exact zeros
    got = pk.dequantize()
    assert got.shape == (48, 96)
    # Exact up to the planes' zeros, which are added in fp32 when packing (one rounding).
    assert torch.allclose(got[:40], w, rtol=0, atol=1e-8) and torch.equal(got[40:], torch.zeros(8, 96))


@pytest.mark.parametrize("planes", [1, 2])
def test_every_row_count_matches_fp64_and_each_row_alone(planes):
    """1..30 rows cover every tile (1-12 rows of one plane, 1-8 of two, wide and narrow column
    groups, the tail of column blocks) and several row chunks."""
    pk, w = _packed(planes, 80, 128, seed=2)  # 5 column blocks: wide groups leave a tail
    x = torch.randn(30, 128).bfloat16()
    full = pk.matmul(x)
    ref = x.double() @ w.T
    scale = x.double().abs() @ w.abs().T
    assert bool(((full[:, :80].double() - ref).abs() <= 136 * 2.0 ** -24 * scale + 1e-12).all())
    alone = torch.cat([pk.matmul(x[i:i + 1]) for i in range(30)])
    assert torch.equal(full, alone)
    for m in range(1, 30):
        assert torch.equal(pk.matmul(x[:m]), full[:m]), m


def test_chosen_column_blocks_and_threads_give_the_same_bits():
    pk, _ = _packed(2, 256, 64, seed=3)
    x = torch.randn(13, 64).bfloat16()
    full = pk.matmul(x)
    for blocks in ([0], [15], [3, 1], [0, 5, 6, 7, 9]):
        b = torch.tensor(blocks)
        cols = (b[:, None] * 16 + torch.arange(16)).flatten()
        assert torch.equal(pk.matmul(x, b), full[:, cols])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(pk.matmul(x), full)
    finally:
        torch.set_num_threads(before)


def test_refuses_bad_shapes():
    with pytest.raises(ValueError, match="K % 32"):
        native.PackedInt4(torch.zeros(1, 16, 48, dtype=torch.uint8), torch.zeros(1, 16, 1), torch.zeros(1, 16, 1))
    with pytest.raises(ValueError, match="planes"):
        native.PackedInt4(torch.zeros(3, 16, 32, dtype=torch.uint8), torch.zeros(3, 16, 1), torch.zeros(3, 16, 1))


def test_switched_off_by_environment():
    code = "from kernels import native; print(native.available())"
    env = {**os.environ, "STENCIL_NATIVE": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert out.stdout.strip() == "False"
