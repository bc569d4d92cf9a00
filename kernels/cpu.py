"""Native paged attention for x86 CPUs, the CPU default: ``kernels/csrc/attention.c`` (AVX512)
where it builds, else ``kernels/csrc/vec_attention.c`` (the same algorithm on 8-lane vectors:
AVX2 + FMA on this project's AMD EPYC machines; ``stencil.kernels.vec_attention``).

One C call per layer computes every query row of the step (decode, forced, draft and prompt
rows alike) against exactly the keys it sees, reading K/V through the block table: no gather,
no per-row Python. Each row's result is the same bits in any batch and any prefill chunking
(see the C file), which the torch reference guarantees only for short queries.

Measured here (SmolLM2 shapes: 9 query heads, 3 kv heads, head_dim 64; one thread): one
decode row over 500 keys 24 us of kernel time; a 400-token prefill 3.2 ms against 4.3 ms for
torch's fused CPU SDPA. The AVX512 kernel needs what ``stencil.kernels.native`` needs (a C compiler,
AVX512-BF16); the portable one a C compiler for x86-64. Both take fp32, bf16 or fp16 caches
(bf16/fp16 K/V are widened exactly to fp32 as they are read: half the memory traffic); any other
input (another cache dtype, a head_dim the kernel does not take: not a multiple of 16 for AVX512,
of 8 for the portable one, or above 256) goes to the torch reference.
"""

from __future__ import annotations

import torch

from stencil.kernels import native, vec_attention
from stencil.kernels.attention_backend import AttentionMetadata
from stencil.kernels.torch_ref import TorchAttentionBackend


class CpuAttentionBackend(TorchAttentionBackend):
    """``TorchAttentionBackend`` with a native kernel for fp32, bf16 and fp16 CPU caches (AVX512's
    where it builds, else the portable one; ``kernel`` names it).

    Args:
        device: must be a CPU device (or None).

    Raises:
        RuntimeError: neither kernel can be built or run here.
        ValueError: a non-CPU device.
    """

    name = "cpu"

    def __init__(self, device: torch.device | str | None = None) -> None:
        super().__init__(device)
        if self.device is not None and self.device.type != "cpu":
            raise ValueError(f"the cpu attention backend runs on CPU, got {self.device}")
        if native.available():
            self.kernel, self._supported, self._attend = "avx512", native.attention_supported, native.paged_attention
        elif vec_attention.available():
            self.kernel, self._supported, self._attend = ("vec", vec_attention.supported,
                                                          vec_attention.paged_attention)
        else:
            raise RuntimeError(f"native CPU kernels unavailable: {native.unavailable_reason()}; "
                               f"portable: {vec_attention.unavailable_reason()}")

    def supports_cache(self, k_cache: torch.Tensor) -> bool:
        """Whether the native kernel reads this cache (else the torch reference does)."""
        return self._supported(k_cache)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:  # [T, H, D]
        """Same contract as ``TorchAttentionBackend.forward`` (``window`` included);
        ``[T, num_heads, head_dim]``."""
        if window is not None and window < 1:
            raise ValueError(f"window must be >= 1 token, got {window}")
        if not self._supported(k_cache):
            return super().forward(query, k_cache, v_cache, meta, scale, window)
        out = self._attend(query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                           meta.seq_lens, scale, window)
        return out.to(query.dtype)
