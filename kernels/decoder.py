"""The C decoder (``csrc/decoder.c``): every layer of a Llama-family or Gemma 3 model in one call
a step, over CPU fp32 activations, quantized projections and the paged KV cache.

This module holds the ctypes mirror of the C structures and the entry points; which models and
weights it takes is decided by ``stencil.engine.models.native_decoder``, which builds the structures
from a loaded model. The C file lives in the ``stencil_layer_ops`` library
(``stencil.kernels.layer_ops.library``) beside the RMSNorm, RoPE and gated-activation kernels it calls
directly; the GEMM and attention kernels live in other libraries (other compiler flags) and are
called through the function pointers ``kernel_pointers`` returns.
"""

from __future__ import annotations

import ctypes

from stencil.kernels import ggml_blocks, layer_ops, native, vec_attention

MAX_PARTS = 4
KIND_VNNI, KIND_GGUF = 1, 2
ACT_SILU, ACT_GELU_TANH = 0, 1

_p, _i32, _i64, _f = ctypes.c_void_p, ctypes.c_int32, ctypes.c_int64, ctypes.c_float


class Part(ctypes.Structure):
    """One GGUF part of a fused projection: rows ``start .. start + rows`` of its output."""
    _fields_ = [("type", _i32), ("group", _i32), ("row_bytes", _i64), ("w", _p), ("start", _i32), ("rows", _i32)]


class Linear(ctypes.Structure):
    """A projection ``y [T, ldy] = x [T, k] @ W.T (+ bias)``: kind 1 (``native.PackedInt4``
    packed for VNNI) or 2 (GGUF blocks, up to ``MAX_PARTS`` parts)."""
    _fields_ = [("kind", _i32), ("k", _i32), ("n", _i32), ("ldy", _i32), ("bias", _p), ("codes", _p),
                ("scales", _p), ("zeros", _p), ("planes", _i32), ("nblocks", _i32), ("terms", _i32),
                ("nparts", _i32), ("parts", Part * MAX_PARTS)]


class Layer(ctypes.Structure):
    """A decoder layer: its norms (NULL where absent), projections, cache (and its slots), attention
    window, and which of the step's block tables it reads (1: a hybrid cache's window group)."""
    _fields_ = [("attn_in_norm", _p), ("attn_out_norm", _p), ("mlp_in_norm", _p), ("mlp_out_norm", _p),
                ("q_norm", _p), ("k_norm", _p), ("qkv", Linear), ("o", Linear), ("gate_up", Linear),
                ("down", Linear), ("k_cache", _p), ("v_cache", _p), ("num_slots", _i64), ("window", _i32),
                ("rope", _i32), ("table", _i32), ("scale", _f)]


class Model(ctypes.Structure):
    """The stack's shapes, the kernels' pointers and the layers."""
    _fields_ = [("num_layers", _i32), ("hidden", _i32), ("heads", _i32), ("kv_heads", _i32), ("head_dim", _i32),
                ("inter", _i32), ("act", _i32), ("cache_kind", _i32), ("block_size", _i32), ("eps", _f),
                ("vnni_gemm", _p), ("gguf_quantize", _p), ("gguf_gemm", _p), ("attention", _p),
                ("layers", ctypes.POINTER(Layer))]


class Step(ctypes.Structure):
    """One step's tokens: the residual stream ``h`` (in and out), RoPE rows, cache slots and block
    tables (two of each: group 0's and a window group's, the same with one group), the attention
    metadata and the workspace."""
    _fields_ = [("t", _i32), ("num_seqs", _i32), ("max_blocks", _i32), ("threads", _i32), ("h", _p),
                ("cos", _p * 2), ("sin", _p * 2), ("slots", _p * 2), ("block_tables", _p * 2),
                ("query_start_loc", _p), ("seq_lens", _p), ("workspace", _p), ("workspace_bytes", _i64)]


def library() -> ctypes.CDLL | None:
    """The library holding ``stencil_decoder_forward``, or None where it does not build (the
    caller keeps its torch-driven layers)."""
    lib = layer_ops.library()
    if lib is None or not hasattr(lib, "stencil_decoder_forward"):
        return None
    return lib


def kernel_pointers(attention: str) -> dict[str, int] | None:
    """Addresses of the kernels the decoder calls through pointers: ``vnni_gemm``,
    ``gguf_quantize``, ``gguf_gemm`` (0 where that library is not built) and ``attention``
    (``"avx512"``: ``csrc/attention.c``; ``"vec"``: ``csrc/vec_attention.c``); None when the
    attention kernel named is not available."""
    def addr(lib, name: str) -> int:
        return 0 if lib is None else ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

    att_lib, att_name = ((native.library(), "stencil_paged_attention") if attention == "avx512"
                         else (vec_attention.library(), "stencil_vec_attention"))
    if att_lib is None:
        return None
    nat = native.library() if native.vnni_available() else None
    return {"vnni_gemm": addr(nat, "stencil_vnni_gemm"),
            "gguf_quantize": addr(ggml_blocks.library(), "stencil_gguf_quantize"),
            "gguf_gemm": addr(ggml_blocks.library(), "stencil_gguf_gemm"),
            "attention": addr(att_lib, att_name)}


__all__ = ["ACT_GELU_TANH", "ACT_SILU", "KIND_GGUF", "KIND_VNNI", "Layer", "Linear", "MAX_PARTS", "Model", "Part",
           "Step", "kernel_pointers", "library"]
