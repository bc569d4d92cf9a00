"""Whether drafting pays, decided on the throughput it measurably gets (goodput).

A verified draft costs a row of the step. Where rows ride on weight reads (a GPU, one sequence
on a CPU) that row is nearly free; in a compute-bound CPU batch it is not, and a step that
verifies drafts can take twice as long as one that does not (issue 22: 0.84x at concurrency 8,
with drafts priced by a wall-clock model of step time that nothing checked). So the decision
rests on outcomes, measured online:

- **Baseline.** Decode steps without drafting (a one-step probe every 4 to 48 drafting steps,
  often where the gain is small and a probe costs little, rarely where it is large; every step
  while drafting is off) are the plain steps (``stencil.engine.speculative.plain_steps``).
- **Outcome, judged near in time.** A drafting step made ``tokens`` tokens in ``ms``; plain
  decoding would have made ``tokens - accepted`` in the time of a plain step, so the same
  tokens would have taken ``plain * tokens / (tokens - accepted)`` ms. ``plain`` is the mean
  of the plain steps nearest to that step in time (the probe that ends its run of drafting
  steps and the three before it, of the same batch composition where there are such), so a
  drafting step is judged when the next plain step arrives, against the machine as it was
  then: a slow spell that lands on the drafting steps lands on the probes between them too
  (issue 35). Four steps, not two: under noise a reference of two misjudges too often. Over the latest judged
  steps (``window``, the recent ones weighing most), saved ms over spent ms is the *gain*:
  tokens per second with drafting over tokens per second without. Below ``min_gain`` the
  whole batch stops drafting for ``backoff`` steps (doubled each time a trial fails, up to
  ``max_backoff``; reset once drafting has held up for ``settle_steps``), then a trial
  measures again: load from another process, or a batch that changed, can turn a loss into a
  gain and back.
- **A change of speed.** A plain step 1.5x slower (or faster) than the median of the recent
  ones is held back, and the next steps are probes, until four in a row confirm it (or one
  refutes it: noise). Confirmed, the evidence taken at the old speed goes (the drafting steps
  not yet judged, the gain's window; the row price keeps a prior's weight), so the switch
  re-measures before it decides; while drafting is off, the change starts a trial at once.
- **Price.** The time of a drafting step above its nearest plain steps, fitted against its
  draft rows, is what one draft row costs. It never goes below ``row_floor_ms``, what one more
  row costs the model's own projections on this machine (``stencil.engine.speculative.row_cost``), so it can
  never read drafts as free. Over the time a plain step spends per token it is the least
  chance of acceptance at which a draft pays (``threshold``). The proposer applies it per
  request and per draft position (the j-th draft of a request whose drafts are accepted with
  chance p is accepted with chance p^j), so a request whose drafts fail stops paying for rows
  even while the batch gains. Until the price is measured (at start, when a trial begins, and
  after a change of speed, where the old price stays as a prior worth a few steps), each
  request drafts one token unpriced, its likeliest: that measures a row's price at a small
  fraction of what unpriced full drafts would risk.

Time comes from the engine: the wall clock in production, an injected cost model in tests
(``LLMEngine(cost_model=...)``), so every decision can be tested without reading a clock.
SmartSpec (Liu et al. 2024, "Optimizing Speculative Decoding for Serving Large Language
Models Using Goodput", arXiv 2406.14066) picks draft lengths from modelled goodput; here the model only prices
rows, and the measured outcome has the last word.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from stencil.engine.speculative.fit import LinearFit
from stencil.engine.speculative.plain_steps import PlainStep, PlainSteps

__all__ = ["DraftPlan", "Goodput", "LinearFit", "StepShape"]


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
        requests: requests in the step, its batch composition (0: not told; all alike).
    """

    base_rows: int
    draft_rows: int = 0
    tokens: int = 0
    accepted: int = 0
    proposed: int = 0
    requests: int = 0

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
            step to refresh the baseline, or to confirm a change of speed) or "off" (drafting
            measurably lost; a trial follows after the backoff).
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
        row_floor_ms: least price of a draft row (ms; ``stencil.engine.speculative.row_cost``); None until
            measured (the engine measures it before the first drafting step), 0 for none.
        change / confirm: a plain step this many times slower or faster than the recent median
            is suspect; this many in a row are a change of speed (``PlainSteps``).
    """

    def __init__(self, *, min_gain: float = 1.0, min_steps: int = 8, settle_steps: int = 64,
                 probe_cost: float = 0.02, min_probe_every: int = 4, max_probe_every: int = 48,
                 backoff: int = 16, max_backoff: int = 256, min_baseline: int = 3, min_priced: int = 4,
                 gain_decay: float = 0.95, baseline_decay: float = 0.8, price_decay: float = 0.95,
                 window: int = 48, row_floor_ms: float | None = None, change: float = 1.5,
                 confirm: int = 4) -> None:
        self.min_gain, self.min_steps, self.settle_steps = min_gain, min_steps, settle_steps
        self.probe_cost, self.min_probe_every, self.max_probe_every = probe_cost, min_probe_every, max_probe_every
        self.min_backoff, self.max_backoff = backoff, max_backoff
        self.min_baseline, self.min_priced = min_baseline, min_priced
        self.gain_decay = gain_decay
        self.row_floor_ms = row_floor_ms
        self.prior_weight = 0.25  # share of its weight the price keeps when it is measured afresh
        self.plain = PlainSteps(decay=baseline_decay, change=change, confirm=confirm,
                                horizon=2 * max_probe_every)
        self.excess = LinearFit(price_decay)  # drafting step ms above its plain steps, against draft rows
        # Drafting steps since the last plain step, (t, shape, ms, priced then): judged when
        # the plain step after them is in.
        self._pending: list[tuple[int, StepShape, float, bool]] = []
        # The latest judged priced drafting steps: (ms plain decoding needed for their tokens, ms spent).
        self._recent: deque[tuple[float, float]] = deque(maxlen=window)
        self.t = 0  # decode steps seen
        self.priced_steps = 0  # priced drafting steps judged since the trial began
        self.since_plain = 0  # drafting steps since the last plain step
        self.off_left = 0  # plain steps still to go before the next trial
        self.backoff = backoff  # the next failure's time off
        self.trials = 0  # times drafting (re)started after being off
        self.stops = 0  # times it was switched off
        self.remeasures = 0  # changes of speed that made it measure afresh

    # -- queries -------------------------------------------------------------------------------
    def plan(self, base_rows: int, measurable: bool = True) -> DraftPlan:
        """What the next step, with ``base_rows`` rows besides drafts, may do.

        ``measurable``: the step will likely be a decode step (no prompt rows), so a probe
        there would be observed; a probe is never spent on a step that cannot measure it.
        """
        if self.off_left > 0:
            return DraftPlan(False, 0.0, "off")
        if measurable and (self.plain.suspect or self.since_plain >= self._probe_interval()):
            return DraftPlan(False, 0.0, "probe")
        if not self.priced:
            return DraftPlan(True, 0.0, "explore", max_drafts=1)
        return DraftPlan(True, self.threshold(base_rows), "draft")

    @property
    def priced(self) -> bool:
        """Whether the baseline and the price of a draft row are measured (since the trial began)."""
        return self.plain.count >= self.min_baseline and self.excess.count >= self.min_priced

    @property
    def row_ms(self) -> float | None:
        """The price of one draft row (ms): the fit's, never below ``row_floor_ms``; None
        before any drafting step was judged."""
        line = self.excess.line(flat_through_origin=True)
        if line is None:
            return None
        return max(line[1], self.row_floor_ms or 0.0)

    def threshold(self, base_rows: int) -> float:
        """Least chance of acceptance at which a draft row pays, in a step of ``base_rows``
        other rows: ms per draft row over ms per token of a plain step (0 while unmeasured)."""
        if not self.priced or base_rows <= 0:
            return 0.0
        plain = self.plain.at(base_rows)
        return self.row_ms * base_rows / plain if plain and plain > 0 else 0.0

    @property
    def gain(self) -> float | None:
        """Measured tokens/s with drafting over tokens/s without, or None before evidence: over
        the latest ``window`` judged priced drafting steps (the most recent weigh most), each
        against the plain steps nearest to it."""
        if not self._recent:
            return None
        saved = spent = 0.0
        w = 1.0
        for plain_ms, ms in reversed(self._recent):
            saved += w * plain_ms
            spent += w * ms
            w *= self.gain_decay
        return saved / spent if spent > 0 else None

    def stats(self) -> dict:
        """For /health and ``stencil bench spec``: the gain, the price of a draft row and its
        floor (ms), whether drafting is on, trials, stops, changes of speed re-measured."""
        return {"drafting": self.off_left == 0, "gain": self.gain, "draft_row_ms": self.row_ms,
                "row_floor_ms": self.row_floor_ms, "trials": self.trials, "stops": self.stops,
                "remeasures": self.remeasures}

    def _probe_interval(self) -> int:
        """Drafting steps between probes. A probe gives up what drafting gains on one step, so
        probes are spaced to cost about ``probe_cost`` of the throughput: every few steps while
        the gain is near 1 (a probe then costs next to nothing, and the decision needs plain
        steps taken close by), rarely while drafting wins by far."""
        if self.plain.count < self.min_baseline:
            return 2
        gain = self.gain
        if gain is None:
            return self.min_probe_every
        spacing = (gain - 1.0) / gain / self.probe_cost
        return int(min(max(spacing, self.min_probe_every), self.max_probe_every))

    # -- evidence ------------------------------------------------------------------------------
    def observe(self, shape: StepShape, ms: float) -> None:
        """Account one decode step that took ``ms`` (proposing its drafts included)."""
        self.t += 1
        if shape.drafting:
            self.since_plain += 1
            self._pending.append((self.t, shape, ms, self.priced))
            return
        if shape.draft_rows:
            return  # drafts nobody proposed: not a plain step, nothing to judge
        self.since_plain = 0
        was_off = self.off_left > 0  # this step was one of the stretch off (not the probe that stops it)
        verdict = self.plain.add(PlainStep(self.t, shape.requests, shape.base_rows, ms))
        if verdict == "changed":
            self.remeasures += 1
            if was_off:  # conditions changed while off: try again now
                self.off_left = 0
                self._begin_trial()
            else:
                self._measure_afresh()
            return
        if verdict == "kept":
            self._judge()
        if was_off:
            self.off_left -= 1
            if self.off_left == 0:
                self._begin_trial()

    def _judge(self) -> None:
        """Judge the drafting steps since the last plain step against the plain steps nearest
        to them; then decide whether drafting goes on."""
        pending, self._pending = self._pending, []
        if self.plain.count < self.min_baseline:
            return  # too few plain steps to judge by: they measured nothing
        judged = 0
        for t, shape, ms, priced in pending:
            refs = self.plain.near(t, shape.requests, shape.base_rows)
            if not refs:
                continue  # no plain step near enough: no evidence
            plain = sum(refs) / len(refs)
            self.excess.observe(shape.draft_rows, ms - plain)
            if not priced:
                continue  # explored before the price was known: it measured the price, not the outcome
            self._recent.append((plain * shape.tokens / max(shape.tokens - shape.accepted, 1), ms))
            self.priced_steps += 1
            judged += 1
        if not judged or self.priced_steps < self.min_steps:
            return
        if self.gain < self.min_gain:
            self.off_left, self.backoff = self.backoff, min(2 * self.backoff, self.max_backoff)
            self.stops += 1
        elif self.priced_steps >= self.settle_steps:
            self.backoff = self.min_backoff

    def _measure_afresh(self) -> None:
        """Forget the outcomes, and most of the price: they were measured under other
        conditions. The old price stays as a prior worth a few steps (under load one step's
        time is noisy; four alone mislead)."""
        self.excess.shrink(self.prior_weight)
        self._pending.clear()
        self._recent.clear()
        self.priced_steps = 0
        self.since_plain = 0

    def _begin_trial(self) -> None:
        self._measure_afresh()
        self.trials += 1
