"""GEMM and row lookup straight from GGUF's quantized blocks (``csrc/gguf_gemm.c``), via ctypes.

Types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 (blocks of 32 weights) and Q4_K, Q5_K, Q6_K (super-blocks
of 256). The weight stays the file's bytes, uint8 ``[N, row_bytes]``: nothing is repacked, so
the resident size is the GGUF's. Activations are quantized per row and group of 32 to two int8
terms (``quantize``; error at most the group's max / 32512), multiplied with the codes exactly
in integer, and scaled in fp32 in a fixed order: each row's result is the same bits whatever
the batch, the columns asked for or the thread count, and the same bits on every ISA the
source compiles for (AVX512-VNNI, AVX-VNNI, AVX2, plain C: the file is built with
``-ffp-contract=off``). ``dequantize_rows`` gives rows as gguf-py's ``dequantize`` does, bit
for bit.

Unlike ``stencil.kernels.native`` (AVX512-BF16 only), this library builds wherever a C compiler does
(``-march=native``); ``available()`` says whether it did, ``STENCIL_NATIVE=0`` turns it off.
Callers without it use ``stencil.engine.models.kquants`` (numpy) and torch instead. Threads: the
``threads`` argument (callers pass ``torch.get_num_threads()``), OpenMP when the compiler has it.
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from stencil.kernels import native

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "gguf_gemm.c"
# ggml type name -> (kernel's type id, weights per block, bytes per block), ggml-common.h
BLOCKS = {"Q4_0": (0, 32, 18), "Q4_1": (1, 32, 20), "Q5_0": (2, 32, 22), "Q5_1": (3, 32, 24),
          "Q8_0": (4, 32, 34), "Q4_K": (5, 256, 144), "Q5_K": (6, 256, 176), "Q6_K": (7, 256, 210)}
SPAN = 256  # weights per span of the activations' dx / X16 arrays
ISA_NAMES = {3: "avx512vnni", 2: "avxvnni", 1: "avx2", 0: "c"}
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11", "-ffp-contract=off"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_reason = ""


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None (``STENCIL_NATIVE=0``, not x86-64, no compiler, build
    failed); builds on the first call (a few seconds) and logs why when it cannot."""
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
                lib = ctypes.CDLL(str(native._build(cc, [SOURCE], _FLAGS, "stencil_gguf")))
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _reason = f"the build failed: {e}"
                log.warning("GGUF block kernel off: %s", _reason)
                return None
            p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
            lib.stencil_gguf_quantize.argtypes = [p, i, i, i, p, p, p, p, i]
            lib.stencil_gguf_gemm.argtypes = [i, p, lg, i, p, i, i, p, p, p, p, i, p, lg, i]
            lib.stencil_gguf_dequantize.argtypes = [i, p, lg, i, p, i, p]
            for f in (lib.stencil_gguf_quantize, lib.stencil_gguf_gemm, lib.stencil_gguf_dequantize,
                      lib.stencil_gguf_isa):
                f.restype = ctypes.c_int
            log.info("GGUF block kernel (%s) loaded from %s", ISA_NAMES[lib.stencil_gguf_isa()], lib._name)
            _lib = lib
            return _lib
        log.info("GGUF block kernel off: %s", _reason)
        return None


def available() -> bool:
    """Whether the block kernel runs here (builds it on the first call)."""
    return library() is not None


def unavailable_reason() -> str:
    """Why ``library()`` returned None ("" when it did not, or before the first call)."""
    return _reason


def isa() -> str:
    """The dot-product instructions of this build: ``avx512vnni``, ``avxvnni``, ``avx2``, ``c``,
    or ``""`` when the kernel is not available."""
    lib = library()
    return "" if lib is None else ISA_NAMES[lib.stencil_gguf_isa()]


def row_bytes(qtype: str, k: int) -> int:
    """Bytes of one row of ``k`` weights of ``qtype``. Raises KeyError, ValueError (``k`` not
    whole blocks)."""
    _, weights, nbytes = BLOCKS[qtype]
    if k % weights:
        raise ValueError(f"{qtype} rows hold whole blocks of {weights} weights; in_features {k} is not")
    return k // weights * nbytes


