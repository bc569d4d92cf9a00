"""Speculative decoding: draft proposal, its price and its off-switch.

- ``config``: ``SpecConfig``, the settings (server default, per request).
- ``lookup``: prompt lookup on token ids and on text; where a copied span ends.
- ``splits``: ``TokenSplits``, how the model spells grammar-forced text.
- ``state``: ``SpecState``, one request's acceptance record and drafts in flight.
- ``drafter``: ``Drafter.propose(requests, budget) -> Drafts``, the engine's one call.
- ``goodput``: ``Goodput``, whether drafting pays, from measured step times.
- ``plain_steps``: ``PlainSteps``, the recent plain steps a drafting step is judged by, and
  changes of the machine's speed.
- ``fit``: ``LinearFit``, a decayed least-squares line of step time over rows.
- ``row_cost``: ``decoder_row_ms``, what one more row costs the model's projections (the
  floor of a draft row's price).

Verification (greedy argmax or rejection sampling) lives in ``stencil.engine.sampler``.
"""

from stencil.engine.speculative.spec_config import SpecConfig
from stencil.engine.speculative.drafter import DraftBudget, Drafter, Drafts
from stencil.engine.speculative.goodput import DraftPlan, Goodput, StepShape
from stencil.engine.speculative.splits import TokenSplits
from stencil.engine.speculative.spec_state import Acceptance, SpecState

__all__ = ["Acceptance", "DraftBudget", "DraftPlan", "Drafter", "Drafts", "Goodput", "SpecConfig", "SpecState",
           "StepShape", "TokenSplits"]
