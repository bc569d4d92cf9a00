"""GGUF 4-bit and 8-bit blocks served as torch int4-packed weights on CPU, without re-quantizing.

(This module's int4 planes serve the HF-directory models' ``--weights int4``. For GGUF-native
loading, every supported block type kept as the file's bytes, it re-exports the factory API of
``stencil.engine.models.gguf_layers``: ``linear_from_gguf``, ``fuse``, ``embedding_from_gguf``,
``tied_lm_head``, ``SUPPORTED_TYPES``, ``check_type``.)

Formats (ggml's ``ggml-common.h``; gguf-py's ``gguf.quants`` decodes them the same way), each
block holds 32 consecutive weights of one row, ``d`` and ``m`` are fp16:

* ``Q4_0``: ``w = d * (q - 8)``, ``q`` in ``0..15`` (low nibbles: weights 0-15, high: 16-31);
* ``Q4_1``: ``w = d * q + m``, same nibble order;
* ``Q8_0``: ``w = d * q``, ``q`` an int8.

torch's CPU kernel ``aten._weight_int4pack_mm_for_cpu(x, packed, 32, scales_and_zeros)``
dequantizes each group of 32 input features as ``(c - 8) * scale + zero`` (checked empirically
with unit and identity inputs, and pinned by ``tests/engine/test_quant.py``), ``c`` in ``0..15``,
``scales_and_zeros[g, n] = (scale, zero)`` ``[K / 32, N, 2]``. So, with ``c = q``:

* ``Q4_0``: ``scale = d``, ``zero = 0``;
* ``Q4_1``: ``scale = d``, ``zero = m + 8 d``;
* ``Q8_0``: two planes of nibbles ``hi, lo`` with ``q + 128 = 16 hi + lo``:
  ``d q = 16 d (hi - 8) + d (lo - 8) + 8 d``, i.e. ``(scale, zero) = (16 d, 8 d)`` for ``hi``
  and ``(d, 0)`` for ``lo``; the layer runs the kernel once per plane and adds.

The codes and the fp32 scale/zero planes (``Int4Planes``) are exact: decoding them in fp32
gives gguf's own ``dequantize`` (bit-exact on SmolLM2's file; ``m + 8 d`` is one fp32
rounding in general). The kernel itself is fast only with bf16 activations (fp32 and fp16
inputs take a scalar path, 50-100x slower here), and then scales, zeros and outputs are bf16
too: each is rounded to 8 significant bits (unit roundoff ``u = 2^-8``). For one layer,
``|y_int4 - x @ W.T| <= 2.02 u A + 1.01 u |x @ W.T|`` with
``A[n] = sum_k |x[k]| (|c[n,k] - 8| |scale[n,k]| + |zero[n,k]|)`` (one plane; accumulation is
fp32). That bf16 rounding of activations, scales/zeros and outputs is the only difference from
fp32 layers built on ``gguf.quants.dequantize``.

Where it builds (x86 with AVX512-BF16 and a C compiler), output rows go through Stencil's own
kernel instead (``stencil.kernels.native.PackedInt4``, ``kernels/csrc/int4_gemm.c``): the codes become
exact bf16 integers ``c - 8``, VDPBF16PS multiplies them into every row of the step, and each
group's fp32 scale and zero are applied once per 32 inputs. Only the activations are rounded
(to bf16); everything else is fp32 arithmetic in a fixed order, so the error is that of an
fp32 dot product, ``|y - x_bf16 @ W.T| <= (K + 4) 2^-24 A`` (pinned by ``tests/engine/test_quant.py``),
and a row's result never depends on the batch. It is about twice as fast as torch's kernel at
any row count on SmolLM2's shapes (576 -> 1536: 1 row 14 vs 25 us, 20 rows 102 vs 206 us),
because torch's multiplies 4 rows at a time with fp32 FMAs.

Where the CPU also has AVX512-VNNI, ``stencil.kernels.native`` multiplies with int8 activations instead
(``kernels/csrc/vnni_gemm.c``): each row's fp32 activations become two int8 terms per group of
32 (error at most the group's max / 32512), multiplied by the codes exactly in int32, then
scaled in fp32 in a fixed order. It is again batch-invariant, 1.5-2.7x faster than the bf16
kernel, and about 40x closer to the exact product; prompt rows then take it too (no dense copy).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

GROUP = 32  # weights per GGUF block = the kernel's group size
_Q4_0, _Q4_1, _Q8_0 = "Q4_0", "Q4_1", "Q8_0"
INT4_TYPES = frozenset({_Q4_0, _Q4_1, _Q8_0})  # GGUF tensor types this module serves as int4
_N_ALIGN = 16  # the CPU packing wants out_features % 16 == 0
COLUMN_BLOCK = 64  # output columns the CPU int4 kernel computes as one independent block


@dataclass(slots=True)
class Int4Planes:
    """Exact int4 form of a weight ``W [N, K]``: ``W = sum_p (codes[p] - 8) * scales[p] + zeros[p]``
    (scales and zeros repeated over each group of 32 input features).

    Attributes:
        codes: uint8 ``[P, N, K]`` in ``0..15``.
        scales: fp32 ``[P, N, K / 32]``.
        zeros: fp32 ``[P, N, K / 32]``.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape[1:])

    def dequantize(self) -> torch.Tensor:
        """fp32 ``[N, K]`` as the formula above, computed in fp32."""
        s = self.scales.repeat_interleave(GROUP, dim=-1)
        z = self.zeros.repeat_interleave(GROUP, dim=-1)
        w = (self.codes.float() - 8) * s + z
        return w[0] if w.shape[0] == 1 else w.sum(0)


