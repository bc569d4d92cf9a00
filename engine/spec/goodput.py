"""Whether drafting pays, decided on the throughput it measurably gets (goodput).

A verified draft costs a row of the step. Where rows ride on weight reads (a GPU, one sequence
on a CPU) that row is nearly free; in a compute-bound CPU batch it is not, and a step that
verifies drafts can take twice as long as one that does not (issue 22: 0.84x at concurrency 8,
with drafts priced by a wall-clock model of step time that nothing checked). So the decision
rests on outcomes, measured online:

- **Baseline.** Decode steps without drafting (a one-step probe every 4 to 48 drafting steps,
  often where the gain is small and a probe costs little, rarely where it is large; every step
  while drafting is off) give the time of a plain step against its rows: a ``LinearFit`` of ms
  over rows, which only interpolates between rows it has seen, and forgets fast (a machine's
  load drifts).
- **Outcome.** A drafting step made ``tokens`` tokens in ``ms``; plain decoding would have made
  ``tokens - accepted`` in ``plain(rows)``, so the same tokens would have taken
  ``plain(rows) * tokens / (tokens - accepted)`` ms. Summed over the latest drafting steps
  (``window``, the recent ones weighing most) and divided by their ms, that is the *gain*:
  tokens per second with drafting over tokens per second without, for the batch. Each step is
  judged by the baseline as it is now, so a probe that finds the machine slower re-prices them. Below ``min_gain`` the whole batch stops drafting for ``backoff``
  steps (doubled each time a trial fails, up to ``max_backoff``; reset once drafting has held
  up for ``settle_steps``), then a trial measures again: load from another process, or a batch
  that changed, can turn a loss into a gain and back.
- **Price.** The step time above the baseline, fitted against draft rows, is what one draft
  row costs; over the time a plain step spends per token it is the least chance of acceptance
  at which a draft pays (``threshold``). The proposer applies it per request and per draft
  position (the j-th draft of a request whose drafts are accepted with chance p is accepted
  with chance p^j), so a request whose drafts fail stops paying for rows even while the batch
  gains. Until the price is measured (at start, and when a trial begins, where the old price
  stays as a prior worth a few steps), each request drafts one token unpriced, its likeliest:
  that measures a row's price at a small fraction of what unpriced full drafts would risk.

Time comes from the engine: the wall clock in production, an injected cost model in tests
(``LLMEngine(cost_model=...)``), so every decision can be tested without reading a clock.
SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language
Models Using Goodput", arXiv 2406.14066) picks draft lengths from modelled goodput; here the model only prices
rows, and the measured outcome has the last word.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


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


@dataclass(frozen=True, slots=True)
class StepShape:
    """One decode step (no prompt rows), as the goodput monitor sees it.

    Attributes:
        base_rows: rows fed that are not drafts: one per running request that samples, plus
            its pending grammar-forced tokens.
        draft_rows: draft tokens verified.
        tokens: output tokens the step made (sampled, accepted drafts, and the grammar-forced
            tokens appended after them).
        accepted: draft tokens accepted.
        proposed: requests the proposers ran for before the step (0: a plain step).
    """

    base_rows: int
    draft_rows: int = 0
    tokens: int = 0
    accepted: int = 0
    proposed: int = 0

    @property
    def drafting(self) -> bool:
        return self.proposed > 0


@dataclass(frozen=True, slots=True)
class DraftPlan:
    """What the next step may do.

    Attributes:
        draft: whether to run the proposers at all.
        threshold: least chance of acceptance at which a draft is worth its row (0: all are).
        max_drafts: most drafts per request (None: as many as pay).
        reason: "draft" (priced), "explore" (the price of a row is not measured yet: one
            unpriced draft per request, the likeliest, measures it cheaply), "probe" (a plain
            step to refresh the baseline) or "off" (drafting measurably lost; a trial follows
            after the backoff).
    """

    draft: bool
    threshold: float
    reason: str
    max_drafts: int | None = None


class Goodput:
    """Decides, from measured step times, whether and how much the batch drafts.

    ``plan(rows)`` before the proposers run for the next step (a query: no state changes);
    ``observe(shape, ms)`` after each decode step.

    Args:
        min_gain: drafting goes on while its measured gain is at least this.
        min_steps: priced drafting steps a trial needs before it can fail.
        settle_steps: priced steps after which a trial counts as held (backoff reset).
        probe_cost: share of the throughput probes may cost; spaces them
            (``(gain - 1) / gain / probe_cost`` drafting steps apart).
        min_probe_every / max_probe_every: bounds of that spacing.
        backoff / max_backoff: steps off after the first failed trial / at most.
        min_baseline: plain steps measured before drafting steps are judged (until then a
            probe follows every second drafting step).
        min_priced: drafting steps measured with one unpriced draft per request, to price a
            row, before the price applies.
        gain_decay / baseline_decay / price_decay: weight the past keeps at each step.
        window: priced drafting steps the gain is measured over.
    """

    def __init__(self, *, min_gain: float = 1.0, min_steps: int = 8, settle_steps: int = 64,
                 probe_cost: float = 0.02, min_probe_every: int = 4, max_probe_every: int = 48,
                 backoff: int = 16, max_backoff: int = 256, min_baseline: int = 3, min_priced: int = 4,
                 gain_decay: float = 0.95, baseline_decay: float = 0.8, price_decay: float = 0.95,
                 window: int = 48) -> None:
        self.min_gain, self.min_steps, self.settle_steps = min_gain, min_steps, settle_steps
        self.probe_cost, self.min_probe_every, self.max_probe_every = probe_cost, min_probe_every, max_probe_every
        self.min_backoff, self.max_backoff = backoff, max_backoff
        self.min_baseline, self.min_priced = min_baseline, min_priced
        self.gain_decay = gain_decay
        self.prior_weight = 0.25  # share of its weight the price keeps when a trial begins
        self.baseline = LinearFit(baseline_decay)  # plain step ms against base rows
        self.excess = LinearFit(price_decay)  # drafting step ms above the baseline, against draft rows
        # The latest priced drafting steps, (base rows, tokens, accepted, ms), judged against the
        # baseline as it is now: a probe that shows the machine got slower re-prices them all.
        self._recent: deque[tuple[int, int, int, float]] = deque(maxlen=window)
        self.priced_steps = 0  # priced drafting steps since the trial began
        self.since_plain = 0  # drafting steps since the last plain step
        self.off_left = 0  # plain steps still to go before the next trial
        self.backoff = backoff  # the next failure's time off
        self.trials = 0  # times drafting (re)started after being off
        self.stops = 0  # times it was switched off

    # -- queries -------------------------------------------------------------------------------
    def plan(self, base_rows: int, measurable: bool = True) -> DraftPlan:
        """What the next step, with ``base_rows`` rows besides drafts, may do.

        ``measurable``: the step will likely be a decode step (no prompt rows), so a probe
        there would be observed; a probe is never spent on a step that cannot measure it.
        """
        if self.off_left > 0:
            return DraftPlan(False, 0.0, "off")
        if measurable and self.since_plain >= self._probe_interval():
            return DraftPlan(False, 0.0, "probe")
        if not self.priced:
            return DraftPlan(True, 0.0, "explore", max_drafts=1)
        return DraftPlan(True, self.threshold(base_rows), "draft")

    @property
    def priced(self) -> bool:
        """Whether the baseline and the price of a draft row are measured (since the trial began)."""
        return self.baseline.count >= self.min_baseline and self.excess.count >= self.min_priced

    def threshold(self, base_rows: int) -> float:
        """Least chance of acceptance at which a draft row pays, in a step of ``base_rows``
        other rows: ms per draft row over ms per token of a plain step (0 while unmeasured)."""
        if not self.priced or base_rows <= 0:
            return 0.0
        plain = self.baseline.at(base_rows)
        _, per_row = self.excess.line(flat_through_origin=True)
        return per_row * base_rows / plain if plain > 0 else 0.0

    @property
    def gain(self) -> float | None:
        """Measured tokens/s with drafting over tokens/s without, or None before evidence: over
        the latest ``window`` priced drafting steps (the most recent weigh most), each against
        the time a plain step of its rows takes by the current baseline."""
        if not self._recent:
            return None
        saved = spent = 0.0
        w = 1.0
        for rows, tokens, accepted, ms in reversed(self._recent):
            saved += w * self.baseline.at(rows) * tokens / max(tokens - accepted, 1)
            spent += w * ms
            w *= self.gain_decay
        return saved / spent if spent > 0 else None

    def stats(self) -> dict:
        """For /health: the gain, the price of a draft row (ms), whether drafting is on."""
        price = self.excess.line(flat_through_origin=True) if self.priced else None
        return {"drafting": self.off_left == 0, "gain": self.gain,
                "draft_row_ms": price[1] if price else None, "trials": self.trials, "stops": self.stops}

    def _probe_interval(self) -> int:
        """Drafting steps between probes. A probe gives up what drafting gains on one step, so
        probes are spaced to cost about ``probe_cost`` of the throughput: every few steps while
        the gain is near 1 (a probe then costs next to nothing, and the decision needs a baseline
        taken under the same load), rarely while drafting wins by far."""
        if self.baseline.count < self.min_baseline:
            return 2
        gain = self.gain
        if gain is None:
            return self.min_probe_every
        spacing = (gain - 1.0) / gain / self.probe_cost
        return int(min(max(spacing, self.min_probe_every), self.max_probe_every))

    # -- evidence ------------------------------------------------------------------------------
    def observe(self, shape: StepShape, ms: float) -> None:
        """Account one decode step that took ``ms`` (proposing its drafts included)."""
        if not shape.drafting:
            if shape.draft_rows == 0:
                self.baseline.observe(shape.base_rows, ms)
            self.since_plain = 0
            if self.off_left > 0:
                self.off_left -= 1
                if self.off_left == 0:
                    self._begin_trial()
            return
        self.since_plain += 1
        if self.baseline.count < self.min_baseline:
            return
        plain = self.baseline.at(shape.base_rows)
        self.excess.observe(shape.draft_rows, ms - plain)
        if self.excess.count <= self.min_priced:
            return  # explored before the price was known: it measured the price, not the outcome
        self._recent.append((shape.base_rows, shape.tokens, shape.accepted, ms))
        self.priced_steps += 1
        if self.priced_steps < self.min_steps:
            return
        if self.gain < self.min_gain:
            self.off_left, self.backoff = self.backoff, min(2 * self.backoff, self.max_backoff)
            self.stops += 1
        elif self.priced_steps >= self.settle_steps:
            self.backoff = self.min_backoff

    def _begin_trial(self) -> None:
        """Measure afresh: the row price and the gain may be different now. The old price stays
        as a prior worth a few steps (under load one step's time is noisy; four alone mislead)."""
        self.excess.shrink(self.prior_weight)
        self._recent.clear()
        self.priced_steps = 0
        self.since_plain = 0
        self.trials += 1
