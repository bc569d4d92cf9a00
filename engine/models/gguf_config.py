"""The architecture, special tokens and chat template of a GGUF file, from its metadata alone.

Keys are llama.cpp's (``src/llama-arch.cpp`` ``LLM_KV_NAMES``; gguf-py ``constants.py`` ``Keys``),
prefixed by the architecture: ``{arch}.block_count``, ``.embedding_length``,
``.feed_forward_length``, ``.context_length``, ``.attention.head_count``, ``.head_count_kv``,
``.key_length``, ``.layer_norm_rms_epsilon``, ``.sliding_window``, ``.rope.freq_base``,
``.rope.dimension_count``, ``.rope.scaling.type`` / ``.factor``; and ``tokenizer.ggml.*``,
``tokenizer.chat_template``. Where a file leaves a Gemma 3 value out, the defaults are those
llama.cpp's ``llama-model.cpp`` hard-codes for ``LLM_ARCH_GEMMA3`` (and transformers'
``Gemma3TextConfig`` agrees): every 6th layer global, local RoPE base 10,000, attention scale
``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the 62-layer 27B).

Which tokens end an output: the file's ``eos_token_id``, ``eot_token_id`` and ``eom_token_id``,
and every control token spelled like one of llama.cpp's end-of-generation markers
(``llama-vocab.cpp``: ``<end_of_turn>``, ``<|eot_id|>``, ``<|im_end|>``, ...), as llama.cpp
decides for files that do not name their end-of-turn token (Gemma 3's name only ``<eos>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stencil.engine.models.gemma3 import (DEFAULT_LOCAL_ROPE_THETA, DEFAULT_SLIDING_WINDOW_PATTERN, FULL, SLIDING,
                                  Gemma3Spec, default_layer_types)
from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.gguf_weights import DENSE_TYPES
from stencil.engine.models.rope import RopeSpec
from stencil.engine.models.architecture import LlamaSpec

SUPPORTED_GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
"""``general.architecture`` values served (Mistral and SmolLM files are ``llama``)."""

END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|eom_id|>", "<EOT>", "_<EOT>", "<|end▁of▁sentence|>", "<end_of_utterance>")
"""Control tokens llama.cpp treats as end of generation by their text (``llama-vocab.cpp``)."""

_CONTROL = 3  # tokenizer.ggml.token_type of a control token (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL)


class UnsupportedModelError(ValueError):
    """A model Stencil cannot serve; the one-line message names what and lists what is supported."""


@dataclass(frozen=True, slots=True)
class GgufModelInfo:
    """What a GGUF says about its model, read once.

    Attributes:
        path: the file.
        architecture: ``general.architecture``.
        spec: ``LlamaSpec`` or ``Gemma3Spec``.
        bos_token_id, eos_token_id: from ``tokenizer.ggml``, or None.
        stop_token_ids: ids that end an output: EOS first, then end-of-turn tokens.
        chat_template: ``tokenizer.chat_template`` or None (a base model).
        max_position_embeddings: ``{arch}.context_length`` (tokens).
    """

    path: Path
    architecture: str
    spec: LlamaSpec | Gemma3Spec
    bos_token_id: int | None
    eos_token_id: int | None
    stop_token_ids: tuple[int, ...]
    chat_template: str | None

    @property
    def max_position_embeddings(self) -> int:
        return self.spec.max_position_embeddings


def read_gguf_info(gguf: GgufFile | Path | str) -> GgufModelInfo:
    """Read a GGUF's model description (see the module docstring).

    Raises:
        UnsupportedModelError: an architecture outside ``SUPPORTED_GGUF_ARCHITECTURES``, a tensor
            type outside ``gguf_weights.DENSE_TYPES``, or settings the forward lacks (partial
            rotary, YaRN, per-layer KV head counts, attention soft-capping).
        KeyError: a required metadata key is missing (named).
    """
    gguf = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    arch = gguf.architecture
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} in {gguf.path.name}; supported: "
                                    f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)} (Mistral and SmolLM files are llama)")
    check_tensor_types(gguf)
    spec = _gemma3_spec(gguf) if arch == "gemma3" else _llama_spec(gguf)
    eos = _int_or_none(gguf.get("tokenizer.ggml.eos_token_id"))
    return GgufModelInfo(path=gguf.path, architecture=arch, spec=spec,
                         bos_token_id=_int_or_none(gguf.get("tokenizer.ggml.bos_token_id")), eos_token_id=eos,
                         stop_token_ids=stop_token_ids(gguf), chat_template=gguf.get("tokenizer.chat_template"))


def check_tensor_types(gguf: GgufFile) -> None:
    """Raise ``UnsupportedModelError`` naming the first tensor of a type Stencil cannot read."""
    bad = [t for t in gguf.tensors.values() if t.tensor_type.name not in DENSE_TYPES]
    if bad:
        kinds = sorted({t.tensor_type.name for t in bad})
        raise UnsupportedModelError(
            f"unsupported GGUF tensor type {', '.join(kinds)} in {gguf.path.name} ({bad[0].name}"
            f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}); supported: {', '.join(DENSE_TYPES)}")


def stop_token_ids(gguf: GgufFile) -> tuple[int, ...]:
    """EOS, then the named end-of-turn/message ids, then control tokens spelled like
    ``END_OF_GENERATION_TEXTS`` (each once, in that order)."""
    out: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        v = _int_or_none(gguf.get(f"tokenizer.ggml.{key}"))
        if v is not None and v not in out:
            out.append(v)
    tokens = gguf.get("tokenizer.ggml.tokens") or []
    types = gguf.get("tokenizer.ggml.token_type")
    wanted = set(END_OF_GENERATION_TEXTS)
    for i, text in enumerate(tokens):
        if text in wanted and (types is None or int(types[i]) == _CONTROL) and i not in out:
            out.append(i)
    return tuple(out)


def _int_or_none(v) -> int | None:
    return None if v is None else int(v)


def _need(gguf: GgufFile, key: str):
    v = gguf.arch_get(key)
    if v is None:
        raise KeyError(f"{gguf.path.name}: metadata {gguf.architecture}.{key} is missing")
    return v


def _scalar_heads(gguf: GgufFile, key: str, default=None) -> int:
    v = gguf.arch_get(key, default)
    if v is None:
        raise KeyError(f"{gguf.path.name}: metadata {gguf.architecture}.{key} is missing")
    if hasattr(v, "__len__"):  # a per-layer array
        values = {int(x) for x in v}
        if len(values) != 1:
            raise UnsupportedModelError(f"{gguf.path.name}: per-layer {key} {sorted(values)} is not supported")
        return values.pop()
    return int(v)


def _common(gguf: GgufFile) -> dict:
    hidden = int(_need(gguf, "embedding_length"))
    heads = _scalar_heads(gguf, "attention.head_count")
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
        intermediate_size=_scalar_heads(gguf, "feed_forward_length"), num_layers=int(_need(gguf, "block_count")),
        num_heads=heads, num_kv_heads=_scalar_heads(gguf, "attention.head_count_kv", heads), head_dim=head_dim,
        rms_norm_eps=float(_need(gguf, "attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(_need(gguf, "context_length")),
    )


def _rope(gguf: GgufFile, theta: float, freq_factors=None) -> RopeSpec:
    kind = gguf.arch_get("rope.scaling.type", "none")
    factor = float(gguf.arch_get("rope.scaling.factor", 1.0) or 1.0)
    if kind in ("none", None) or (kind == "linear" and factor == 1.0):
        return RopeSpec(theta=theta, freq_factors=freq_factors)
    if kind == "linear":
        return RopeSpec(rope_type="linear", theta=theta, factor=factor, freq_factors=freq_factors)
    raise UnsupportedModelError(f"{gguf.path.name}: rope scaling {kind!r} is not supported; supported: none, linear")


def _llama_spec(gguf: GgufFile) -> LlamaSpec:
    c = _common(gguf)
    freqs = gguf.tensors.get("rope_freqs.weight")  # Llama 3.1-style scaling, precomputed by the converter
    factors = None if freqs is None else tuple(float(x) for x in freqs.data.reshape(-1))
    window = gguf.arch_get("attention.sliding_window")
    has = gguf.tensors.__contains__
    return LlamaSpec(
        model_type=gguf.architecture, rope=_rope(gguf, float(gguf.arch_get("rope.freq_base", 10000.0)), factors),
        qkv_bias=has("blk.0.attn_q.bias"), o_bias=has("blk.0.attn_output.bias"), mlp_bias=has("blk.0.ffn_up.bias"),
        qk_norm=has("blk.0.attn_q_norm.weight"), tie_word_embeddings=not has("output.weight"),
        sliding_window=None if window is None else int(window), **c)


def _gemma3_spec(gguf: GgufFile) -> Gemma3Spec:
    c = _common(gguf)
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
    return Gemma3Spec(
        rope=_rope(gguf, float(gguf.arch_get("rope.freq_base", 1_000_000.0))),
        local_rope=RopeSpec(theta=float(gguf.arch_get("rope.freq_base_swa", DEFAULT_LOCAL_ROPE_THETA))),
        sliding_window=int(_need(gguf, "attention.sliding_window")), layer_types=layer_types,
        query_pre_attn_scalar=float(scalar),
        final_logit_softcapping=None if cap is None else float(cap), **c)


__all__ = ["END_OF_GENERATION_TEXTS", "GgufModelInfo", "SUPPORTED_GGUF_ARCHITECTURES", "UnsupportedModelError",
           "check_tensor_types", "read_gguf_info", "stop_token_ids"]
