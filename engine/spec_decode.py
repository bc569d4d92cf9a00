"""Moved to the ``engine.spec`` package; these names stay importable from here."""

from engine.spec.config import SpecConfig
from engine.spec.lookup import propose_ngram, propose_text, propose_value, span_end
from engine.spec.splits import TokenSplits
from engine.spec.state import SpecState

__all__ = ["SpecConfig", "SpecState", "TokenSplits", "propose_ngram", "propose_text", "propose_value", "span_end"]
