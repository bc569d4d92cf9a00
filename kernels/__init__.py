"""Paged attention backends (see ``kernels.attention_backend`` for the interface, ``kernels.registry`` to pick one)."""

from kernels.attention_backend import BLOCK_SIZE, AttentionBackend, AttentionMetadata
from kernels.registry import backend_names, get_backend

__all__ = ["BLOCK_SIZE", "AttentionBackend", "AttentionMetadata", "backend_names", "get_backend"]
