"""Where a Triton kernel can run: compiled on CUDA, or interpreted on CPU.

Triton decides at decoration time (when a kernel module is first imported) whether
``@triton.jit`` compiles or interprets, from ``TRITON_INTERPRET``; that environment variable
must be set before ``triton`` itself is first imported, because the interpreter needs
triton's own library functions (``tl.max``, ``tl.sum``) decorated the same way.
"""

from __future__ import annotations

import torch


def is_interpreted(kernel) -> bool:
    """True when ``kernel`` (a ``@triton.jit`` object) runs in Triton's CPU interpreter."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)


def check_launchable(kernel, tensor: torch.Tensor) -> None:
    """Raise unless ``kernel`` can run on ``tensor``'s device.

    Raises:
        RuntimeError: a CPU (or other non-CUDA) tensor while the kernel is compiled.
    """
    if tensor.device.type != "cuda" and not is_interpreted(kernel):
        raise RuntimeError(
            f"Triton kernels on {tensor.device} tensors need TRITON_INTERPRET=1 set before "
            "triton is first imported")
