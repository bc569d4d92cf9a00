"""A fast reader of GGUF files: metadata, tensor directory, and memory-mapped tensor data.

``gguf.GGUFReader`` builds a numpy view for every element of every metadata array, so a
262,144-token vocabulary (three arrays of that length) takes it 45 s on this 2-core machine
before a single weight is read. This reader walks the same format (ggml's specification,
github.com/ggml-org/ggml/blob/master/docs/gguf.md; gguf-py's ``gguf_reader.py`` reads it the same
way) with ``struct`` over one memory map: strings decoded once, numeric arrays as one
``np.frombuffer`` each. Gemma 3 270M's header is read in well under a second.

Format (little-endian; version 2 and 3)::

    "GGUF"  u32 version  u64 tensor_count  u64 kv_count
    kv_count x (string key, u32 value_type, value)      value_type 9 = array: u32 type, u64 n, items
    tensor_count x (string name, u32 n_dims, u64 dims[n_dims], u32 ggml_type, u64 offset)
    padding to general.alignment (default 32), then the tensor data (offsets relative to it)

A string is ``u64 length`` + UTF-8 bytes. ``dims[0]`` is the innermost (contiguous) dimension.

``GgufFile`` also answers the calls one makes of a ``quant.GgufWeights`` (``architecture``,
``tensors``, ``qtype``, ``planes``, ``dequantized``, ``count``), without gguf-py's slower parse.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value_type -> (struct format, numpy dtype) of the scalar types
_SCALARS: dict[int, tuple[str, Any]] = {
    0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
    4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
    10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64),
}
_STRING, _ARRAY = 8, 9


class GgufFormatError(ValueError):
    """The file is not a GGUF this reader understands (the message says why)."""


@dataclass(frozen=True, slots=True)
class GgufTensor:
    """One tensor of the directory.

    Attributes:
        name: e.g. ``blk.0.attn_q.weight``.
        tensor_type: ``gguf.GGMLQuantizationType``.
        shape: int64 ``[n_dims]`` in GGUF order (innermost first), as ``GGUFReader`` gives.
        data: a read-only view of the file: float arrays (F32, F16, F64, I8..I64) in torch's
            shape order (outermost first); block-quantized ones (and BF16) as uint8
            ``[..., row_bytes]``, one weight row per array row for a matrix.
    """

    name: str
    tensor_type: Any
    shape: np.ndarray
    data: np.ndarray


class GgufFile:
    """A GGUF file's metadata and tensors (see the module docstring).

    Attributes:
        path: the file.
        metadata: key -> value: ints, floats, bools and strings as Python values, numeric arrays
            as numpy arrays, string arrays as lists of ``str``.
        tensors: name -> ``GgufTensor``, in file order.
        architecture: ``general.architecture`` (``""`` if absent).
        header_bytes: length of everything before the tensor data (metadata and directory).

    Raises:
        FileNotFoundError: no such file.
        GgufFormatError: not a GGUF, a big-endian or version-1 file, or a truncated one.
    """

    def __init__(self, path: Path | str) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        if self.path.stat().st_size < 24:  # magic, version, two counts; numpy cannot map an empty file
            raise GgufFormatError(f"{self.path} is not a GGUF file ({self.path.stat().st_size} bytes, "
                                  "shorter than a GGUF header)")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        buf = memoryview(self._map)
        if bytes(buf[:4]) != GGUF_MAGIC:
            raise GgufFormatError(f"{self.path} is not a GGUF file (magic {bytes(buf[:4])!r})")
        (version,) = struct.unpack_from("<I", buf, 4)
        if version not in (2, 3):
            raise GgufFormatError(f"{self.path}: GGUF version {version} (big-endian or v1?) is not supported; "
                                  "expected 2 or 3")
        try:
            n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
            pos = 24
            self.metadata: dict[str, Any] = {}
            for _ in range(n_kv):
                key, pos = _string(buf, pos)
                (vtype,), pos = struct.unpack_from("<I", buf, pos), pos + 4
                self.metadata[key], pos = _value(buf, pos, vtype)
            directory = []
            for _ in range(n_tensors):
                name, pos = _string(buf, pos)
                (n_dims,) = struct.unpack_from("<I", buf, pos)
                dims = np.frombuffer(buf, np.uint64, n_dims, pos + 4).astype(np.int64)
                pos += 4 + 8 * n_dims
                ggml_type, offset = struct.unpack_from("<IQ", buf, pos)
                pos += 12
                directory.append((name, dims, ggml_type, offset))
        except struct.error as e:
            raise GgufFormatError(f"{self.path}: truncated header ({e})") from None
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        self.header_bytes = pos + (-pos % align)
        self.tensors: dict[str, GgufTensor] = {}
        for name, dims, ggml_type, offset in directory:
            try:
                qtype = GGMLQuantizationType(ggml_type)
            except ValueError:
                raise GgufFormatError(f"{self.path}: tensor {name} has unknown ggml type {ggml_type}") from None
            self.tensors[name] = GgufTensor(name, qtype, dims, self._tensor_data(
                self.header_bytes + offset, dims, qtype, GGML_QUANT_SIZES[qtype], name))
        arch = self.metadata.get("general.architecture", "")
        self.architecture = arch if isinstance(arch, str) else ""

    def _tensor_data(self, start: int, dims: np.ndarray, qtype, sizes: tuple[int, int], name: str) -> np.ndarray:
        block, type_size = sizes
        shape = tuple(int(d) for d in reversed(dims.tolist()))
        typed = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}.get(qtype.name)
        if typed is not None:
            count = int(np.prod(shape))
            nbytes = count * np.dtype(typed).itemsize
            view = self._map[start:start + nbytes]
            if view.size != nbytes:
                raise GgufFormatError(f"{self.path}: tensor {name} runs past the end of the file")
            return view.view(typed).reshape(shape)
        if shape[-1] % block:
            raise GgufFormatError(f"{self.path}: tensor {name} row of {shape[-1]} is not whole {qtype.name} blocks")
        byte_shape = (*shape[:-1], shape[-1] // block * type_size)
        nbytes = int(np.prod(byte_shape))
        view = self._map[start:start + nbytes]
        if view.size != nbytes:
            raise GgufFormatError(f"{self.path}: tensor {name} runs past the end of the file")
        return view.reshape(byte_shape)

    def get(self, key: str, default: Any = None) -> Any:
        """A metadata value, or ``default``."""
        return self.metadata.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        """``{architecture}.{key}`` (``arch_get("block_count")`` is ``llama.block_count``)."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def header_digest(self) -> str:
        """SHA-256 (hex) of the header: metadata and tensor directory, everything a tokenizer or
        a config is derived from, hashed without reading the weights."""
        import hashlib

        return hashlib.sha256(memoryview(self._map)[:self.header_bytes]).hexdigest()

    # -- the calls one makes of a quant.GgufWeights ----------------------------------------------

    def qtype(self, name: str) -> str:
        """ggml type name of tensor ``name`` (``"Q4_1"``, ``"F32"``, ...). Raises KeyError."""
        return self.tensors[name].tensor_type.name

    def planes(self, name: str):
        """Exact int4 planes of a Q4_0/Q4_1/Q8_0 matrix (``quant.planes_from_blocks``)."""
        from stencil.engine.models.quant import planes_from_blocks

        t = self.tensors[name]
        return planes_from_blocks(np.asarray(t.data), t.tensor_type.name)

    def dequantized(self, name: str) -> torch.Tensor:
        """fp32 tensor in torch's shape order, decoded by ``gguf.quants.dequantize``."""
        from stencil.engine.models.gguf_weights import dequantize_tensor

        return dequantize_tensor(self.tensors[name])

    def count(self, types: frozenset[str]) -> int:
        """How many tensors are of one of ``types`` (names like ``"Q4_1"``)."""
        return sum(t.tensor_type.name in types for t in self.tensors.values())


