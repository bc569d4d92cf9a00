"""Our forward for the Llama family: Llama / SmolLM / Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

One flat batch of tokens with no padding goes through the decoder; attention reads and writes
a paged KV cache through an ``AttentionBackend`` (``stencil.kernels.attention_backend``). Q, K and V come from one
fused projection and the MLP's gate and up from another, so a decode step runs two matmuls
where transformers runs five.

Every linear layer is a module with ``forward(x [N, in_features]) -> [N, out_features]``
(``DenseLinear`` here); a quantized module with the same call can replace any of them by
attribute assignment (see ``LlamaForCausalLM.linear_layers``) without touching the attention
or MLP code.

Sources: Llama (Touvron et al. 2023, arXiv 2302.13971): pre-norm RMSNorm (Zhang & Sennrich
2019, arXiv 1910.07467), SwiGLU MLP (Shazeer 2020, arXiv 2002.05202), rotary position
embedding (Su et al. 2021, arXiv 2104.09864) in the "rotate half" layout of transformers'
``modeling_llama``; Qwen3's per-head q/k RMSNorm as in transformers' ``modeling_qwen3``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from stencil.engine.models.rope import RopeSpec, RopeTable
from stencil.engine.models.architecture import LlamaSpec
from stencil.engine.models.native_decoder import DecoderPlan, plan_key
from stencil.kernels import layer_ops
from stencil.kernels.attention_backend import AttentionBackend, AttentionMetadata
from stencil.kernels.layer_ops import apply_rope


class DenseLinear(nn.Module):
    """``y = x @ weight.T + bias`` with frozen weights.

    Attributes:
        weight: ``[out_features, in_features]``.
        bias: ``[out_features]`` or ``None``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, *,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param((out_features, in_features), dtype, device)
        self.bias = _empty_param((out_features,), dtype, device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, in] -> [N, out]
        return F.linear(x, self.weight, self.bias)


class DenseEmbedding(nn.Module):
    """Token embedding ``ids int64 [...] -> [..., dim]`` from a frozen dense matrix.

    Attributes:
        weight: ``[num_embeddings, dim]``. A quantized module with the same call
            (``gguf_layers.QuantEmbedding``) can replace it by attribute assignment.
    """

    def __init__(self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, dim
        self.weight = _empty_param((num_embeddings, dim), dtype, device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dim, computed in fp32 (as HF)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call (native on CPU: stencil.kernels.layer_ops.rms_norm); the same products as below.
            return layer_ops.rms_norm(x, self.weight, self.eps)
        normed = F.rms_norm(x.float(), self.weight.shape, eps=self.eps)
        return self.weight * normed.to(x.dtype)


FLAT_CACHE_BACKENDS = ("cpu", "torch")
"""Attention backends whose KV cache is the flat ``[slot, kv_heads, head_dim]`` layout that
``stencil.kernels.layer_ops.rope_and_cache`` writes itself (one native call for RoPE and the write)."""


def rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, meta: AttentionMetadata, backend: AttentionBackend):
    """RoPE on q and k, k and v into the cache (``stencil.kernels.layer_ops.rope_and_cache``, natively
    for the flat-cache backends); the rotated q ``[T, heads, head_dim]``."""
    return layer_ops.rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, meta.slot_mapping, backend.reshape_and_cache,
                                    flat_cache=backend.name in FLAT_CACHE_BACKENDS)


class Attention(nn.Module):
    """Self-attention over the paged cache: fused QKV, optional q/k norm, RoPE, cache write,
    backend attention, output projection. ``[T, hidden] -> [T, hidden]``.

    ``window``: the layer's sliding window (tokens; None: full causal attention), masked by the
    backend exactly (``stencil.kernels.attention_backend``)."""

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype, device: torch.device,
                 window: int | None = None) -> None:
        super().__init__()
        self.window = window
        self.num_heads, self.num_kv_heads, self.head_dim = (
            spec.num_heads, spec.num_kv_heads, spec.head_dim)
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.scale = spec.head_dim ** -0.5
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = DenseLinear(spec.hidden_size, self.q_size + 2 * self.kv_size,
                                    spec.qkv_bias, **kw)
        self.o_proj = DenseLinear(self.q_size, spec.hidden_size, spec.o_bias, **kw)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **kw) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps, **kw) if spec.qk_norm else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, meta, backend)
        if self.window is None:
            o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        else:
            o = backend.forward(q, k_cache, v_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up fused in one projection."""

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = DenseLinear(spec.hidden_size, 2 * spec.intermediate_size,
                                        spec.mlp_bias, **kw)
        self.down_proj = DenseLinear(spec.intermediate_size, spec.hidden_size, spec.mlp_bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden] -> [T, hidden]
        # silu(gate) * up in one call (stencil.kernels.layer_ops.glu): the C decoder's bits
        return self.down_proj(layer_ops.glu(self.gate_up_proj(x), "silu"))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``h + attn(norm(h))``, then ``h + mlp(norm(h))``."""

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype, device: torch.device,
                 window: int | None = None) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.input_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.attn = Attention(spec, window=window, **kw)
        self.post_attn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.mlp = MLP(spec, **kw)

    def forward(self, h, cos, sin, k_cache, v_cache, meta, backend) -> torch.Tensor:
        h = h + self.attn(self.input_norm(h), cos, sin, k_cache, v_cache, meta, backend)
        return h + self.mlp(self.post_attn_norm(h))


