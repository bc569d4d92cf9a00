"""What one more row costs the model's own kernels on this machine: the floor of a draft row's price.

The goodput switch (``stencil.engine.speculative.goodput``) prices a draft row from step times: a drafting
step's time above the plain steps near it, fitted against its draft rows. On a shared machine
that fit can read zero (noise makes more rows look no dearer), and a price of zero lets every
draft through however unlikely (issue 35: ``draft_row_ms`` 0.0 while drafting steps took twice
a plain one). A draft row costs at least what the decoder's projections spend on one more row,
so that is measured once, here, on the machine that serves, and the price never goes below it.

What is timed: the projections of the first decoder layer (``model.linear_layers()``: q/k/v,
o, gate/up, down), fed ``small`` and then ``large`` rows, interleaved ``pairs`` times; the
median over pairs of the time difference per added row, times the number of layers. The LM head
is left out (constrained rows compute only the columns their grammar allows), and so is
attention (it grows with the context): the result is a floor, not the price. One layer's
weights stay in cache, which again errs low. Where noise hides the slope (a median at or below
zero), a tenth of the per-row time at ``large`` rows stands in: still measured, never zero.
"""

from __future__ import annotations

import statistics
import time

import torch


@torch.no_grad()
def decoder_row_ms(model, *, small: int = 4, large: int = 16, pairs: int = 5) -> float:
    """Milliseconds one more row costs the decoder's projections (all layers), at ``small`` to
    ``large`` rows: the floor of a draft row's price.

    Args:
        model: a model with ``linear_layers()`` yielding ``(name, module)`` per projection
            (``stencil.engine.models.llama.LlamaForCausalLM``), each module taking ``[N, in_features]``
            activations in ``model.dtype``.
        small / large: rows of the two batches timed (``large > small >= 1``).
        pairs: interleaved (small, large) timings; the median difference counts.

    Returns:
        ms per row, > 0; 0.0 for a model without ``linear_layers`` (no floor known).

    Reads the wall clock (``time.perf_counter``): call it outside tests' decisions (the engine
    does so only without an injected cost model).
    """
    if large <= small or small < 1:
        raise ValueError(f"need large > small >= 1 rows, got small={small}, large={large}")
    layers = getattr(model, "linear_layers", None)
    if layers is None:
        return 0.0
    modules = list(layers())
    first = [m for name, m in modules if name.startswith("layers.0.")] or [m for _, m in modules]
    if not first:
        return 0.0
    copies = len(modules) / len(first)  # layers, when every layer has the same projections
    gen = torch.Generator().manual_seed(0)
    dtype = getattr(model, "dtype", torch.float32)
    inputs = {n: [torch.randn(n, m.in_features, generator=gen).to(dtype) for m in first] for n in (small, large)}

    def timed(n: int) -> float:
        t = time.perf_counter()
        for m, x in zip(first, inputs[n]):
            m(x)
        return (time.perf_counter() - t) * 1e3

    timed(small), timed(large)  # first calls pay for allocation and packing caches
    diffs, large_ms = [], []
    for _ in range(pairs):
        a, b = timed(small), timed(large)
        diffs.append((b - a) / (large - small))
        large_ms.append(b / large)
    slope = statistics.median(diffs)
    per_row = slope if slope > 0 else 0.1 * min(large_ms)
    return per_row * copies