def _string(buf: memoryview, pos: int) -> tuple[str, int]:
    (n,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + n
    if end > len(buf):
        raise struct.error("string runs past the end of the file")
    return bytes(buf[pos + 8:end]).decode("utf-8", errors="replace"), end


def _value(buf: memoryview, pos: int, vtype: int) -> tuple[Any, int]:
    if vtype == _STRING:
        return _string(buf, pos)
    if vtype in _SCALARS:
        fmt, _ = _SCALARS[vtype]
        (v,) = struct.unpack_from(fmt, buf, pos)
        return v, pos + struct.calcsize(fmt)
    if vtype == _ARRAY:
        etype, n = struct.unpack_from("<IQ", buf, pos)
        pos += 12
        if etype == _STRING:
            out = []
            for _ in range(n):
                s, pos = _string(buf, pos)
                out.append(s)
            return out, pos
        if etype in _SCALARS:
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            if pos + n * dtype.itemsize > len(buf):
                raise struct.error("array runs past the end of the file")
            return np.frombuffer(buf, dtype, n, pos).copy(), pos + n * dtype.itemsize
        if etype == _ARRAY:  # arrays of arrays (rare): each item is a whole array value
            out = []
            for _ in range(n):
                v, pos = _value(buf, pos, _ARRAY)
                out.append(v)
            return out, pos
    raise struct.error(f"unknown GGUF value type {vtype}")
