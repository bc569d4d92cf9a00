"""Fill our model's parameters from a GGUF file's tensors.

Names: llama.cpp's (``gguf-py``'s ``constants.py``, ``MODEL_TENSORS``): ``token_embd``,
``output_norm``, ``output``, and per block ``blk.{i}.attn_norm``, ``attn_q/k/v``, ``attn_output``,
``attn_q_norm``/``attn_k_norm`` (Qwen3, Gemma 3), ``ffn_norm``, ``ffn_gate/up/down``, and Gemma's
``post_attention_norm``/``post_ffw_norm``. Q and K rows of the ``llama`` architecture are put back
in transformers' order (``quant.qk_row_order``: llama.cpp's converter interleaves each head's
rotary halves). A file without ``output.weight`` ties the LM head to the embedding.

Every tensor that is not served by a quantized layer (``quant.int4_projections``) is decoded to
fp32 by ``dequantize_tensor`` and cast to the model's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

DENSE_TYPES = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
               "Q5_K", "Q6_K")
"""GGUF tensor types this loader decodes (ggml's float, legacy and k-quant types); the IQ, TQ and
FP4 types are refused with a message naming them."""

_LAYER = {  # our parameter (after "layers.{i}.") -> GGUF tensors (after "blk.{i}."), rows stacked
    "input_norm.weight": ("attn_norm.weight",),
    "attn.qkv_proj.weight": ("attn_q.weight", "attn_k.weight", "attn_v.weight"),
    "attn.qkv_proj.bias": ("attn_q.bias", "attn_k.bias", "attn_v.bias"),
    "attn.o_proj.weight": ("attn_output.weight",),
    "attn.o_proj.bias": ("attn_output.bias",),
    "attn.q_norm.weight": ("attn_q_norm.weight",),
    "attn.k_norm.weight": ("attn_k_norm.weight",),
    "mlp.gate_up_proj.weight": ("ffn_gate.weight", "ffn_up.weight"),
    "mlp.gate_up_proj.bias": ("ffn_gate.bias", "ffn_up.bias"),
    "mlp.down_proj.weight": ("ffn_down.weight",),
    "mlp.down_proj.bias": ("ffn_down.bias",),
}
_LLAMA_NORMS = {"post_attn_norm.weight": ("ffn_norm.weight",)}  # HF post_attention_layernorm: before the MLP
_GEMMA_NORMS = {
    "post_attn_norm.weight": ("post_attention_norm.weight",),
    "pre_mlp_norm.weight": ("ffn_norm.weight",),
    "post_mlp_norm.weight": ("post_ffw_norm.weight",),
}
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def dequantize_tensor(tensor) -> torch.Tensor:
    """fp32 copy of one GGUF tensor in torch's shape order (outermost dimension first).

    The one place a quantized GGUF tensor becomes dense: ``gguf.quants.dequantize`` (gguf-py's
    numpy decoders of ggml's block formats). Until native k-quant layers land
    (``engine.models.quant``'s ``linear_from_gguf`` / ``embedding_from_gguf`` factory), Q4_K, Q5_K,
    Q6_K and the other types outside ``quant.INT4_TYPES`` are served dense through here: swap the
    callers of this function for that factory to keep them quantized.

    Args:
        tensor: a ``gguf_file.GgufTensor`` (or gguf-py's ``ReaderTensor``).

    Raises:
        ValueError: a type outside ``DENSE_TYPES`` (the message names it and the supported ones).
    """
    from gguf.quants import dequantize

    name = tensor.tensor_type.name
    if name not in DENSE_TYPES:
        raise ValueError(f"tensor {tensor.name} has GGUF type {name}, which Stencil does not read; "
                         f"supported: {', '.join(DENSE_TYPES)}")
    shape = tuple(int(s) for s in reversed(tensor.shape.tolist()))
    data = np.asarray(tensor.data)
    if name == "F32":
        return torch.from_numpy(np.array(data, np.float32)).reshape(shape)
    return torch.from_numpy(np.asarray(dequantize(data, tensor.tensor_type), np.float32)).reshape(shape)


def gguf_names(name: str, model_type: str) -> tuple[str, ...]:
    """The GGUF tensors behind our parameter ``name`` (rows stacked in this order).

    Raises:
        KeyError: a parameter this mapping does not know.
    """
    if name in _TOP:
        return (_TOP[name],)
    _, index, rest = name.split(".", 2)
    table = {**_LAYER, **(_GEMMA_NORMS if model_type == "gemma3" else _LLAMA_NORMS)}
    return tuple(f"blk.{index}.{t}" for t in table[rest])


def load_gguf_weights(model: nn.Module, gguf, *, device: torch.device | str | None = None) -> None:
    """Replace every parameter of ``model`` with its GGUF tensor(s), decoded and cast to the
    parameter's dtype, on ``device`` (default: where the parameter is). Projections already
    replaced by quantized layers have no parameters and are skipped.

    Args:
        model: a ``LlamaForCausalLM`` or ``Gemma3ForCausalLM`` (parameters may be on meta).
        gguf: a ``gguf_file.GgufFile``.

    Raises:
        KeyError: a tensor the architecture needs is missing from the file (named).
        ValueError: a tensor's shape does not match the architecture, or its type is unsupported.
    """
    from engine.models.quant import qk_row_order

    spec = model.spec
    target = torch.device(device) if device is not None else None
    permute = gguf.architecture == "llama"
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        parts = []
        for tname in gguf_names(name, spec.model_type):
            if tname not in gguf.tensors:
                raise KeyError(f"{gguf.path}: tensor {tname} (for {name}) is missing")
            t = dequantize_tensor(gguf.tensors[tname])
            kind = tname.split(".")[2] if tname.startswith("blk.") else ""
            heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}.get(kind)
            if permute and heads:
                t = t[qk_row_order(t.shape[0], heads)]
            parts.append(t)
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts)
        if tensor.shape != param.shape:
            raise ValueError(f"{name}: GGUF {gguf.path} gives {tuple(tensor.shape)}, the model needs "
                             f"{tuple(param.shape)}")
        module_name, _, attr = name.rpartition(".")
        # Into memory torch allocates (64-byte aligned): the decoders' numpy buffers need not be,
        # and a GEMV's reduction order (so its low bits) can depend on the alignment of its rows.
        data = torch.empty(param.shape, dtype=param.dtype, device=target or param.device).copy_(tensor)
        new = nn.Parameter(data, requires_grad=False)
        setattr(model.get_submodule(module_name), attr, new)
    if spec.tie_word_embeddings:
        model.tie_weights()


__all__ = ["DENSE_TYPES", "dequantize_tensor", "gguf_names", "load_gguf_weights"]
