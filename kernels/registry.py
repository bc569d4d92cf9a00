"""Attention backends by name, imported lazily.

Each entry names a module and a class; the module is imported only when that backend is
asked for, so importing this registry never imports ``flash_attn`` or ``triton``. A backend
class is constructed as ``cls(device)``.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

import torch

from stencil.kernels.attention_backend import AttentionBackend

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class BackendSpec:
    """Where a backend lives and what it runs on.

    Attributes:
        module: dotted module path (imported on first use).
        cls: class name inside ``module``.
        cuda_only: refuse non-CUDA devices.
    """

    module: str
    cls: str
    cuda_only: bool


BACKENDS: dict[str, BackendSpec] = {
    "torch": BackendSpec("stencil.kernels.torch_ref", "TorchAttentionBackend", cuda_only=False),
    "cpu": BackendSpec("stencil.kernels.cpu", "CpuAttentionBackend", cuda_only=False),
    "flash": BackendSpec("stencil.kernels.flash", "FlashAttentionBackend", cuda_only=True),
    "triton": BackendSpec("stencil.kernels.triton", "TritonAttentionBackend", cuda_only=True),
}

AUTO_ORDER_CUDA = ("flash", "triton")
"""Preference of ``"auto"`` on CUDA: the first one that constructs wins, else torch."""


def backend_names() -> list[str]:
    """Every name ``get_backend`` accepts, ``"auto"`` included."""
    return [*BACKENDS, "auto"]


def get_backend(name: str, device: torch.device | str) -> AttentionBackend:
    """Construct the attention backend called ``name`` for ``device``.

    ``"auto"`` picks, on CUDA, the first of flash, triton whose construction succeeds (a
    backend whose library is missing raises ImportError or RuntimeError there), else torch;
    on CPU, the native kernel ("cpu") when it builds here, else torch; elsewhere, torch.

    Raises:
        ValueError: unknown name (the message lists the choices), or a CUDA-only backend
            asked for on another device.
        ImportError, RuntimeError: a named backend's module or library is unavailable.
    """
    device = torch.device(device)
    if name == "auto":
        return _auto(device)
    spec = BACKENDS.get(name)
    if spec is None:
        raise ValueError(f"unknown attention backend {name!r}; choices: {backend_names()}")
    if spec.cuda_only and device.type != "cuda":
        raise ValueError(f"attention backend {name!r} needs a CUDA device, got {device}")
    cls = getattr(importlib.import_module(spec.module), spec.cls)
    return cls(device)


def _auto(device: torch.device) -> AttentionBackend:
    if device.type == "cpu":
        try:
            return get_backend("cpu", device)
        except (ImportError, RuntimeError) as exc:
            log.info("attention backend 'cpu' unavailable: %s", exc)
        return get_backend("torch", device)
    if device.type != "cuda":
        return get_backend("torch", device)
    for name in AUTO_ORDER_CUDA:
        try:
            return get_backend(name, device)
        except (ImportError, RuntimeError) as exc:
            log.info("attention backend %r unavailable on %s: %s", name, device, exc)
    return get_backend("torch", device)
