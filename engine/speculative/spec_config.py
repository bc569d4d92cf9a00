"""Speculation settings: one validated object, the server's default or a request's own."""

from __future__ import annotations

from dataclasses import dataclass


class SpecConfigError(ValueError):
    """Speculation settings that cannot be used; ``field`` names the key at fault
    (``"speculative.num_speculative_tokens"``), as the message does."""

    def __init__(self, message: str, field: str = "speculative"):
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class SpecConfig:
    """Speculation settings (server default, overridable per request).

    Attributes:
        method: "ngram" or "off".
        num_speculative_tokens: most draft tokens per step.
        prompt_lookup_min / prompt_lookup_max: suffix lengths searched (tokens).
        max_batch_size: speculation is skipped when more requests than this are running
            (verification then costs real compute instead of riding on weight reads).
        max_draft_tokens_per_step: rows one step may spend on drafts, less the step's other
            rows beyond the first (a decode row per running request, plus its grammar-forced
            tokens). Drafts get them by expected value, most likely first
            (``stencil.engine.speculative.drafter.Drafter.propose``). On a CPU every verified row costs
            compute, so this bounds the step's time as well as its rows.
        row_tile: rows the model's matmul kernel processes together (0: the engine's choice, 4
            with torch's int4 kernel, 1 otherwise); drafts that would spill a row or two into a
            new tile are dropped (``stencil.engine.speculative.drafter.trim_to_tile``).
        cost_aware: keep a draft only while its estimated chance of acceptance pays for the
            row it costs, at the price the engine measures (``stencil.engine.speculative.goodput.Goodput``);
            False keeps every draft the budget allows. Either way the engine stops drafting
            for the whole batch while drafting measurably loses throughput.
        min_acceptance: a request whose recent acceptance rate falls below this stops proposing
            for ``backoff_steps`` steps, once ``min_evidence`` (decayed) drafts were judged.
        grammar_drafts: for constrained requests, draft the text the grammar forces next (e.g.
            ``,"age":`` after a string field), tokenized.
        text_lookup: look the output's last characters up in the prompt *text* (not token ids:
            a name copied into a JSON string is tokenized differently from the same name in
            running prose) and draft the text that follows, tokenized.
    """

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    max_batch_size: int = 8
    max_draft_tokens_per_step: int = 20
    row_tile: int = 0
    cost_aware: bool = True
    min_acceptance: float = 0.15
    min_evidence: float = 12.0
    backoff_steps: int = 16
    grammar_drafts: bool = True
    text_lookup: bool = True

    @classmethod
    def from_dict(cls, d: dict | None) -> "SpecConfig | None":
        """Parse ``{"method": "ngram", ...}``; ``None`` or method "off" → None.

        Raises:
            SpecConfigError: (a ``ValueError``) an unknown key or method, a value of the wrong
                JSON type, or an out-of-range number; its message and ``field`` name the key.
        """
        if not d:
            return None
        if not isinstance(d, dict):
            raise SpecConfigError(f"speculative must be an object, got {type(d).__name__}")
        allowed = set(cls.__dataclass_fields__)
        unknown = set(d) - allowed
        if unknown:
            first = sorted(unknown)[0]
            raise SpecConfigError(f"speculative.{first} is not a field; allowed: {sorted(allowed)}",
                                  field=f"speculative.{first}")
        for name, value in d.items():  # JSON types: a bool is not a number, a number not a bool
            want = type(cls.__dataclass_fields__[name].default)
            ok = (isinstance(value, str) if want is str else isinstance(value, bool) if want is bool
                  else isinstance(value, int) and not isinstance(value, bool) if want is int
                  else isinstance(value, (int, float)) and not isinstance(value, bool))
            if not ok:
                kind = {str: "a string", bool: "a boolean", int: "an integer"}.get(want, "a number")
                raise SpecConfigError(f"speculative.{name} must be {kind}, got {value!r}", field=f"speculative.{name}")
        cfg = cls(**d)
        if cfg.method == "off":
            return None
        if cfg.method != "ngram":
            raise SpecConfigError(f"speculative.method must be 'ngram' or 'off', got {cfg.method!r}",
                                  field="speculative.method")
        if not (1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max):
            raise SpecConfigError("speculative: need 1 <= prompt_lookup_min <= prompt_lookup_max",
                                  field="speculative.prompt_lookup_min")
        if not (1 <= cfg.num_speculative_tokens <= 64):
            raise SpecConfigError("speculative.num_speculative_tokens must be in 1..64",
                                  field="speculative.num_speculative_tokens")
        if cfg.max_draft_tokens_per_step < 0:
            raise SpecConfigError("speculative.max_draft_tokens_per_step must be >= 0",
                                  field="speculative.max_draft_tokens_per_step")
        if not (0 <= cfg.row_tile <= 64):
            raise SpecConfigError("speculative.row_tile must be in 0..64", field="speculative.row_tile")
        if cfg.max_batch_size < 1:
            raise SpecConfigError("speculative.max_batch_size must be >= 1", field="speculative.max_batch_size")
        if not (0.0 <= cfg.min_acceptance <= 1.0):
            raise SpecConfigError("speculative.min_acceptance must be in 0..1", field="speculative.min_acceptance")
        for name in ("min_evidence", "backoff_steps"):
            if getattr(cfg, name) < 0:
                raise SpecConfigError(f"speculative.{name} must be >= 0, got {getattr(cfg, name)}",
                                      field=f"speculative.{name}")
        return cfg
