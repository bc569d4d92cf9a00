"""Paged attention backends (see ``stencil.kernels.attention_backend`` for the interface, ``stencil.kernels.registry`` to pick one).

This folder is ``stencil.kernels``. Imported by the top-level name ``kernels`` (the repository
root on ``sys.path``: ``python -m`` or ``python -c`` run from the root, or a Ray worker, which puts the
driver's working directory there), it would stand in for Hugging Face's ``kernels`` distribution,
which transformers imports; so under that name it loads the distribution found on the rest of
``sys.path`` instead, and is ``ModuleNotFoundError`` where there is none (docs/architecture.md,
"One import name").
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    _spec = importlib.machinery.PathFinder.find_spec(
        "kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != _root])
    if _spec is None:
        raise ModuleNotFoundError("No module named 'kernels' (the repository's kernels/ folder is stencil.kernels)",
                                  name="kernels")
    _module = importlib.util.module_from_spec(_spec)
    sys.modules["kernels"] = _module  # what the import statement returns: the distribution's module
    _spec.loader.exec_module(_module)
else:
    from stencil.kernels.attention_backend import BLOCK_SIZE, AttentionBackend, AttentionMetadata
    from stencil.kernels.registry import backend_names, get_backend

__all__ = ["BLOCK_SIZE", "AttentionBackend", "AttentionMetadata", "backend_names", "get_backend"]
