"""Engine configuration: one validated object passed down to every part."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from stencil.engine.structured_output import grammar_backends


ACTIVATION_PRECISIONS = {"exact": 2, "int8": 1}
"""``EngineConfig.activation_precision`` -> int8 terms per activation of the GGUF block kernels
(``stencil.engine.models.kernel_policy``)."""


class ConfigError(ValueError):
    """A configuration value is out of range; the message names the field."""


@dataclass(slots=True)
class EngineConfig:
    """Settings of one engine instance.

    Attributes:
        model: directory of an HF-format model (config.json, safetensors, tokenizer).
        device: torch device string ("cpu", "cuda", "cuda:0").
        dtype: weight and KV-cache dtype ("float32", "bfloat16", "float16") or "auto":
            bfloat16 on CUDA, float32 on CPU (this CPU's bf16 matmuls lose to fp32 for prefill).
        kv_cache_dtype: "auto", "float32", "bfloat16" or "float16": the K/V cache alone.
            float16 or bfloat16 on CPU halve the cache's memory and the attention's memory
            traffic (the native kernels widen them to fp32 exactly as they read), at the cost of
            rounding each key and value once, to 11 significant bits (float16, llama.cpp's default
            cache) or 8 (bfloat16). Next-token agreement with transformers' fp32 forward over 512
            positions (``stencil bench agreement``): float16 1.0000 on SmolLM2 Q4_1 and 0.998-1.000 on
            Gemma 3 270M, bfloat16 0.9961 / 0.9922, float32 1.0000 / 1.0000. "auto" is float16
            for a GGUF model on CPU (what llama.cpp keeps for the same file: the same KV capacity
            in the same memory; its weights are already rounded far more than the cache) and
            ``dtype`` otherwise: an HF checkpoint keeps an exact fp32 cache on CPU, its outputs
            those of the fp32 reference (on CUDA the cache always takes ``dtype``).
        activation_precision: how the GGUF block kernels quantize a layer's input activations
            (CPU): "exact" (the default) rounds each group of 32 to two int8 terms, error at most
            the group's max / 32512, so every logit stays within fp32 rounding of the dequantized
            model's (top-1 agreement with transformers 1.0000 on SmolLM2 and Gemma 3); "int8" is
            llama.cpp's one int8 term (max / 254) and half the integer work per weight: faster where
            a step is all GEMM (many rows: batched decode, prompts), at a measured cost in agreement
            (docs/models.md, "Activation precision"). Both are bit-identical across batch sizes, so greedy
            output stays independent of batching either way.
        gpu_memory_utilization: share of the device memory free after loading the weights that
            the KV cache takes on CUDA (when neither ``num_kv_blocks`` nor ``kv_cache_gib`` is set).
        weights: "fp32" (dense weights in ``dtype``), "int4" (GGUF 4-bit blocks served as
            torch int4-packed weights, CPU) or "auto" (the faster one for the model).
        prompt_weights: with int4 weights, "bf16" reads prompt tokens through a dense bf16
            copy of the same weights (faster prefill than torch's int4 kernel on CPUs with
            AVX512-BF16/AMX but no VNNI; oneDNN's bf16 GEMM can round a row differently with the
            number of rows beside it, so prefill chunking and prefix caching may change a greedy
            output), "int4", or "auto" (int4: bit-identical rows at any row count).
        attention_backend: name in ``stencil.kernels.registry`` ("cpu", "torch", "flash", "triton") or
            "auto" (the fastest one available on ``device``).
        block_size: tokens per KV-cache block.
        num_kv_blocks: KV-cache blocks per layer, the token capacity (``block_size`` tokens
            each); with a hybrid cache, the full-attention layers' count (the windowed layers
            hold fewer: ``stencil.engine.kv_cache_manager.kv_cache_groups``); ``None`` = derive from
            ``kv_cache_gib``.
        kv_cache_gib: KV-cache size in GiB (K and V, every layer and group's tensors): the token
            capacity is what fits, so a hybrid cache, whose windowed layers hold only their
            windows, holds more tokens in the same bytes (``stencil.engine.kv_cache_manager.blocks_for_bytes``);
            ``None`` = a default from the machine's free memory (see
            ``stencil.engine.model_runner.default_kv_cache_bytes``), counted the same way.
        max_num_seqs: most requests running in one step. 256: the per-step CPU work around the
            model stays under 10 % of a step there (``stencil bench overhead``), and a server
            under thousands of clients keeps that many moving.
        max_num_batched_tokens: token budget of one step (prefill chunks + decode + drafts).
        max_prefill_chunk: most prompt tokens one request reads in one step (chunked prefill).
        max_model_len: longest prompt + output (tokens); ``None`` = the model's own limit.
        enable_prefix_caching: reuse cached full blocks across requests.
        hybrid_kv_cache: a model mixing full-attention and sliding-window layers (Gemma 3) keeps
            its windowed layers in a KV cache group of their own that holds only each request's
            window (``stencil.engine.kv_cache_manager``); False keeps every position of every layer in
            one group (the layout before, for tests and comparisons).
        max_waiting: requests allowed to wait before new ones are refused (HTTP 429). 4096: a
            queued request costs a few kB, so thousands of clients can wait their turn (first
            come, first served) instead of being refused; one that waits past its deadline is
            answered 429 all the same (``stencil.service.generation.GenerationStream.wait_started``).
        num_threads: torch intra-op threads on CPU; ``None`` = leave torch's default.
        grammar_workers: threads compiling grammars.
        grammar_timeout_s: longest one grammar compile may take (seconds).
        grammar_backend: "auto" (lazy llguidance matcher at once, eager outlines-core index
            built in the background for reused grammars), "eager" or "lazy".
        speculative: default n-gram speculation settings (``None`` = off unless a request asks).
        seed: base seed for requests without their own.
    """

    model: Path
    device: str = "cpu"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"
    activation_precision: str = "exact"
    gpu_memory_utilization: float = 0.85
    weights: str = "auto"
    prompt_weights: str = "auto"
    attention_backend: str = "auto"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_gib: float | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_prefill_chunk: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    hybrid_kv_cache: bool = True
    max_waiting: int = 4096
    num_threads: int | None = None
    grammar_workers: int = 2
    grammar_timeout_s: float = 10.0
    grammar_backend: str = "auto"
    speculative: dict | None = None
    seed: int = 0
    extra: dict = field(default_factory=dict)

    def validate(self) -> "EngineConfig":
        """Check ranges; return self.

        Raises:
            ConfigError: naming the offending field.
        """
        self.model = Path(self.model)
        positive = ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_prefill_chunk",
                    "max_waiting", "grammar_workers")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ConfigError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.kv_cache_gib is not None and self.kv_cache_gib <= 0:
            raise ConfigError(f"kv_cache_gib must be > 0, got {self.kv_cache_gib}")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device.startswith("cuda") else "float32"
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.kv_cache_dtype == "auto":
            self.kv_cache_dtype = "float16" if self._gguf_on_cpu() else self.dtype
        if self.kv_cache_dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"kv_cache_dtype must be auto, float32, bfloat16 or float16, got {self.kv_cache_dtype!r}")
        if self.device.startswith("cuda") and self.kv_cache_dtype != self.dtype:
            raise ConfigError(f"on CUDA the KV cache takes the model dtype ({self.dtype}); "
                              f"kv_cache_dtype {self.kv_cache_dtype!r} is for CPU")
        if self.activation_precision not in ACTIVATION_PRECISIONS:
            raise ConfigError(f"activation_precision must be exact or int8, got {self.activation_precision!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.weights not in ("auto", "fp32", "int4"):
            raise ConfigError(f"weights must be auto, fp32 or int4, got {self.weights!r}")
        if self.prompt_weights not in ("auto", "bf16", "int4"):
            raise ConfigError(f"prompt_weights must be auto, bf16 or int4, got {self.prompt_weights!r}")
        if self.grammar_backend not in (backends := grammar_backends()):
            raise ConfigError(f"grammar_backend must be {', '.join(backends[:-1])} or {backends[-1]}, "
                              f"got {self.grammar_backend!r}")
        if self.grammar_timeout_s <= 0:
            raise ConfigError(f"grammar_timeout_s must be > 0, got {self.grammar_timeout_s}")
        return self

    def _gguf_on_cpu(self) -> bool:
        """Whether ``model`` names a GGUF file (or a directory of one) served on CPU."""
        from stencil.engine.models.source import ModelPathError, resolve_model_path

        if self.device.startswith("cuda"):
            return False
        try:
            return resolve_model_path(self.model).kind == "gguf"
        except ModelPathError:
            return False  # (the loader reports the path)
