"""RoPE and the paged-cache write of an attention layer, in one native call where it builds.

``apply_rope`` is the rotary embedding of Llama / Qwen / Gemma ("rotate half": dims ``i`` and
``i + D/2`` form a pair) in torch: the reference. ``rope_and_cache`` rotates q and k, writes k
and v into their cache slots and returns the rotated q; on CPU with fp32 activations and an fp32
or bf16 cache it is one C call (``csrc/rope_cache.c``) with the bits of the torch path (each
product and sum rounded on its own; bf16 rounded to nearest even), else the torch path itself.
At one decode row the torch path is ~25 dispatches per layer: 1.5 ms of a 12 ms step of the
30-layer default model on a 2-core AMD EPYC (2026-12-05).

The library is built with the system C compiler on first use into ``$STENCIL_CACHE_DIR/kernels``
(``kernels.native._build``); ``STENCIL_NATIVE=0`` keeps the torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import subprocess
from pathlib import Path

import torch

from kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "rope_cache.c"
_FLAGS = ["-O2", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]


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
        lib = ctypes.CDLL(str(native._build(cc, [SOURCE], _FLAGS, "stencil_rope_cache")))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        log.warning("native RoPE + cache write off: %s", e)
        return None
    p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.stencil_rope_cache.argtypes = [p, lg, i, p, lg, p, lg, i, i, p, p, i, p, lg, p, p, i, p]
    lib.stencil_rope_cache.restype = ctypes.c_int
    return lib


def _rows_ok(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


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
    fp32 rows (heads and dims contiguous), the caches contiguous fp32 or bf16 and ``cos``/``sin``
    contiguous fp32; otherwise ``apply_rope`` and ``write``.

    Raises:
        IndexError: a slot outside the cache (native path; the backend's own error otherwise).
    """
    lib = library() if flat_cache else None
    if (lib is None or q.device.type != "cpu" or not (_rows_ok(q) and _rows_ok(k) and _rows_ok(v))
            or k_cache.dtype not in (torch.float32, torch.bfloat16) or v_cache.dtype != k_cache.dtype
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
                                int(k_cache.dtype == torch.bfloat16), out.data_ptr())
    if rc:
        raise IndexError(f"a slot of {slot_mapping.tolist()} is outside the cache's {num_slots} slots "
                         f"(or head_dim {dim} is odd)")
    return out


__all__ = ["apply_rope", "library", "rope_and_cache"]
