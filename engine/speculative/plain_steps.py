"""The recent plain decode steps (no drafts): what a plain step costs now, near a given step and at
its batch composition, and whether the machine changed speed.

A drafting step is only worth what plain decoding would have made in the same time *on the
machine as it was then*. On a shared machine that changes within seconds (issue 35: the same
step took 22 ms in one run and 45 ms in the next), so a drafting step is judged against the
plain steps nearest to it in time, the first after it and the latest before it (``near``),
preferring those of the same batch composition (as many requests), each adjusted to its rows
by the slope of a fast-forgetting fit of ms over rows.

A plain step 1.5x slower (or faster) than the median of the recent ones is *suspect*: it is
held back until ``confirm`` steps in a row say the same (the machine changed speed: the record
restarts from them, and the goodput switch re-measures before it decides anything) or one
says otherwise (noise: they all join the record). Time is the switch's own step count, never
the clock.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

from stencil.engine.speculative.fit import LinearFit


@dataclass(frozen=True, slots=True)
class PlainStep:
    """One plain decode step.

    Attributes:
        t: its index among the decode steps the switch saw.
        requests: requests in the step (its batch composition).
        rows: rows fed (one per request plus grammar-forced tokens).
        ms: its time.
    """

    t: int
    requests: int
    rows: int
    ms: float


class PlainSteps:
    """The record of recent plain steps.

    Args:
        decay: weight the rows fit keeps per new step.
        size: plain steps kept.
        window: recent steps whose median a new one is compared with.
        change: ratio to that median at which a step is suspect (slower or faster).
        confirm: suspect steps in a row, all one way, that make a change of speed. Four: under
            step times off by a lognormal factor of sigma 0.35 (the noisy test of
            ``tests/engine/test_spec_decode.py``) one step in eight is 1.5x off the median, and three
            in a row made 6-10 false changes in 1000 steps; four make 0-4.
        horizon: most decode steps between a drafting step and a plain step it is judged by.
        nearest: plain steps a drafting step is judged by (fewer where fewer are near).
    """

    def __init__(self, *, decay: float = 0.8, size: int = 32, window: int = 16, change: float = 1.5,
                 confirm: int = 4, horizon: int = 96, nearest: int = 4) -> None:
        self.fit = LinearFit(decay)  # ms against rows, for the slope
        self.steps: deque[PlainStep] = deque(maxlen=size)
        self.window, self.change, self.confirm, self.horizon = window, change, confirm, horizon
        self.nearest = nearest
        self.suspect: list[PlainStep] = []  # the latest steps, all off the median the same way
        self._direction = 0  # +1 slower, -1 faster

    @property
    def count(self) -> int:
        """Plain steps recorded since the start or the last change of speed."""
        return self.fit.count

    @property
    def slope(self) -> float:
        """ms per row of a plain step (0 while rows hardly vary)."""
        line = self.fit.line()
        return line[1] if line else 0.0

    def at(self, rows: int) -> float | None:
        """ms of a plain step of ``rows`` by the fit (None before any step)."""
        return self.fit.at(rows)

    def typical(self, requests: int, rows: int) -> float | None:
        """Median ms of the latest ``window`` plain steps (of ``requests`` requests where there
        are three such), each moved to ``rows`` by the slope; None with fewer than three."""
        same = [s for s in self.steps if s.requests == requests]
        pool = same if len(same) >= 3 else list(self.steps)
        if len(pool) < 3:
            return None
        b = self.slope
        return statistics.median(s.ms + b * (rows - s.rows) for s in pool[-self.window:])

    def add(self, step: PlainStep) -> str:
        """Record ``step``; returns "kept", "suspect" (held back, off the median) or "changed"
        (the ``confirm``-th suspect in a row: the record now holds only those)."""
        ref = self.typical(step.requests, step.rows)
        ratio = step.ms / ref if ref else 1.0
        direction = 1 if ratio >= self.change else -1 if ratio * self.change <= 1.0 else 0
        if direction != self._direction and self.suspect:
            self._keep(self.suspect)  # the other way, or back to normal: the suspects were noise
            self.suspect = []
        if direction == 0:
            self._keep([step])
            self._direction = 0
            return "kept"
        self._direction = direction
        self.suspect.append(step)
        if len(self.suspect) < self.confirm:
            return "suspect"
        self.steps.clear()
        self.fit.reset()
        self._keep(self.suspect)
        self.suspect, self._direction = [], 0
        return "changed"

    def near(self, t: int, requests: int, rows: int) -> list[float]:
        """What a plain step of ``rows`` took around step ``t``: the ``nearest`` recorded plain
        steps within ``horizon`` steps of it, the first one after ``t`` always among them (the
        probe that ends its run of drafting steps) and the rest the latest before it, of
        ``requests`` requests where there are such; each moved to ``rows`` by the slope
        (ms; empty when none is near enough)."""
        close = [s for s in self.steps if abs(s.t - t) <= self.horizon]
        same = [s for s in close if s.requests == requests]
        pool = same or close
        after = [s for s in pool if s.t > t][:1]
        before = [s for s in pool if s.t < t][-(self.nearest - len(after)):]
        b = self.slope
        return [s.ms + b * (rows - s.rows) for s in before + after]

    def _keep(self, steps: list[PlainStep]) -> None:
        for s in steps:
            self.steps.append(s)
            self.fit.observe(s.rows, s.ms)
