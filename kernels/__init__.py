"""Paged attention backends (see ``stencil.kernels.attention_backend`` for the interface, ``stencil.kernels.registry`` to pick one)."""

from stencil.kernels.attention_backend import BLOCK_SIZE, AttentionBackend, AttentionMetadata
from stencil.kernels.registry import backend_names, get_backend

__all__ = ["BLOCK_SIZE", "AttentionBackend", "AttentionMetadata", "backend_names", "get_backend"]
