"""The architectures Stencil serves: one table from an architecture's name to its parts.

An entry names the architecture as a GGUF names it (``general.architecture``) and as transformers
configs do (``model_type``), and the model file (``stencil.engine.models.<module>``) that holds its
parts, by attribute:

* ``spec``: a frozen dataclass with ``from_hf_config(config, **hf_fixed)`` and ``from_gguf(gguf)``
  (``GgufFile``), ``num_layers`` and the other sizes, ``model_type``, ``tie_word_embeddings``,
  ``layer_window(i)``, and what the C decoder asks (``activation``, ``sandwich_norms``,
  ``uses_local_rope(i)``);
* ``model``: the torch module, built as ``model(spec, dtype=, device=)``;
* ``hf_tensor(name, get)``: our parameter's tensor from transformers' checkpoint names;
* ``GGUF_NORMS``: our per-layer norms -> their GGUF tensors (the shared tensor names are
  ``gguf_weights``'s).

Everything that differs by architecture asks its entry or its spec; nothing else compares names
(``tests/test_layout.py`` keeps it so). Entries import their module only when a part is asked for,
so reading the names (the CLI's help) costs no torch import.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Architecture:
    """One architecture Stencil serves.

    Attributes:
        name: the GGUF ``general.architecture`` value (and this entry's key).
        module: the model file, ``stencil.engine.models.<module>``.
        spec, model: names in ``module`` of the spec class and the model class.
        hf_model_types: transformers ``model_type`` values of this architecture.
        hf_fixed: spec fields an HF config does not state but the architecture implies, as
            ``(field, value)`` pairs passed to ``spec.from_hf_config``.
        gguf_qk_permuted: llama.cpp's converter interleaves each head's rotary halves in the Q
            and K rows (its ``LlamaModel.permute``); the loader puts them back.
        also: model families whose files carry this name (Mistral and SmolLM files are ``llama``).
    """

    name: str
    module: str
    spec: str
    model: str
    hf_model_types: tuple[str, ...]
    hf_fixed: tuple[tuple[str, object], ...] = ()
    gguf_qk_permuted: bool = False
    also: tuple[str, ...] = ()

    def part(self, attr: str):
        """Attribute ``attr`` of the model file (imported on first use). Raises AttributeError."""
        return getattr(importlib.import_module(f"stencil.engine.models.{self.module}"), attr)

    def spec_from_hf(self, config):
        """The spec of a transformers config of this architecture (``hf_fixed`` applied).

        Raises:
            ValueError: settings the forward lacks (the spec's ``from_hf_config``).
        """
        return self.part(self.spec).from_hf_config(config, **dict(self.hf_fixed))

    def spec_from_gguf(self, gguf):
        """The spec of a ``gguf_file.GgufFile`` of this architecture.

        Raises:
            KeyError, UnsupportedModelError: as the spec's ``from_gguf``.
        """
        return self.part(self.spec).from_gguf(gguf)

    def build(self, spec, *, dtype, device):
        """The model for ``spec``, parameters uninitialised (``device="meta"``: none allocated)."""
        return self.part(self.model)(spec, dtype=dtype, device=device)

    def hf_tensor(self, name: str, get):
        """Our parameter ``name``'s tensor read through ``get(hf_name)`` (fused where we fuse)."""
        return self.part("hf_tensor")(name, get)

    @property
    def gguf_norms(self) -> dict[str, tuple[str, ...]]:
        """Our per-layer norm parameters (after ``layers.{i}.``) -> GGUF tensors (after ``blk.{i}.``)."""
        return self.part("GGUF_NORMS")


_LLAMA = dict(module="llama", spec="LlamaSpec", model="LlamaForCausalLM")

ARCHITECTURES: tuple[Architecture, ...] = (
    Architecture("llama", hf_model_types=("llama", "mistral"), gguf_qk_permuted=True, also=("Mistral", "SmolLM"),
                 **_LLAMA),
    Architecture("qwen2", hf_model_types=("qwen2",), hf_fixed=(("qkv_bias", True), ("o_bias", False)), **_LLAMA),
    Architecture("qwen3", hf_model_types=("qwen3",), hf_fixed=(("qk_norm", True),), **_LLAMA),
    Architecture("gemma3", module="gemma3", spec="Gemma3Spec", model="Gemma3ForCausalLM",
                 hf_model_types=("gemma3_text",)),
)
"""Every architecture served, in the order messages list them."""


def names() -> tuple[str, ...]:
    """Every entry's ``name`` (the GGUF architectures served)."""
    return tuple(a.name for a in ARCHITECTURES)


def hf_model_types() -> tuple[str, ...]:
    """Every transformers ``model_type`` served."""
    return tuple(t for a in ARCHITECTURES for t in a.hf_model_types)


def lookup(name: str | None) -> Architecture | None:
    """The entry whose ``name`` or one of whose ``hf_model_types`` is ``name`` (a spec's
    ``model_type`` is either), or None."""
    return next((a for a in ARCHITECTURES if name == a.name or name in a.hf_model_types), None)


def for_gguf(architecture: str) -> Architecture | None:
    """The entry of a GGUF ``general.architecture`` value, or None."""
    return next((a for a in ARCHITECTURES if a.name == architecture), None)


def for_hf_config(config) -> Architecture:
    """The entry of a transformers config (its ``model_type``).

    Raises:
        ValueError: a ``model_type`` no entry serves; the message lists ``hf_model_types()``.
    """
    model_type = getattr(config, "model_type", None)
    arch = next((a for a in ARCHITECTURES if model_type in a.hf_model_types), None)
    if arch is None:
        raise ValueError(f"unsupported model_type {model_type!r}; supported: {list(hf_model_types())}")
    return arch


def for_spec(spec) -> Architecture:
    """The entry of a spec built by one (its ``model_type``). Raises KeyError for another."""
    arch = lookup(spec.model_type)
    if arch is None:
        raise KeyError(f"no registered architecture for model_type {spec.model_type!r}")
    return arch


def describe() -> str:
    """The served names for help texts: ``"llama (Mistral, SmolLM), qwen2, qwen3, gemma3"``."""
    return ", ".join(f"{a.name} ({', '.join(a.also)})" if a.also else a.name for a in ARCHITECTURES)


def describe_gguf() -> str:
    """The served GGUF names for errors: ``"llama, qwen2, qwen3, gemma3 (Mistral and SmolLM files
    are llama)"``."""
    notes = "; ".join(f"{' and '.join(a.also)} files are {a.name}" for a in ARCHITECTURES if a.also)
    return ", ".join(names()) + (f" ({notes})" if notes else "")


__all__ = ["ARCHITECTURES", "Architecture", "describe", "describe_gguf", "for_gguf", "for_hf_config", "for_spec",
           "hf_model_types", "lookup", "names"]
