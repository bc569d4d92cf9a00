"""An exponentially weighted least-squares line, for step times that drift."""

from __future__ import annotations


class LinearFit:
    """Exponentially weighted least squares ``y ≈ a + b·x`` over a stream of (x, y) pairs.

    Args:
        decay: weight the past keeps at each new pair (0 < decay < 1).
    """

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.reset()

    def reset(self) -> None:
        self.count = 0  # pairs seen since the last reset or shrink
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def shrink(self, keep: float) -> None:
        """Keep the fit but weigh it as ``keep`` times as many pairs: new pairs then move it
        faster (a prior that the next measurements may overrule)."""
        sums = (self._w, self._x, self._y, self._xx, self._xy)
        self._w, self._x, self._y, self._xx, self._xy = (v * keep for v in sums)
        self.count = 0

    def observe(self, x: float, y: float) -> None:
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.count += 1

    def line(self, *, flat_through_origin: bool = False) -> tuple[float, float] | None:
        """``(a, b)`` with ``b >= 0``, or None before any pair.

        While ``x`` hardly varies (variance under 0.25) no slope can be read: the line is then
        the weighted mean (``b = 0``), or with ``flat_through_origin`` the ray through it
        (``a = 0``, all of ``y`` put on ``x``: the cautious reading of a cost).
        """
        if self._w <= 0.0:
            return None
        mx, my = self._x / self._w, self._y / self._w
        var = self._xx / self._w - mx * mx
        if var < 0.25:
            if flat_through_origin and mx > 0:
                return 0.0, max(my / mx, 0.0)
            return my, 0.0
        b = max((self._xy / self._w - mx * my) / var, 0.0)  # more rows never cost less
        return my - b * mx, b

    def at(self, x: float) -> float | None:
        line = self.line()
        return None if line is None else line[0] + line[1] * x
