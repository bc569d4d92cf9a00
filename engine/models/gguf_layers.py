"""Layers that keep a GGUF file's quantized tensors as they are: linear (projections, LM head)
and embedding, built from a tensor's raw rows of blocks.

The factory API (re-exported by ``stencil.engine.models.quant``):

* ``linear_from_gguf(qtype, raw, in_features, bias=None) -> QuantLinear``: ``raw`` is the
  tensor's data as ``gguf.GGUFReader`` gives it (uint8 ``[N, row_bytes]`` for a quantized type,
  float ``[N, K]`` for F32/F16/BF16); the module maps fp32 ``[M, in_features]`` to fp32
  ``[M, N]``.
* ``fuse(*layers) -> QuantLinear``: the rows of several layers stacked (q/k/v, gate/up), each
  part keeping its own type.
* ``embedding_from_gguf(qtype, raw, embedding_dim) -> QuantEmbedding``: int64 ids ``[...]`` ->
  fp32 ``[..., embedding_dim]``, dequantizing only the rows looked up; ``tied_lm_head(emb)``
  serves the same bytes as the LM head.
* ``SUPPORTED_TYPES``; ``check_type(qtype)`` raises the ValueError that names an unsupported
  type and lists the supported ones.

Kernel: ``stencil.kernels.ggml_blocks`` (``csrc/gguf_gemm.c``) reads the blocks in place, so a
quantized matrix costs exactly its bytes in the file (the bytes are copied once at load, off
the file's memory map; no repacking, no dense copy). Activations are quantized to two int8
terms per group (32 inputs for the 32-weight types, 256 for the k-quants), multiplied exactly
in integer and scaled in fp32 in a fixed order, so each row's output is the same bits in any
batch and with any column subset (``forward_columns``). Error against the exact product
``x @ W.T`` (fp64, W as ``gguf.quants.dequantize`` gives it), per output:
``|y - x W| <= sum_k e_k |c_k s_k| + (K / 32 + 16) 2^-24 (sum_k |x^_k c_k s_k| + sum_j |X_j z_j|)
+ 2^-24 sum_k |x_k w_k|`` with ``e_k <= max|x| / 32512`` over ``k``'s activation group
(``max|x| / 254`` with ``terms=1``, llama.cpp's activation arithmetic and half the integer work),
``x^`` the quantized activations, ``c, s, z`` the kernel's codes, scales and offsets
(``kquants.units``) and ``X_j`` the sums of each 16 inputs; ``tests/kernels/test_kquants.py`` pins it.

Without the kernel (no C compiler, not x86-64, ``STENCIL_NATIVE=0``) the same modules run on
torch: each forward dequantizes the weight in chunks of rows (``kquants.dequantize``, exact)
and multiplies in fp32. That is correct but slow (every step decodes every weight), and, like
any torch GEMM, not guaranteed batch-invariant. Float parts (F32/F16/BF16) are held as fp32 and
multiplied by torch in both cases.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from stencil.engine.models import kquants
from stencil.kernels import ggml_blocks

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})
SUPPORTED_TYPES = frozenset(kquants.QUANT_TYPES | FLOAT_TYPES)
_COLUMN_BLOCK = 64  # = stencil.engine.models.quant.COLUMN_BLOCK (the LM head's column blocks)
_FALLBACK_ROWS = 1024  # weight rows dequantized at once on the torch path


def check_type(qtype: str) -> None:
    """Raise ``ValueError`` unless ``qtype`` (a ggml type name) is one of ``SUPPORTED_TYPES``."""
    if qtype not in SUPPORTED_TYPES:
        raise ValueError(f"unsupported GGUF tensor type {qtype}; supported: {', '.join(sorted(SUPPORTED_TYPES))}")


@dataclass(slots=True)
class _Part:
    """Rows ``start .. stop`` of a (fused) layer's output: quantized bytes or a float matrix."""

    qtype: str
    data: torch.Tensor  # uint8 [n, row_bytes] or fp32 [n, K]
    start: int
    stop: int


