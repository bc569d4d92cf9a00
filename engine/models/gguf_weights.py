"""Fill our model's parameters from a GGUF file's tensors.

Names: llama.cpp's (``gguf-py``'s ``constants.py``, ``MODEL_TENSORS``): ``token_embd``,
``output_norm``, ``output``, and per block ``blk.{i}.attn_norm``, ``attn_q/k/v``, ``attn_output``,
``attn_q_norm``/``attn_k_norm`` (Qwen3, Gemma 3), ``ffn_gate/up/down``; the other norms are each
architecture's (its model file's ``GGUF_NORMS``, through ``registry``: the Llama family's
``ffn_norm``, Gemma's ``post_attention_norm``/``ffn_norm``/``post_ffw_norm``). Q and K rows of an
architecture whose entry says ``gguf_qk_permuted`` (``llama``) are put back in transformers' order
(``quant.qk_row_order``: llama.cpp's converter interleaves each head's rotary halves). A file
without ``output.weight`` ties the LM head to the embedding.

``quantized_modules`` builds the quantized layers (projections, LM head, embedding) by the rule
of ``kernel_policy.layer_kind``: a quantized matrix stays the file's blocks (``QuantLinear``,
``QuantEmbedding``; a tied LM head shares the embedding's bytes), or int4 planes where the
AVX512 int4 kernels run. ``load_gguf_weights`` then fills the parameters that remain (norms,
float matrices, types no kernel reads), each decoded to fp32 by ``dequantize_tensor`` and cast
to the model's dtype.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from stencil.engine.models import registry

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
_TOP = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight"}


def dequantize_tensor(tensor) -> torch.Tensor:
    """fp32 copy of one GGUF tensor in torch's shape order (outermost dimension first).

    The one place a quantized GGUF tensor becomes dense: ``gguf.quants.dequantize`` (gguf-py's
    numpy decoders of ggml's block formats). Until native k-quant layers land
    (``stencil.engine.models.quant``'s ``linear_from_gguf`` / ``embedding_from_gguf`` factory), Q4_K, Q5_K,
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


_PARTS = {  # our projection (after "layers.{i}.") -> GGUF tensors whose rows it stacks, in our row order
    "attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def quantized_modules(gguf, spec, *, embedding: bool = True, route=None, terms: int | None = None) -> dict:
    """The modules that serve ``gguf``'s quantized matrices, keyed by our dotted module names
    (``layers.{i}.attn.qkv_proj``, ``.attn.o_proj``, ``.mlp.gate_up_proj``, ``.mlp.down_proj``,
    ``lm_head``, ``embed_tokens``); a layer ``kernel_policy.layer_kind`` calls dense is left out.

    Q and K rows of a ``gguf_qk_permuted`` architecture are reordered (``quant.qk_row_order``: whole
    rows of blocks, exact); biases are read as fp32. The LM head is ``output.weight``, else (tied
    embeddings) ``token_embd.weight``: with a ``QuantEmbedding`` the head shares its bytes
    (``gguf_layers.tied_lm_head``).

    Args:
        gguf: a ``gguf_file.GgufFile``.
        spec: the model's ``LlamaSpec`` / ``Gemma3Spec``.
        embedding: also build ``embed_tokens`` (a GGUF-native model; an HF directory reads its
            embedding from its safetensors).
        route: ``quant.RowRoute`` for the int4 layer projections (dense bf16 prompt rows).
        terms: the block kernel's activation terms (default ``kernel_policy.BLOCK_TERMS``).

    Raises:
        KeyError: a tensor the architecture needs is missing (named).
    """
    from stencil.engine.models.kernel_policy import BLOCK_TERMS, layer_kind

    terms = BLOCK_TERMS if terms is None else terms
    out: dict[str, nn.Module] = {}
    permute = qk_permuted(gguf)
    for i in range(spec.num_layers):
        for ours, theirs in _PARTS.items():
            names = [f"blk.{i}.{t}.weight" for t in theirs]
            for n in names:
                if n not in gguf.tensors:
                    raise KeyError(f"{gguf.path}: tensor {n} (for layers.{i}.{ours}) is missing")
            kind = layer_kind((gguf.tensors[n].tensor_type.name for n in names), terms)
            if kind == "dense":
                continue
            orders = [qk_order(t, gguf.tensors[n], spec) if permute else None for t, n in zip(theirs, names)]
            biases = [_bias(gguf, f"blk.{i}.{t}.bias", o) for t, o in zip(theirs, orders)]
            out[f"layers.{i}.{ours}"] = _layer(kind, [gguf.tensors[n] for n in names], orders, biases, route, terms)
    from stencil.engine.models.gguf_layers import embedding_from_gguf, tied_lm_head
    from stencil.engine.models.kernel_policy import BLOCK_TYPES

    emb = gguf.tensors.get("token_embd.weight")
    if emb is None:
        raise KeyError(f"{gguf.path}: tensor token_embd.weight is missing")
    head = gguf.tensors.get("output.weight", emb)
    kind = layer_kind([head.tensor_type.name], terms)
    if kind == "int4" and head is emb:
        # a tied Q8_0 head on the VNNI kernel: the embedding reads its rows from the packed head
        out["lm_head"] = _layer(kind, [head], [None], [None], None, terms)
        if embedding and getattr(out["lm_head"].native, "holds_q8_rows", False):
            from stencil.engine.models.quant import HeadEmbedding

            out["embed_tokens"] = HeadEmbedding(out["lm_head"])
            return out
    if embedding and emb.tensor_type.name in BLOCK_TYPES:
        out["embed_tokens"] = embedding_from_gguf(emb.tensor_type.name, emb.data, int(emb.shape[0]))
    if kind == "blocks" and head is emb and "embed_tokens" in out:
        out["lm_head"] = tied_lm_head(out["embed_tokens"], terms=terms)
    elif kind != "dense" and "lm_head" not in out:
        out["lm_head"] = _layer(kind, [head], [None], [None], None, terms)
    return out


def qk_permuted(gguf) -> bool:
    """Whether ``gguf``'s Q/K rows are in llama.cpp's interleaved order (its architecture's
    registry entry says ``gguf_qk_permuted``; False for an architecture the registry lacks)."""
    entry = registry.for_gguf(gguf.architecture)
    return entry is not None and entry.gguf_qk_permuted


def qk_order(kind: str, tensor, spec) -> torch.Tensor | None:
    """For a ``qk_permuted`` file's ``attn_q`` / ``attn_k``: the row order that undoes
    llama.cpp's Q/K permutation (``quant.qk_row_order``); None for other tensors."""
    from stencil.engine.models.quant import qk_row_order

    heads = {"attn_q": spec.num_heads, "attn_k": spec.num_kv_heads}.get(kind)
    return None if heads is None else qk_row_order(_rows(tensor), heads)


def _rows(tensor) -> int:
    return int(tensor.shape[-1]) if len(tensor.shape) > 1 else 1


def _bias(gguf, name: str, order: torch.Tensor | None) -> torch.Tensor | None:
    if name not in gguf.tensors:
        return None
    b = dequantize_tensor(gguf.tensors[name])
    return b if order is None else b[order]


def _layer(kind: str, tensors: list, orders: list, biases: list, route, terms: int) -> nn.Module:
    """One (fused) layer over GGUF tensors, rows reordered by ``orders`` (None: as stored),
    with per-part fp32 biases (None: zeros)."""
    if kind == "int4":
        from stencil.engine.models.quant import Int4Linear, concat_planes, permute_rows, planes_from_blocks

        planes = [planes_from_blocks(np.asarray(t.data), t.tensor_type.name) for t in tensors]
        planes = [p if o is None else permute_rows(p, o) for p, o in zip(planes, orders)]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b if b is not None else torch.zeros(p.shape[0]) for b, p in zip(biases, planes)])
        return Int4Linear(planes[0] if len(planes) == 1 else concat_planes(planes), bias, route=route)
    from stencil.engine.models.gguf_layers import fuse, linear_from_gguf

    layers = []
    for t, o, b in zip(tensors, orders, biases):
        raw = np.asarray(t.data)
        layers.append(linear_from_gguf(t.tensor_type.name, raw if o is None else raw[o.numpy()], int(t.shape[0]), b,
                                       terms=terms))
    return layers[0] if len(layers) == 1 else fuse(*layers)


def install(model: nn.Module, modules: dict) -> None:
    """Put ``modules`` (from ``quantized_modules``) in place of the model's submodules of the
    same names, checking their shapes.

    Raises:
        ValueError: a module's shape differs from what the model needs.
    """
    for name, module in modules.items():
        old = model.get_submodule(name)
        if name == "embed_tokens":
            got, want = (module.num_embeddings, module.embedding_dim), (old.num_embeddings, old.embedding_dim)
        else:
            got, want = (module.out_features, module.in_features), (old.out_features, old.in_features)
        if got != want:
            raise ValueError(f"{name}: the GGUF gives {list(got)}, the model needs {list(want)}")
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, attr, module)


def gguf_names(name: str, norms: dict[str, tuple[str, ...]]) -> tuple[str, ...]:
    """The GGUF tensors behind our parameter ``name`` (rows stacked in this order); ``norms``: the
    architecture's own per-layer norms (``registry.Architecture.gguf_norms``).

    Raises:
        KeyError: a parameter this mapping does not know.
    """
    if name in _TOP:
        return (_TOP[name],)
    _, index, rest = name.split(".", 2)
    table = {**_LAYER, **norms}
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
    from stencil.engine.models.quant import qk_row_order

    spec = model.spec
    norms = registry.for_spec(spec).gguf_norms
    target = torch.device(device) if device is not None else None
    permute = qk_permuted(gguf)
    for name, param in list(model.named_parameters(remove_duplicate=False)):
        if name == "lm_head.weight" and spec.tie_word_embeddings:
            continue
        parts = []
        for tname in gguf_names(name, norms):
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


__all__ = ["DENSE_TYPES", "dequantize_tensor", "gguf_names", "install", "load_gguf_weights", "qk_order",
           "qk_permuted", "quantized_modules"]
