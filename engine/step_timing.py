"""Where the time of one engine step goes, phase by phase (``stencil bench overhead`` reads it).

A step is schedule → mask → run (inputs, forward, logits, sample) → update → outputs → propose.
Everything but ``forward`` and ``logits`` (the model's own compute) is *overhead*: the CPU work
around the model that grows with the number of running requests. Marking a phase costs one
``time.perf_counter`` call (≈ 50 ns), so the timer is always on.
"""

from __future__ import annotations

import time

#: Phases in step order. ``forward``: the decoder stack; ``logits``: the LM head (both the
#: model's compute). The rest is overhead.
PHASES = ("schedule", "mask", "inputs", "forward", "logits", "sample", "update", "outputs", "propose")
MODEL_PHASES = frozenset({"forward", "logits"})


class StepTimer:
    """Accumulates the milliseconds of each phase of one step.

    Usage: ``t.start()``, then ``t.mark("schedule")`` at the end of each phase (the time since
    the previous mark is added to that phase). ``ms`` maps phase → milliseconds of the last
    step (phases that did not run are absent).
    """

    __slots__ = ("ms", "_last")

    def __init__(self) -> None:
        self.ms: dict[str, float] = {}
        self._last = 0.0

    def start(self) -> None:
        self.ms = {}
        self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        now = time.perf_counter()
        self.ms[phase] = self.ms.get(phase, 0.0) + (now - self._last) * 1e3
        self._last = now

    @property
    def total_ms(self) -> float:
        return sum(self.ms.values())

    @property
    def overhead_ms(self) -> float:
        """Milliseconds of the step outside the model's compute."""
        return sum(v for k, v in self.ms.items() if k not in MODEL_PHASES)