def _as_data(qtype: str, raw, in_features: int) -> torch.Tensor:
    """Own contiguous copy of a tensor's rows: uint8 ``[N, row_bytes]`` or fp32 ``[N, K]``."""
    check_type(qtype)
    t = raw if isinstance(raw, torch.Tensor) else torch.from_numpy(np.array(raw, copy=True))
    if qtype in FLOAT_TYPES:
        if qtype == "BF16" and t.dtype in (torch.uint8, torch.int16, torch.uint16):
            t = t.contiguous().view(torch.bfloat16)
        t = t.reshape(-1, in_features).to(torch.float32).contiguous()
        return t
    if t.dtype != torch.uint8 or t.dim() != 2:
        raise ValueError(f"{qtype} rows must be uint8 [N, row_bytes], got {t.dtype} {tuple(t.shape)}")
    want = ggml_blocks.row_bytes(qtype, in_features)
    if t.shape[1] != want:
        raise ValueError(f"{qtype} rows of {in_features} weights take {want} bytes, got {t.shape[1]}")
    return t.contiguous()


class QuantLinear(nn.Module):
    """``y = x @ W.T (+ bias)`` with ``W`` kept as GGUF blocks (see the module docstring).

    Args:
        parts: ``(qtype, data)`` per stacked weight, ``data`` as ``_as_data`` returns it.
        in_features: ``K``.
        bias: fp32 ``[out_features]`` or None.
        native: use ``stencil.kernels.ggml_blocks`` (True), torch (False), or the kernel where it runs
            (None).
        terms: int8 terms per activation, 2 (default: error at most a group's max / 32512) or 1
            (max / 254, llama.cpp's activation arithmetic, for half the integer work: on a CPU
            without VNNI a decode step is compute-bound and takes about half the time).

    Raises:
        RuntimeError: ``native=True`` where the kernel is not available.
        ValueError: ``terms`` not 1 or 2.
    """

    def __init__(self, parts: Sequence[tuple[str, torch.Tensor]], in_features: int,
                 bias: torch.Tensor | None = None, *, native: bool | None = None, terms: int = 2) -> None:
        super().__init__()
        if terms not in (1, 2):
            raise ValueError(f"activations have 1 or 2 int8 terms, not {terms}")
        self.terms = terms
        if native is None:
            native = ggml_blocks.available()
        elif native and not ggml_blocks.available():
            raise RuntimeError(f"GGUF block kernel not available: {ggml_blocks.unavailable_reason()}")
        self.native = bool(native)
        self.in_features = in_features
        self.parts: list[_Part] = []
        start = 0
        for qtype, data in parts:
            self.parts.append(_Part(qtype, data, start, start + data.shape[0]))
            start += data.shape[0]
        self.out_features = start
        self.bias = None if bias is None else bias.float().reshape(self.out_features)

    @property
    def qtypes(self) -> list[str]:
        return [p.qtype for p in self.parts]

    @property
    def padded_out_features(self) -> int:
        """``out_features`` rounded up to whole ``COLUMN_BLOCK``s of 64 (``forward_columns``)."""
        return -(-self.out_features // _COLUMN_BLOCK) * _COLUMN_BLOCK

    def nbytes(self) -> int:
        """Bytes the weight holds (the GGUF's own size for quantized parts)."""
        return sum(p.data.numel() * p.data.element_size() for p in self.parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] in x.dtype
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        if len(self.parts) == 1 and self.native and self.parts[0].qtype not in FLOAT_TYPES:
            p = self.parts[0]  # the common case, with the fewest torch calls (a decode step has ~100)
            y = ggml_blocks.gemm(p.qtype, p.data,
                                 ggml_blocks.quantize(x2, ggml_blocks.BLOCKS[p.qtype][1], terms=self.terms))
        else:
            y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
            acts: dict[int, ggml_blocks.Activations] = {}
            for p in self.parts:
                self._part(p, x2, acts, None, y[:, p.start:p.stop])
        if self.bias is not None:
            y += self.bias
        if x.dim() != 2:
            y = y.reshape(*x.shape[:-1], self.out_features)
        return y if x.dtype == torch.float32 else y.to(x.dtype)

    def forward_columns(self, x: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Output columns of ``COLUMN_BLOCK``-wide blocks only: ``x [M, in]``, ``blocks`` int64
        ``[b]`` -> fp32 ``[M, b * 64]``, columns ``blocks[i] * 64 + j`` in order; columns past
        ``out_features`` are 0. The same bits as those columns of ``forward`` (every column is
        computed on its own), at a cost that grows with ``b``."""
        cols = (blocks.reshape(-1, 1).long() * _COLUMN_BLOCK + torch.arange(_COLUMN_BLOCK)).flatten()
        x2 = x.reshape(-1, self.in_features).to(torch.float32)
        y = torch.zeros(x2.shape[0], cols.numel(), dtype=torch.float32)
        acts: dict[int, ggml_blocks.Activations] = {}
        for p in self.parts:
            at = ((cols >= p.start) & (cols < p.stop)).nonzero().flatten()
            if at.numel():
                y[:, at] = self._part(p, x2, acts, cols[at] - p.start, None)
        if self.bias is not None:
            live = cols < self.out_features
            y[:, live] += self.bias[cols[live]]
        return y

    def _part(self, p: _Part, x: torch.Tensor, acts: dict, cols: torch.Tensor | None,
              out: torch.Tensor | None) -> torch.Tensor:
        """fp32 ``[M, n]``: x times rows ``cols`` of part ``p`` (all rows when None), written into
        ``out`` when given."""
        if p.qtype in FLOAT_TYPES:
            w = p.data if cols is None else p.data[cols]
            y = x @ w.T
        elif self.native:
            group = ggml_blocks.BLOCKS[p.qtype][1]
            if group not in acts:  # one quantization per group size, shared by the parts
                acts[group] = ggml_blocks.quantize(x, group, terms=self.terms)
            return ggml_blocks.gemm(p.qtype, p.data, acts[group], cols, out)
        else:
            rows = torch.arange(p.data.shape[0]) if cols is None else cols
            y = torch.empty(x.shape[0], rows.numel(), dtype=torch.float32)
            for i in range(0, rows.numel(), _FALLBACK_ROWS):
                chunk = rows[i:i + _FALLBACK_ROWS]
                w = torch.from_numpy(kquants.dequantize(p.data[chunk].numpy(), p.qtype))
                y[:, i:i + chunk.numel()] = x @ w.T
        if out is not None:
            out.copy_(y)
            return out
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, types={self.qtypes}, "
                f"kernel={'native ' + ggml_blocks.isa() if self.native else 'torch'}, terms={self.terms}, "
                f"bias={self.bias is not None}")


class QuantEmbedding(nn.Module):
    """Token embedding kept as GGUF rows: ``forward(ids int64 [...]) -> fp32 [..., dim]``, each
    looked-up row dequantized exactly as ``gguf.quants.dequantize`` does (bit for bit).

    Args:
        qtype, data: as for ``QuantLinear`` (one part).
        embedding_dim: ``K``.
        native: the C row decoder (True), numpy (False), or C where it runs (None).

    Raises:
        IndexError: (from ``forward``) an id outside ``0 .. num_embeddings - 1``.
    """

    def __init__(self, qtype: str, data: torch.Tensor, embedding_dim: int, *, native: bool | None = None) -> None:
        super().__init__()
        self.qtype, self.data, self.embedding_dim = qtype, data, embedding_dim
        self.num_embeddings = data.shape[0]
        self.native = ggml_blocks.available() if native is None else native

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).long()
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError(f"token id outside 0..{self.num_embeddings - 1}")
        uniq, inverse = torch.unique(flat, return_inverse=True)
        if self.qtype in FLOAT_TYPES:
            rows = self.data[uniq]
        elif self.native:
            rows = ggml_blocks.dequantize_rows(self.qtype, self.data, self.embedding_dim, uniq)
        else:
            rows = torch.from_numpy(kquants.dequantize(self.data[uniq].numpy(), self.qtype))
        return rows[inverse].reshape(*ids.shape, self.embedding_dim)

    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, type={self.qtype}"


def linear_from_gguf(qtype: str, raw, in_features: int, bias: torch.Tensor | None = None, *,
                     native: bool | None = None, terms: int = 2) -> QuantLinear:
    """A ``QuantLinear`` over one GGUF tensor's rows (see the module docstring).

    Args:
        qtype: the tensor's ggml type name (``tensor.tensor_type.name``).
        raw: numpy array or tensor, uint8 ``[N, row_bytes]`` (quantized) or float ``[N, K]``;
            copied, so the file's memory map can be dropped.
        in_features: ``K``, the weights per row.
        bias: fp32 ``[N]`` or None.
        native, terms: see ``QuantLinear``.

    Raises:
        ValueError: an unsupported type (naming it and listing ``SUPPORTED_TYPES``), or rows
            that are not ``in_features`` weights of that type.
    """
    return QuantLinear([(qtype, _as_data(qtype, raw, in_features))], in_features, bias, native=native, terms=terms)


def fuse(*layers: QuantLinear) -> QuantLinear:
    """One layer whose output is the layers' outputs side by side (their rows stacked). Each
    part keeps its type and bytes; neighbouring parts of one type become one part (their rows
    concatenated once, here), so that gate/up or q/k of one type cost one kernel call a step.
    Every output column is computed from its own row alone, so the bits do not change. Missing
    biases count as zeros.

    Raises:
        ValueError: no layers, or layers of different ``in_features``.
    """
    if not layers or len({la.in_features for la in layers}) != 1:
        raise ValueError(f"cannot fuse layers of in_features {[la.in_features for la in layers]}")
    bias = None
    if any(la.bias is not None for la in layers):
        bias = torch.cat([la.bias if la.bias is not None else torch.zeros(la.out_features) for la in layers])
    runs: list[tuple[str, list[torch.Tensor]]] = []
    for p in (p for la in layers for p in la.parts):
        if runs and runs[-1][0] == p.qtype:
            runs[-1][1].append(p.data)
        else:
            runs.append((p.qtype, [p.data]))
    parts = [(qtype, data[0] if len(data) == 1 else torch.cat(data)) for qtype, data in runs]
    return QuantLinear(parts, layers[0].in_features, bias, native=all(la.native for la in layers),
                       terms=layers[0].terms)


def embedding_from_gguf(qtype: str, raw, embedding_dim: int, *, native: bool | None = None) -> QuantEmbedding:
    """A ``QuantEmbedding`` over a GGUF tensor's rows (``token_embd.weight``: one row per token).

    Raises:
        ValueError: as ``linear_from_gguf``.
    """
    return QuantEmbedding(qtype, _as_data(qtype, raw, embedding_dim), embedding_dim, native=native)


def tied_lm_head(embedding: QuantEmbedding, *, terms: int = 2) -> QuantLinear:
    """The LM head of a tied-embedding model: the embedding's own bytes (shared, not copied)
    served by the quantized GEMM; fp32 hidden ``[M, dim]`` -> logits ``[M, num_embeddings]``."""
    return QuantLinear([(embedding.qtype, embedding.data)], embedding.embedding_dim, native=embedding.native,
                       terms=terms)


__all__ = ["FLOAT_TYPES", "SUPPORTED_TYPES", "QuantEmbedding", "QuantLinear", "check_type", "embedding_from_gguf",
           "fuse", "linear_from_gguf", "tied_lm_head"]
