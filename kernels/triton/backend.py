"""The ``triton`` attention backend: our paged FlashAttention-style kernels.

Constructing it imports ``triton`` and the kernel modules; importing this module does not, so
``import stencil.kernels.triton`` works on a machine without triton.
"""

from __future__ import annotations

import importlib.util

import torch

from stencil.kernels.attention_backend import AttentionMetadata


class TritonAttentionBackend:
    """Paged attention and cache writes through the kernels of ``stencil.kernels.triton``.

    Runs compiled on CUDA; on CPU only under the Triton interpreter (``TRITON_INTERPRET=1``
    set before ``triton`` is first imported), which is how the tests check it without a GPU.

    Args:
        device: the device the engine runs on (kept for the registry's uniform constructor;
            the kernels run where their input tensors are).

    Raises:
        RuntimeError: ``triton is not installed``.
    """

    name = "triton"

    def __init__(self, device: torch.device | str | None = None) -> None:
        if importlib.util.find_spec("triton") is None:
            raise RuntimeError("triton is not installed")
        from stencil.kernels.triton.paged_attention import paged_attention
        from stencil.kernels.triton.reshape_and_cache import reshape_and_cache

        self.device = torch.device(device) if device is not None else None
        self._attention = paged_attention
        self._cache_write = reshape_and_cache

    def reshape_and_cache(
        self,
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # int64 [T]
    ) -> None:
        """Write each new token's K and V into its slot (in place); negative slots are skipped.

        Raises:
            ValueError: mismatched shapes or dtypes (K/V must already have the cache dtype).
            RuntimeError: CPU tensors without the Triton interpreter.
        """
        self._cache_write(key, value, k_cache, v_cache, slot_mapping)

    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Causal attention of every query row over its sequence's paged K/V (GQA aware),
        fp32 accumulation; see ``stencil.kernels.triton.paged_attention.paged_attention``.

        Raises:
            ValueError: shapes, dtypes or strides the kernel cannot serve, or a ``window``
                (the kernel has no sliding-window mask yet: it would read the whole prefix).
            RuntimeError: CPU tensors without the Triton interpreter.
        """
        if window is not None:
            raise ValueError(f"the triton attention backend has no sliding window (asked for {window} "
                             "tokens); use the flash or torch backend for this model")
        return self._attention(query, k_cache, v_cache, meta, scale)
