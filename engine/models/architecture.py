"""The architecture of a Llama-family model, read once from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass

from stencil.engine.models.rope import RopeSpec

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class LlamaSpec:
    """Everything the forward needs to know about an architecture.

    Attributes:
        model_type: one of ``SUPPORTED_MODEL_TYPES``.
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
    """

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

    @classmethod
    def from_hf_config(cls, config) -> "LlamaSpec":
        """Build from a transformers ``PretrainedConfig``.

        Raises:
            ValueError: unsupported ``model_type`` (the message names the supported ones),
                activation other than SiLU, or unsupported RoPE settings.
        """
        model_type = getattr(config, "model_type", None)
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {model_type!r}; supported: "
                             f"{list(SUPPORTED_MODEL_TYPES) + ['gemma3_text']}")
        act = getattr(config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"unsupported hidden_act {act!r} for {model_type}; only 'silu'")
        attention_bias = bool(getattr(config, "attention_bias", False))
        qwen2 = model_type == "qwen2"
        return cls(
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
            qkv_bias=qwen2 or attention_bias,
            o_bias=attention_bias and not qwen2,
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            sliding_window=_sliding_window(config),
            sliding_layers=_sliding_layers(config),
        )


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
