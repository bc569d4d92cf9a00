"""Which kernel serves a GGUF matrix on this CPU: the rule the loaders follow.

A projection (one GGUF tensor, or the stacked q/k/v or gate/up tensors of a fused one), or an
LM head, is served by ``layer_kind(types)``:

1. ``"int4"``: every part is Q4_0, Q4_1 or Q8_0, ``stencil.kernels.native`` builds here (x86 with
   AVX512-BF16) and the block kernel is not asked for one activation term (``terms=1``, llama.cpp's
   arithmetic, which only ``csrc/gguf_gemm.c`` does): ``quant.Int4Linear`` on ``csrc/vnni_gemm.c`` (AVX512-VNNI) or
   ``csrc/int4_gemm.c``. These kernels were measured on this project's AVX512 Xeons against
   torch's and oneDNN's (docs/benchmarks.md, "Many rows through one matrix (the block kernel)");
   keeping them there keeps the default model's greedy outputs on those machines as they were.
   (Not measured against ``gguf_gemm.c``'s AVX512-VNNI path: no AVX512 machine in that session; ``stencil bench
   cpu_kernels`` times both where both build.)
2. ``"blocks"``: otherwise, every quantized part is of a type ``csrc/gguf_gemm.c`` reads
   (``ggml_blocks.BLOCKS``) and at least one part is quantized: ``gguf_layers.QuantLinear``,
   the file's bytes as they are. Where that kernel does not build either (no C compiler, not
   x86-64, ``STENCIL_NATIVE=0``), Q4_0/Q4_1/Q8_0 projections take ``Int4Linear`` on torch's
   int4 kernel and the other types ``QuantLinear``'s torch path (each step dequantizes: slow,
   but the memory stays the file's).
3. ``"dense"``: every part is F32/F16/BF16, or one is of a type no kernel reads (Q2_K, Q3_K):
   decoded to a dense matrix (``gguf_weights.dequantize_tensor``).

``BLOCK_TERMS``: the int8 terms per activation of the block kernel (``QuantLinear(terms=)``);
``load_model(block_terms=)`` overrides it, as the engine does from
``EngineConfig.activation_precision`` (``--activation-precision``: exact = 2, int8 = 1).
"""

from __future__ import annotations

from collections.abc import Iterable

from stencil.engine.models.gguf_layers import FLOAT_TYPES
from stencil.kernels import ggml_blocks, native

INT4_TYPES = frozenset({"Q4_0", "Q4_1", "Q8_0"})  # = quant.INT4_TYPES
BLOCK_TYPES = frozenset(ggml_blocks.BLOCKS)

BLOCK_TERMS = 2
"""Two int8 terms per activation (error at most a group's max / 32512), not llama.cpp's one
(max / 254). Measured on this project's AMD EPYC (AVX2, 2 threads, idle, 2026-12-02), SmolLM2
Q4_1 teacher-forced over 400 tokens of this README against the fp32 model on the same
dequantized weights: two terms agree on every top-1 (median logit error 2.6e-4 of the logits'
norm), one term on 0.947 (median 4.1e-2): SmolLM2's outlier activations leave the rest of a
group of 32 a few levels of one int8 term. The speed cost is small where a step is not all GEMM:
a decode step took 49.5 ms with two terms, 46.7 ms with one (the GEMMs alone 10-20% slower,
``stencil bench cpu_kernels --block-terms``). ``load_model(block_terms=1)`` takes one term."""


def layer_kind(qtypes: Iterable[str], terms: int = BLOCK_TERMS) -> str:
    """``"int4"``, ``"blocks"`` or ``"dense"`` for a layer whose parts have ggml types
    ``qtypes``, the block kernel taking ``terms`` activation terms (see the module docstring)."""
    qtypes = list(qtypes)
    quantized = [q for q in qtypes if q not in FLOAT_TYPES]
    if not quantized or any(q not in BLOCK_TYPES for q in quantized):
        return "dense"
    if not ggml_blocks.available():
        return "int4" if set(qtypes) <= INT4_TYPES else "blocks"
    if set(qtypes) <= INT4_TYPES and native.available() and terms != 1:
        return "int4"
    return "blocks"


__all__ = ["BLOCK_TERMS", "BLOCK_TYPES", "INT4_TYPES", "layer_kind"]
