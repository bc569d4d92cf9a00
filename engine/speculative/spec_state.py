"""What one request's speculation has learned: how often its drafts are accepted, per kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from stencil.engine.speculative.spec_config import SpecConfig

if TYPE_CHECKING:
    from stencil.engine.speculative.splits import TokenSplits


@dataclass(slots=True)
class Acceptance:
    """Exponentially decayed counts of one kind of draft's verifications.

    Attributes:
        prior: the per-token acceptance assumed before any evidence.
        proposed: draft tokens verified (decayed).
        accepted: draft tokens accepted (decayed).
        rejected: verifications that stopped at a rejected draft (decayed).
    """

    prior: float
    proposed: float = 0.0
    accepted: float = 0.0
    rejected: float = 0.0

    def record(self, proposed: int, accepted: int, decay: float = 0.7) -> None:
        """One verification: ``accepted`` of ``proposed`` drafts taken (the first ones)."""
        self.proposed = self.proposed * decay + proposed
        self.accepted = self.accepted * decay + accepted
        self.rejected = self.rejected * decay + (1.0 if accepted < proposed else 0.0)

    @property
    def rate(self) -> float:
        """Accepted over proposed (1.0 with no evidence)."""
        return self.accepted / self.proposed if self.proposed else 1.0

    def per_token(self, weight: float = 2.0) -> float:
        """Chance that the next draft is accepted given the previous one was: the geometric
        model's estimate ``accepted / (accepted + rejections)``, shrunk towards ``prior`` by
        ``weight`` pseudo-drafts while there is little evidence."""
        return (self.accepted + self.prior * weight) / (self.accepted + self.rejected + weight)

    def forget(self, keep: float) -> None:
        """Decay the evidence without new verifications (towards the prior): a request priced
        out of drafting gets tried again once its old record has faded."""
        self.proposed *= keep
        self.accepted *= keep
        self.rejected *= keep

    def clear(self) -> None:
        self.proposed = self.accepted = self.rejected = 0.0


@dataclass(slots=True)
class SpecState:
    """One request's speculation: its settings, its record, the drafts in flight.

    Attributes:
        config: the request's speculation settings.
        ngram: record of its lookup drafts (token n-grams and text lookup); drives the
            ``min_acceptance`` off-switch and the price check.
        grammar: record of its drafts of grammar-forced text (nearly always right).
        backoff: steps left without lookup drafts after the off-switch tripped.
        from_grammar: the drafts in flight came from the grammar, not from lookup.
        prompt_text: the decoded prompt, for text lookup (filled on first use).
        dropped / dropped_at: the last token of forced text left out of the drafts in flight,
            and after how many drafts (``TokenSplits`` learns whether the model writes it).
        splits: this request's lessons on the model's tokenization.
    """

    config: SpecConfig
    ngram: Acceptance = field(default_factory=lambda: Acceptance(prior=0.8))
    grammar: Acceptance = field(default_factory=lambda: Acceptance(prior=0.9))
    backoff: int = 0
    from_grammar: bool = False
    prompt_text: str | None = None
    dropped: int | None = None
    dropped_at: int = 0
    splits: "TokenSplits | None" = None

    @property
    def in_flight(self) -> Acceptance:
        """The record of the kind of drafts now in flight."""
        return self.grammar if self.from_grammar else self.ngram

    def record(self, proposed: int, accepted: int) -> None:
        """One verification of the drafts in flight (called by the scheduler's update)."""
        self.in_flight.record(proposed, accepted)
