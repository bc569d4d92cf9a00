"""Paged attention in portable C (``csrc/vec_attention.c``: 8-lane GCC vectors, AVX2 + FMA on
this project's AMD EPYC machines), for CPUs where the AVX512 kernel (``stencil.kernels.native``) does not
build. Same contract and the same guarantee: each row's result is the same bits in any batch,
chunking and thread count, so greedy outputs cannot change with batching, prefix caching,
preemption or speculation (the torch reference keeps that only for short queries, and quantized
layers magnify its low-bit differences into other tokens).

Built with ``-O3 -march=native`` at first use into the kernel cache (``stencil.kernels.native._build``);
``available()`` says whether it did, ``STENCIL_NATIVE=0`` turns it off.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import threading
from pathlib import Path

import torch

from stencil.kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "vec_attention.c"
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``STENCIL_NATIVE=0``, not x86-64, no compiler, build
    failed); builds on the first call and logs why when it cannot."""
    global _lib, _tried, _reason
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        cc = native.c_compiler()
        if os.environ.get("STENCIL_NATIVE", "1") == "0":
            _reason = "STENCIL_NATIVE=0"
        elif platform.machine() not in ("x86_64", "AMD64"):
            _reason = f"not an x86-64 CPU ({platform.machine()})"
        elif not cc:
            _reason = "no C compiler ($CC, cc or gcc)"
        else:
            try:
                lib = ctypes.CDLL(str(native._build(cc, [SOURCE], _FLAGS, "stencil_vec_attention")))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _reason = f"the build failed: {e}"
                log.warning("portable attention kernel off: %s", _reason)
                return None
            p, i, f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float
            lib.stencil_vec_attention.argtypes = [p, i, i, i, p, p, i, i, p, i, p, p, i, f, i, p, i]
            lib.stencil_vec_attention.restype = ctypes.c_int
            _lib = lib
            return _lib
        log.info("portable attention kernel off: %s", _reason)
        return None


def available() -> bool:
    """Whether the kernel runs here (builds it on the first call)."""
    return library() is not None


def unavailable_reason() -> str:
    """Why ``library()`` returned None ("" when it did not, or before the first call)."""
    return _reason


def supported(k_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` takes this cache: fp32, bf16 or fp16, contiguous, on CPU, head_dim
    a multiple of 8 up to 256."""
    dim = k_cache.shape[-1]
    return (k_cache.dtype in native.CACHE_KINDS and k_cache.device.type == "cpu"
            and k_cache.is_contiguous() and dim % 8 == 0 and dim <= 256 and available())


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged K/V.

    Args:
        query: ``[T, num_heads, head_dim]`` (read as fp32).
        k_cache, v_cache: fp32, bf16 or fp16 ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, of one dtype.
        block_tables: int32 ``[num_seqs, max_blocks]``; query_start_loc: int32
            ``[num_seqs + 1]``; seq_lens: int32 ``[num_seqs]``.
        scale: softmax scale.
        window: each row sees only its last ``window`` positions; None: every earlier one.

    Returns:
        fp32 ``[T, num_heads, head_dim]``.

    Raises:
        RuntimeError: the kernel is not available, or it rejected the shapes.
    """
    lib = library()
    if lib is None:
        raise RuntimeError(f"portable attention kernel not available: {_reason}")
    if v_cache.dtype != k_cache.dtype or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise RuntimeError("attention kernel needs contiguous K and V caches of one dtype")
    q = query.float().contiguous()
    t, heads, dim = q.shape
    _, block_size, kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    starts = query_start_loc.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty_like(q)
    if t == 0:
        return out
    rc = lib.stencil_vec_attention(
        q.data_ptr(), heads, kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(),
        native.CACHE_KINDS[k_cache.dtype], block_size, tables.data_ptr(), tables.shape[1], starts.data_ptr(),
        lens.data_ptr(), lens.numel(), float(scale), int(window or 0), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention kernel rejected heads={heads}/{kv_heads} head_dim={dim}")
    return out


__all__ = ["available", "library", "paged_attention", "supported", "unavailable_reason"]
