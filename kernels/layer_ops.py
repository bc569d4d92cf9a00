"""The small per-layer operations of a decode step in one native call each, where they build:
RoPE with the paged-cache write, RMSNorm and the MLP's gated activation (``glu``). The same
library holds the C decoder (``stencil.kernels.decoder``), which calls these three directly.

``apply_rope`` is the rotary embedding of Llama / Qwen / Gemma ("rotate half": dims ``i`` and
``i + D/2`` form a pair) in torch: the reference. ``rope_and_cache`` rotates q and k, writes k
and v into their cache slots and returns the rotated q; on CPU with fp32 activations and an fp32
bf16 or fp16 cache it is one C call (``csrc/rope_cache.c``) with the bits of the torch path (each
product and sum rounded on its own; bf16 and fp16 rounded to nearest even), else the torch path itself.
At one decode row the torch path is ~25 dispatches per layer: 1.5 ms of a 12 ms step of the
30-layer default model on a 2-core AMD EPYC (2026-12-05).

``rms_norm`` is ``F.rms_norm`` (``(x * r) * w``, ``r = 1 / sqrt(mean(x^2) + eps)``) in one C call
for CPU fp32 rows (``csrc/rms_norm.c``): torch's is ~10 dispatches, ~13 µs at one row, 109 calls a
Gemma 3 step. Its sum of squares runs in its own fixed order (per row: the same bits whatever the
batch), so it may differ from torch's by an ulp or so.

The library is built with the system C compiler on first use (``-O3 -march=native
-ffp-contract=off``: vectorized for this CPU, but no multiply-add fused and no sum reordered, so
the bits are those of the C source on every ISA) into ``$STENCIL_CACHE_DIR/kernels``
(``stencil.kernels.native._build``); ``STENCIL_NATIVE=0`` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

from stencil.kernels import native

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).resolve().parent / "csrc" / name
           for name in ("rope_cache.c", "rms_norm.c", "glu.c", "decoder.c")]
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``cos, sin [T, head_dim // 2]`` (rotate-half layout:
    dims ``i`` and ``i + head_dim/2`` form one pair)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


@functools.cache
def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``STENCIL_NATIVE=0``, no C compiler, the build failed);
    decided once (the build writes its file atomically, so a racing first call only builds twice)."""
    cc = native.c_compiler()
    if os.environ.get("STENCIL_NATIVE", "1") == "0" or not cc:
        return None
    try:
        lib = ctypes.CDLL(str(native._build(cc, SOURCES, _FLAGS, "stencil_layer_ops")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native RoPE + cache write and RMSNorm off: %s", e)
        return None
    p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.stencil_rope_cache.argtypes = [p, lg, i, p, lg, p, lg, i, i, p, p, i, p, lg, p, p, i, p]
    lib.stencil_rope_cache.restype = ctypes.c_int
    lib.stencil_rms_norm.argtypes = [p, lg, lg, i, lg, p, ctypes.c_float, p, i]
    lib.stencil_rms_norm.restype = ctypes.c_int
    lib.stencil_glu.argtypes = [i, p, lg, lg, i, p, i]
    lib.stencil_glu.restype = ctypes.c_int
    lib.stencil_decoder_forward.argtypes = [p, p]
    lib.stencil_decoder_forward.restype = ctypes.c_int
    lib.stencil_decoder_workspace.argtypes = [p, i]
    lib.stencil_decoder_workspace.restype = ctypes.c_int64
    return lib


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``F.rms_norm(x, weight.shape, weight, eps)`` over the last dim: ``x [..., D]``, ``weight
    [D]``; returns a new contiguous tensor of ``x``'s shape. One native call (``csrc/rms_norm.c``)
    where it builds and ``x`` and ``weight`` are CPU fp32 with ``x[0]`` a contiguous block (a
    matrix, or a ``[T, heads, D]`` view of a fused projection's rows); torch's otherwise."""
    lib = library()
    if (lib is None or x.device.type != "cpu" or x.dtype != torch.float32 or weight.dtype != torch.float32
            or x.numel() == 0 or not _block_rows(x) or not weight.is_contiguous() or weight.shape != x.shape[-1:]):
        return F.rms_norm(x, weight.shape, weight, eps=eps)
    shape, dim = x.shape, x.shape[-1]
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # (torch.empty(shape) costs 2x)
    lib.stencil_rms_norm(x.data_ptr(), shape[0], x.numel() // (shape[0] * dim), dim, x.stride(0),
                         weight.data_ptr(), eps, out.data_ptr(), torch.get_num_threads())
    return out


def glu(gate_up: torch.Tensor, kind: str = "silu") -> torch.Tensor:
    """The gated activation of a fused gate/up projection: ``act(gate) * up`` with ``gate,
    up = gate_up.chunk(2, -1)``; ``gate_up [T, 2 I]`` -> fp32 ``[T, I]``. ``kind``: ``"silu"``
    (Llama, Qwen) or ``"gelu_tanh"`` (Gemma: GELU's tanh approximation).

    One native call (``csrc/glu.c``: its own exp, each element's bits set by its value alone)
    where it builds and ``gate_up`` is CPU fp32 rows with contiguous columns; torch's
    ``F.silu`` / ``F.gelu(approximate="tanh")`` otherwise (within a few ulp of it).

    Raises:
        ValueError: an unknown ``kind``.
    """
    if kind not in _GLU_KINDS:
        raise ValueError(f"unknown gated activation {kind!r}; known: {', '.join(_GLU_KINDS)}")
    lib = library()
    t, width = gate_up.shape
    if (lib is None or gate_up.device.type != "cpu" or gate_up.dtype != torch.float32 or width % 2
            or (gate_up.stride(1) != 1 and width > 1) or t == 0):
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.silu(gate) if kind == "silu" else F.gelu(gate, approximate="tanh")) * up
    out = torch.empty(t, width // 2, dtype=torch.float32)
    lib.stencil_glu(_GLU_KINDS[kind], gate_up.data_ptr(), gate_up.stride(0), t, width // 2, out.data_ptr(),
                    torch.get_num_threads())
    return out


_GLU_KINDS = {"silu": 0, "gelu_tanh": 1}


def _block_rows(x: torch.Tensor) -> bool:
    """``x`` has two or more dims, rows, and each ``x[i]`` is one contiguous block (read from
    the strides: ``x[0].is_contiguous()`` makes a view, a microsecond at one decode row)."""
    shape, stride = x.shape, x.stride()
    if len(shape) < 2:
        return False
    expected = 1
    for d in range(len(shape) - 1, 0, -1):
        if shape[d] != 1 and stride[d] != expected:
            return False
        expected *= shape[d]
    return True


def _rows_ok(x: torch.Tensor) -> bool:
    """fp32 ``[T, heads, D]`` rows whose heads and dims are contiguous (views of a fused QKV output)."""
    return x.dtype == torch.float32 and x.dim() == 3 and _block_rows(x)


def rope_and_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, write,
                   flat_cache: bool = True) -> torch.Tensor:
    """RoPE on ``q [T, heads, D]`` and ``k [T, kv_heads, D]``; rotated k and ``v`` written to
    slots ``slot_mapping`` (int64 ``[T]``) of the paged caches ``[num_blocks, block_size,
    kv_heads, D]``; returns the rotated q (fp32 ``[T, heads, D]``).

    ``write(k, v, k_cache, v_cache, slot_mapping)`` is the attention backend's cache write (its
    ``reshape_and_cache``), which the torch path calls. ``flat_cache``: the backend's cache is
    the flat ``[slot, kv_heads, D]`` layout the native kernel writes itself (the ``torch`` and
    ``cpu`` backends). The native path runs then, when the kernel builds and the tensors are CPU
    fp32 rows (heads and dims contiguous), the caches contiguous fp32, bf16 or fp16 and ``cos``/``sin``
    contiguous fp32; otherwise ``apply_rope`` and ``write``.

    Raises:
        IndexError: a slot outside the cache (native path; the backend's own error otherwise).
    """
    lib = library() if flat_cache else None
    if (lib is None or q.device.type != "cpu" or not (_rows_ok(q) and _rows_ok(k) and _rows_ok(v))
            or k_cache.dtype not in native.CACHE_KINDS or v_cache.dtype != k_cache.dtype
            or not (k_cache.is_contiguous() and v_cache.is_contiguous() and cos.is_contiguous()
                    and sin.is_contiguous()) or cos.dtype != torch.float32 or sin.dtype != torch.float32):
        write(apply_rope(k, cos, sin), v, k_cache, v_cache, slot_mapping)
        return apply_rope(q, cos, sin)
    t, heads, dim = q.shape
    slots = slot_mapping if slot_mapping.dtype == torch.int64 and slot_mapping.is_contiguous() \
        else slot_mapping.to(torch.int64).contiguous()
    out = torch.empty(t, heads, dim, dtype=torch.float32)
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    rc = lib.stencil_rope_cache(q.data_ptr(), q.stride(0), heads, k.data_ptr(), k.stride(0), v.data_ptr(),
                                v.stride(0), k.shape[1], dim, cos.data_ptr(), sin.data_ptr(), t, slots.data_ptr(),
                                num_slots, k_cache.data_ptr(), v_cache.data_ptr(),
                                native.CACHE_KINDS[k_cache.dtype], out.data_ptr())
    if rc:
        raise IndexError(f"a slot of {slot_mapping.tolist()} is outside the cache's {num_slots} slots "
                         f"(or head_dim {dim} is odd)")
    return out


__all__ = ["apply_rope", "glu", "library", "rms_norm", "rope_and_cache"]
