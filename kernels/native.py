"""Native CPU kernels (C with AVX512 intrinsics), compiled with the system C compiler at first use.

Kernels, each giving every row the same bits whatever the batch (a greedy output cannot
change with batching, chunking or speculation):

* ``PackedInt4.matmul``: GGUF int4 / int8 weights, used by ``stencil.engine.models.quant.Int4Linear``.
  Where the CPU has AVX512-VNNI (``csrc/vnni_gemm.c``) the activations are quantized per row
  and group of 32 to two int8 terms (error at most the group's max / 32512) and multiplied with
  VPDPBUSD, for every row of a step, prompt rows included; else (``csrc/int4_gemm.c``) they are
  rounded to bf16 and multiplied with VDPBF16PS. On this project's Xeons VPDPBUSD issues about
  three times as often as VDPBF16PS, and the two-term product is both faster (1.5-2.7x on
  SmolLM2's shapes, 1-256 rows) and closer to fp32 (about 40x) than the bf16 one.
  ``STENCIL_VNNI=0`` keeps the bf16 kernel;
* ``paged_attention`` (``csrc/attention.c``): causal attention over the paged fp32, bf16 or fp16
  K/V cache, the ``"cpu"`` attention backend (``stencil.kernels.cpu``).

They need an x86 CPU with AVX512-BF16 and a C compiler (``$CC``, flags allowed, else ``cc``); without either,
``available()`` is False and callers keep torch's int4 kernel and the torch attention
reference. ``STENCIL_NATIVE=0`` turns them off. Threads: ``torch.get_num_threads()`` (OpenMP).

The shared object is built once per source text, compiler and CPU (``-march=native``) into
``$STENCIL_CACHE_DIR/kernels`` (default ``~/.cache/stencil/kernels``, beside the models), written to a temporary name
and renamed, so concurrent first uses do not see half a file. It is loaded with ``ctypes``:
no Python headers or torch extension toolchain are needed.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = [Path(__file__).parent / "csrc" / name for name in ("int4_gemm.c", "vnni_gemm.c", "attention.c")]
BLOCK = 16  # output columns per column block of the kernel
GROUP = 32  # input features sharing one scale and zero
_PACK_CHUNK = 1024  # column blocks packed at a time (bounds the temporaries of a large LM head)
_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=gnu11"]

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False


def _cache_dir() -> Path:
    root = os.environ.get("STENCIL_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "stencil") / "kernels"


def _cpu_id() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor()
    lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _build(cc: list[str], sources: list[Path] = SOURCES, flags: list[str] = _FLAGS,
           name: str = "stencil_native") -> Path:
    """Compile ``sources`` into one shared object in the cache (or find it there); its name
    hashes the sources, the compiler's version, the CPU and the flags."""
    source = b"\0".join(p.read_bytes() for p in sources)
    version = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256(b"\0".join([source, version.encode(), _cpu_id().encode(),
                                     " ".join(flags).encode()])).hexdigest()[:16]
    out = _cache_dir() / f"{name}_{key}.so"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        for extra in (["-fopenmp"], []):  # OpenMP threads if the compiler has them
            r = subprocess.run([*cc, *flags, *extra, "-o", tmp, *map(str, sources), "-lm"], capture_output=True,
                               text=True, timeout=300)
            if r.returncode == 0:
                break
        else:
            raise RuntimeError(f"{' '.join(cc)} failed: {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def c_compiler() -> list[str]:
    """The C compiler command: ``$CC`` (may carry flags, e.g. ``"gcc -O0"``), else ``cc`` or
    ``gcc`` on the PATH; ``[]`` when there is none."""
    return shlex.split(os.environ.get("CC", "")) or [c for c in (shutil.which("cc") or shutil.which("gcc"),) if c]


def library() -> ctypes.CDLL | None:
    """The compiled kernels, or None (disabled, no compiler, build failed, CPU lacks AVX512-BF16).

    Builds on the first call (about 3 s) and logs why when it cannot.
    """
    global _lib, _tried
    if _tried:  # the hot path: no lock once decided
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("STENCIL_NATIVE", "1") == "0":
            _why("STENCIL_NATIVE=0")
            return None
        if platform.machine() not in ("x86_64", "AMD64"):
            _why(f"not an x86-64 CPU ({platform.machine()})")
            return None
        cc = c_compiler()
        if not cc:
            _why("no C compiler ($CC, cc or gcc)")
            return None
        try:
            lib = ctypes.CDLL(str(_build(cc)))  # $CC may carry flags: "gcc -O0"
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _why(f"the build failed: {e}", warn=True)
            return None
        lib.stencil_int4_supported.restype = ctypes.c_int
        if not lib.stencil_int4_supported():
            _why("this CPU has no AVX512-BF16")
            return None
        p = ctypes.c_void_p
        i = ctypes.c_int
        lib.stencil_int4_gemm.argtypes = [p, i, i, p, p, p, i, i, p, i, p, i, i]
        lib.stencil_int4_gemm.restype = ctypes.c_int
        lib.stencil_vnni_gemm.argtypes = [p, i, i, p, p, p, i, i, p, i, p, i, i]
        lib.stencil_vnni_gemm.restype = ctypes.c_int
        lib.stencil_vnni_supported.restype = ctypes.c_int
        f = ctypes.c_float
        lib.stencil_paged_attention.argtypes = [p, i, i, i, p, p, i, i, p, i, p, p, i, f, i, p, i]
        lib.stencil_paged_attention.restype = ctypes.c_int
        log.info("native CPU kernels (int4 GEMM, paged attention) loaded from %s", lib._name)
        _lib = lib
        return _lib


_reason = ""


def _why(reason: str, warn: bool = False) -> None:
    global _reason
    _reason = reason
    (log.warning if warn else log.info)("native CPU kernels off: %s", reason)


def unavailable_reason() -> str:
    """Why ``library()`` returned None ("" when it did not, or before the first call)."""
    return _reason


def available() -> bool:
    """Whether the native kernels can run here (builds them on the first call)."""
    return library() is not None


def vnni_available() -> bool:
    """Whether ``PackedInt4`` multiplies with the int8-activation VNNI kernel here: the native
    kernels load, the CPU has AVX512-VNNI, and ``STENCIL_VNNI`` is not ``0``."""
    lib = library()
    return lib is not None and os.environ.get("STENCIL_VNNI", "1") != "0" and bool(lib.stencil_vnni_supported())


def reference_activations(x: torch.Tensor) -> torch.Tensor:
    """The activations the VNNI kernel multiplies by, fp64 ``[M, K]`` from fp32 ``x [M, K]``
    (for tests; the kernel's own quantization, ``csrc/vnni_gemm.c``, in torch).

    Per row and group of 32: ``d = max|x| / 127``, ``q1 = round(x / d)``,
    ``q2 = clamp(round((x - d q1) / (d / 256)), -127, 127)``; the result is ``d (q1 + q2 / 256)``.
    """
    m, k = x.shape
    g = x.float().reshape(m, k // GROUP, GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    step = amax / 127.0
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q1 = torch.round(g * inv).clamp(-127, 127)
    q2 = torch.round((g - q1 * step) * (inv * 256.0)).clamp(-127, 127)
    return ((step / 256.0).double() * (256.0 * q1.double() + q2.double())).reshape(m, k)


class PackedInt4:
    """Int4 weights in the native kernel's layout (see ``kernels/csrc/int4_gemm.c``).

    Args:
        codes: uint8 ``[P, N, K]`` in ``0..15`` (P = 1 or 2 planes).
        scales: fp32 ``[P, N, K / 32]``.
        zeros: fp32 ``[P, N, K / 32]``; ``W = sum_p (codes[p] - 8) * scales[p] + zeros[p]``.

    Columns are padded to a multiple of 16 with exact zeros (code 8, scale 0, zero 0). Two
    planes that are GGUF Q8_0's split (``stencil.engine.models.quant``: scales ``16 d, d``, zeros
    ``8 d, 0``) are packed as one plane of int8 codes (``planes == 0``): half the
    multiplications, faster from about 8 rows up, about 20% slower at 1-6 rows (its int8 to
    bf16 conversion costs more than two nibble lookups).

    With ``vnni`` (default: ``vnni_available()``) one int4 plane or the int8 plane is packed
    for ``csrc/vnni_gemm.c`` instead (``self.vnni``): int8 activations, fp32 input; two
    planes that are not Q8_0 keep the bf16 kernel.

    Raises:
        ValueError: ``K`` not a multiple of 32, or more than 2 planes.
    """

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 vnni: bool | None = None) -> None:
        p, n, k = codes.shape
        if k % GROUP or p > 2:
            raise ValueError(f"need K % {GROUP} == 0 and at most 2 planes, got K={k}, P={p}")
        pad = -n % BLOCK
        if pad:
            codes = torch.cat([codes, codes.new_full((p, pad, k), 8)], dim=1)
            scales = torch.cat([scales, scales.new_zeros(p, pad, k // GROUP)], dim=1)
            zeros = torch.cat([zeros, zeros.new_zeros(p, pad, k // GROUP)], dim=1)
        nb = (n + pad) // BLOCK
        self.num_blocks, self.in_features, self.out_features = nb, k, n
        q8 = _is_q8(scales, zeros)
        self.vnni = (vnni_available() if vnni is None else vnni) and (q8 or p == 1)
        if self.vnni:
            self._pack_vnni(codes, scales, zeros, q8)
            return
        if q8:
            # GGUF Q8_0 held as two nibble planes (stencil.engine.models.quant): one int8 plane
            # q = 16 hi + lo - 128 with scale d, half the multiplications of two planes.
            q = codes[0].to(torch.int16) * 16 + codes[1].to(torch.int16) - 128  # [N, K] in -128..127
            # [block, column j, k-pair, t] -> byte e = 2 j + t of (block, k-pair)
            c = q.to(torch.int8).reshape(nb, BLOCK, k // 2, 2).permute(0, 2, 1, 3)
            self.codes = c.reshape(nb, k // 2, 2 * BLOCK).contiguous()  # [NB, K/2, 32]
            scales, zeros, p = scales[1:], torch.zeros_like(zeros[:1]), 0
        else:
            # [p, block, column j, quad q, half, t] -> byte e = 2 j + t of (block, quad): the low
            # nibble holds k = 4 q + t, the high nibble k = 4 q + 2 + t
            c = codes.to(torch.uint8).reshape(p, nb, BLOCK, k // 4, 2, 2).permute(0, 1, 3, 4, 2, 5)
            c = c.reshape(p, nb, k // 4, 2, 2 * BLOCK)
            self.codes = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).contiguous()  # [P, NB, K/4, 32]
        planes = max(p, 1)
        self.scales = scales.float().reshape(planes, nb, BLOCK, k // GROUP).transpose(2, 3).contiguous()
        # The planes' zeros, added: [NB, K/32, 16]
        self.zeros = zeros.float().sum(0).reshape(nb, BLOCK, k // GROUP).transpose(1, 2).contiguous()
        self.planes = p  # 0: one int8 plane; 1 or 2: int4 planes
        # The weight's pointers, passed on every call
        self._weights = (self.codes.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr(), p, nb)

    def _pack_vnni(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, q8: bool) -> None:
        """The layout of ``csrc/vnni_gemm.c`` (see its header)."""
        nb, k = self.num_blocks, self.in_features
        groups = k // GROUP

        def per_block(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [NB, G, 16]
            return t.reshape(nb, BLOCK, groups).transpose(1, 2).contiguous()

        if q8:
            self.codes = torch.empty(nb, k // 4, 4 * BLOCK, dtype=torch.int8)
            self.zeros = torch.empty(nb, groups, BLOCK, dtype=torch.int32)
            # In chunks of rows: a 262,144-token LM head made ~2 GB of int32 temporaries at once.
            for b0 in range(0, nb, _PACK_CHUNK):
                b1 = min(nb, b0 + _PACK_CHUNK)
                rows = slice(b0 * BLOCK, b1 * BLOCK)
                q = codes[0, rows].to(torch.int16) * 16 + codes[1, rows].to(torch.int16) - 128  # -128..127
                # [block, column j, quad u, t] -> byte 4 j + t of (block, quad)
                self.codes[b0:b1] = q.to(torch.int8).reshape(b1 - b0, BLOCK, k // 4, 4).permute(0, 2, 1, 3).reshape(
                    b1 - b0, k // 4, 4 * BLOCK)
                # the activations' offset of 128 in both terms: 257 * 128 * sum_k q over the group
                self.zeros[b0:b1] = (257 * 128 * q.reshape(-1, groups, GROUP).sum(-1, dtype=torch.int32)).reshape(
                    b1 - b0, BLOCK, groups).transpose(1, 2)
            self.scales = per_block(scales[1].float())
            self.planes = 0
        else:
            # [block, column j, octet o, half, t] -> byte 4 j + t of (block, octet); low nibble
            # k = 8 o + t, high nibble k = 8 o + 4 + t
            c = codes[0].to(torch.uint8).reshape(nb, BLOCK, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
            self.codes = (c[..., 0] | (c[..., 1] << 4)).reshape(nb, k // 8, 4 * BLOCK).contiguous()
            self.scales = per_block(scales[0].float())
            self.zeros = per_block(zeros[0].float() - 8 * scales[0].float())  # the code offset folded in
            self.planes = 1
        self._weights = (self.codes.data_ptr(), self.scales.data_ptr(), self.zeros.data_ptr(), self.planes, nb)

    @property
    def holds_q8_rows(self) -> bool:
        """Whether ``rows`` can read weight rows back (a VNNI-packed GGUF Q8_0 weight)."""
        return self.vnni and self.planes == 0

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Weight rows ``ids`` (int64 ``[n]``, each below ``out_features``) as fp32 ``[n, K]``:
        ``q * d`` of the packed int8 codes and fp32 scales, bit for bit the values
        ``gguf.quants.dequantize`` gives for the Q8_0 rows they were packed from. Serves a tied
        embedding from its LM head's bytes (no second copy).

        Raises:
            ValueError: the weight is not VNNI-packed Q8_0 (``holds_q8_rows``).
        """
        if not self.holds_q8_rows:
            raise ValueError("rows are kept only for VNNI-packed Q8_0 weights")
        k = self.in_features
        block, col = ids // BLOCK, ids % BLOCK
        q = self.codes.view(self.num_blocks, k // 4, BLOCK, 4)[block, :, col, :]  # [n, K/4, 4]
        d = self.scales[block, :, col]  # [n, K/32]
        return (q.reshape(-1, k // GROUP, GROUP).float() * d[..., None]).reshape(-1, k)

    def matmul(self, x: torch.Tensor, blocks: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W.T``: ``[M, K]`` -> fp32 ``[M, 16 * nb]`` (padded columns included).

        Args:
            x: activations, cast to contiguous fp32 (VNNI kernel) or bf16.
            blocks: int ``[nb]`` column blocks (of 16) to compute, in output order; None = all.

        Raises:
            RuntimeError: the kernels are not available, or the kernel rejected the shapes.
        """
        lib = library()
        if lib is None:
            raise RuntimeError("native int4 kernel not available")
        xb = x.to(torch.float32 if self.vnni else torch.bfloat16).contiguous()
        m = xb.shape[0]
        if blocks is not None:
            blocks = blocks.to(torch.int32).contiguous()
        nb = self.num_blocks if blocks is None else blocks.numel()
        y = torch.empty(m, nb * BLOCK, dtype=torch.float32)
        if m == 0 or nb == 0:
            return y
        gemm = lib.stencil_vnni_gemm if self.vnni else lib.stencil_int4_gemm
        rc = gemm(
            xb.data_ptr(), m, self.in_features, *self._weights,
            None if blocks is None else blocks.data_ptr(), nb, y.data_ptr(), nb * BLOCK,
            torch.get_num_threads())
        if rc != 0:
            raise RuntimeError(f"int4 kernel rejected M={m} K={self.in_features}")
        return y

    def dequantize(self) -> torch.Tensor:
        """The exact weight the kernel multiplies by, fp64 ``[N_padded, K]`` (for tests)."""
        nb, k = self.num_blocks, self.in_features
        if self.vnni:
            s = self.scales.transpose(1, 2).reshape(nb * BLOCK, -1).double().repeat_interleave(GROUP, -1)
            if self.planes == 0:
                q = self.codes.reshape(nb, k // 4, BLOCK, 4).permute(0, 2, 1, 3).reshape(nb * BLOCK, k)
                return q.double() * s
            lo, hi = (self.codes & 15).long(), (self.codes >> 4).long()  # [NB, K/8, 64]
            c = torch.stack([lo, hi], dim=-1).reshape(nb, k // 8, BLOCK, 4, 2).permute(0, 2, 1, 4, 3)
            z = self.zeros.transpose(1, 2).reshape(nb * BLOCK, -1).double().repeat_interleave(GROUP, -1)
            return c.reshape(nb * BLOCK, k).double() * s + z
        s = self.scales.transpose(2, 3).reshape(-1, nb * BLOCK, k // GROUP).double().repeat_interleave(GROUP, -1)
        z = self.zeros.transpose(1, 2).reshape(nb * BLOCK, -1).double().repeat_interleave(GROUP, -1)
        if self.planes == 0:
            q = self.codes.reshape(nb, k // 2, BLOCK, 2).permute(0, 2, 1, 3).reshape(nb * BLOCK, k)
            return q.double() * s[0] + z
        p, _, quads, _ = self.codes.shape
        lo, hi = (self.codes & 15).long(), (self.codes >> 4).long()
        c = torch.stack([lo, hi], dim=3).reshape(p, nb, quads, 2, BLOCK, 2)  # [.., half, j, t]
        c = c.permute(0, 1, 4, 2, 3, 5).reshape(p, nb * BLOCK, 4 * quads)
        return ((c - 8).double() * s).sum(0) + z


def _is_q8(scales: torch.Tensor, zeros: torch.Tensor) -> bool:
    """Whether two planes are GGUF Q8_0's split ``(16 d, 8 d)`` high and ``(d, 0)`` low nibbles."""
    return (scales.shape[0] == 2 and torch.equal(scales[0], 16 * scales[1])
            and torch.equal(zeros[0], 8 * scales[1]) and not bool(zeros[1].any()))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of every query row over its sequence's paged K/V (``attention.c``).

    Args:
        query: fp32 ``[T, num_heads, head_dim]``.
        k_cache, v_cache: fp32, bf16 or fp16 ``[num_blocks, block_size, num_kv_heads, head_dim]``,
            contiguous, of one dtype.
        block_tables: int32 ``[num_seqs, max_blocks]``.
        query_start_loc: int32 ``[num_seqs + 1]``; seq_lens: int32 ``[num_seqs]``.
        scale: softmax scale.
        window: each row sees only its last ``window`` positions (a sliding-window layer);
            None: every earlier position.

    Returns:
        fp32 ``[T, num_heads, head_dim]``; each row the same bits in any batch.

    Raises:
        RuntimeError: the kernels are not available, or the kernel rejected the shapes.
    """
    lib = library()
    if lib is None:
        raise RuntimeError("native attention kernel not available")
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
    rc = lib.stencil_paged_attention(
        q.data_ptr(), heads, kv_heads, dim, k_cache.data_ptr(), v_cache.data_ptr(),
        CACHE_KINDS[k_cache.dtype], block_size,
        tables.data_ptr(), tables.shape[1], starts.data_ptr(), lens.data_ptr(), lens.numel(),
        float(scale), int(window or 0), out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"attention kernel rejected heads={heads}/{kv_heads} head_dim={dim}")
    return out


CACHE_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
"""The KV-cache dtypes the native kernels read and write, and the code each passes to C (bf16
and fp16 widened exactly to fp32 as they are read; written rounded to nearest even)."""


def attention_supported(k_cache: torch.Tensor) -> bool:
    """Whether ``paged_attention`` takes this cache: fp32, bf16 or fp16, contiguous, on CPU, head_dim
    (its last dimension) a multiple of 16 up to 256."""
    dim = k_cache.shape[-1]
    return (k_cache.dtype in CACHE_KINDS and k_cache.device.type == "cpu"
            and k_cache.is_contiguous() and dim % 16 == 0 and dim <= 256 and available())


__all__ = ["BLOCK", "CACHE_KINDS", "PackedInt4", "attention_supported", "available", "library", "paged_attention",
           "reference_activations", "unavailable_reason", "vnni_available"]
