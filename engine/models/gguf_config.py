"""The architecture, special tokens and chat template of a GGUF file, from its metadata alone.

The architecture (``general.architecture``) picks its ``registry`` entry, whose spec reads the
hyperparameters (``gguf_hparams`` for the keys all share, the spec's ``from_gguf`` for its own);
``tokenizer.ggml.*`` and ``tokenizer.chat_template`` are read here.

Which tokens end an output: the file's ``eos_token_id``, ``eot_token_id`` and ``eom_token_id``,
and every control token spelled like one of llama.cpp's end-of-generation markers
(``llama-vocab.cpp``: ``<end_of_turn>``, ``<|eot_id|>``, ``<|im_end|>``, ...), as llama.cpp
decides for files that do not name their end-of-turn token (Gemma 3's name only ``<eos>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from stencil.engine.models import registry
from stencil.engine.models.gguf_file import GgufFile
from stencil.engine.models.gguf_hparams import UnsupportedModelError
from stencil.engine.models.gguf_weights import DENSE_TYPES

SUPPORTED_GGUF_ARCHITECTURES = registry.names()
"""``general.architecture`` values served: the registry's names (Mistral and SmolLM files are ``llama``)."""

END_OF_GENERATION_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                           "<|eom_id|>", "<EOT>", "_<EOT>", "<|end▁of▁sentence|>", "<end_of_utterance>")
"""Control tokens llama.cpp treats as end of generation by their text (``llama-vocab.cpp``)."""

_CONTROL = 3  # tokenizer.ggml.token_type of a control token (llama.cpp's LLAMA_TOKEN_TYPE_CONTROL)


@dataclass(frozen=True, slots=True)
class GgufModelInfo:
    """What a GGUF says about its model, read once.

    Attributes:
        path: the file.
        architecture: ``general.architecture``.
        spec: the architecture's spec (``LlamaSpec``, ``Gemma3Spec``: its ``registry`` entry's).
        bos_token_id, eos_token_id: from ``tokenizer.ggml``, or None.
        stop_token_ids: ids that end an output: EOS first, then end-of-turn tokens.
        chat_template: ``tokenizer.chat_template`` or None (a base model).
        max_position_embeddings: ``{arch}.context_length`` (tokens).
    """

    path: Path
    architecture: str
    spec: object
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
        UnsupportedModelError: an architecture the registry lacks (the message lists its names), a tensor
            type outside ``gguf_weights.DENSE_TYPES``, or settings the forward lacks (partial
            rotary, YaRN, per-layer KV head counts, attention soft-capping).
        KeyError: a required metadata key is missing (named).
    """
    gguf = gguf if isinstance(gguf, GgufFile) else GgufFile(gguf)
    arch = gguf.architecture
    entry = registry.for_gguf(arch)
    if entry is None:
        raise UnsupportedModelError(f"unsupported GGUF architecture {arch!r} in {gguf.path.name}; supported: "
                                    f"{registry.describe_gguf()}")
    check_tensor_types(gguf)
    spec = entry.spec_from_gguf(gguf)
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


__all__ = ["END_OF_GENERATION_TEXTS", "GgufModelInfo", "SUPPORTED_GGUF_ARCHITECTURES", "UnsupportedModelError",
           "check_tensor_types", "read_gguf_info", "stop_token_ids"]
