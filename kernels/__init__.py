"""Paged attention backends (see ``stencil.kernels.attention_backend`` for the interface, ``stencil.kernels.registry`` to pick one).

This folder is ``stencil.kernels``. Imported as a top-level ``kernels`` (the repository root on
``sys.path``: ``python -m`` or ``python -c`` run from the root), it would stand in for Hugging Face's
``kernels`` distribution, which transformers imports; that import fails here with the reason
instead of somewhere inside transformers (docs/architecture.md, "One import name").
"""

if __name__ == "kernels":
    raise ImportError("the repository root is on sys.path, so Stencil's kernels/ folder shadows Hugging Face's "
                      "`kernels` package that transformers imports: run Python from another directory, use the "
                      "`stencil` command, or set PYTHONSAFEPATH=1 (the Makefile and the tests do)")

from stencil.kernels.attention_backend import BLOCK_SIZE, AttentionBackend, AttentionMetadata
from stencil.kernels.registry import backend_names, get_backend

__all__ = ["BLOCK_SIZE", "AttentionBackend", "AttentionMetadata", "backend_names", "get_backend"]