@dataclass(slots=True)
class Activations:
    """One step's activations as the kernel reads them (see ``csrc/gguf_gemm.c``), in one buffer
    (one allocation a call: a decode step quantizes about a hundred times).

    Attributes:
        group: inputs per activation scale: 32 (for the 32-weight block types) or 256 (k-quants).
        m, k: the shape of ``x``.
        buffer: uint8, holding in order ``q1``, ``q2``, ``dx``, ``x16`` (the properties).
        terms: 2 (``x = dq (q1 + q2 / 256)``) or 1 (``x = dq q1``, as llama.cpp's Q8 blocks; ``q2``
            is neither written nor read).
    """

    group: int
    m: int
    k: int
    buffer: torch.Tensor
    terms: int = 2

    @property
    def shape(self) -> tuple[int, int]:
        return self.m, self.k

    @property
    def spans(self) -> int:
        return -(-self.k // SPAN)

    def pointers(self) -> tuple[int, int | None, int, int]:
        """Addresses of ``q1, q2, dx, x16`` (``q2`` None with one term)."""
        base, mk = self.buffer.data_ptr(), self.m * self.k
        return base, base + mk if self.terms == 2 else None, base + 2 * mk, base + 2 * mk + 32 * self.m * self.spans

    @property
    def q1(self) -> torch.Tensor:  # int8 [M, K], the first term
        return self.buffer[:self.m * self.k].view(torch.int8).view(self.m, self.k)

    @property
    def q2(self) -> torch.Tensor:  # int8 [M, K], the second term
        mk = self.m * self.k
        return self.buffer[mk:2 * mk].view(torch.int8).view(self.m, self.k)

    @property
    def dx(self) -> torch.Tensor:
        """fp32 ``[M, 8 S]``: the step / 256 of each block of 32 inputs (S = ceil(K / 256), zero
        padded; with group 256 the 8 of a span are equal)."""
        mk, f = 2 * self.m * self.k, 32 * self.m * self.spans
        return self.buffer[mk:mk + f].view(torch.float32).view(self.m, 8 * self.spans)

    @property
    def x16(self) -> torch.Tensor:
        """``[M, 16 S]``, the sums of each 16 inputs: with group 32, fp32 sums of the raw inputs
        (two terms, in the order of ``csrc/gguf_gemm.c``) or ``dq`` times the sum of ``q1`` (one);
        with group 256 (k-quants), int32 ``B16``, the exact sums of ``256 q1 + q2``."""
        mk, f = 2 * self.m * self.k, 32 * self.m * self.spans
        dtype = torch.int32 if self.group == SPAN else torch.float32
        return self.buffer[mk + f:].view(dtype).view(self.m, 16 * self.spans)


def quantize(x: torch.Tensor, group: int, threads: int | None = None, terms: int = 2) -> Activations:
    """Quantize fp32 ``x [M, K]`` (``K % group == 0``) for ``gemm`` of types whose blocks hold
    ``group`` weights (``BLOCKS[qtype][1]``: 32 or 256), in ``terms`` int8 terms (2: error at
    most the group's max / 32512, the product near exact; 1: llama.cpp's Q8_0 / Q8_K activations
    and arithmetic, error max / 254, half the integer work of the GEMM; see
    ``kernels/csrc/gguf_gemm.c``).

    Raises:
        RuntimeError: the kernel is not available, or it rejected the shape.
    """
    lib = _need()
    if x.dtype != torch.float32 or not x.is_contiguous():
        x = x.to(torch.float32).contiguous()
    m, k = x.shape
    spans = -(-k // SPAN)
    # 2 M K bytes of terms (K % 32 == 0 keeps the floats after them aligned), 24 S floats a row
    if terms not in (1, 2):
        raise ValueError(f"activations have 1 or 2 int8 terms, not {terms}")
    a = Activations(group, m, k, torch.empty(2 * m * k + 96 * m * spans, dtype=torch.uint8), terms)
    if m and lib.stencil_gguf_quantize(x.data_ptr(), m, k, group, *a.pointers(), threads or torch.get_num_threads()):
        raise RuntimeError(f"GGUF block kernel rejected activations of shape {tuple(x.shape)} (group {group})")
    return a


def gemm(qtype: str, weight: torch.Tensor, acts: Activations, cols: torch.Tensor | None = None,
         out: torch.Tensor | None = None, threads: int | None = None) -> torch.Tensor:
    """``x @ W[cols].T`` -> fp32 ``[M, len(cols)]`` (all ``N`` rows of ``W`` when ``cols`` is None).

    Args:
        qtype: ggml type name, a key of ``BLOCKS``.
        weight: uint8 ``[N, row_bytes]``, contiguous: the GGUF tensor's bytes.
        acts: ``quantize(x, BLOCKS[qtype][1])``.
        cols: int ``[C]`` weight rows (output features) to compute, in output order.
        out: fp32 ``[M, >= C]`` view to write into (its row stride is kept), or None.

    Raises:
        RuntimeError: kernel unavailable or rejected the shapes (``row_bytes`` not
            ``row_bytes(qtype, K)``).
    """
    lib = _need()
    m, k = acts.shape
    if cols is not None:
        cols = cols.to(torch.int32).contiguous()
    n = weight.shape[0] if cols is None else cols.numel()
    y = torch.empty(m, n, dtype=torch.float32) if out is None else out
    if m == 0 or n == 0:
        return y
    rc = lib.stencil_gguf_gemm(BLOCKS[qtype][0], weight.data_ptr(), weight.shape[1], k,
                               None if cols is None else cols.data_ptr(), n, acts.group, *acts.pointers(), m,
                               y.data_ptr(), y.stride(0), threads or torch.get_num_threads())
    if rc:
        raise RuntimeError(f"GGUF block kernel rejected {qtype} weight {tuple(weight.shape)} with K={k} "
                           f"(activations of group {acts.group})")
    return y


def dequantize_rows(qtype: str, weight: torch.Tensor, k: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows ``rows`` (int ``[R]``) of ``weight`` dequantized: fp32 ``[R, k]``, bit for bit what
    ``gguf.quants.dequantize`` gives. Raises RuntimeError (unavailable, bad shape)."""
    lib = _need()
    rows = rows.to(torch.int64).contiguous()
    out = torch.empty(rows.numel(), k, dtype=torch.float32)
    if lib.stencil_gguf_dequantize(BLOCKS[qtype][0], weight.data_ptr(), weight.shape[1], k, rows.data_ptr(),
                                   rows.numel(), out.data_ptr()):
        raise RuntimeError(f"GGUF block kernel rejected {qtype} weight {tuple(weight.shape)} with K={k}")
    return out


def reference_activations(x: torch.Tensor, group: int, terms: int = 2) -> torch.Tensor:
    """What ``gemm`` multiplies the weights by, fp64 ``[M, K]`` (for tests): per group,
    ``dq (q1 + q2 / 256)`` with ``dq = max|x| / 127``, or with one term ``dq q1`` with llama.cpp's
    scale (``1 / (127 / max|x|)`` for a 256-input group, ``max|x| / 127`` rounded to fp16 for 32),
    the arithmetic of ``quantize`` in torch (unfused, as the C file is built; each division in
    fp64 rounded to fp32, the correctly rounded fp32 quotient the C file gets: torch's own fp32
    division may be an ulp off). Its error is at most the group's ``max|x| / 32512`` up to fp32
    rounding (a residual a hair over half a step, its q2 clamped from 128 to 127, reaches
    1.0002 times that; one term: ``max|x| / 254``, plus fp16's rounding of the scale, ``2^-11``
    of it, for 32-input groups)."""
    m, k = x.shape
    g = x.float().reshape(m, k // group, group)
    amax = g.abs().amax(-1, keepdim=True)
    step = (amax.double() / 127.0).float()
    inv = torch.where(amax > 0, (127.0 / amax.double()).float(), torch.zeros_like(amax))
    q1 = torch.round(g * inv).clamp(-127, 127)
    q2 = torch.round((g - q1 * step) * (inv * 256.0)).clamp(-127, 127) if terms == 2 else torch.zeros_like(g)
    if terms == 1:  # llama.cpp's scales: Q8_K's 1 / (127 / max), Q8_0's fp16 max / 127
        step = (torch.where(amax > 0, (1.0 / inv.double()).float(), torch.zeros_like(amax)) if group == SPAN
                else step.half().float())
    return ((step / 256.0).double() * (256.0 * q1.double() + q2.double())).reshape(m, k)


def _need() -> ctypes.CDLL:
    lib = library()
    if lib is None:
        raise RuntimeError(f"GGUF block kernel not available: {_reason}")
    return lib


__all__ = ["BLOCKS", "Activations", "available", "dequantize_rows", "gemm", "isa", "library", "quantize",
           "reference_activations", "row_bytes", "unavailable_reason"]
