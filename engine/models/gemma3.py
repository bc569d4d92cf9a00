"""Our forward for Gemma 3's text decoder (``gemma3`` GGUFs, transformers' ``gemma3_text``).

What differs from the Llama family (``stencil.engine.models.llama``), as in transformers'
``modeling_gemma3`` and llama.cpp's ``gemma3`` graph:

* RMSNorm multiplies by ``1 + w``. We hold ``1 + w`` itself as the norm's weight: that is what a
  GGUF stores (llama.cpp's converter adds 1 to every Gemma ``*norm.weight``; transformers' GGUF
  loader subtracts it again), and an HF checkpoint's ``w`` gets 1 added on load
  (``hf_tensor``). The product is taken in fp32 and cast back, as transformers does;
* four norms per layer: before and after attention, before and after the MLP, the "after" ones
  applied to the block's output before the residual add;
* per-head RMSNorm (``1 + w`` too) on q and k before RoPE;
* GeGLU MLP: ``down(gelu_tanh(gate(x)) * up(x))``;
* embeddings scaled by ``sqrt(hidden_size)``, the factor rounded to the embedding's dtype first
  (transformers' ``Gemma3TextScaledWordEmbedding``); the LM head is the embedding (tied);
* attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim ** -0.5``);
* local layers: a sliding window (512 tokens in the released models) and their own RoPE base
  (10,000), interleaved with global layers (full attention, base 1,000,000, optionally linearly
  scaled); in the released models every 6th layer is global;
* optional final logit soft-capping ``cap * tanh(logits / cap)`` (``final_logit_softcapping``;
  Gemma 3 ships without it). Attention-logit soft-capping (Gemma 2) is refused.

A local layer's attention masks its window exactly in the backend (``stencil.kernels.attention_backend``).
Its KV cache holds only the window: the engine keeps the local layers in a KV cache group of their
own (vLLM's hybrid KV cache allocator, llama.cpp's SWA cache: ``stencil.engine.kv_cache_manager``), whose
blocks are given back once they fall out of every later query's window, while the global layers
keep every position. The local layers read that group's block tables through
``AttentionMetadata.for_window``. ``EngineConfig.hybrid_kv_cache=False`` keeps every position of
every layer in one group instead (the same outputs, bit for bit).

Sources: Gemma Team, "Gemma 3 Technical Report" (2025, arXiv 2503.19786); GeGLU (Shazeer 2020,
arXiv 2002.05202); RMSNorm (Zhang & Sennrich 2019, arXiv 1910.07467).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.gguf_hparams import UnsupportedModelError, common_sizes, need, rope_spec
from stencil.engine.models.llama import DenseEmbedding, DenseLinear, LlamaForCausalLM, _empty_param, rope_and_cache
from stencil.engine.models.rope import RopeSpec, RopeTable
from stencil.kernels import layer_ops
from stencil.kernels.attention_backend import AttentionBackend, AttentionMetadata

SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_SLIDING_WINDOW_PATTERN = 6  # every 6th layer global: transformers' and llama.cpp's default
DEFAULT_LOCAL_ROPE_THETA = 10_000.0


@dataclass(frozen=True, slots=True)
class Gemma3Spec:
    """Everything the Gemma 3 forward needs.

    Attributes:
        vocab_size, hidden_size, intermediate_size, num_layers: sizes.
        num_heads, num_kv_heads, head_dim: attention shape.
        rms_norm_eps: RMSNorm epsilon.
        max_position_embeddings: length of the RoPE tables (tokens).
        rope: global layers' rotary settings; local_rope: the sliding layers'.
        sliding_window: the local layers' window (tokens).
        layer_types: per layer, ``"sliding_attention"`` or ``"full_attention"``.
        query_pre_attn_scalar: attention scores are scaled by its ``-0.5`` power.
        final_logit_softcapping: ``cap`` of ``cap * tanh(logits / cap)``, or None.
        model_type: ``"gemma3"``.
        tie_word_embeddings: always True (Gemma's LM head is its embedding).
        activation: the gated MLP's activation (class constant; ``layer_ops.glu``'s name).
        sandwich_norms: True (class constant): norms after attention and after the MLP too.
    """

    activation: ClassVar[str] = "gelu_tanh"
    sandwich_norms: ClassVar[bool] = True

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeSpec
    local_rope: RopeSpec
    sliding_window: int
    layer_types: tuple[str, ...]
    query_pre_attn_scalar: float
    final_logit_softcapping: float | None = None
    model_type: str = "gemma3"
    tie_word_embeddings: bool = True

    def __post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must name {self.num_layers} layers, each {SLIDING!r} or {FULL!r}")

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (tokens), or None for a global layer."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` reads the local RoPE table (``local_rope``): the sliding layers."""
        return self.layer_types[layer] == SLIDING

    @classmethod
    def from_hf_config(cls, config) -> "Gemma3Spec":
        """Build from a transformers ``Gemma3TextConfig``.

        Raises:
            ValueError: attention-logit soft-capping, bidirectional attention, an activation other
                than gelu-tanh, or unsupported RoPE settings.
        """
        if getattr(config, "attn_logit_softcapping", None) is not None:
            raise ValueError("gemma3 with attn_logit_softcapping is not supported (no backend caps scores)")
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("gemma3 with use_bidirectional_attention is not supported (a decoder is causal)")
        act = getattr(config, "hidden_activation", "gelu_pytorch_tanh")
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported hidden_activation {act!r} for gemma3; only 'gelu_pytorch_tanh'")
        params = config.rope_parameters
        return cls(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size, num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads, num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim, rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=config.max_position_embeddings,
            rope=RopeSpec.from_parameters(params[FULL]), local_rope=RopeSpec.from_parameters(params[SLIDING]),
            sliding_window=int(config.sliding_window), layer_types=tuple(config.layer_types),
            query_pre_attn_scalar=float(config.query_pre_attn_scalar),
            final_logit_softcapping=getattr(config, "final_logit_softcapping", None),
        )

    @classmethod
    def from_gguf(cls, gguf: GgufFile) -> "Gemma3Spec":
        """Build from a ``gemma3`` GGUF's metadata. Where the file leaves a value out, the defaults
        are those llama.cpp's ``llama-model.cpp`` hard-codes for ``LLM_ARCH_GEMMA3`` (transformers'
        ``Gemma3TextConfig`` agrees): every 6th layer global, local RoPE base 10,000, attention
        scale ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 62-layer 27B).

        Raises:
            KeyError: a required key (``attention.sliding_window``, ...) is missing (named).
            UnsupportedModelError: attention-logit soft-capping, or settings ``gguf_hparams`` refuses.
        """
        c = common_sizes(gguf)
        if gguf.arch_get("attn_logit_softcapping") is not None:
            raise UnsupportedModelError(f"{gguf.path.name}: attention-logit soft-capping is not supported")
        pattern = gguf.arch_get("attention.sliding_window_pattern")
        if pattern is None:
            layer_types = default_layer_types(c["num_layers"], DEFAULT_SLIDING_WINDOW_PATTERN)
        elif hasattr(pattern, "__len__"):  # one flag per layer: true = sliding
            layer_types = tuple(SLIDING if bool(p) else FULL for p in pattern)
        else:
            layer_types = default_layer_types(c["num_layers"], int(pattern))
        # llama.cpp: f_attention_scale = 1/sqrt(n_embd / n_head) for the 27B (62 layers), else 1/sqrt(head_dim)
        scalar = c["hidden_size"] / c["num_heads"] if c["num_layers"] == 62 else c["head_dim"]
        cap = gguf.arch_get("final_logit_softcapping")
        return cls(
            rope=rope_spec(gguf, float(gguf.arch_get("rope.freq_base", 1_000_000.0))),
            local_rope=RopeSpec(theta=float(gguf.arch_get("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_THETA))),
            sliding_window=int(need(gguf, "attention.sliding_window")), layer_types=layer_types,
            query_pre_attn_scalar=float(scalar),
            final_logit_softcapping=None if cap is None else float(cap), **c)


def default_layer_types(num_layers: int, pattern: int = DEFAULT_SLIDING_WINDOW_PATTERN) -> tuple[str, ...]:
    """Layer ``i`` is global when ``(i + 1) % pattern == 0`` (transformers'
    ``Gemma3TextConfig``; llama.cpp's ``set_swa_pattern``), else local."""
    return tuple(FULL if (i + 1) % pattern == 0 else SLIDING for i in range(num_layers))


class GemmaRMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` in fp32, cast back to ``x``'s dtype; ``weight``
    holds Gemma's ``1 + w`` (see the module docstring)."""

    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _empty_param((dim,), dtype, device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., dim]
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return layer_ops.rms_norm(x, self.weight, self.eps)  # one native call on CPU
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), eps=self.eps).to(x.dtype)


class Gemma3Attention(nn.Module):
    """Fused QKV, q/k norm, RoPE, cache write, (windowed) backend attention, output projection.
    ``[T, hidden] -> [T, hidden]``."""

    def __init__(self, spec: Gemma3Spec, layer: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.scale = spec.query_pre_attn_scalar ** -0.5
        self.window = spec.layer_window(layer)
        kw = dict(dtype=dtype, device=device)
        self.qkv_proj = DenseLinear(spec.hidden_size, self.q_size + 2 * self.kv_size, False, **kw)
        self.o_proj = DenseLinear(self.q_size, spec.hidden_size, False, **kw)
        self.q_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps, **kw)
        self.k_norm = GemmaRMSNorm(spec.head_dim, spec.rms_norm_eps, **kw)

    def forward(self, x, cos, sin, k_cache, v_cache, meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(t, self.num_kv_heads, self.head_dim))
        v = v.view(t, self.num_kv_heads, self.head_dim)
        q = rope_and_cache(q, k, v, cos, sin, k_cache, v_cache, meta, backend)
        if self.window is None:
            o = backend.forward(q, k_cache, v_cache, meta, self.scale)
        else:
            o = backend.forward(q, k_cache, v_cache, meta, self.scale, window=self.window)
        return self.o_proj(o.reshape(t, self.q_size))


class GegluMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate and up fused in one projection."""

    def __init__(self, spec: Gemma3Spec, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.gate_up_proj = DenseLinear(spec.hidden_size, 2 * spec.intermediate_size, False, **kw)
        self.down_proj = DenseLinear(spec.intermediate_size, spec.hidden_size, False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # gelu_tanh(gate) * up in one call (stencil.kernels.layer_ops.glu): the C decoder's bits
        return self.down_proj(layer_ops.glu(self.gate_up_proj(x), "gelu_tanh"))


class Gemma3DecoderLayer(nn.Module):
    """``h + post_attn_norm(attn(input_norm(h)))``, then ``h + post_mlp_norm(mlp(pre_mlp_norm(h)))``."""

    def __init__(self, spec: Gemma3Spec, layer: int, *, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        kw = dict(dtype=dtype, device=device)
        self.local = spec.layer_types[layer] == SLIDING
        self.input_norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.attn = Gemma3Attention(spec, layer, **kw)
        self.post_attn_norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.pre_mlp_norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.mlp = GegluMLP(spec, **kw)
        self.post_mlp_norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)

    def forward(self, h, cos, sin, k_cache, v_cache, meta, backend) -> torch.Tensor:
        h = h + self.post_attn_norm(self.attn(self.input_norm(h), cos, sin, k_cache, v_cache, meta, backend))
        return h + self.post_mlp_norm(self.mlp(self.pre_mlp_norm(h)))


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3's decoder stack and tied LM head over a flat token batch and a paged KV cache;
    the same calls as ``LlamaForCausalLM`` (whose properties, ``linear_layers`` and
    ``tie_weights`` it inherits).

    Parameter names: those of ``LlamaForCausalLM`` with Gemma's norms: ``layers.{i}.input_norm``,
    ``.post_attn_norm`` (after attention), ``.pre_mlp_norm``, ``.post_mlp_norm``,
    ``.attn.{q,k}_norm``; every norm weight is ``1 + w``.

    Args:
        spec: the architecture (``Gemma3Spec``).
        dtype: weight dtype.
        device: where weights and RoPE tables live (``"meta"`` defers both).
    """

    def __init__(self, spec: Gemma3Spec, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        nn.Module.__init__(self)
        device = torch.device(device)
        kw = dict(dtype=dtype, device=device)
        self.spec = spec
        self.embed_tokens = DenseEmbedding(spec.vocab_size, spec.hidden_size, **kw)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(spec, i, **kw) for i in range(spec.num_layers))
        self.norm = GemmaRMSNorm(spec.hidden_size, spec.rms_norm_eps, **kw)
        self.lm_head = DenseLinear(spec.hidden_size, spec.vocab_size, False, **kw)
        self.build_rope_tables(device, dtype)
        self.tie_weights()
        self.row_route = None  # int4 prompt routing (quant.RowRoute), set by the loader
        self._decoder = None  # the C decoder's plan (LlamaForCausalLM.decoder_plan)

    def build_rope_tables(self, device: torch.device | str, dtype: torch.dtype) -> None:
        """(Re)make both cos/sin tables (``rope.RopeTable``): the global layers' (``rope``) and
        the local ones' (``local_rope``, their own base)."""
        spec = self.spec
        self.rope = RopeTable(spec.rope, spec.head_dim, spec.max_position_embeddings, device, dtype)
        self.local_rope = RopeTable(spec.local_rope, spec.head_dim, spec.max_position_embeddings, device, dtype)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], meta: AttentionMetadata,
                backend: AttentionBackend, prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Same contract as ``LlamaForCausalLM.forward``: ``[T]`` ids and positions ->
        final-normed hidden states ``[T, hidden_size]`` in ``self.dtype``.

        Raises:
            ValueError: ``kv_caches`` does not hold one pair per layer.
        """
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} KV cache pairs, got {len(kv_caches)}")
        end = int(positions.max()) + 1 if self.rope.grows and positions.numel() else None
        tables = {False: self.rope.lookup(positions, end), True: self.local_rope.lookup(positions, end)}
        h = self.embed_tokens(input_ids)
        # as transformers: sqrt(hidden) as an fp32 tensor, cast to the rows' dtype (a quantized
        # embedding's rows are fp32, exactly gguf's dequantized values)
        h = h * torch.tensor(self.spec.hidden_size ** 0.5).to(h.dtype)
        if h.dtype != self.dtype:
            h = h.to(self.dtype)
        plan = self.decoder_plan(kv_caches, backend)
        if plan is not None:
            h = h.contiguous()
            plan.run(h, [tables[False], tables[True]], meta)
            return self.norm(h)
        if self.row_route is not None:
            self.row_route.set(prompt_mask)
        metas = (meta, meta.for_window())  # local layers may read their own KV cache group
        try:
            for layer, (k_cache, v_cache) in zip(self.layers, kv_caches):
                h = layer(h, *tables[layer.local], k_cache, v_cache, metas[layer.attn.window is not None], backend)
        finally:
            if self.row_route is not None:
                self.row_route.clear()
        return self.norm(h)

    def finish_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Final logit soft-capping ``cap * tanh(logits / cap)`` when the config has a cap."""
        cap = self.spec.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


GGUF_NORMS = {
    "post_attn_norm.weight": ("post_attention_norm.weight",),
    "pre_mlp_norm.weight": ("ffn_norm.weight",),
    "post_mlp_norm.weight": ("post_ffw_norm.weight",),
}
"""Our per-layer norms (after ``layers.{i}.``) -> their GGUF tensors (after ``blk.{i}.``), besides
the shared ``attn_norm`` / ``attn_{q,k}_norm`` (``gguf_weights``)."""


def hf_tensor(name: str, get: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The transformers ``Gemma3ForCausalLM`` tensor(s) behind our parameter ``name``: fused
    where we fuse, norm weights ``w`` returned as ``1 + w``."""
    if name == "embed_tokens.weight":
        return get("model.embed_tokens.weight")
    if name == "norm.weight":
        return get("model.norm.weight") + 1
    _, index, rest = name.split(".", 2)
    hf = f"model.layers.{index}."
    if rest == "attn.qkv_proj.weight":
        return torch.cat([get(f"{hf}self_attn.{p}_proj.weight") for p in "qkv"])
    if rest == "mlp.gate_up_proj.weight":
        return torch.cat([get(f"{hf}mlp.{p}_proj.weight") for p in ("gate", "up")])
    norms = {"input_norm": "input_layernorm", "post_attn_norm": "post_attention_layernorm",
             "pre_mlp_norm": "pre_feedforward_layernorm", "post_mlp_norm": "post_feedforward_layernorm",
             "attn.q_norm": "self_attn.q_norm", "attn.k_norm": "self_attn.k_norm"}
    module = rest.rsplit(".", 1)[0]
    if module in norms:
        return get(f"{hf}{norms[module]}.weight") + 1
    return get(hf + rest.replace("attn.", "self_attn.", 1))


__all__ = ["GGUF_NORMS", "Gemma3ForCausalLM", "Gemma3Spec", "GemmaRMSNorm", "default_layer_types", "hf_tensor"]
