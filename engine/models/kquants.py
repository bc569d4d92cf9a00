"""Readers for GGUF's quantized blocks, in numpy: the 32-weight types and the k-quants.

Layouts (llama.cpp's ``ggml/src/ggml-common.h``; fp16 fields little-endian), per block of
one weight row:

* ``Q4_0`` (18 bytes / 32): ``d``, 16 bytes of nibbles (low: weights 0-15, high: 16-31);
  ``w = d (q - 8)``. ``Q4_1`` (20): ``d, m``, nibbles; ``w = d q + m``.
* ``Q5_0`` (22): ``d``, ``qh`` (uint32, bit i the 5th bit of weight i), nibbles;
  ``w = d (q - 16)``. ``Q5_1`` (24): ``d, m, qh``, nibbles; ``w = d q + m``.
* ``Q8_0`` (34): ``d``, 32 int8; ``w = d q``.
* ``Q4_K`` (144 / 256): ``d, dmin``, 12 bytes of 6-bit scales ``sc`` and mins ``m`` of 8
  sub-blocks of 32 (``get_scale_min_k4``), 128 bytes of nibbles: bytes ``32 i .. 32 i + 31``
  hold sub-block ``2 i`` in their low nibbles and ``2 i + 1`` in their high ones;
  ``w = (d sc) q - dmin m``.
* ``Q5_K`` (176): as Q4_K with ``qh`` (32 bytes) before the nibbles: bit ``j`` of ``qh[l]`` is
  the 5th bit of weight ``l`` of sub-block ``j``.
* ``Q6_K`` (210): ``ql`` (128 bytes), ``qh`` (64), 16 int8 scales of sub-blocks of 16, ``d``.
  Per half ``n`` of 128 weights: ``ql[64 n ..]`` low nibbles are weights 0-63, high nibbles
  64-127; ``qh[32 n + l]`` bits ``2 t, 2 t + 1`` are the top two bits of weight ``32 t + l``;
  ``w = (d sc) (q - 32)``.

``dequantize`` performs gguf-py's ``gguf.quants.dequantize`` fp32 operations in the same
order, so it gives the same bits (pinned by ``tests/kernels/test_kquants.py``). ``units`` gives the
form the native kernel (``kernels/csrc/gguf_gemm.c``) multiplies by: codes and, per 16 weights,
a scale and an offset, ``w = code * scale + offset`` exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ggml type name -> (weights per block, bytes per block)
BLOCK_SHAPES = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24), "Q8_0": (32, 34),
                "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}
QUANT_TYPES = frozenset(BLOCK_SHAPES)


@dataclass(slots=True)
class Units:
    """A quantized matrix ``[N, K]`` as the kernel reads it: ``W = codes * scales + offsets``
    with scales and offsets repeated over each 16 weights (exact in fp64).

    Attributes:
        codes: int16 ``[N, K]`` (0..63, or -128..127 for Q8_0).
        scales: fp32 ``[N, K / 16]``.
        offsets: fp32 ``[N, K / 16]``.
    """

    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray

    def dequantize(self) -> np.ndarray:
        """fp64 ``[N, K]``, the exact value of ``codes * scales + offsets``."""
        s = np.repeat(self.scales.astype(np.float64), 16, axis=1)
        z = np.repeat(self.offsets.astype(np.float64), 16, axis=1)
        return self.codes * s + z


def _blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, int]:
    """uint8 ``[N, B, block_bytes]`` and K; raises ValueError (type, partial blocks)."""
    if qtype not in BLOCK_SHAPES:
        raise ValueError(f"unsupported GGUF tensor type {qtype}; supported: {', '.join(sorted(QUANT_TYPES))}")
    weights, nbytes = BLOCK_SHAPES[qtype]
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    if raw.ndim != 2 or raw.shape[1] % nbytes:
        raise ValueError(f"{qtype} rows must be whole {nbytes}-byte blocks, got shape {raw.shape}")
    return raw.reshape(raw.shape[0], -1, nbytes), raw.shape[1] // nbytes * weights


def _half(b: np.ndarray, at: int) -> np.ndarray:
    return b[..., at:at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``[..., 16]`` bytes -> ``[..., 32]`` codes: low nibbles then high ones."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """``[..., 4]`` bytes (little-endian uint32) -> ``[..., 32]`` bits."""
    return np.unpackbits(qh, axis=-1, bitorder="little")


def scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 6-bit ``sc`` and ``m`` of Q4_K / Q5_K's 8 sub-blocks, uint8 ``[..., 8]`` each, from
    the 12 packed bytes ``[..., 12]`` (ggml's ``get_scale_min_k4``)."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    m = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc, m


def _kquant_codes(b: np.ndarray, qtype: str) -> np.ndarray:
    """uint8 ``[N, B, 256]`` codes of Q4_K / Q5_K / Q6_K super-blocks ``b [N, B, bytes]``."""
    if qtype == "Q6_K":
        ql = b[..., :128].reshape(*b.shape[:2], 2, 64)
        qh = b[..., 128:192].reshape(*b.shape[:2], 2, 1, 32)
        low = np.concatenate([ql & 15, ql >> 4], axis=-1)  # [N, B, 2, 128]
        high = (qh >> np.array([0, 2, 4, 6], np.uint8).reshape(4, 1)) & 3  # [N, B, 2, 4, 32]
        return (low | (high.reshape(*b.shape[:2], 2, 128) << 4)).reshape(*b.shape[:2], 256)
    qs = b[..., 16:144] if qtype == "Q4_K" else b[..., 48:176]
    qs = qs.reshape(*b.shape[:2], 4, 1, 32)
    q = (qs >> np.array([0, 4], np.uint8).reshape(2, 1)) & 15  # [N, B, 4, 2, 32]: sub-block 2i + t
    q = q.reshape(*b.shape[:2], 8, 32)
    if qtype == "Q5_K":
        qh = b[..., 16:48].reshape(*b.shape[:2], 1, 32)
        q = q | (((qh >> np.arange(8, dtype=np.uint8).reshape(8, 1)) & 1) << 4)
    return q.reshape(*b.shape[:2], 256)


def dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """fp32 ``[N, K]`` weights of quantized rows ``raw`` (uint8 ``[N, row_bytes]``), bit for bit
    what ``gguf.quants.dequantize`` gives.

    Raises:
        ValueError: an unsupported type (the message lists the supported ones), or rows that are
            not whole blocks.
    """
    b, k = _blocks(raw, qtype)
    n = b.shape[0]
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _half(b, 0)[..., None], _half(b, 2)[..., None]
        sc, m = scale_min_k4(b[..., 4:16])
        q = _kquant_codes(b, qtype).reshape(n, -1, 8, 32).astype(np.float32)
        w = (d * sc.astype(np.float32))[..., None] * q - (dmin * m.astype(np.float32))[..., None]
    elif qtype == "Q6_K":
        d = _half(b, 208)[..., None]
        sc = b[..., 192:208].view(np.int8).astype(np.float32)
        q = (_kquant_codes(b, qtype).astype(np.int8) - np.int8(32)).reshape(n, -1, 16, 16).astype(np.float32)
        w = (d * sc)[..., None] * q
    else:
        d = _half(b, 0)[..., None]
        if qtype == "Q8_0":
            w = d * b[..., 2:].view(np.int8).astype(np.float32)
        else:
            nib = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qtype]
            q = _nibbles(b[..., nib:nib + 16])
            if qtype in ("Q5_0", "Q5_1"):
                q = q | (_fifth_bits(b[..., nib - 4:nib]) << 4)
            if qtype in ("Q4_1", "Q5_1"):
                w = d * q.astype(np.float32) + _half(b, 2)[..., None]
            else:
                w = d * (q.astype(np.int8) - np.int8(8 if qtype == "Q4_0" else 16)).astype(np.float32)
    return w.reshape(n, k)


def units(raw: np.ndarray, qtype: str) -> Units:
    """The kernel's form of quantized rows ``raw`` (uint8 ``[N, row_bytes]``); see ``Units``.

    Raises:
        ValueError: as ``dequantize``.
    """
    b, k = _blocks(raw, qtype)
    n = b.shape[0]
    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        codes = _kquant_codes(b, qtype).astype(np.int16).reshape(n, k)
        if qtype == "Q6_K":
            s = _half(b, 208)[..., None] * b[..., 192:208].view(np.int8).astype(np.float32)  # [N, B, 16]
            z = np.float32(-32) * s
        else:
            sc, m = scale_min_k4(b[..., 4:16])
            s = np.repeat(_half(b, 0)[..., None] * sc.astype(np.float32), 2, axis=-1)
            z = np.repeat(-(_half(b, 2)[..., None] * m.astype(np.float32)), 2, axis=-1)
        return Units(codes, s.reshape(n, -1), z.reshape(n, -1))
    d = _half(b, 0)  # [N, B]
    if qtype == "Q8_0":
        codes, z = b[..., 2:].view(np.int8).astype(np.int16), np.zeros_like(d)
    else:
        nib = {"Q4_0": 2, "Q4_1": 4, "Q5_0": 6, "Q5_1": 8}[qtype]
        codes = _nibbles(b[..., nib:nib + 16]).astype(np.int16)
        if qtype in ("Q5_0", "Q5_1"):
            codes |= _fifth_bits(b[..., nib - 4:nib]).astype(np.int16) << 4
        z = {"Q4_0": np.float32(-8) * d, "Q5_0": np.float32(-16) * d}.get(qtype)
        if z is None:
            z = _half(b, 2)
    return Units(codes.reshape(n, k), np.repeat(d, 2, axis=1), np.repeat(z, 2, axis=1))


__all__ = ["BLOCK_SHAPES", "QUANT_TYPES", "Units", "dequantize", "scale_min_k4", "units"]
