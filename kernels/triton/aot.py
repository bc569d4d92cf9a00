"""Compile the kernels ahead of time for a GPU architecture, on a machine without a GPU.

Triton lowers a kernel to PTX and then to a cubin with the ``ptxas`` bundled in its wheel, so
a CPU-only machine (CI) can check that every configuration the launchers produce compiles
for, say, Hopper (compute capability 9.0), which the interpreter does not prove: it never
runs Triton's type checks and code generation. Needs ``TRITON_INTERPRET`` unset when triton
is first imported (interpreted kernels cannot be compiled).
"""

from __future__ import annotations

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from stencil.kernels.triton.paged_attention import _paged_attention_kernel
from stencil.kernels.triton.reshape_and_cache import _reshape_and_cache_kernel

_TRITON_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def _compile(kernel, pointer_types: dict[str, str], constexprs: dict[str, object],
             capability: int):
    names = kernel.arg_names
    signature = {name: pointer_types.get(name, "i32") for name in names}
    signature.update({name: "constexpr" for name in constexprs})
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(source, target=GPUTarget("cuda", capability, 32))


def compile_paged_attention(dtype: torch.dtype, config: dict[str, object],
                            capability: int = 90):
    """Compile the attention kernel for ``dtype`` with ``config`` (from ``launch_config``).

    Returns the compiled kernel (``.asm["cubin"]``, ``.metadata.shared`` bytes).

    Raises:
        triton.CompilationError: the configuration does not compile.
    """
    elem = "*" + _TRITON_DTYPES[dtype]
    pointers = {"q_ptr": elem, "k_cache_ptr": elem, "v_cache_ptr": elem, "out_ptr": elem,
                "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32",
                "block_tables_ptr": "*i32", "scale_log2": "fp32"}
    return _compile(_paged_attention_kernel, pointers, config, capability)


def compile_reshape_and_cache(dtype: torch.dtype, num_kv_heads: int, head_dim: int,
                              block_size: int = 16, capability: int = 90):
    """Compile the cache-write kernel for ``dtype`` and a ``[num_kv_heads, head_dim]`` row.

    Raises:
        triton.CompilationError: the configuration does not compile.
    """
    elem = "*" + _TRITON_DTYPES[dtype]
    pointers = {"key_ptr": elem, "value_ptr": elem, "k_cache_ptr": elem, "v_cache_ptr": elem,
                "slot_mapping_ptr": "*i64"}
    config = {"NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim,
              "HEADS_PAD": triton.next_power_of_2(num_kv_heads),
              "HEAD_DIM_PAD": triton.next_power_of_2(head_dim), "BLOCK_SIZE": block_size}
    return _compile(_reshape_and_cache_kernel, pointers, config, capability)
