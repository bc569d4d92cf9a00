"""Hyperparameters every architecture reads alike from a GGUF's metadata: the shared sizes
(``common_sizes``), RoPE (``rope_spec``), one required key (``need``), a per-layer array that must
hold one value (``scalar``). Each spec's ``from_gguf`` (``LlamaSpec``, ``Gemma3Spec``) builds on
these and adds its own keys.

Keys are llama.cpp's (``src/llama-arch.cpp`` ``LLM_KV_NAMES``; gguf-py ``constants.py`` ``Keys``),
prefixed by the architecture: ``{arch}.block_count``, ``.embedding_length``,
``.feed_forward_length``, ``.context_length``, ``.attention.head_count``, ``.head_count_kv``,
``.key_length``, ``.layer_norm_rms_epsilon``, ``.rope.freq_base``, ``.rope.dimension_count``,
``.rope.scaling.type`` / ``.factor``.
"""

from __future__ import annotations

from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.rope import RopeSpec


class UnsupportedModelError(ValueError):
    """A model Stencil cannot serve; the one-line message names what and lists what is supported."""


def need(gguf: GgufFile, key: str):
    """``{arch}.{key}`` of ``gguf``. Raises KeyError naming the file and key when it is absent."""
    v = gguf.arch_get(key)
    if v is None:
        raise KeyError(f"{gguf.path.name}: metadata {gguf.architecture}.{key} is missing")
    return v


def scalar(gguf: GgufFile, key: str, default=None) -> int:
    """``{arch}.{key}`` as one int, also when stored per layer with one value for all.

    Raises:
        KeyError: absent and no ``default``.
        UnsupportedModelError: a per-layer array with differing values (named).
    """
    v = gguf.arch_get(key, default)
    if v is None:
        raise KeyError(f"{gguf.path.name}: metadata {gguf.architecture}.{key} is missing")
    if hasattr(v, "__len__"):  # a per-layer array
        values = {int(x) for x in v}
        if len(values) != 1:
            raise UnsupportedModelError(f"{gguf.path.name}: per-layer {key} {sorted(values)} is not supported")
        return values.pop()
    return int(v)


def common_sizes(gguf: GgufFile) -> dict:
    """The spec fields every architecture shares: ``vocab_size`` (rows of ``token_embd.weight``),
    ``hidden_size``, ``intermediate_size``, ``num_layers``, ``num_heads``, ``num_kv_heads``,
    ``head_dim``, ``rms_norm_eps``, ``max_position_embeddings``.

    Raises:
        KeyError: a required key or ``token_embd.weight`` is missing.
        UnsupportedModelError: partial rotary embedding, or per-layer head / MLP sizes.
    """
    hidden = int(need(gguf, "embedding_length"))
    heads = scalar(gguf, "attention.head_count")
    head_dim = int(gguf.arch_get("attention.key_length", hidden // heads))
    rope_dims = gguf.arch_get("rope.dimension_count")
    if rope_dims is not None and int(rope_dims) != head_dim:
        raise UnsupportedModelError(f"{gguf.path.name}: partial rotary embedding ({rope_dims} of {head_dim} "
                                    "dims) is not supported")
    embd = gguf.tensors.get("token_embd.weight")
    if embd is None:
        raise KeyError(f"{gguf.path.name}: tensor token_embd.weight is missing")
    return dict(
        vocab_size=int(embd.shape[1]), hidden_size=hidden,
        intermediate_size=scalar(gguf, "feed_forward_length"), num_layers=int(need(gguf, "block_count")),
        num_heads=heads, num_kv_heads=scalar(gguf, "attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=float(need(gguf, "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(need(gguf, "context_length")),
    )


def rope_spec(gguf: GgufFile, theta: float, freq_factors=None) -> RopeSpec:
    """RoPE with base ``theta`` and the file's scaling (none, or linear).

    Raises:
        UnsupportedModelError: another scaling type (YaRN, ...), named.
    """
    kind = gguf.arch_get("rope.scaling.type", "none")
    factor = float(gguf.arch_get("rope.scaling.factor", 1.0) or 1.0)
    if kind in ("none", None) or (kind == "linear" and factor == 1.0):
        return RopeSpec(theta=theta, freq_factors=freq_factors)
    if kind == "linear":
        return RopeSpec(rope_type="linear", theta=theta, factor=factor, freq_factors=freq_factors)
    raise UnsupportedModelError(f"{gguf.path.name}: rope scaling {kind!r} is not supported; supported: none, linear")


__all__ = ["UnsupportedModelError", "common_sizes", "need", "rope_spec", "scalar"]
