"""Paged attention kernels written in Triton (CUDA; CPU through the Triton interpreter).

``TritonAttentionBackend`` is importable without triton installed; constructing it is what
needs triton. The kernel modules (``paged_attention``, ``reshape_and_cache``) import triton
when they are imported.
"""

from stencil.kernels.triton.backend import TritonAttentionBackend

__all__ = ["TritonAttentionBackend"]