def block_columns(blocks: torch.Tensor, width: int = COLUMN_BLOCK) -> torch.Tensor:
    """Indices int64 ``[b * width]`` of the members of the ``width``-wide blocks ``blocks``
    (columns of 64-column blocks; or, with ``width=4``, the native kernel's 16-column blocks
    inside them)."""
    return (blocks[:, None] * width + torch.arange(width, device=blocks.device)).flatten()


def planes_from_blocks(raw: np.ndarray, qtype: str) -> Int4Planes:
    """Decode GGUF blocks into exact int4 planes, without going through dequantized floats.

    Args:
        raw: uint8 ``[N, K / 32 * block_bytes]``, one weight row per array row (the layout
            ``gguf.GGUFReader`` gives for a 2-D quantized tensor).
        qtype: ``"Q4_0"``, ``"Q4_1"`` or ``"Q8_0"``.

    Returns:
        ``Int4Planes`` with one plane (Q4_0, Q4_1) or two (Q8_0).

    Raises:
        ValueError: another type, or a row length that is not whole blocks.
    """
    if qtype not in INT4_TYPES:
        raise ValueError(f"cannot serve {qtype} as int4; expected one of {sorted(INT4_TYPES)}")
    head = 4 if qtype == _Q4_1 else 2
    nbytes = head + (GROUP if qtype == _Q8_0 else GROUP // 2)
    rows, width = raw.shape
    if width % nbytes:
        raise ValueError(f"{qtype} row of {width} bytes is not a whole number of {nbytes}-byte blocks")
    blocks = np.ascontiguousarray(raw).reshape(rows, width // nbytes, nbytes)
    d = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)  # [N, K/32]
    body = blocks[..., head:]  # [N, K/32, 16 or 32] bytes
    if qtype == _Q8_0:
        q = body.view(np.int8).astype(np.int16) + 128  # 0..255
        codes = np.stack([q >> 4, q & 15]).astype(np.uint8)
        scales = np.stack([16 * d, d])
        zeros = np.stack([8 * d, np.zeros_like(d)])
    else:
        codes = np.empty((1, rows, width // nbytes, GROUP), np.uint8)
        codes[..., :GROUP // 2] = body & 15  # low nibbles are the block's first 16 weights
        codes[..., GROUP // 2:] = body >> 4
        scales = d[None]
        if qtype == _Q4_1:
            m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
            zeros = (m + 8 * d)[None]
        else:
            zeros = np.zeros_like(scales)
    return Int4Planes(torch.from_numpy(codes.reshape(codes.shape[0], rows, -1)),
                      torch.from_numpy(scales), torch.from_numpy(zeros))


def concat_planes(parts: list[Int4Planes]) -> Int4Planes:
    """Stack the rows of several weights (a fused projection's output is just more rows).

    Parts with fewer planes get zero planes (code 8, scale 0, zero 0: contributes exactly 0).

    Raises:
        ValueError: the parts disagree on ``in_features``.
    """
    if len({p.shape[1] for p in parts}) != 1:
        raise ValueError(f"cannot fuse weights of in_features {[p.shape[1] for p in parts]}")
    depth = max(p.codes.shape[0] for p in parts)
    return Int4Planes(*(torch.cat([_pad_planes(getattr(p, f), depth, fill) for p in parts], dim=1)
                        for f, fill in (("codes", 8), ("scales", 0), ("zeros", 0))))


def _pad_planes(t: torch.Tensor, depth: int, fill: int) -> torch.Tensor:
    extra = depth - t.shape[0]
    return t if extra == 0 else torch.cat([t, torch.full((extra, *t.shape[1:]), fill, dtype=t.dtype)])


def permute_rows(planes: Int4Planes, order: torch.Tensor) -> Int4Planes:
    """Rows ``order`` (int64 ``[N]``) of every plane: reordering whole rows is exact."""
    return Int4Planes(planes.codes[:, order], planes.scales[:, order], planes.zeros[:, order])


class RowRoute:
    """Which rows of the current step's flat batch are prompt tokens, shared by a model's layers.

    A CPU with native bf16 GEMMs reads a prompt 2-3x faster through a dense bf16 copy of the
    weights than through the int4 kernel (576 -> 1536 features, 512 rows: 2.0 vs 5.7 ms), while
    the int4 kernel wins at the few rows of a decode step (1 row: 0.04 vs 0.09 ms). Routing by
    the *kind* of token (prompt or output), not by how many rows a step has, keeps every
    token's computation independent of the batch around it: a prompt token always goes through
    the dense copy, an output token (decoded, forced, draft, or re-read after preemption)
    always through int4. The int4 kernels give each row the same bits at any row count (pinned
    by ``tests/engine/test_quant.py``); oneDNN's dense bf16 GEMM does only within one of its kernels
    (on an AMX Xeon, 576 -> 3072 with 33 rows or more takes another kernel than with fewer), so
    a prompt read in chunks can differ in low bits from one read whole: the route is taken only
    on request (``prompt_weights="bf16"``), never by default.

    The model sets the route at the start of each forward (``set``) and clears it at the end.
    """

    __slots__ = ("dense", "quant")

    def __init__(self) -> None:
        self.dense: torch.Tensor | None = None  # int64 [D] prompt rows (None: no row / all)
        self.quant: torch.Tensor | None = None  # int64 [T - D] output rows

    def set(self, prompt_mask: torch.Tensor | None) -> None:
        """Route the rows of bool ``prompt_mask [T]`` (None: every row through int4)."""
        self.clear()
        if prompt_mask is None or not bool(prompt_mask.any()):
            return
        if bool(prompt_mask.all()):
            self.dense = _ALL
            return
        self.dense = prompt_mask.nonzero().squeeze(1)
        self.quant = (~prompt_mask).nonzero().squeeze(1)

    def clear(self) -> None:
        self.dense = self.quant = None


_ALL = torch.empty(0, dtype=torch.long)  # marker: every row is a prompt row


class Int4Linear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` held as int4 planes, run by the native int4 kernel
    where it builds, else by torch's CPU int4 kernel.

    Activations are cast to bf16 for the kernel (the only fast input type of both) and the
    result back to ``x.dtype``; see the module docstring for the error bounds.

    Args:
        planes: the exact weight (``planes_from_blocks`` / ``concat_planes``).
        bias: fp32 ``[out_features]`` or None.
        route: also keep ``W`` dense in bf16 (decoded in fp32 from the planes, then rounded)
            and run the rows ``route`` marks as prompt rows through it (see ``RowRoute``).
        native: use ``stencil.kernels.native`` (True), torch's kernel (False), or the native one when
            it is available (None). One model uses one kernel for all its output rows.

    Raises:
        ValueError: ``in_features`` not a multiple of 32.
    """

    def __init__(self, planes: Int4Planes, bias: torch.Tensor | None = None, *,
                 route: RowRoute | None = None, native: bool | None = None) -> None:
        super().__init__()
        from stencil.kernels import native as native_kernels

        self.route = route
        self.dense = None if route is None else planes.dequantize().to(torch.bfloat16)
        n, k = planes.shape
        if k % GROUP:
            raise ValueError(f"in_features {k} is not a multiple of {GROUP}")
        self.in_features, self.out_features = k, n
        self.bias = None if bias is None else bias.float()
        self.packed: list[torch.Tensor] = []
        self.scales_and_zeros: list[torch.Tensor] = []
        self.native = None
        if native is None:
            native = native_kernels.available()
        if native and planes.codes.shape[0] <= 2:
            self.native = native_kernels.PackedInt4(planes.codes, planes.scales, planes.zeros)
            return
        pad = -n % _N_ALIGN
        for p in range(planes.codes.shape[0]):
            codes = planes.codes[p].to(torch.int32)
            scale_zero = torch.stack([planes.scales[p], planes.zeros[p]], dim=-1)  # [N, K/32, 2]
            if pad:
                codes = torch.cat([codes, torch.full((pad, k), 8, dtype=torch.int32)])
                scale_zero = torch.cat([scale_zero, scale_zero.new_zeros(pad, k // GROUP, 2)])
            self.packed.append(torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1))
            # per plane bf16 [K / 32, N_pad, 2]
            self.scales_and_zeros.append(scale_zero.transpose(0, 1).contiguous().to(torch.bfloat16))

    @property
    def padded_out_features(self) -> int:
        """Output columns including the kernel's padding (a multiple of 16)."""
        return self.native.num_blocks * 16 if self.native is not None else self.packed[0].shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out] in x.dtype
        xq = self._kernel_input(x)
        dense = None if self.route is None else self.route.dense
        if dense is None:
            return self._int4(xq).to(x.dtype)
        xb = x.to(torch.bfloat16).contiguous()
        if dense is _ALL:
            return self._dense(xb).to(x.dtype)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        y[dense] = self._dense(xb[dense]).to(x.dtype)
        y[self.route.quant] = self._int4(xq[self.route.quant]).to(x.dtype)
        return y

    def _kernel_input(self, x: torch.Tensor) -> torch.Tensor:
        """What the int4 kernel reads: the VNNI kernel quantizes fp32 activations itself, the
        others read contiguous bf16."""
        return x if self.native is not None and self.native.vnni else x.to(torch.bfloat16).contiguous()

    def _dense(self, xb: torch.Tensor) -> torch.Tensor:  # bf16 [N, in] -> fp32 [N, out]
        y = F.linear(xb, self.dense).float()
        return y if self.bias is None else y + self.bias

    def _int4(self, xb: torch.Tensor) -> torch.Tensor:  # bf16 (fp32 for VNNI) [N, in] -> fp32 [N, out]
        if self.native is not None:
            y = self.native.matmul(xb)
        else:
            y = None
            for packed, sz in zip(self.packed, self.scales_and_zeros):
                part = torch.ops.aten._weight_int4pack_mm_for_cpu(xb, packed, GROUP, sz).float()
                y = part if y is None else y + part
        if self.out_features != y.shape[1]:
            y = y[:, :self.out_features]
        if self.bias is not None:
            y = y + self.bias
        return y

    def forward_columns(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Only the output columns of ``COLUMN_BLOCK``-wide blocks: ``x [N, in]``, ``blocks``
        int64 ``[b]`` -> fp32 ``[N, b * COLUMN_BLOCK]``, columns ``blocks[i] * 64 + j`` in order.

        The same bits as those columns of ``forward`` (both kernels compute each column block
        on its own: tests pin it), at a cost that grows with ``b``: a grammar that allows a few
        tokens needs a few blocks of the LM head, not all 768.

        Raises:
            ValueError: the padded ``out_features`` is not a multiple of ``COLUMN_BLOCK``.
        """
        n_pad = self.padded_out_features
        if n_pad % COLUMN_BLOCK:
            raise ValueError(f"{n_pad} output rows are not a multiple of {COLUMN_BLOCK}")
        rows = block_columns(blocks)
        xb = self._kernel_input(x)
        if self.native is not None:
            y = self.native.matmul(xb, block_columns(blocks, COLUMN_BLOCK // 16))
        else:
            y = None
            for packed, sz in zip(self.packed, self.scales_and_zeros):
                part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    xb, packed.index_select(0, rows), GROUP, sz.index_select(1, rows)).float()
                y = part if y is None else y + part
        if self.bias is not None:
            y = y + self.bias[rows.clamp(max=self.out_features - 1)]
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"kernel={'native' if self.native is not None else 'torch'}, bias={self.bias is not None}, "
                f"dense_prompt={self.route is not None}")


class GgufWeights:
    """The tensors of one GGUF file, read lazily through ``gguf.GGUFReader`` (memory-mapped).

    Args:
        path: the ``.gguf`` file.

    Raises:
        FileNotFoundError: no such file.
    """

    def __init__(self, path: Path | str) -> None:
        from gguf import GGUFReader

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        reader = GGUFReader(str(self.path))
        self.tensors = {t.name: t for t in reader.tensors}
        arch = reader.fields.get("general.architecture")
        self.architecture = bytes(arch.parts[arch.data[0]]).decode() if arch else ""

    def qtype(self, name: str) -> str:
        """ggml type name of tensor ``name`` (``"Q4_1"``, ``"F32"``, ...). Raises KeyError."""
        return self.tensors[name].tensor_type.name

    def planes(self, name: str) -> Int4Planes:
        """Exact int4 planes of a Q4_0/Q4_1/Q8_0 matrix. Raises KeyError, ValueError."""
        t = self.tensors[name]
        return planes_from_blocks(np.asarray(t.data), t.tensor_type.name)

    def dequantized(self, name: str) -> torch.Tensor:
        """fp32 tensor in torch's shape order (outer dimension first), by ``gguf.quants``."""
        from gguf.quants import dequantize

        t = self.tensors[name]
        shape = tuple(int(s) for s in reversed(t.shape))
        return torch.from_numpy(np.array(dequantize(np.asarray(t.data), t.tensor_type), np.float32)
                                ).reshape(shape)

    def linear(self, name: str, bias: torch.Tensor | None = None) -> "QuantLinear":
        """``linear_from_gguf`` over 2-D tensor ``name`` (rows in the file's order; reorder with
        ``raw[order]`` first where an architecture needs it). Raises KeyError, ValueError."""
        t = self.tensors[name]
        return linear_from_gguf(t.tensor_type.name, np.asarray(t.data), int(t.shape[0]), bias)

    def embedding(self, name: str = "token_embd.weight") -> "QuantEmbedding":
        """``embedding_from_gguf`` over tensor ``name``. Raises KeyError, ValueError."""
        t = self.tensors[name]
        return embedding_from_gguf(t.tensor_type.name, np.asarray(t.data), int(t.shape[0]))

    def count(self, types: frozenset[str] = INT4_TYPES) -> int:
        """How many tensors are of one of ``types``."""
        return sum(t.tensor_type.name in types for t in self.tensors.values())


def qk_row_order(rows: int, num_heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's Q/K permutation for the ``llama`` GGUF architecture.

    llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) stores each
    head's rotary halves interleaved; transformers' GGUF loader undoes it
    (``reverse_permute_weights``). Returns int64 ``[rows]``: HF row ``i`` is GGUF row
    ``order[i]``.
    """
    half = rows // num_heads // 2
    return torch.arange(rows).reshape(num_heads, half, 2).transpose(1, 2).reshape(rows)


class HeadEmbedding(nn.Module):
    """A tied embedding read from its LM head's packed bytes: ``forward(ids int64 [...]) -> fp32
    [..., dim]``, the rows ``gguf.quants.dequantize`` gives for the Q8_0 matrix both share (bit
    for bit, ``PackedInt4.rows``). Gemma 3's 262,144 x 640 matrix is then held once (178 MB),
    not once for the lookup and once packed for the head.

    Args:
        head: an ``Int4Linear`` whose native weight ``holds_q8_rows``.

    Raises:
        ValueError: the head keeps no readable rows; (``forward``) IndexError for an id outside
            ``0 .. num_embeddings - 1``.
    """

    def __init__(self, head: Int4Linear) -> None:
        super().__init__()
        if head.native is None or not head.native.holds_q8_rows:
            raise ValueError("the LM head keeps no readable rows (not a VNNI-packed Q8_0 weight)")
        self.head = [head]  # not a submodule: the model owns the head once
        self.num_embeddings, self.embedding_dim = head.out_features, head.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside 0..{self.num_embeddings - 1}")
        return self.head[0].native.rows(flat).reshape(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, rows of the LM head's packed Q8_0"


__all__ = ["HeadEmbedding", "GROUP", "INT4_TYPES", "GgufWeights", "Int4Linear", "Int4Planes", "RowRoute", "concat_planes",
           "permute_rows", "planes_from_blocks",
           "qk_row_order"]


# The GGUF-native factory API (any supported block type, blocks kept as they are): see
# engine/models/gguf_layers.py. Imported last: that module needs nothing from this one.
from stencil.engine.models.gguf_layers import (  # noqa: E402
    SUPPORTED_TYPES, QuantEmbedding, QuantLinear, check_type, embedding_from_gguf, fuse, linear_from_gguf,
    tied_lm_head)

__all__ += ["SUPPORTED_TYPES", "QuantEmbedding", "QuantLinear", "check_type", "embedding_from_gguf", "fuse",
            "linear_from_gguf", "tied_lm_head"]
