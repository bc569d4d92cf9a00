"""A small quantizer into ggml's k-quant blocks (Q4_K, Q5_K, Q6_K), for tests that write tiny
GGUF files: gguf-py's ``gguf.quants.quantize`` implements the 32-weight types only, and
llama.cpp's ``llama-quantize`` is not available in tests.

Layouts as ``stencil.engine.models.kquants`` reads them (llama.cpp's ``ggml-common.h``). Scales are
chosen plainly (per sub-block the range over the code range, then the sub-block scales
rounded to 6 bits, or to int8 for Q6_K), not with llama.cpp's error search: the tests need
valid blocks with every field exercised, and compare against ``gguf.quants.dequantize`` of
these very bytes, not against llama.cpp's choice of codes.
"""

from __future__ import annotations

import numpy as np

QK = 256


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """fp16 bytes (uint8 [..., 2]) and the fp32 value they hold."""
    h = x.astype(np.float16)
    return h[..., None].view(np.uint8), h.astype(np.float32)


def _pack_scale_min_k4(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins ``[B, 8]`` -> the 12 bytes ``get_scale_min_k4`` reads."""
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    return out


def _affine_k(x: np.ndarray, levels: int):
    """Q4_K / Q5_K fields of super-blocks ``x [B, 256]``: d, dmin bytes, packed scales, codes."""
    sub = x.reshape(-1, 8, 32)
    lo = np.minimum(sub.min(-1), 0.0)  # [B, 8]; w = d sc q - dmin m with m >= 0
    step = (sub.max(-1) - lo) / levels
    d_bytes, d = _f16(step.max(-1) / 63)
    dmin_bytes, dmin = _f16(-lo.min(-1) / 63)
    sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / np.where(dmin > 0, dmin, 1)[:, None]), 0, 63).astype(np.uint8)
    scale = d[:, None] * sc  # [B, 8]
    q = np.round((sub + (dmin[:, None] * m)[..., None]) / np.where(scale > 0, scale, 1)[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8)  # [B, 8, 32]
    return d_bytes, dmin_bytes, _pack_scale_min_k4(sc, m), q


def _nibbles_k(q: np.ndarray) -> np.ndarray:
    """Codes [B, 8, 32] -> 128 bytes: bytes 32 i + l hold sub-block 2 i (low) and 2 i + 1 (high)."""
    q4 = q & 15
    return (q4[:, 0::2] | (q4[:, 1::2] << 4)).reshape(q.shape[0], 128)


def quantize_k(w: np.ndarray, qtype: str) -> np.ndarray:
    """fp32 ``w [N, K]`` (``K % 256 == 0``) -> uint8 ``[N, K / 256 * block_bytes]`` of ``qtype``.

    Raises:
        ValueError: another type, or K not whole super-blocks.
    """
    n, k = w.shape
    if k % QK:
        raise ValueError(f"{qtype} rows hold whole super-blocks of {QK}; K={k} is not")
    x = np.ascontiguousarray(w, np.float32).reshape(-1, QK)
    if qtype == "Q4_K":
        d, dmin, scales, q = _affine_k(x, 15)
        blocks = np.concatenate([d, dmin, scales, _nibbles_k(q)], axis=1)
    elif qtype == "Q5_K":
        d, dmin, scales, q = _affine_k(x, 31)
        # bit j of qh[l] is the 5th bit of weight l of sub-block j
        qh = np.zeros((x.shape[0], 32), np.uint8)
        for j in range(8):
            qh |= ((q[:, j] >> 4) & 1) << j
        blocks = np.concatenate([d, dmin, scales, qh, _nibbles_k(q)], axis=1)
    elif qtype == "Q6_K":
        sub = x.reshape(-1, 16, 16)
        step = np.abs(sub).max(-1) / 31  # [B, 16]: codes q - 32 in -31..31
        d_bytes, d = _f16(step.max(-1) / 127)
        sc = np.clip(np.round(step / np.where(d > 0, d, 1)[:, None]), 1, 127).astype(np.int8)
        scale = d[:, None] * sc
        q = np.clip(np.round(sub / np.where(scale > 0, scale, 1)[..., None]) + 32, 0, 63).astype(np.uint8)
        q = q.reshape(-1, 2, 4, 32)  # [B, half n, unit t, l]: weight 128 n + 32 t + l
        ql = np.concatenate([(q[:, :, 0] & 15) | ((q[:, :, 2] & 15) << 4),
                             (q[:, :, 1] & 15) | ((q[:, :, 3] & 15) << 4)], axis=2)  # [B, 2, 64]
        qh = (q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4) | ((q[:, :, 3] >> 4) << 6)
        blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8), d_bytes], axis=1)
    else:
        raise ValueError(f"quantize_k writes Q4_K, Q5_K and Q6_K, not {qtype}")
    return blocks.reshape(n, -1)


__all__ = ["quantize_k"]
