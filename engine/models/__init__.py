"""Model code: our Llama-family forward (``llama``) and Gemma 3's (``gemma3``), their
architecture specs (``architecture``), RoPE tables (``rope``), what a model path names (``source``),
the loaders (``loader``: HF safetensors directories and GGUF files; ``gguf_file``,
``gguf_config``, ``gguf_weights``), tokenizers (``tokenizer``), and the model fetchers
(``default_model``, ``pypi_gguf``)."""

from stencil.engine.models.llama import DenseLinear, LlamaForCausalLM
from stencil.engine.models.loader import load_model, load_weights
from stencil.engine.models.architecture import SUPPORTED_MODEL_TYPES, LlamaSpec

__all__ = ["DenseLinear", "LlamaForCausalLM", "LlamaSpec", "SUPPORTED_MODEL_TYPES", "load_model",
           "load_weights"]