class LlamaForCausalLM(nn.Module):
    """The decoder stack plus the LM head, over a flat token batch and a paged KV cache.

    Parameters are created uninitialised (on ``device="meta"``: without memory); fill them
    with ``stencil.engine.models.loader``, which builds on meta and places weights as it reads them.
    Parameter
    names: ``embed_tokens.weight``, ``layers.{i}.input_norm.weight``,
    ``layers.{i}.attn.qkv_proj.{weight,bias}`` (rows: q, then k, then v),
    ``layers.{i}.attn.o_proj.weight``, ``layers.{i}.attn.{q,k}_norm.weight`` (Qwen3),
    ``layers.{i}.post_attn_norm.weight``, ``layers.{i}.mlp.gate_up_proj.weight`` (rows: gate,
    then up), ``layers.{i}.mlp.down_proj.weight``, ``norm.weight``, ``lm_head.weight`` (the
    embedding itself when ``spec.tie_word_embeddings``; see ``tie_weights``).

    Args:
        spec: the architecture (``LlamaSpec.from_hf_config``).
        dtype: weight dtype.
        device: where weights and the RoPE tables live; ``"meta"`` defers both (see
            ``build_rope_tables``).
    """

    def __init__(self, spec: LlamaSpec, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        kw = dict(dtype=dtype, device=device)
        self.spec = spec
        self.embed_tokens = DenseEmbedding(spec.vocab_size, spec.hidden_size, **kw)
        self.layers = nn.ModuleList(DecoderLayer(spec, window=spec.layer_window(i), **kw)
                                    for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.lm_head = DenseLinear(spec.hidden_size, spec.vocab_size, False, **kw)
        self.build_rope_tables(device, dtype)
        if spec.tie_word_embeddings:
            self.tie_weights()
        # Set by the int4 loader when prompt rows take another kernel (``quant.RowRoute``).
        self.row_route = None
        self._decoder: tuple | None = None  # (plan key, DecoderPlan or None): see decoder_plan

    def build_rope_tables(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """(Re)make the cos/sin table (``rope.RopeTable``: rows ``[head_dim // 2]`` per position
        up to ``max_position_embeddings``, grown as positions arrive on CPU) on ``device`` in
        ``dtype`` (HF casts its tables to the activation dtype too)."""
        spec = self.spec
        self.rope = RopeTable(spec.rope, spec.head_dim, spec.max_position_embeddings, device, dtype)

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def num_kv_heads(self) -> int:
        return self.spec.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def vocab_size(self) -> int:
        return self.spec.vocab_size

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype: the final norm's (norms are never quantized)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    @property
    def max_context_len(self) -> int:
        """Longest sequence this forward computes exactly: the position table's length (sliding
        windows are masked by the attention backend, so they set no limit)."""
        return self.spec.max_position_embeddings

    def tie_weights(self) -> None:
        """Make a dense LM head share a dense embedding's matrix (``tie_word_embeddings``); a
        quantized head is tied by its loader (``gguf_layers.tied_lm_head`` shares the
        embedding's bytes; an int4 head holds its own planes of the same weights)."""
        if isinstance(self.lm_head, DenseLinear) and isinstance(self.embed_tokens, DenseEmbedding):
            self.lm_head.weight = self.embed_tokens.weight

    def linear_layers(self) -> Iterator[tuple[str, nn.Module]]:
        """``(dotted name, module)`` of every projection a quantized module may replace:
        ``layers.{i}.attn.qkv_proj``, ``.attn.o_proj``, ``.mlp.gate_up_proj``, ``.mlp.down_proj``."""
        for i, layer in enumerate(self.layers):
            for name in ("attn.qkv_proj", "attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
                yield f"layers.{i}.{name}", layer.get_submodule(name)

    def decoder_plan(self, kv_caches, backend):
        """The C decoder's plan for these caches and backend (``stencil.engine.models.native_decoder``),
        built on first use; None where the model, its weights or the backend are not what the
        C decoder runs (the torch-driven layers then run, with the same bits). Call
        ``drop_decoder_plan`` after replacing a layer or a weight tensor."""
        key = plan_key(kv_caches, backend)
        if self._decoder is None or self._decoder[0] != key:
            self._decoder = (key, DecoderPlan.build(self, kv_caches, backend))
        return self._decoder[1]

    def drop_decoder_plan(self) -> None:
        """Forget the C decoder's plan (it holds the weights' addresses)."""
        self._decoder = None

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,  # int64 [T]
        positions: torch.Tensor,  # int64 [T]
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer K, V
        meta: AttentionMetadata,
        backend: AttentionBackend,
        prompt_mask: torch.Tensor | None = None,  # bool [T]
    ) -> torch.Tensor:  # [T, hidden_size], final norm applied
        """Run the decoder over a flat batch, writing each new token's K/V into its cache slot.

        Args:
            input_ids: token ids ``[T]``.
            positions: position of each token in its sequence ``[T]`` (< ``max_context_len``;
                past ``max_position_embeddings`` the table lookup raises IndexError).
            kv_caches: one ``(k_cache, v_cache)`` per layer, each
                ``[num_blocks, block_size, num_kv_heads, head_dim]`` in ``self.dtype`` (a layer with
                a window may have a cache of its own size: a hybrid cache's sliding-window group).
            meta: where each token's sequence and cache slots are (a windowed layer reads
                ``meta.for_window()``).
            backend: the attention implementation.
            prompt_mask: which tokens are prompt tokens; only read when ``row_route`` is set
                (int4 layers with a dense copy for prompt rows), else ignored.

        Returns:
            Final-normed hidden states ``[T, hidden_size]`` in ``self.dtype``.

        Raises:
            ValueError: ``kv_caches`` does not hold one pair per layer.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache pairs, got {len(kv_caches)}")
        # One table lookup per step, shared by every layer.
        cos, sin = self.rope.lookup(positions)
        h = self.embed_tokens(input_ids)
        if h.dtype != self.dtype:  # a quantized embedding gives fp32 rows
            h = h.to(self.dtype)
        plan = self.decoder_plan(kv_caches, backend)
        if plan is not None:
            h = h.contiguous()
            plan.run(h, [(cos, sin)], meta)
            return self.norm(h)
        if self.row_route is not None:
            self.row_route.set(prompt_mask)
        metas = (meta, meta.for_window())  # a windowed layer may read its own KV cache group
        try:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                h = layer(h, cos, sin, k_cache, v_cache, metas[layer.attn.window is not None], backend)
        finally:
            if self.row_route is not None:
                self.row_route.clear()
        return self.norm(h)

    @torch.no_grad()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head: ``hidden [R, hidden_size]`` -> fp32 logits ``[R, vocab_size]``."""
        return self.finish_logits(self.lm_head(hidden).float())

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """What follows the LM head's product (nothing here; Gemma's soft-capping): the runner
        calls it on logits it computed from ``lm_head`` itself (a grammar's sparse columns)."""
        return logits


def _empty_param(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


GGUF_NORMS = {"post_attn_norm.weight": ("ffn_norm.weight",)}
"""Our per-layer norms (after ``layers.{i}.``) -> their GGUF tensors (after ``blk.{i}.``), besides
the shared ``attn_norm`` / ``attn_{q,k}_norm`` (``gguf_weights``): HF's post_attention_layernorm is
llama.cpp's ``ffn_norm``, the norm before the MLP."""


def hf_tensor(name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The transformers tensor(s) behind our parameter ``name`` (``LlamaForCausalLM``'s names),
    fused where we fuse: q/k/v rows stacked into ``qkv_proj``, gate/up into ``gate_up_proj``.

    Raises:
        KeyError: ``get`` lacks a tensor (its message).
    """
    if name == "lm_head.weight":
        return get("lm_head.weight")
    if name in ("embed_tokens.weight", "norm.weight"):
        return get(f"model.{name}")
    _, index, rest = name.split(".", 2)  # "layers", "3", "attn.qkv_proj.weight"
    hf_layer = f"model.layers.{index}."
    if rest.startswith("attn.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]
        return torch.cat([get(f"{hf_layer}self_attn.{p}_proj.{kind}") for p in "qkv"])
    if rest.startswith("mlp.gate_up_proj."):
        kind = rest.rsplit(".", 1)[1]
        return torch.cat([get(f"{hf_layer}mlp.{p}_proj.{kind}") for p in ("gate", "up")])
    renamed = {
        "input_norm.weight": "input_layernorm.weight",
        "post_attn_norm.weight": "post_attention_layernorm.weight",
    }.get(rest)
    if renamed is None:
        renamed = rest.replace("attn.", "self_attn.", 1) if rest.startswith("attn.") else rest
    return get(hf_layer + renamed)


__all__ = ["Attention", "DecoderLayer", "DenseEmbedding", "DenseLinear", "GGUF_NORMS", "LlamaForCausalLM", "LlamaSpec",
           "MLP", "RMSNorm", "RopeSpec", "apply_rope", "hf_tensor", "rope_and_cache"]
