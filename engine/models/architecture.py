"""The architecture of a Llama-family model (Llama, Mistral, SmolLM, Qwen2, Qwen3), read once from a
transformers config or a GGUF's metadata; ``stencil.engine.models.registry`` says which names it serves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.gguf_hparams import common_sizes, rope_spec
from stencil.engine.models.rope import RopeSpec


@dataclass(frozen=True, slots=True)
class LlamaSpec:
    """Everything the forward needs to know about an architecture.

    Attributes:
        model_type: the config's ``model_type`` or the GGUF's ``general.architecture`` (a name
            ``registry.lookup`` knows).
        vocab_size, hidden_size, intermediate_size, num_layers: sizes.
        num_heads, num_kv_heads, head_dim: attention shape (GQA when ``num_kv_heads <
            num_heads``).
        rms_norm_eps: RMSNorm epsilon.
        max_position_embeddings: length of the RoPE tables (tokens).
        rope: rotary embedding settings.
        qkv_bias: q/k/v projections have biases (Qwen2; ``attention_bias`` elsewhere).
        o_bias: output projection has a bias (``attention_bias``, not Qwen2).
        mlp_bias: gate/up/down have biases (Llama's ``mlp_bias``).
        qk_norm: per-head RMSNorm on q and k before RoPE (Qwen3).
        tie_word_embeddings: the LM head is the embedding matrix.
        sliding_window: attention window (tokens) when any layer uses one, else ``None``.
        sliding_layers: which layers use it (``layer_types`` of the config); ``None`` with a
            ``sliding_window``: every layer (Mistral).
        activation: the gated MLP's activation (class constant; ``layer_ops.glu``'s name).
        sandwich_norms: whether blocks norm their outputs too (class constant; False: one norm
            before attention, one before the MLP).
    """

    activation: ClassVar[str] = "silu"
    sandwich_norms: ClassVar[bool] = False

    model_type: str
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
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[bool, ...] | None = None

    def layer_window(self, layer: int) -> int | None:
        """The attention window of layer ``layer`` (tokens), or None for full attention."""
        if self.sliding_window is None:
            return None
        return self.sliding_window if self.sliding_layers is None or self.sliding_layers[layer] else None

    def uses_local_rope(self, layer: int) -> bool:
        """Whether layer ``layer`` reads the second RoPE table (never: one table for every layer)."""
        return False

    @classmethod
    def from_hf_config(cls, config, **fixed) -> "LlamaSpec":
        """Build from a transformers ``PretrainedConfig``; ``fixed`` sets fields the config does not
        say but the architecture implies (the registry's ``hf_fixed``: Qwen2's q/k/v biases,
        Qwen3's q/k norm), over what the config gives.

        Raises:
            ValueError: an activation other than SiLU, or unsupported RoPE settings.
        """
        model_type = getattr(config, "model_type", None)
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; only 'silu'")
        attention_bias = bool(getattr(config, "attention_bias", False))
        fields = dict(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            head_dim=(getattr(config, "head_dim", None)
                      or config.hidden_size // config.num_attention_heads),
            rms_norm_eps=float(config.rms_norm_eps),
            max_position_embeddings=config.max_position_embeddings,
            rope=RopeSpec.from_hf_config(config),
            qkv_bias=attention_bias,
            o_bias=attention_bias,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(config),
            sliding_layers=_sliding_layers(config),
        )
        return cls(**{**fields, **fixed})

    @classmethod
    def from_gguf(cls, gguf: GgufFile) -> "LlamaSpec":
        """Build from a GGUF's metadata and tensor directory: biases, q/k norms and a separate LM
        head are read off which tensors exist; Llama 3.1-style RoPE factors from ``rope_freqs.weight``.

        Raises:
            KeyError: a required key or tensor is missing (named).
            UnsupportedModelError: settings the forward lacks (``gguf_hparams``).
        """
        freqs = gguf.tensors.get("rope_freqs.weight")  # Llama 3.1-style scaling, precomputed by the converter
        factors = None if freqs is None else tuple(float(x) for x in freqs.data.reshape(-1))
        window = gguf.arch_get("attention.sliding_window")
        has = gguf.tensors.__contains__
        return cls(
            model_type=gguf.architecture,
            rope=rope_spec(gguf, float(gguf.arch_get("rope.freq_base", 10000.0)), factors),
            qkv_bias=has("blk.0.attn_q.bias"), o_bias=has("blk.0.attn_output.bias"), mlp_bias=has("blk.0.ffn_up.bias"),
            qk_norm=has("blk.0.attn_q_norm.weight"), tie_word_embeddings=not has("output.weight"),
            sliding_window=None if window is None else int(window), **common_sizes(gguf))


def _sliding_window(config) -> int | None:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return None
    layer_types = getattr(config, "layer_types", None)
    # Qwen2/3 keep a window size in the config even when every layer is full attention.
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


def _sliding_layers(config) -> tuple[bool, ...] | None:
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or _sliding_window(config) is None:
        return None
    return tuple(t == "sliding_attention" for t in layer_types)
