"""Model code: our Llama-family forward (``llama``), its architecture spec (``spec``), RoPE
tables (``rope``), the safetensors loader (``loader``) and the default model fetcher
(``default_model``)."""

from engine.models.llama import DenseLinear, LlamaForCausalLM
from engine.models.loader import load_model, load_weights
from engine.models.spec import SUPPORTED_MODEL_TYPES, LlamaSpec

__all__ = ["DenseLinear", "LlamaForCausalLM", "LlamaSpec", "SUPPORTED_MODEL_TYPES", "load_model",
           "load_weights"]
